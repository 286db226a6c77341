"""Microbenchmark: formulations of the int8 matrix-vector product (batch-1 decode) on XLA
CPU, streaming weights that do not fit in cache.

Each candidate multiplies one activation row by ``n`` distinct int8 weights of one of
SmolLM2-135M's shapes inside one jitted call (enough copies that they total >= --mbytes, so
every weight comes from memory as in a decode step), and the time per weight is turned into
GB/s of int8 weight read. ``read`` is the machine's read bandwidth on as many bytes
(a max over int8), the ceiling a matvec that reads each byte once can approach.

Candidates, for x f32[1, I] and an int8 weight stored [I, O] (QuantArray's layout) or
[O, I] (transposed at load):
  s8 dot M=2     quantize x, duplicate the row, s8 x s8 -> s32 dot (QuantArray's one-row
                 path through XLA: XLA CPU's one-row s8 dot is slower still)
  f32 dot        x @ w.astype(f32) (XLA converts the weight, then a float gemv)
  reduce [I,O]   sum over I of x[i] * w[i, :]: one elementwise-and-reduce fusion
  reduce [O,I]   sum over I of w[o, i] * x[i]: the reduction along contiguous memory
  s8 dot [O,I]   quantized x against the transposed int8 weight, s32 accumulation
  s8 dot M=m     as M=2 with m copies of the row
  bf16 dot       x and w converted to bfloat16, f32 accumulation
  f32 weight     the float32 model's gemv on a float32 weight (4x the bytes; GB/s counted
                 on the int8 bytes it stands for, so it compares as time)
  reduce [O,I] blocked   the [O,I] reduction split into blocks of 64 along I

    python benchmarks/int8_matvec.py [--mbytes 128] [--reps 5]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxinfer import quant  # noqa: E402
from timing import median_seconds  # noqa: E402

SHAPES = {"qkv/gate-up in [D, F]": (576, 1536), "down [F, D]": (1536, 576), "wq [D, D]": (576, 576),
          "head [D, V]": (576, 49152)}
_MM = (((1,), (0,)), ((), ()))


def s8_dot_m2(x, w, s):
    xq, xs = quant.quantize_rows(jnp.concatenate([x, x]))
    acc = jax.lax.dot_general(xq, w, _MM, preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * xs[:, None] * s)[:1]


def f32_dot(x, w, s):
    return (x @ w.astype(jnp.float32)) * s


def reduce_io(x, w, s):
    return jnp.sum(x[0][:, None] * w.astype(jnp.float32), axis=0)[None] * s


def reduce_oi(x, wt, s):
    return jnp.sum(wt.astype(jnp.float32) * x, axis=1)[None] * s


def s8_dot_oi(x, wt, s):
    xq, xs = quant.quantize_rows(x)
    acc = jax.lax.dot_general(xq, wt, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * xs[:, None] * s


def s8_dot_rows(m):
    """The one-row product as an m-row s8 dot (the row repeated)."""
    def fn(x, w, s):
        xq, xs = quant.quantize_rows(jnp.broadcast_to(x, (m, x.shape[1])))
        acc = jax.lax.dot_general(xq, w, _MM, preferred_element_type=jnp.int32)
        return (acc.astype(jnp.float32) * xs[:, None] * s)[:1]
    return fn


def bf16_dot(x, w, s):
    return jax.lax.dot_general(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), _MM,
                               preferred_element_type=jnp.float32) * s


def f32_weight(x, wf, s):  # the float32 model's gemv on a float32 weight (4x the bytes)
    return (x @ wf) * s


def reduce_oi_blocked(x, wt, s):
    O, I = wt.shape
    p = wt.reshape(O, I // 64, 64).astype(jnp.float32) * x.reshape(1, I // 64, 64)
    return jnp.sum(jnp.sum(p, axis=2), axis=1)[None] * s


CANDIDATES = {"s8 dot M=2": (s8_dot_m2, False), "s8 dot M=4": (s8_dot_rows(4), False),
              "s8 dot M=8": (s8_dot_rows(8), False), "s8 dot M=16": (s8_dot_rows(16), False),
              "f32 dot": (f32_dot, False), "bf16 dot": (bf16_dot, False),
              "f32 weight": (f32_weight, "f32"), "reduce [O,I] blocked": (reduce_oi_blocked, True),
              "reduce [I,O]": (reduce_io, False), "reduce [O,I]": (reduce_oi, True),
              "s8 dot [O,I]": (s8_dot_oi, True)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbytes", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--candidates", nargs="+", default=list(CANDIDATES))
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__}, load average {os.getloadavg()[0]:.1f} at start")
    big = jnp.asarray(rng.integers(-127, 128, a.mbytes << 20), jnp.int8)
    t = median_seconds(jax.jit(lambda b: jnp.max(b.reshape(-1, 4096), axis=0)), big, reps=a.reps)
    print(f"read (max over {a.mbytes} MiB of int8): {big.nbytes / t / 1e9:.1f} GB/s")
    print("| weight | " + " | ".join(f"{c} GB/s" for c in a.candidates) + " |")
    print("|---|" + "---|" * len(a.candidates))
    for name in a.shapes:
        I, O = SHAPES[name]
        n = max(1, (a.mbytes << 20) // (I * O))
        # a list of separate arrays: slicing one stacked array copies each slice on XLA CPU
        ws = [jnp.asarray(rng.integers(-127, 128, (I, O)), jnp.int8) for _ in range(n)]
        wts = [w.T.copy() for w in ws]
        nbytes = sum(w.nbytes for w in ws)
        s = jnp.asarray(rng.random(O), jnp.float32)
        x = jnp.asarray(rng.normal(size=(1, I)), jnp.float32)
        ref = None
        cells = []
        for cname in a.candidates:
            fn, transposed = CANDIDATES[cname]
            # a python loop over the n weights: n separate fusions, like n layers of a step
            f = jax.jit(lambda x, ws, s, fn=fn: sum(fn(x, ws[i], s) for i in range(n)))
            w = [w.astype(jnp.float32) for w in ws] if transposed == "f32" else wts if transposed else ws
            out = f(x, w, s)
            if ref is None:
                ref = out
            assert np.allclose(out, ref, rtol=0.05, atol=0.05 * float(jnp.max(jnp.abs(ref)))), cname
            t = median_seconds(f, x, w, s, reps=a.reps)
            cells.append(f"{nbytes / t / 1e9:.1f}")
        print(f"| {name} x{n} | " + " | ".join(cells) + " |", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at end")


if __name__ == "__main__":
    main()
