"""Make golden outputs for SmolLM2-135M-Instruct (GGUF Q4_1) from an independent reference.

The reference is Hugging Face transformers on PyTorch CPU in float32: transformers reads the
GGUF itself (dequantizing every tensor to float and un-permuting Q/K back to the HF layout),
so nothing from jaxinfer is used except ``registry`` to locate the file.

Regenerate (from the repository root, with the ``reference`` extra installed)::

    python tests/golden/make_goldens.py

What is stored per prompt (see ``metadata.notes`` in the JSON too):

* ``prompt_ids``: ``tokenizer(prompt_text, add_special_tokens=True)``; this tokenizer does not
  add a BOS (GGUF ``tokenizer.ggml.add_bos_token = false``), chat prompts start with
  ``<|im_start|>`` (id 1) from the template instead.
* ``greedy_ids``: 32 greedy tokens, EOS ignored (the loop never stops early).
* ``margins[k]``: top1 - top2 logit of the distribution that chose ``greedy_ids[k]``; a test
  should forgive a mismatch where the margin is below ~0.05.
* ``logits``: at absolute positions T-1, T, T+7 and T+30 (T = prompt length), i.e. the
  logits that predicted generated steps 0, 1, 8 and 31: top-64 ids and float32 logits,
  the full-vocabulary logsumexp, mean and (population) std.
* ``prompt_logprobs`` (separate section): log-softmax logprob of each prompt token 1..T-1
  given its prefix, for two plain prompts.

The greedy tokens come from an incremental (KV-cached) loop; the stored logits and margins
come from one full, uncached forward pass over prompt + generated[:-1], and the script checks
that its argmax agrees with the cached loop at every step.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

MODEL = "smollm2-135m-instruct"
N_NEW = 32
TOP_K = 64
LOGIT_STEPS = (0, 1, 8, 31)  # generated steps whose predicting logits are stored
DEFAULT_OUT = Path(__file__).resolve().parent / "smollm2-135m-instruct.json"

LONG_PARAGRAPH = (
    "The history of the printing press is closely tied to the spread of literacy in Europe. "
    "Before Johannes Gutenberg built his press in Mainz around 1440, books were copied by "
    "hand, usually by monks working in scriptoria, and a single volume could take months to "
    "finish. Movable metal type, oil-based ink and a screw press adapted from wine making "
    "allowed a small workshop to produce hundreds of identical pages in a day. Within fifty "
    "years, presses were operating in more than two hundred cities, and millions of books had "
    "been printed. Pamphlets, newspapers and scientific journals followed, and ideas could "
    "now travel faster than ever before. Historians often argue that the Reformation, the "
    "Scientific Revolution and the Enlightenment would have been impossible without"
)

PLAIN = [
    ("france", "The capital of France is"),
    ("prose", "Once upon a time, in a small village at the edge of a great forest,"),
    ("code", "def fibonacci(n):\n"),
    ("numbers", "The first ten prime numbers are 2, 3, 5, 7,"),
    ("long_paragraph", LONG_PARAGRAPH),
    (
        "unicode",
        "Café crème ☕ and croissants 🥐 make a classic French breakfast. "
        "In Japanese, breakfast is called 朝食 (chōshoku), and",
    ),
]

CHAT = [
    ("chat_capital", [{"role": "user", "content": "What is the capital of France?"}]),
    ("chat_haiku", [{"role": "user", "content": "Write a haiku about the ocean."}]),
    (
        "chat_system_pirate",
        [
            {"role": "system", "content": "You are a pirate. Always answer like a pirate."},
            {"role": "user", "content": "How do I make a cup of tea?"},
        ],
    ),
    (
        "chat_multi_turn",
        [
            {"role": "user", "content": "Hi! My name is Alice."},
            {"role": "assistant", "content": "Hello Alice! How can I help you today?"},
            {"role": "user", "content": "What is my name, and what is 2 + 2?"},
        ],
    ),
    (
        "chat_code",
        [{"role": "user", "content": "Write a Python function that checks if a number is prime."}],
    ),
    (
        "chat_translate",
        [{"role": "user", "content": "Translate to French: I love reading books in the garden."}],
    ),
]

PROMPT_LOGPROBS_FOR = ("long_paragraph", "unicode")


def f32(x) -> float:
    """A float32 value as the shortest decimal that round-trips to the same float32."""
    return float(str(np.float32(x)))


def g8(x) -> float:
    """A float64 statistic rounded to 8 significant digits."""
    return float(f"{float(x):.8g}")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def logits_summary(row: torch.Tensor, position: int, step: int, next_id: int) -> dict:
    """row: float32 logits over the vocabulary at one absolute position."""
    top = torch.topk(row, TOP_K, sorted=True)
    d = row.double()
    return {
        "position": position,
        "step": step,
        "next_id": next_id,
        "top_ids": top.indices.tolist(),
        "top_logits": [f32(v) for v in top.values.tolist()],
        "logsumexp": g8(torch.logsumexp(d, 0)),
        "mean": g8(d.mean()),
        "std": g8(d.std(unbiased=False)),
    }


@torch.no_grad()
def run_prompt(model, tok, name, kind, prompt_text, extra) -> tuple[dict, dict | None, dict]:
    ids = tok(prompt_text, add_special_tokens=True)["input_ids"]
    T = len(ids)
    x = torch.tensor([ids])

    # 1) greedy with a KV cache, EOS ignored
    out = model(input_ids=x, use_cache=True)
    prefill = out.logits[0].float()  # [T, V], all prompt positions
    cache = out.past_key_values
    step_logits = [prefill[-1]]
    greedy = []
    for k in range(N_NEW):
        nxt = int(torch.argmax(step_logits[-1]))
        greedy.append(nxt)
        if k == N_NEW - 1:
            break
        out = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        step_logits.append(out.logits[0, -1].float())

    # 2) one full uncached forward over prompt + greedy[:-1]: the stored logits
    full_ids = ids + greedy[:-1]
    full = model(input_ids=torch.tensor([full_ids]), use_cache=False).logits[0].float()
    gen_rows = full[T - 1 :]  # row k predicted greedy[k]
    assert gen_rows.shape[0] == N_NEW
    top2 = torch.topk(gen_rows, 2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    full_argmax = gen_rows.argmax(-1).tolist()
    disagree = [k for k in range(N_NEW) if full_argmax[k] != greedy[k] and margins[k] > 1e-3]
    assert not disagree, f"{name}: cached and full forward disagree at steps {disagree}"
    cached = torch.stack(step_logits)
    check = {
        "max_abs_cached_vs_full": float((cached - gen_rows).abs().max()),
        "max_abs_prefill_vs_full": float((prefill - full[:T]).abs().max()),
    }

    rec = {"name": name, "kind": kind, **extra, "prompt_text": prompt_text, "prompt_ids": ids}
    rec["greedy_ids"] = greedy
    rec["greedy_text"] = tok.decode(greedy)
    rec["margins"] = [g8(m) for m in margins]
    rec["logits"] = [
        logits_summary(gen_rows[s], T - 1 + s, s, greedy[s]) for s in LOGIT_STEPS
    ]

    plp = None
    if name in PROMPT_LOGPROBS_FOR:
        lp = torch.log_softmax(full[: T - 1].double(), dim=-1)
        tgt = torch.tensor(ids[1:])
        vals = lp[torch.arange(T - 1), tgt].tolist()
        plp = {
            "name": name,
            "prompt_ids": ids,
            "logprobs": [g8(v) for v in vals],  # logprobs[i] = log p(ids[i+1] | ids[:i+1])
            "sum": g8(sum(vals)),
            "perplexity": g8(math.exp(-sum(vals) / len(vals))),
        }
    return rec, plp, check


def dump(obj, indent=0) -> str:
    """JSON with dicts indented and lists of scalars kept on one line."""
    pad, pad1 = "  " * indent, "  " * (indent + 1)
    if isinstance(obj, dict):
        items = [f"{pad1}{json.dumps(k)}: {dump(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}" if items else "{}"
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        return "[\n" + ",\n".join(pad1 + dump(v, indent + 1) for v in obj) + "\n" + pad + "]"
    return json.dumps(obj, ensure_ascii=False, separators=(", ", ": "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxinfer import registry

    path = Path(registry.fetch(MODEL))
    entry = registry.REGISTRY[MODEL]
    actual_sha = sha256(path)
    if actual_sha != entry.sha256:
        sys.exit(f"sha256 mismatch for {path}: {actual_sha} != {entry.sha256}")

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    print(f"loaded in {time.time() - t0:.1f}s", file=sys.stderr)

    jobs = [(n, "plain", p, {"prompt": p}) for n, p in PLAIN]
    for n, msgs in CHAT:
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        jobs.append((n, "chat", text, {"messages": msgs}))

    prompts, plps, checks = [], [], {}
    for n, kind, text, extra in jobs:
        rec, plp, check = run_prompt(model, tok, n, kind, text, extra)
        prompts.append(rec)
        checks[n] = check
        if plp is not None:
            plps.append(plp)
        print(
            f"[{n}] T={len(rec['prompt_ids'])} min_margin={min(rec['margins']):.4f} "
            f"{rec['greedy_text']!r}",
            file=sys.stderr,
        )

    doc = {
        "metadata": {
            "model": MODEL,
            "gguf_file": path.name,
            "gguf_sha256": entry.sha256,
            "reference": "transformers AutoModelForCausalLM (GGUF dequantized by transformers)",
            "attn_implementation": "eager",
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "dtype": "float32",
            "device": "cpu",
            "torch_threads": args.threads,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python tests/golden/make_goldens.py",
            "tokenizer_adds_bos": tok("x", add_special_tokens=True)["input_ids"]
            != tok("x", add_special_tokens=False)["input_ids"],
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "vocab_size": model.config.vocab_size,
            "n_new_tokens": N_NEW,
            "eos_ignored": True,
            "top_k": TOP_K,
            "logit_steps": list(LOGIT_STEPS),
            "self_check": checks,
            "notes": [
                "prompt_ids = tokenizer(prompt_text, add_special_tokens=True).input_ids",
                "greedy: argmax at every step, EOS ignored, always n_new_tokens tokens",
                "margins[k] = top1 - top2 logit of the distribution that chose greedy_ids[k]",
                "logits[].position is the absolute position whose output logits are stored; "
                "they predicted greedy_ids[step] (position = len(prompt_ids) - 1 + step)",
                "top_logits are float32 values; logsumexp/mean/std are float64 statistics of "
                "the float32 logits over the full vocabulary (std with ddof=0)",
                "greedy_ids from a KV-cached loop; logits/margins from one uncached forward "
                "over prompt_ids + greedy_ids[:-1] (self_check: max abs difference)",
                "prompt_logprobs[].logprobs[i] = log_softmax(logits at position i)[ids[i+1]]",
            ],
        },
        "prompts": prompts,
        "prompt_logprobs": plps,
    }
    args.out.write_text(dump(doc) + "\n", encoding="utf-8")
    print(f"wrote {args.out} in {time.time() - t0:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
