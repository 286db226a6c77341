"""Ragged paged attention: query segments of any length, each over its sequence's pages.

One call covers what an engine step mixes: decode rows of one token (or a few, to verify
drafted tokens) and prompt chunks of many tokens, each reading its own sequence's cached
keys and values from a page pool in place (no dense copy of the pages).

Layout: q [T, N, H] packs every segment's query tokens; a page pool per layer, page-major as
the allocator hands pages out: v_pages [P, K, page_size, H] and k_pages the same, or
[P, K, H, page_size] with keys_transposed=True (jaxinfer's paged cache stores keys so).
Segment s has q_len[s] queries at q[q_start[s] :], the last q_len[s] tokens of a sequence
of kv_len[s] tokens whose pages are page_table[s] (so query i sits at position
kv_len[s] - q_len[s] + i; the keys of this step's tokens are written to the pages first).
A query sees the keys at positions <= its own (the last ``window`` of them with a window).
Query head n uses kv head n // (N // K). Tokens in no segment give 0. Optional ``sinks``
f32[N]: head n's softmax has one more logit, sinks[n], that weighs no value (gpt-oss).
"""

from __future__ import annotations

import jax

from pallas_kernels._common import page_kernel_fits as kernel_fits
from pallas_kernels._common import use_kernel
from pallas_kernels.ragged_paged_attention.common import BlockSizes
from pallas_kernels.ragged_paged_attention.kernel import (
    ragged_paged_attention_gpu,
    ragged_paged_attention_kernel,
    ragged_paged_attention_tpu,
)
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

__all__ = [
    "BlockSizes",
    "kernel_fits",
    "ragged_paged_attention",
    "ragged_paged_attention_gpu",
    "ragged_paged_attention_kernel",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_tpu",
]


def ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [P, K, page_size, H] ([P, K, H, page_size] if keys_transposed)
    v_pages: jax.Array,  # [P, K, page_size, H]
    page_table: jax.Array,  # i32[S, pages_per_seq]
    q_start: jax.Array,  # i32[S]
    q_len: jax.Array,  # i32[S]
    kv_len: jax.Array,  # i32[S]
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    keys_transposed: bool = False,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    platform: str | None = None,  # where it runs: "cpu", "gpu", "tpu" (None: the default backend)
    sinks: jax.Array | None = None,  # f32[N] per-head attention sinks (an extra softmax logit)
) -> jax.Array:  # [T, N, H]
    """Dispatch: the Pallas kernel on TPU/GPU or with interpret=True, else the reference."""
    fn = ragged_paged_attention_kernel if use_kernel(interpret, platform) else ragged_paged_attention_reference
    return fn(q, k_pages, v_pages, page_table, q_start, q_len, kv_len, scale=scale, window=window,
              softcap=softcap, keys_transposed=keys_transposed, block_sizes=block_sizes,
              interpret=interpret, platform=platform, sinks=sinks)
