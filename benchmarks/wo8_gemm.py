"""The projections of one SmolLM2-135M step (the 30 layers' q k v o gate up down, every weight
distinct, calls chained so the weights stream from memory in order, as in a step) at several
row counts, by each way jaxinfer can multiply them on this CPU:

* ``f32 xla``: float32 weights, XLA's dot (jaxinfer float32 on a CPU without AVX-512);
* ``f32 native``: float32 weights, ``cpu_kernels.f32_gemv`` (up to 16 rows);
* ``int8 xla``: weight-only int8 as XLA runs it, the whole weight widened to float32 per call;
* ``int8 native``: weight-only int8 through ``cpu_kernels.wo8_gemm``, the weight widened in L1;
* ``w8a8 xla`` / ``w8a8 native``: rows quantized per token, XLA's s8 dot, or
  ``cpu_kernels.int8_gemv`` (up to 4 rows) and ``cpu_kernels.s8_gemm`` (more).

    python benchmarks/wo8_gemm.py --rows 1 8 64 256 512 --rounds 5 [--skip "int8 xla"]

Prints the median time of the step's projections per candidate, in ms, and the ratio to
``f32 xla``. The difference from a whole step is what attention, norms and the head cost.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import cpu_kernels as ck
from jaxinfer import quant

D, F, KV, LAYERS = 576, 1536, 192, 30
LAYER = [(D, D), (D, KV), (D, KV), (D, D), (D, F), (D, F), (F, D)]  # q k v o gate up down


def _chain(dot):
    """One jitted pass over every layer's weights in a layer's order (q k v from the input, o
    from q, gate and up from the input, down from their product), so the calls run one after
    another as in a step."""

    def step(x, ws):
        for i in range(0, len(ws), len(LAYER)):
            wq, wk, wv, wo, wg, wu, wd = ws[i : i + len(LAYER)]
            q = dot(x, wq)
            kv = dot(x, wk) + dot(x, wv)
            h = dot(q, wo)
            d = dot(dot(x, wg) * dot(x, wu), wd)
            x = x + 1e-3 * (h + d + kv[:, :1])
        return x

    return jax.jit(step)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256, 512])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip", nargs="*", default=[], help="candidates left out, e.g. 'int8 xla'")
    args = ap.parse_args()
    if not ck.available():
        raise SystemExit(f"the int8 kernels do not run here: {ck.library_status('int8_gemv').reason}")
    rng = np.random.default_rng(0)
    shapes = LAYER * LAYERS
    wf = [jnp.asarray(rng.standard_normal(s, np.float32) * 0.05) for s in shapes]
    q8 = [quant._per_column_int8(w) for w in wf]
    del rng

    def scaled(dot):
        return lambda x, w: dot(x, w[0]) * w[1]

    def w8a8(gemv):
        def dot(x, w):
            xq, xs = quant.quantize_rows(x)
            return gemv(xq, w[0]).astype(jnp.float32) * xs[:, None] * w[1]
        return dot

    cands = {
        "f32 xla": (lambda x, w: x @ w[0], [(w,) for w in wf], None),
        "f32 native": (lambda x, w: ck.f32_gemv(x, w[0]), [(w,) for w in wf], ck.F32_MAX_ROWS),
        "int8 xla": (scaled(ck.wo8_gemv_reference), q8, None),
        "int8 native": (scaled(ck.wo8_gemm), q8, None),
        "w8a8 xla": (w8a8(ck.int8_gemv_reference), q8, None),
        "w8a8 native": (w8a8(lambda xq, w: (ck.int8_gemv if xq.shape[0] <= ck.MAX_ROWS else ck.s8_gemm)(xq, w)),
                        q8, None),
    }
    print(f"threads {ck.default_threads()}, isas {ck.isas()}")
    for M in args.rows:
        x = jnp.asarray(np.random.default_rng(1).standard_normal((M, D), np.float32))
        fns = {n: (_chain(dot), ws) for n, (dot, ws, most) in cands.items() if (most is None or M <= most) and n not in args.skip}
        times = {n: [] for n in fns}
        for n, (f, ws) in fns.items():
            f(x, ws).block_until_ready()
        for _ in range(args.rounds):
            for n, (f, ws) in fns.items():  # interleaved, so a load change hits every candidate
                t = time.perf_counter()
                f(x, ws).block_until_ready()
                times[n].append(time.perf_counter() - t)
        base = statistics.median(times["f32 xla"])
        line = ", ".join(f"{n} {statistics.median(t) * 1e3:.1f} ({base / statistics.median(t):.2f}x)"
                         for n, t in times.items())
        print(f"M={M}: {line}", flush=True)


if __name__ == "__main__":
    main()
