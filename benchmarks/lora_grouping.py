"""Two ways to compute the LoRA term of one decode step, on this CPU: what ``pallas_kernels.lora``
does (every row times the active adapters' A, masked to its own, times their B: n x R columns,
n - 1 of every n products discarded) against grouping the rows by adapter, so that each row is
multiplied by its own adapter's A and B only (n times fewer products):

* ``blocked``: rows sorted by adapter into blocks of ``bm`` rows of one adapter each (a group
  padded to whole blocks), each block's A and B gathered, two batched matmuls, rows put back;
* ``windows``: rows sorted, a loop over windows of ``bm`` rows of one adapter, each reading its
  adapter's A and B in place (``grouped_matmul_xla``'s scheme).

The shapes are SmolLM2-135M's seven projections over 30 layers (each layer's input scaled apart,
so XLA cannot merge them), 64 rows, rank 16, every row on adapter r % n; interleaved rounds,
min and median ms per step's LoRA terms.

    python benchmarks/lora_grouping.py --rounds 7
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.lora import lora_delta_reference


def _sorted(index, n):
    key = jnp.where(index >= 0, index, n)  # rows without an adapter sort last and are dropped
    order = jnp.argsort(key, stable=True)
    counts = jnp.bincount(key, length=n + 1)[:n]
    return key, order, counts


def blocked(x, a, b, active, index, *, bm: int = 8):
    """x [M, I], a [I, S, R], b [S, R, O], active i32[n], index i32[M] -> [M, O], as the reference."""
    (M, I), O, n = x.shape, b.shape[2], active.shape[0]
    nb = (M + n * (bm - 1)) // bm + 1  # blocks enough for any split of M rows over n adapters
    key, order, counts = _sorted(index, n)
    padded = (counts + bm - 1) // bm * bm
    pstart, rstart = jnp.cumsum(padded) - padded, jnp.cumsum(counts) - counts
    sk = key[order]
    g = jnp.minimum(sk, n - 1)
    dest = jnp.where(sk < n, pstart[g] + jnp.arange(M) - rstart[g], nb * bm)
    src = jnp.full((nb * bm + 1,), M, jnp.int32).at[dest].set(order.astype(jnp.int32))[:-1]
    pos = jnp.zeros((M,), jnp.int32).at[order].set(dest.astype(jnp.int32))
    slot = active[jnp.clip(jnp.searchsorted(jnp.cumsum(padded), jnp.arange(nb) * bm, side="right"), 0, n - 1)]
    xp = jnp.take(jnp.concatenate([x, jnp.zeros((1, I), x.dtype)]), src, axis=0).reshape(nb, bm, I)
    h = jnp.einsum("bmi,ibr->bmr", xp, jnp.take(a, slot, axis=1), preferred_element_type=jnp.float32)
    y = jnp.einsum("bmr,bro->bmo", h.astype(x.dtype), jnp.take(b, slot, axis=0),
                   preferred_element_type=jnp.float32).reshape(nb * bm, O)
    return jnp.take(jnp.concatenate([y, jnp.zeros((1, O), y.dtype)]), pos, axis=0).astype(x.dtype)


def windows(x, a, b, active, index, *, bm: int = 8):
    """As ``blocked``, by a loop over windows of bm sorted rows of one adapter."""
    (M, I), O, n = x.shape, b.shape[2], active.shape[0]
    _, order, counts = _sorted(index, n)
    ends = jnp.cumsum(counts)
    starts = ends - counts
    xs = jnp.concatenate([jnp.take(x, order, axis=0), jnp.zeros((bm, I), x.dtype)])
    nw = (counts + bm - 1) // bm
    wend = jnp.cumsum(nw)

    def body(w, out):
        g = jnp.clip(jnp.searchsorted(wend, w, side="right"), 0, n - 1)
        r0 = starts[g] + (w - (wend[g] - nw[g])) * bm
        aw = jax.lax.dynamic_index_in_dim(a, active[g], axis=1, keepdims=False)
        bw = jax.lax.dynamic_index_in_dim(b, active[g], axis=0, keepdims=False)
        y = jnp.dot(jnp.dot(jax.lax.dynamic_slice_in_dim(xs, r0, bm), aw), bw)
        keep = r0 + jnp.arange(bm) < ends[g]
        cur = jax.lax.dynamic_slice_in_dim(out, r0, bm)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep[:, None], y, cur), r0, 0)

    out = jax.lax.fori_loop(0, wend[-1], body, jnp.zeros((M + bm, O), x.dtype))[:M]
    inv = jnp.zeros((M,), jnp.int32).at[order].set(jnp.arange(M, dtype=jnp.int32))
    return jnp.where((index >= 0)[:, None], jnp.take(out, inv, axis=0), 0)


def _step(fn, stacks, xs, active, index, layers: int):
    out = 0.0
    for i in range(layers):
        for a, b in stacks:
            out = out + fn(xs[a.shape[0]] * (1.0 + i * 1e-3), a, b, active, index).sum()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    D, F, K, S, R, M = 576, 1536, 192, 8, 16, args.rows  # SmolLM2-135M; max_loras 8, rank 16
    shapes = [(D, D), (D, K), (D, K), (D, D), (D, F), (D, F), (F, D)]  # q k v o gate up down: (I, O)
    rng = np.random.default_rng(0)
    stacks = [(jnp.asarray(rng.standard_normal((i, S, R)), jnp.float32),
               jnp.asarray(rng.standard_normal((S, R, o)), jnp.float32)) for i, o in shapes]
    xs = {i: jnp.asarray(rng.standard_normal((M, i)), jnp.float32) for i in (D, F)}
    ways = {"reference (masked)": lora_delta_reference, "blocked bm=8": blocked,
            "blocked bm=4": functools.partial(blocked, bm=4), "windows bm=8": windows}
    cases = {}
    for n in (8, 2):
        active, index = jnp.arange(n, dtype=jnp.int32), jnp.asarray(np.arange(M) % n, jnp.int32)
        want = lora_delta_reference(xs[D], *stacks[0], active, index)
        for name, fn in ways.items():
            np.testing.assert_allclose(fn(xs[D], *stacks[0], active, index), want, rtol=1e-4, atol=1e-3)
            f = jax.jit(functools.partial(_step, fn, layers=args.layers))
            jax.block_until_ready(f(stacks, xs, active, index))
            cases[(n, name)] = (f, active, index)
    times = {k: [] for k in cases}
    for _ in range(args.rounds):
        for k, (f, active, index) in cases.items():
            t = time.perf_counter()
            jax.block_until_ready(f(stacks, xs, active, index))
            times[k].append(time.perf_counter() - t)
    print(f"LoRA terms of one step: {args.layers} layers x 7 projections, {M} rows, rank {R}; ms")
    for (n, name), ts in times.items():
        print(f"  {n} adapters  {name:20s} min {min(ts) * 1e3:7.1f}  median {statistics.median(ts) * 1e3:7.1f}")


if __name__ == "__main__":
    main()
