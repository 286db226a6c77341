"""Decode attention over a paged cache on XLA CPU, per layer, at SmolLM2's shapes: the old
dense copy of every row's pages (a gather of the table's pages + ``layers.attention``)
against the packed step's reader (``models.packed.paged_rows_attention``) under several
settings of its blocking: rows per group (``ROW_GROUP``), key positions per block
(``ROW_BLOCK_POSITIONS``) and whether scores are unrolled multiply-adds
(``UNROLL_QUERIES``), and the native kernel (``cpu_kernels.paged_rows``), over float32 pages
and over int8 ones. Interleaved, medians; pages scattered through a pool as in a running
engine.

    python benchmarks/decode_attention.py --rows 64 --context 256 384 --page-size 16 [--ragged]

With ``--ragged`` the rows' lengths spread from a tenth of the context to all of it, as in a
running batch, whose table width is set by its longest row.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer.models.packed as packed
from jaxinfer import cpu_kernels as ck
from jaxinfer.cache import QuantKV
from jaxinfer.models.layers import attention
from jaxinfer.quant import quantize_kv

# name: (ROW_GROUP, ROW_BLOCK_POSITIONS, UNROLL_QUERIES); "before" is the reader as it was
# (every row at once, blocks of 256 positions, batched dots)
SETTINGS = {
    "before: all rows, 256, dot": (1 << 20, 256, 0),
    "rows 8, 512, dot": (8, 512, 0),
    "rows 8, 512, unrolled": (8, 512, 16),
    "rows 4, 512, unrolled": (4, 512, 16),
    "rows 8, 256, unrolled": (8, 256, 16),
    "rows 8, 128, unrolled": (8, 128, 16),
    "rows 8, 64, unrolled": (8, 64, 16),
}


def _reader(setting):
    group, block, unroll = setting

    @jax.jit
    def f(q, k, v, table, pos):
        saved = packed.ROW_GROUP, packed.ROW_BLOCK_POSITIONS, packed.UNROLL_QUERIES
        packed.ROW_GROUP, packed.ROW_BLOCK_POSITIONS, packed.UNROLL_QUERIES = group, block, unroll
        try:  # the constants are read while tracing: trace the reader itself, not its jit (whose
            # cached trace would keep the first setting's constants)
            return packed.paged_rows_attention.__wrapped__(q, k, v, table, None, pos, pos.max(axis=1) + 1,
                                                           scale=0.125)
        finally:
            packed.ROW_GROUP, packed.ROW_BLOCK_POSITIONS, packed.UNROLL_QUERIES = saved

    return f


def _native(native: bool):
    """The packed step's decode reader as the engine calls it: the native kernel where
    ``native`` (float32 or int8 pools), else XLA's reader with its built-in settings."""

    @jax.jit
    def f(q, k, v, table, pos):
        return packed.paged_rows_attention(q, k, v, table, None, pos, pos.max(axis=1) + 1, scale=0.125,
                                           native=native)

    return f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, nargs="+", default=[256, 384])
    ap.add_argument("--page-size", type=int, nargs="+", default=[16])
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--ragged", action="store_true", help="row lengths spread from context/10 to context")
    a = ap.parse_args()
    B, K, N, H = a.rows, a.kv_heads, a.heads, a.head_dim
    rng = np.random.default_rng(0)
    print(f"rows {B}, K {K}, N {N}, H {H}; ms per layer (median of {a.repeats})")
    for ctx in a.context:
        for ps in a.page_size:
            n = ctx // ps
            P = 4 * B * n + 1
            k = jnp.asarray(rng.standard_normal((P, K, H, ps), np.float32))
            v = jnp.asarray(rng.standard_normal((P, K, ps, H), np.float32))
            table = jnp.asarray(rng.permutation(np.arange(1, P))[: B * n].reshape(B, n), jnp.int32)
            q = jnp.asarray(rng.standard_normal((B, 1, N, H), np.float32))
            if a.ragged:  # row lengths spread as in the batch workload, up to the table's width
                pos = jnp.asarray(rng.integers(ctx // 10, ctx - 2, (B, 1)), jnp.int32)
            else:
                pos = jnp.full((B, 1), ctx - 3, jnp.int32)

            @jax.jit
            def dense(q, k, v, table, pos):  # every row's pages copied into one dense view
                (B, n), (_, K, H, ps) = table.shape, k.shape
                keys = k[table].transpose(0, 2, 3, 1, 4).reshape(B, K, H, n * ps)
                values = v[table].transpose(0, 2, 1, 3, 4).reshape(B, K, n * ps, H)
                kpos = jnp.arange(n * ps)
                values = jnp.where((kpos[None, :] <= pos)[:, None, :, None], values, 0.0)
                return attention(q, keys, values, pos, kpos, scale=0.125)

            args = (q, k, v, table, pos)
            fns = {"dense copy": dense} | {name: _reader(s) for name, s in SETTINGS.items()}
            if ck.attention_available():
                fns["native kernel"] = _native(k.shape[3] <= ck.ROWS_MAX_PAGE)
            want = np.asarray(dense(*args))
            for f in fns.values():
                np.testing.assert_allclose(np.asarray(f(*args)), want, rtol=2e-5, atol=2e-5)
            # int8 pages: the XLA reader as built and the native kernel, over the same pools
            (kq, ks), (vq, vs) = quantize_kv(k, axis=-2), quantize_kv(v, axis=-1)
            args8 = (q, QuantKV(kq, ks, -2), QuantKV(vq, vs, -1), table, pos)
            fns8 = {"int8 pages, XLA reader": _native(False)}
            if ck.attention_available():
                fns8["int8 pages, native kernel"] = _native(True)
            want8 = np.asarray(fns8["int8 pages, XLA reader"](*args8))
            for f in fns8.values():
                np.testing.assert_allclose(np.asarray(f(*args8)), want8, rtol=2e-5, atol=2e-5)
            times = {name: [] for name in [*fns, *fns8]}
            for _ in range(a.repeats):
                for name, f in fns.items():
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(*args))
                    times[name].append(time.perf_counter() - t0)
                for name, f in fns8.items():
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(*args8))
                    times[name].append(time.perf_counter() - t0)
            mb = 2 * B * ctx * K * H * 4 / 1e6
            mb8 = mb / 4 + 2 * B * ctx * K * 4 / 1e6  # int8 values and their scales
            print(f"context {ctx}, pages of {ps} (KV read {mb:.1f} MB; int8 pages {mb8:.1f} MB):")
            for name, ts in times.items():
                m = statistics.median(ts) * 1e3
                print(f"  {name:28s} {m:7.2f} ms  {(mb8 if name in fns8 else mb) / m:5.1f} GB/s")


if __name__ == "__main__":
    main()
