"""The int8 dots of one batch-1 w8a8 decode token of SmolLM2-135M, alone: XLA's s8 dot (two
rows, as quant.s8_dot runs it) against the native kernel (jaxinfer.cpu_kernels)
with one thread, two, and one per core this process may run on. Every weight is distinct and the calls are chained (each input
depends on the last output), so the 134 MB stream from memory in order, as in a decode step.

    python benchmarks/int8_gemv.py [--rounds 7]

Prints, per candidate, the median time of the token's dots and the int8 weight bytes read
per second; the difference from a whole decode step is what the rest of the step costs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import cpu_kernels as ck

D, F, KV, V, LAYERS = 576, 1536, 192, 49152, 30
LAYER = [(D, D), (D, KV), (D, KV), (D, D), (D, F), (D, F), (F, D)]  # q k v o gate up down


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    if not ck.available():
        raise SystemExit("the native kernel is not available here (needs AVX-512BW and g++)")
    rng = np.random.default_rng(0)
    shapes = LAYER * LAYERS + [(D, V)]
    ws = [jnp.asarray(rng.integers(-127, 128, s), jnp.int8) for s in shapes]
    total = sum(w.size for w in ws)
    x0 = jnp.asarray(rng.integers(-127, 128, (1, F)), jnp.int8)

    def chain(mm):
        def f(x, ws):
            s = jnp.int32(0)
            for w in ws:
                xi = x[:, : w.shape[0]] + (s % 2).astype(jnp.int8)  # depends on the last output
                s = mm(xi, w)[0, 0]
            return s
        return jax.jit(f)

    cands = {
        "XLA s8 dot, 2 rows": chain(lambda x, w: ck.int8_gemv_reference(jnp.concatenate([x, x]), w)[:1]),
        "native, 1 thread": chain(lambda x, w: ck.int8_gemv(x, w, threads=1)),
        "native, 2 threads": chain(lambda x, w: ck.int8_gemv(x, w, threads=2)),
    }
    if ck.default_threads() > 2:
        n = ck.default_threads()
        cands[f"native, {n} threads"] = chain(lambda x, w: ck.int8_gemv(x, w, threads=n))
    got = {k: int(f(x0, ws)) for k, f in cands.items()}
    assert len(set(got.values())) == 1, got  # the same integers
    times = {k: [] for k in cands}
    for _ in range(a.rounds):
        for k, f in cands.items():
            t = time.perf_counter()
            jax.block_until_ready(f(x0, ws))
            times[k].append(time.perf_counter() - t)
    print(f"one token's int8 dots: {len(ws)} weights, {total / 1e6:.1f} MB")
    for k, v in times.items():
        t = statistics.median(v)
        print(f"  {k:22s} {t * 1e3:7.2f} ms  {total / t / 1e9:6.1f} GB/s")


if __name__ == "__main__":
    main()
