"""The ``jaxinfer`` command: argument parsing and printing only.

Errors caused by input (``JaxinferError``) print one line ``jaxinfer: error: ...`` and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)


def _add_model(p: argparse.ArgumentParser) -> None:
    from jaxinfer.registry import DEFAULT_MODEL

    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"registry name or path to .gguf / HF dir / Orbax dir (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="default: float32 on CPU, bfloat16 on TPU/GPU")
    p.add_argument("--max-model-len", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="jaxinfer", description="JAX/XLA inference for open LLMs")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    _add_model(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw text prompt")
    src.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    _add_sampling(g)
    g.add_argument("--json", action="store_true", help="print one JSON object")

    b = sub.add_parser("batch", help="generate for every prompt of a file, results to JSONL")
    b.add_argument("input", help="text file, one prompt per line")
    b.add_argument("-o", "--output", required=True, help="JSONL output file")
    _add_model(b)
    _add_sampling(b)
    b.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together")
    b.add_argument("--raw", action="store_true", help="do not apply the chat template")

    sub.add_parser("models", help="list registered models and what is cached")
    f = sub.add_parser("fetch", help="download and verify a registered model")
    f.add_argument("name")

    c = sub.add_parser("convert", help="convert a checkpoint to an Orbax checkpoint")
    c.add_argument("src", help="registry name or path")
    c.add_argument("dest", help="output directory (default store: checkpoints/)")
    c.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    return ap


def _sampling(a):
    from jaxinfer import SamplingParams

    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                          top_k=a.top_k, min_p=a.min_p, seed=a.seed)


def cmd_generate(a) -> int:
    from jaxinfer import LLM

    sp = _sampling(a)  # invalid values fail before the model loads
    llm = LLM(a.model, dtype=a.dtype, max_model_len=a.max_model_len, progress=not a.json)
    t0 = time.perf_counter()
    if a.chat is not None:
        out = llm.chat([{"role": "user", "content": a.chat}], sp, use_tqdm=False)[0]
    else:
        out = llm.generate(a.prompt, sp, use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    c = out.outputs[0]
    m = out.metrics
    decode_s = (m.last_token_time - m.first_token_time) if len(c.token_ids) > 1 else 0.0
    if a.json:
        print(json.dumps({
            "model": a.model, "prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids,
            "token_ids": c.token_ids, "text": c.text, "finish_reason": c.finish_reason,
            "ttft_s": m.ttft, "tokens_per_s": (len(c.token_ids) - 1) / decode_s if decode_s > 0 else None,
            "wall_s": wall,
        }, ensure_ascii=False))
    else:
        print(c.text)
    return 0


def cmd_batch(a) -> int:
    from jaxinfer import LLM
    from jaxinfer.batch import read_prompts, run_quick
    from pathlib import Path

    read_prompts(Path(a.input))  # fail on a bad input file before loading the model
    sp = _sampling(a)
    llm = LLM(a.model, dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs)
    t0 = time.perf_counter()
    s = run_quick(llm, a.input, a.output, sp, raw=a.raw)
    wall = time.perf_counter() - t0
    print(f"{s['requests']} requests, {s['input_tokens']} input and {s['output_tokens']} output tokens "
          f"in {wall:.1f} s ({s['output_tokens'] / wall:.1f} output tok/s) -> {a.output}", file=sys.stderr)
    return 0


def cmd_models(a) -> int:
    from jaxinfer import registry

    for r in registry.list_models():
        state = f"cached at {r['path']}" if r["cached"] else "not cached (jaxinfer fetch " + r["name"] + ")"
        print(f"{r['name']:<24} {r['size'] / 1e6:7.1f} MB  {r['description']}\n{'':<24} {state}")
    return 0


def cmd_fetch(a) -> int:
    from jaxinfer import registry

    print(registry.fetch(a.name))
    return 0


def cmd_convert(a) -> int:
    from jaxinfer.loaders.orbax_io import convert

    print(convert(a.src, a.dest, dtype=a.dtype))
    return 0


def main(argv=None) -> int:
    from jaxinfer.errors import JaxinferError

    a = build_parser().parse_args(argv)
    try:
        return {"generate": cmd_generate, "batch": cmd_batch, "models": cmd_models, "fetch": cmd_fetch,
                "convert": cmd_convert}[a.cmd](a)
    except JaxinferError as e:
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
