"""Single-sequence and batched decode speed of a real model through LLM.generate.

    python benchmarks/decode_speed.py --model smollm2-135m-instruct --batch 1 8 32 64 --new 64 [--quantization w8a8]

For each batch size: one warm-up run (compiles), then --repeats timed runs; prints the median
decode throughput (generated tokens after the first / decode wall time), the median TTFT and
the end-to-end output throughput. EOS is ignored so every row makes exactly --new tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

PROMPT = "The history of the printing press is closely tied to the spread of literacy in Europe."


def run(llm, batch: int, new: int):
    from jaxinfer import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    prompts = [f"{i}. {PROMPT}" for i in range(batch)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    first = min(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.last_token_time for o in outs)
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    decode_tok = n_tok - batch  # tokens after each row's first
    return {
        "decode_tok_s": decode_tok / (last - first),
        "e2e_tok_s": n_tok / wall,
        "ttft_s": statistics.median(o.metrics.ttft for o in outs),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quantization", default=None, help="a weight scheme (w8a8, int8, ...)")
    ap.add_argument("--kernels", default="auto", choices=["auto", "pallas", "native", "xla"],
                    help="LLM's kernels= option (xla: no native CPU kernel)")
    a = ap.parse_args()
    from jaxinfer import LLM

    llm = LLM(a.model, max_model_len=512, max_num_seqs=max(a.batch), progress=False, quantization=a.quantization,
              kernels=a.kernels)
    rows = []
    for b in a.batch:
        run(llm, b, a.new)  # warm-up: compile this batch's buckets
        rs = [run(llm, b, a.new) for _ in range(a.repeats)]
        row = {"batch": b, **{k: statistics.median(r[k] for r in rs) for k in rs[0]}}
        rows.append(row)
        print(f"batch {b:4d}: decode {row['decode_tok_s']:8.1f} tok/s   e2e {row['e2e_tok_s']:8.1f} tok/s   "
              f"TTFT {row['ttft_s'] * 1e3:7.1f} ms", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "new": a.new, "machine": platform.platform(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
