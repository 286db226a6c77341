"""Where the batch workload's wall time goes, step by step: the same 128 requests as
``workload.py`` through ``LLM.generate``, with every packed step timed to completion (the
step is made synchronous, so host work and device work no longer overlap; the total is a
little above the pipelined run's) and grouped by kind and shape.

    python benchmarks/workload_profile.py --block-size 16
    python benchmarks/workload_profile.py --quantization w8a8 --kv-cache-dtype int8

For each group: steps, seconds, real decode rows against computed rows (the row bucket), real
prefill tokens against the prefill bucket, and the page-table width.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from workload import _workload  # noqa: E402

from jaxinfer import LLM, SamplingParams  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--quantization")
    ap.add_argument("--kv-cache-dtype")
    a = ap.parse_args()
    _, reqs, _ = _workload(a.model)
    opts = {k: v for k, v in (("quantization", a.quantization), ("kv_cache_dtype", a.kv_cache_dtype)) if v}
    llm = LLM(a.model, max_model_len=1024, max_num_seqs=a.max_num_seqs, progress=False,
              enable_prefix_caching=False, block_size=a.block_size, **opts)
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    llm.generate(prompts, sps, use_tqdm=False)  # compile every shape

    eng = llm.engine
    real_step = eng.run_step
    log = []

    def timed(batch, **kw):
        t = time.perf_counter()
        out = real_step(batch, **kw)
        jax.block_until_ready((out.tokens, eng.k_pages))
        log.append((batch.rows, batch.table.shape[1], batch.prefill_len, int(np.sum(batch.active)),
                    int(np.sum(batch.seg >= 0)), time.perf_counter() - t))
        return out

    eng.run_step = timed
    t0 = time.perf_counter()
    res = llm.generate(prompts, sps, use_tqdm=False)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in res)
    in_steps = sum(x[-1] for x in log)
    print(f"{a.model} page {a.block_size} {opts or 'float32'}: {n_out} tokens in {wall:.1f} s "
          f"({n_out / wall:.1f} tok/s), {len(log)} steps, {in_steps:.1f} s inside steps, "
          f"{wall - in_steps:.1f} s outside")
    groups = collections.defaultdict(list)
    for R, w, Tp, act, pre, dt in log:
        kind = "decode only" if Tp == 0 else ("prefill only" if R == 0 else "mixed")
        groups[(kind, R, Tp, w)].append((act, pre, dt))
    print(f"{'kind':13s} {'R':>4s} {'Tp':>5s} {'width':>5s} {'steps':>5s} {'s':>7s} {'ms/step':>8s} "
          f"{'rows used':>9s} {'prefill used':>12s}")
    for key in sorted(groups, key=lambda k: -sum(x[2] for x in groups[k])):
        kind, R, Tp, w = key
        g = groups[key]
        s = sum(x[2] for x in g)
        rows = f"{np.mean([x[0] for x in g]) / R:.0%}" if R else "-"
        pre = f"{np.mean([x[1] for x in g]) / Tp:.0%}" if Tp else "-"
        print(f"{kind:13s} {R:4d} {Tp:5d} {w:5d} {len(g):5d} {s:7.1f} {1e3 * s / len(g):8.1f} {rows:>9s} {pre:>12s}")
    by_kind = collections.defaultdict(float)
    for (kind, *_), g in groups.items():
        by_kind[kind] += sum(x[2] for x in g)
    print("by kind: " + ", ".join(f"{k} {v:.1f} s" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])))
    print(f"decode rows computed {sum(x[0] for x in log)}, used {sum(x[3] for x in log)}; prefill tokens "
          f"computed {sum(x[2] for x in log)}, used {sum(x[4] for x in log)}")


if __name__ == "__main__":
    main()
