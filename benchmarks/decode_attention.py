"""Decode attention over a paged cache on XLA CPU: one dense copy of every row's pages (the
old path, ``cache.PagedKVCache.read_layer`` + ``layers.attention``) against reading a block
of page columns at a time into a running softmax (``models.packed.paged_rows_attention``),
per layer, at SmolLM2's shapes, interleaved, medians.

    python benchmarks/decode_attention.py --rows 64 --context 256 512 --page-size 16 64 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cache import PagedKVCache
from jaxinfer.models.layers import attention
from jaxinfer.models.packed import paged_rows_attention


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--page-size", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args()
    B, K, N, H = a.rows, a.kv_heads, a.heads, a.head_dim
    rng = np.random.default_rng(0)
    print(f"rows {B}, K {K}, N {N}, H {H}; ms per layer (median of {a.repeats})")
    for ctx in a.context:
        for ps in a.page_size:
            n = ctx // ps
            P = 2 * B * n + 1
            k = jnp.asarray(rng.standard_normal((P, K, H, ps), np.float32))
            v = jnp.asarray(rng.standard_normal((P, K, ps, H), np.float32))
            table = jnp.asarray(rng.permutation(np.arange(1, P))[: B * n].reshape(B, n), jnp.int32)
            q = jnp.asarray(rng.standard_normal((B, 1, N, H), np.float32))
            pos = jnp.full((B, 1), ctx - 3, jnp.int32)
            end = pos[:, 0] + 1

            @jax.jit
            def dense(q, k, v, table, pos):
                keys, values, kpos = PagedKVCache([k], [v], table).read_layer(0, pos[:, 0] + 1)
                return attention(q, keys, values, pos, kpos, scale=0.125)

            @jax.jit
            def blocks(q, k, v, table, pos):
                return paged_rows_attention(q, k, v, table, None, pos, pos.max(axis=1) + 1, scale=0.125)

            args = (q, k, v, table, pos)
            np.testing.assert_allclose(np.asarray(dense(*args)), np.asarray(blocks(*args)), rtol=2e-5, atol=2e-5)
            del end
            times = {"dense copy": [], "page blocks": []}
            for _ in range(a.repeats):
                for name, f in (("dense copy", dense), ("page blocks", blocks)):
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(*args))
                    times[name].append(time.perf_counter() - t0)
            d, b = (statistics.median(times[x]) * 1e3 for x in ("dense copy", "page blocks"))
            mb = 2 * B * ctx * K * H * 4 / 1e6
            print(f"context {ctx:4d} page {ps:3d}: dense copy {d:6.2f} ms, page blocks {b:6.2f} ms "
                  f"({d / b:.2f}x); KV read {mb:.1f} MB -> {mb / b:.1f} GB/s")


if __name__ == "__main__":
    main()
