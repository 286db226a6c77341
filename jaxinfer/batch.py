"""Batch jobs: a file of prompts in, a JSONL file of results out.

Quick mode: one prompt per line of a text file; each result line holds the prompt and its
generated text. Prompts go through the model's chat template when it has one (``raw=False``).
The output is written to a temporary file beside the target and renamed, so a crash never
leaves a half-written file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from jaxinfer.errors import InvalidRequest


def read_prompts(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidRequest(f"input file {path} does not exist") from None
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"input file {path} is not UTF-8 text ({e})") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise InvalidRequest(f"input file {path} holds no prompts (one per line)")
    return prompts


def run_quick(llm, input_path, output_path, sampling_params, *, raw: bool = False) -> dict:
    """Generate for every line of ``input_path``; write JSONL to ``output_path``."""
    prompts = read_prompts(Path(input_path))
    use_chat = not raw and llm.tokenizer.chat_template is not None
    if use_chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sampling_params)
    else:
        outs = llm.generate(prompts, sampling_params)
    out_path = Path(output_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    n_in = n_out = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for i, (p, o) in enumerate(zip(prompts, outs)):
            c = o.outputs[0]
            n_in += len(o.prompt_token_ids)
            n_out += len(c.token_ids)
            f.write(json.dumps({
                "index": i, "prompt": p, "text": c.text, "finish_reason": c.finish_reason,
                "prompt_tokens": len(o.prompt_token_ids), "completion_tokens": len(c.token_ids),
            }, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out_path)
    return {"requests": len(prompts), "input_tokens": n_in, "output_tokens": n_out}
