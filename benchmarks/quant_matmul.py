"""Microbenchmark: quantized matmuls on this machine's XLA CPU, against float32.

What it times, per row count M (tokens in a batch step), on SmolLM2-135M's shapes:
  f32        jnp.einsum with the float32 weight
  int8       QuantArray weight-only int8 (XLA converts the int8 weight to float each call)
  int4       QuantArray weight-only int4 (unpack + dequantize each call)
  w8a8       QuantArray w8a8 with smoothing: per-token quantization of x, the s8 x s8 -> s32
             dot, and the rescale (the whole einsum, as the model would run it)
  s8 dot     the bare int8 x int8 -> int32 dot_general, nothing else

Each is jitted, warmed up, then timed until it has run >= 1 s and >= 10 times; the median
is reported. --clock cpu times the process's CPU seconds instead of wall seconds: on a
machine shared with other jobs that counts the work done, not the waiting for a core.
Run:  python benchmarks/quant_matmul.py [--m 1 64 256 1024] [--shape mlp] [--clock cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxinfer import quant  # noqa: E402

# (einsum, weight shape, contracted axes): SmolLM2-135M's MLP up/gate, attention output,
# and the tied output head.
SHAPES = {
    "mlp": ("BTD,DF->BTF", (576, 1536), (0,)),
    "attn_out": ("BTNH,NHD->BTD", (9, 64, 576), (0, 1)),
    "head": ("BTD,VD->BTV", (49152, 576), (1,)),
}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


def median_ms(fn, *args, min_time=1.0, min_reps=10) -> float:
    jax.block_until_ready(fn(*args))
    times, start = [], time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t = clock()
        jax.block_until_ready(fn(*args))
        times.append(clock() - t)
    return 1e3 * statistics.median(times)


def run(shape_name: str, ms: list[int]) -> list[str]:
    eq, wshape, contract = SHAPES[shape_name]
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=wshape) * 0.05, jnp.float32)
    xs_letters = eq.split(",")[0]
    I = int(np.prod([wshape[a] for a in contract]))
    O = int(np.prod(wshape)) // I
    schemes = {
        "int8": quant.quantize_int8(w, contract),
        "int4": quant.quantize_int4(w, contract, group=64),
        "w8a8": quant.quantize_w8a8(w, contract, jnp.full((I,), 4.0)),
    }
    rows = []
    for M in ms:
        xshape = (M, 1) + tuple(wshape[a] for a in contract)  # B=M, T=1 (a decode step)
        assert len(xshape) == len(xs_letters)
        x = jnp.asarray(rng.normal(size=xshape), jnp.float32)
        t = {"f32": median_ms(jax.jit(lambda x, w: jnp.einsum(eq, x, w)), x, w)}
        for name, qa in schemes.items():
            t[name] = median_ms(jax.jit(lambda x, qa: qa.einsum(eq, x)), x, qa)
        xq = jnp.asarray(rng.integers(-127, 128, (M, I)), jnp.int8)
        s8 = jax.jit(
            lambda a, b: jax.lax.dot_general(
                a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32
            )
        )
        t["s8 dot"] = median_ms(s8, xq, schemes["w8a8"].values)
        flop = 2 * M * I * O
        cells = [
            f"{t[k]:.3f} ({t['f32'] / t[k]:.1f}x)" if k != "f32" else f"{t[k]:.3f}"
            for k in ("f32", "int8", "int4", "w8a8", "s8 dot")
        ]
        rows.append(
            f"| {shape_name} [{I}x{O}] | {M} | "
            + " | ".join(cells)
            + f" | {flop / t['f32'] / 1e9:.2f} | {flop / t['w8a8'] / 1e9:.2f} |"
        )
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 64, 256, 1024])
    ap.add_argument("--shape", choices=sorted(SHAPES), nargs="+", default=["mlp", "attn_out"])
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = ap.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cpus, "
        f"load average {os.getloadavg()[0]:.1f} at start, {args.clock} clock"
    )
    print(
        "| weight | M | f32 ms | int8 ms | int4 ms | w8a8 ms | s8 dot ms | f32 TOP/s | w8a8 TOP/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.shape:
        for row in run(name, args.m):
            print(row, flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at end; (Nx) = speed-up over f32")


if __name__ == "__main__":
    main()
