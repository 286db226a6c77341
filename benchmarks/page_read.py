"""One layer of 64-row decode attention over SmolLM2's heads (3 KV heads, 9 query heads, head
dim 64), written several ways, timed interleaved in one process on this CPU. Which
formulation of reading a page pool does XLA CPU run well?

    python benchmarks/page_read.py --context 256 --page-size 16

* ``gather``: what the engine does: gather every row's pages ([B, c, K, H, ps]), transpose to
  [B, K, H, c*ps], score, softmax, gather and transpose the values, weighted sum.
* ``gather-2d``: the same, but each page is one row of a 2-D pool view ([P, K*H*ps]), so
  the gather copies whole contiguous pages (one index each).
* ``loop-copy``: a fori_loop of dynamic_slice / dynamic_update_slice page copies into a
  dense [B, K, H, S] buffer (memcpy-like copies instead of an elemental gather).
* ``row-slices``: each row's pages contiguous in the pool (an allocator that hands a slot a
  run of pages), read as one dynamic_slice of c pages per row (vmapped: a gather of 64 big
  slices), then transposed.
* ``dense``: the lower bound: the same attention read in place from a per-slot dense
  buffer [B, K, H, S] (no paging at all).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

K, G, H = 3, 3, 64


def _attend(q, keys, values, lens):
    """q [B, K, G, H], keys [B, K, H, S], values [B, K, S, H] -> [B, K, G, H]."""
    s = jnp.einsum("BKGH,BKHS->BKGS", q, keys)
    S = keys.shape[-1]
    ok = jnp.arange(S)[None, None, None, :] < lens[:, None, None, None]
    s = jnp.where(ok, s, -1e30)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("BKGS,BKSH->BKGH", p, values)


def gather(q, kpool, vpool, table, lens):
    kp = kpool[table]  # [B, c, K, H, ps]
    vp = vpool[table]  # [B, c, K, ps, H]
    B, c, _, _, ps = kp.shape
    keys = kp.transpose(0, 2, 3, 1, 4).reshape(B, K, H, c * ps)
    values = vp.transpose(0, 2, 1, 3, 4).reshape(B, K, c * ps, H)
    return _attend(q, keys, values, lens)


def gather_2d(q, kpool, vpool, table, lens):
    P, _, _, ps = kpool.shape
    B, c = table.shape
    kp = kpool.reshape(P, -1).at[table.reshape(-1)].get(mode="promise_in_bounds")
    vp = vpool.reshape(P, -1).at[table.reshape(-1)].get(mode="promise_in_bounds")
    keys = kp.reshape(B, c, K, H, ps).transpose(0, 2, 3, 1, 4).reshape(B, K, H, c * ps)
    values = vp.reshape(B, c, K, ps, H).transpose(0, 2, 1, 3, 4).reshape(B, K, c * ps, H)
    return _attend(q, keys, values, lens)


def loop_copy(q, kpool, vpool, table, lens):
    _, _, _, ps = kpool.shape
    B, c = table.shape
    kd = jnp.zeros((B, K, H, c * ps), kpool.dtype)
    vd = jnp.zeros((B, K, c * ps, H), vpool.dtype)

    def body(i, kv):
        kd, vd = kv
        b, j = i // c, i % c
        p = table[b, j]
        kpg = jax.lax.dynamic_slice(kpool, (p, 0, 0, 0), (1, K, H, ps))
        vpg = jax.lax.dynamic_slice(vpool, (p, 0, 0, 0), (1, K, ps, H))
        kd = jax.lax.dynamic_update_slice(kd, kpg, (b, 0, 0, j * ps))
        vd = jax.lax.dynamic_update_slice(vd, vpg, (b, 0, j * ps, 0))
        return kd, vd

    kd, vd = jax.lax.fori_loop(0, B * c, body, (kd, vd))
    return _attend(q, kd, vd, lens)


def row_slices(q, kpool, vpool, first, lens, c):
    _, _, _, ps = kpool.shape
    B = first.shape[0]
    kp = jax.vmap(lambda p: jax.lax.dynamic_slice_in_dim(kpool, p, c, 0))(first)  # [B, c, K, H, ps]
    vp = jax.vmap(lambda p: jax.lax.dynamic_slice_in_dim(vpool, p, c, 0))(first)
    keys = kp.transpose(0, 2, 3, 1, 4).reshape(B, K, H, c * ps)
    values = vp.transpose(0, 2, 1, 3, 4).reshape(B, K, c * ps, H)
    return _attend(q, keys, values, lens)


def dense(q, kd, vd, lens):
    return _attend(q, kd, vd, lens)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pages", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    B, ps = a.rows, a.page_size
    c = a.context // ps
    kpool = jnp.asarray(rng.standard_normal((a.pages, K, H, ps), np.float32))
    vpool = jnp.asarray(rng.standard_normal((a.pages, K, ps, H), np.float32))
    table = jnp.asarray(1 + rng.permutation(a.pages - 1)[: B * c].reshape(B, c).astype(np.int32))
    first = jnp.asarray(1 + rng.permutation(a.pages // c - 1)[:B].astype(np.int32) * c)
    lens = jnp.full((B,), a.context - 3, jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, K, G, H), np.float32))
    kd = jnp.asarray(rng.standard_normal((B, K, H, a.context), np.float32))
    vd = jnp.asarray(rng.standard_normal((B, K, a.context, H), np.float32))
    cases = {
        "gather": (jax.jit(gather), (q, kpool, vpool, table, lens)),
        "gather-2d": (jax.jit(gather_2d), (q, kpool, vpool, table, lens)),
        "loop-copy": (jax.jit(loop_copy), (q, kpool, vpool, table, lens)),
        "row-slices": (jax.jit(row_slices, static_argnums=5), (q, kpool, vpool, first, lens, c)),
        "dense": (jax.jit(dense), (q, kd, vd, lens)),
    }
    ref = np.asarray(cases["gather"][0](*cases["gather"][1]))
    for name, (f, args) in cases.items():
        out = np.asarray(f(*args))
        if name not in ("dense", "row-slices"):
            np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    times = {n: [] for n in cases}
    for _ in range(a.rounds):
        for name, (f, args) in cases.items():
            t = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[name].append(time.perf_counter() - t)
    kv_mb = 2 * B * K * H * a.context * 4 / 1e6
    print(f"{B} rows, context {a.context}, pages of {ps}: K+V read {kv_mb:.1f} MB; ms per layer")
    for name, ts in times.items():
        print(f"  {name:10s} min {min(ts) * 1e3:6.2f}  median {statistics.median(ts) * 1e3:6.2f}")


if __name__ == "__main__":
    main()
