"""The float32 dots of one SmolLM2-135M step of M rows, alone: XLA's float32 dot against the
native kernel (jaxinfer.cpu_kernels.f32_gemv), for the projections ([I, O], 30 layers) and the
tied LM head ([V, D], contracted on D) separately. Every weight is distinct and the calls are
chained (each input depends on the last output), so the weights stream from memory in order,
as in a decode or verification step.

    python benchmarks/f32_gemv.py [--rows 1 2 5 8] [--rounds 7] [--threads N] [--isa avx2]

``--threads`` is the kernel's (default: ``cpu_kernels.default_threads()``, the cores this
process may run on); XLA's dot uses its own pool, of the same size. Each M also prints how many
ranges (threads, the caller's included) the kernel cut each projection's call into. ``--isa`` picks the kernel's vector variant (default: the best this CPU runs); ``avx2`` on an
AVX-512 machine times what an AVX2-only box (AMD EPYC) would run.

Prints, per M and candidate, the median time and the weight bytes read per second. A
verification step of k + 1 rows is cheap only when M rows cost about what one row does.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import cpu_kernels as ck

D, F, QKV, V, LAYERS = 576, 1536, 960, 49152, 30
LAYER = [(D, QKV), (D, D), (D, 2 * F), (F, D)]  # fused qkv, o, fused gate/up, down


def chain(mm, flags):
    """mm(x, w, transposed) over the weights ws with their ``transposed`` flags, each call's
    input depending on the last output."""
    def f(x, ws):
        s = jnp.float32(0)
        for w, t in zip(ws, flags):
            xi = x[:, : w.shape[1 if t else 0]] + s * 1e-30
            s = mm(xi, w, t)[0, 0]
        return s
    return jax.jit(f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=ck.default_threads())
    ap.add_argument("--isa", choices=list(ck.ISA_FLAGS), default=None)
    a = ap.parse_args()
    if not ck.f32_available():
        raise SystemExit("the native float32 kernel is not available here (needs AVX2 + FMA and g++)")
    if a.isa is not None and a.isa not in ck.isas():
        raise SystemExit(f"--isa {a.isa} does not run here: {', '.join(ck.isas())}")
    print(f"isa: {a.isa or ck.isas()[0]}, threads: {a.threads}", flush=True)
    rng = np.random.default_rng(0)
    layers = [(jnp.asarray(rng.standard_normal(s, np.float32) * 0.05), False) for s in LAYER * LAYERS]
    head = [(jnp.asarray(rng.standard_normal((V, D), np.float32) * 0.05), True)]
    xla = lambda x, w, t: ck.f32_gemv_reference(x, w, transposed=t)
    native = lambda x, w, t: ck.f32_gemv(x, w, transposed=t, threads=a.threads, isa=a.isa)
    parts = {"layers": layers, "layers + head": layers + head}
    for M in a.rows:
        x0 = jnp.asarray(rng.standard_normal((M, F), np.float32))
        cands = {(part, who): (chain(mm, [t for _, t in ws]), [w for w, _ in ws]) for part, ws in parts.items()
                 for who, mm in (("XLA", xla), ("native", native))}
        got = {k: float(f(x0, ws)) for k, (f, ws) in cands.items()}
        f, ws = cands[("layers", "native")]
        before = ck.split_count("f32_gemv")
        jax.block_until_ready(f(x0, ws))
        # how many threads shared each call (the calling one included): the kernel's own count
        print(f"M={M} native ranges per call: {(ck.split_count('f32_gemv') - before) / len(ws):.2f}", flush=True)
        for part in parts:
            ref, nat = got[(part, "XLA")], got[(part, "native")]
            assert abs(ref - nat) <= 1e-4 * max(1.0, abs(ref)), (part, ref, nat)
        times = {k: [] for k in cands}
        for _ in range(a.rounds):
            for k, (f, ws) in cands.items():
                t = time.perf_counter()
                jax.block_until_ready(f(x0, ws))
                times[k].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        for (part, who), t in med.items():
            nbytes = sum(w.size * 4 for w, _ in parts[part])
            print(f"M={M} {part:13s} {who:6s} {t * 1e3:7.2f} ms  {nbytes / t / 1e9:6.1f} GB/s", flush=True)
        for who in ("XLA", "native"):
            t = med[("layers + head", who)] - med[("layers", who)]
            print(f"M={M} {'head (diff.)':13s} {who:6s} {t * 1e3:7.2f} ms", flush=True)


if __name__ == "__main__":
    main()
