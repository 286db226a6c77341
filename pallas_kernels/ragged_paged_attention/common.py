"""Ragged paged attention's shared pieces: block sizes, input validation, the work items
(query blocks) that the kernels walk, and the masks both the kernels and the reference use.

A *segment* s is a run of query tokens q[q_start[s] : q_start[s] + q_len[s]] that belong to
one sequence whose first kv_len[s] tokens sit in the pages page_table[s]. Its queries are the
last q_len[s] of those tokens: query i sits at position kv_len[s] - q_len[s] + i and sees the
keys at positions <= its own (and, with a window, fewer than ``window`` behind it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels._common import cdiv, check, check_options, check_pages


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """queries_per_block: query tokens of one segment handled by one work item (their G heads
    per kv head become G * queries_per_block rows of one tile). pages_per_block: pages per
    grid step (TPU: each its own pipelined DMA) or loop step (GPU), clipped to the table."""

    queries_per_block: int = 16
    pages_per_block: int = 8

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            check(isinstance(v, int) and v > 0, f"{f.name}={v} must be a positive int")


def validate(q, k_pages, v_pages, page_table, q_start, q_len, kv_len, *, scale, window, softcap,
             keys_transposed, sinks=None):
    """Checks shapes and options; returns the scale to use."""
    check_pages(q, k_pages, v_pages, keys_transposed=keys_transposed, rows="T")
    check(page_table.ndim == 2, f"page_table must be [S, pages_per_seq]; got {page_table.shape}")
    S = page_table.shape[0]
    for name, a in (("q_start", q_start), ("q_len", q_len), ("kv_len", kv_len)):
        check(a.shape == (S,), f"{name} must be [S]={S} (one per page-table row); got {a.shape}")
    for name, a in (("page_table", page_table), ("q_start", q_start), ("q_len", q_len),
                    ("kv_len", kv_len)):
        check(jnp.issubdtype(a.dtype, jnp.integer), f"{name} must be integer; got {a.dtype}")
    return check_options(q, scale=scale, window=window, softcap=softcap, sinks=sinks)


def max_items(T: int, S: int, queries_per_block: int) -> int:
    """Work items for T query tokens in S segments: sum_s cdiv(q_len[s], bq) <= T/bq + S."""
    return min(cdiv(T, queries_per_block) + S, T) if T else 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class WorkItems:
    """The query blocks the kernels walk: item i holds queries qoff .. qoff + nq - 1 of
    segment seq, at positions qpos0 .. qpos0 + nq - 1. Items past the last real one have
    nq = 0 (and seq, qpos0 of the last segment, so their index maps stay in bounds)."""

    seq: jax.Array  # i32[I]
    qoff: jax.Array  # i32[I]
    nq: jax.Array  # i32[I] 0..bq
    qpos0: jax.Array  # i32[I]

    def tokens(self, q_start, T: int, bq: int):
        """i32[I, bq] the packed token of each item row, T (out of range) where none."""
        j = jnp.arange(bq, dtype=jnp.int32)[None, :]
        tok = q_start[self.seq][:, None] + self.qoff[:, None] + j
        return jnp.where(j < self.nq[:, None], tok, T)


def work_items(q_len, kv_len, *, n_items: int, bq: int) -> WorkItems:
    """Split every segment's queries into blocks of bq (in segment order)."""
    q_len = jnp.maximum(q_len.astype(jnp.int32), 0)
    kv_len = kv_len.astype(jnp.int32)
    blocks = (q_len + bq - 1) // bq
    ends = jnp.cumsum(blocks)
    item = jnp.arange(n_items, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, item, side="right"), q_len.shape[0] - 1).astype(jnp.int32)
    qoff = (item - (ends - blocks)[seq]) * bq
    real = item < ends[-1]
    nq = jnp.where(real, jnp.clip(q_len[seq] - qoff, 0, bq), 0)
    qpos0 = kv_len[seq] - q_len[seq] + qoff
    return WorkItems(seq, jnp.where(real, qoff, 0), nq, qpos0)


def page_range(qpos0, nq, page_size: int, pages_per_seq: int, window: int | None):
    """Pages [first, last] holding keys that queries qpos0 .. qpos0 + nq - 1 can see, and
    whether the item has any query. Pages after the last query or wholly before the first
    query's window are skipped; their page-table entries are never dereferenced."""
    last = jnp.clip((qpos0 + nq - 1) // page_size, 0, pages_per_seq - 1)
    first = jnp.int32(0) if window is None else jnp.maximum(qpos0 - window + 1, 0) // page_size
    return jnp.minimum(first, last), last, nq > 0


def visible(row_token, kpos, qpos0, nq, window: int | None):
    """Whether item row token ``row_token`` (query qpos0 + row_token) sees the key at kpos."""
    qpos = qpos0 + row_token
    ok = (row_token < nq) & (kpos <= qpos)
    if window is not None:
        ok &= kpos > qpos - window
    return ok


def sink_tiles(sinks, K: int, bq: int, rows: int):
    """Per-head sinks f32[N] as each kv head's item-tile column f32[K, rows]: row r = t * G + g
    (token t, head g of the kv head's group) holds sinks[k * G + g]; rows past bq * G (padding)
    repeat the last."""
    G = sinks.shape[0] // K
    tile = jnp.tile(sinks.astype(jnp.float32).reshape(K, G), (1, bq))
    return jnp.pad(tile, ((0, 0), (0, rows - bq * G)), mode="edge")


def live(kpos, qpos0, nq, window: int | None):
    """Whether key position kpos lies inside what some query of the item may see: slots
    outside may hold anything (stale keys, NaN), so values there are zeroed before p @ v."""
    ok = kpos < qpos0 + nq
    if window is not None:
        ok &= kpos > qpos0 - window
    return ok
