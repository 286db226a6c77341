"""Speculative decoding against plain decoding on the real SmolLM2, in one process, methods
interleaved per repeat so the machine's load falls on all of them alike; medians reported.

    python benchmarks/spec_decode.py --repeats 3 --json benchmarks/spec_decode.json

* batch 1, input-grounded prompts (copy or quote a passage, edit or annotate code), greedy,
  up to 128 new tokens, one request at a time: off, ngram (k=--ngram-k, default 4; lookup 1-4),
  early_exit;
* batch 1, general chat prompts: off, early_exit, ngram, medusa (k=3, the committed heads),
  eagle (k=--eagle-k, branches=--eagle-branches, head weights --eagle-quantization; the
  committed EAGLE head),
  draft_model (k=3; the draft is SmolLM2 itself quantized to int8 while loading: the only
  smaller model we have with its vocabulary, a quarter of its weight bytes; on this CPU its
  batch-1 forward is no faster than float32's, so it measures overhead, not a speedup);
* batch 16 (16 chat prompts at once): off against ngram with its default disable_by_batch_size.
Every mode's greedy tokens are checked equal to plain decoding's before anything is timed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

GROUNDED = [
    "Copy the following passage exactly, word for word:\n\nThe history of the printing press begins in "
    "the fifteenth century, when Johannes Gutenberg combined movable metal type, oil-based ink and a "
    "wooden screw press. His workshop in Mainz produced the famous Bible around 1455, and within fifty "
    "years presses were running in more than two hundred European cities.",
    "Add type hints to this function and return the whole function:\n\n"
    "def moving_average(values, window):\n    result = []\n    total = 0\n    for i, v in enumerate(values):\n"
    "        total += v\n        if i >= window:\n            total -= values[i - window]\n"
    "        if i >= window - 1:\n            result.append(total / window)\n    return result\n",
    "Quote the first two sentences of this text, then say who wrote it:\n\n\"It was the best of times, it was "
    "the worst of times, it was the age of wisdom, it was the age of foolishness, it was the epoch of belief, "
    "it was the epoch of incredulity.\" (Charles Dickens, A Tale of Two Cities)",
    "Add a docstring to this Python function and return the full code:\n\n"
    "def clamp(x, lo, hi):\n    if x < lo:\n        return lo\n    if x > hi:\n        return hi\n    return x\n",
]
CHAT = [
    "Write a short story about a robot who learns to paint.",
    "What are three tips for staying productive when working from home?",
    "Explain how a rainbow forms, in simple words.",
    "Give me a recipe for a quick vegetarian pasta dinner.",
]


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:
        return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--early-exit-layers", type=int, default=24)
    ap.add_argument("--medusa", default="checkpoints/medusa-smollm2-135m-instruct",
                    help="Medusa heads directory (jaxinfer train-medusa); skipped if missing")
    ap.add_argument("--eagle", default="checkpoints/eagle-smollm2-135m-instruct",
                    help="EAGLE head directory (jaxinfer train-eagle); skipped if missing")
    ap.add_argument("--ngram-k", type=int, nargs="+", default=[4], help="k of each ngram mode (several: ngram_k4, ...)")
    ap.add_argument("--eagle-k", type=int, nargs="+", default=[2], help="k of each eagle mode (several: eagle_k2, ...)")
    ap.add_argument("--eagle-branches", type=int, nargs="+", default=[1],
                    help="branches of each eagle mode (several: eagle_b1, eagle_b3, ...)")
    ap.add_argument("--eagle-quantization", nargs="+", default=["int8"], choices=["none", "int8"],
                    help="the head's weights in each eagle mode (several: eagle_none, eagle_int8)")
    ap.add_argument("--draft", default=None, help="draft_model's draft (default: --model itself)")
    ap.add_argument("--draft-quantization", default="int8", help="int8 or int4: quantize the draft while loading")
    ap.add_argument("--draft-k", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=None, help="cases to run (default: all)")
    ap.add_argument("--modes", nargs="*", default=None, help="modes to load and run (default: all)")
    ap.add_argument("--quantization", default=None, help="the target's weights, every mode alike (int8, int4, w8a8)")
    ap.add_argument("--allow-mismatch", action="store_true",
                    help="time a mode whose greedy tokens differ from plain decoding (w8a8's int8 activation "
                         "rounding is not batch-shape invariant: RESULTS.md) and report how many prompts differ")
    ap.add_argument("--json")
    args = ap.parse_args()

    from jaxinfer import LLM, SamplingParams

    modes = {
        "off": None,
        **{"ngram" + (f"_k{k}" if len(args.ngram_k) > 1 else ""):
           {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
           for k in args.ngram_k},
        "early_exit": {"method": "early_exit", "num_speculative_tokens": 2, "num_layers": args.early_exit_layers},
    }
    import os

    if os.path.isdir(args.medusa):
        modes["medusa"] = {"method": "medusa", "num_speculative_tokens": 3, "model": args.medusa}
    if os.path.isdir(args.eagle):
        for k in args.eagle_k:
            for w in args.eagle_branches:
                for qz in args.eagle_quantization:
                    name = "eagle" + (f"_k{k}" if len(args.eagle_k) > 1 else "") + \
                        (f"_b{w}" if len(args.eagle_branches) > 1 else "") + \
                        (f"_{qz}" if len(args.eagle_quantization) > 1 else "")
                    modes[name] = {"method": "eagle", "num_speculative_tokens": k, "model": args.eagle,
                                   "branches": w, "quantization": None if qz == "none" else qz}
    modes["draft_model"] = {"method": "draft_model", "num_speculative_tokens": args.draft_k,
                            "model": args.draft or args.model, "quantization": args.draft_quantization}
    if args.modes:
        modes = {m: c for m, c in modes.items() if m in args.modes or m.split("_")[0] in args.modes or m == "off"}
    llms = {m: LLM(args.model, progress=False, max_model_len=1024, max_num_seqs=16, speculative_config=c,
                   quantization=args.quantization) for m, c in modes.items()}
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    convs = lambda ps: [[{"role": "user", "content": p}] for p in ps]  # noqa: E731

    def one_at_a_time(llm, prompts):
        n, t0 = 0, time.perf_counter()
        toks = []
        for c in convs(prompts):
            o = llm.chat([c], sp, use_tqdm=False)[0].outputs[0]
            n += len(o.token_ids)
            toks.append(o.token_ids)
        return n / (time.perf_counter() - t0), toks

    def batched(llm, prompts):
        t0 = time.perf_counter()
        outs = llm.chat(convs(prompts), sp, use_tqdm=False)
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        return n / (time.perf_counter() - t0), [o.outputs[0].token_ids for o in outs]

    cases = {
        "batch1_grounded": (one_at_a_time, GROUNDED, ["off", "ngram", "early_exit"]),
        "batch1_chat": (one_at_a_time, CHAT, ["off", "early_exit", "ngram", "medusa", "draft_model", "eagle"]),
        "batch16_chat": (batched, (CHAT * 4)[:16], ["off", "ngram"]),
    }
    # a case's mode "eagle" (or "ngram") runs every eagle_* (ngram_*) variant loaded
    cases = {name: (run, prompts, [x for m in ms for x in modes if x == m or x.startswith(m + "_")])
             for name, (run, prompts, ms) in cases.items()}
    results = {}
    mismatched = {}  # (case, mode) -> prompts whose greedy tokens differ from plain decoding
    for name, (run, prompts, ms) in cases.items():
        if args.only and name not in args.only:
            continue
        ref = None
        for m in ms:  # warm pass: compiles, and checks greedy equality with plain decoding
            _, toks = run(llms[m], prompts)
            ref = toks if ref is None else ref
            differ = sum(a != b for a, b in zip(toks, ref))
            assert args.allow_mismatch or not differ, f"{name}: {m} differs from plain decoding"
            mismatched[(name, m)] = differ
            llms[m].engine.spec_stats and llms[m].engine.spec_stats.__init__(llms[m].engine.spec.num_speculative_tokens)
        rates = {m: [] for m in ms}
        for _ in range(args.repeats):
            for m in ms:
                rates[m].append(run(llms[m], prompts)[0])
        res = {m: {"tok_s_median": round(statistics.median(r), 2), "tok_s": [round(x, 2) for x in r]} for m, r in rates.items()}
        for m in ms:
            st = llms[m].engine.spec_stats
            if st is not None:
                res[m]["acceptance"] = st.summary()
                st.__init__(st.k)
            res[m]["speedup"] = round(res[m]["tok_s_median"] / res["off"]["tok_s_median"], 3)
            res[m]["prompts_differing_from_off"] = mismatched[(name, m)]
        results[name] = res
        print(name, json.dumps(res))
    info = {"cpu": _cpu(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "repeats": args.repeats,
            "quantization": args.quantization,
            "max_tokens": args.max_tokens, "modes": modes, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
