"""Ragged paged decode attention: one new token per sequence over its cached pages.

Layout: q [B, N, H]; a page pool per layer, page-major as the allocator hands pages out:
v_pages [P, K, page_size, H] and k_pages the same, or [P, K, H, page_size] with
keys_transposed=True (jaxinfer's paged cache stores keys so, for XLA CPU); page_table
i32[B, pages_per_seq] lists each sequence's pages in order; lengths i32[B] counts its
cached tokens, the new one included (its query sits at position lengths[b] - 1). Query head
n uses kv head n // (N // K). Page-table entries past a sequence's last page are ignored.
Optional ``sinks`` f32[N]: head n's softmax has one more logit, sinks[n], that weighs no
value (gpt-oss).

What ``ragged_paged_attention`` does for segments of one query, with one [G, H] tile per
(sequence, kv head) instead of a query block of many tokens: the packed engine step's
attention on TPU/GPU when the step has only decode rows of one query each.
"""

from __future__ import annotations

import jax

from pallas_kernels._common import page_kernel_fits as kernel_fits
from pallas_kernels._common import use_kernel
from pallas_kernels.paged_attention.common import BlockSizes
from pallas_kernels.paged_attention.kernel import (
    paged_attention_gpu,
    paged_attention_kernel,
    paged_attention_tpu,
)
from pallas_kernels.paged_attention.reference import paged_attention_reference

__all__ = [
    "BlockSizes",
    "kernel_fits",
    "paged_attention",
    "paged_attention_gpu",
    "paged_attention_kernel",
    "paged_attention_reference",
    "paged_attention_tpu",
]


def paged_attention(
    q: jax.Array,  # [B, N, H]
    k_pages: jax.Array,  # [P, K, page_size, H] ([P, K, H, page_size] if keys_transposed)
    v_pages: jax.Array,  # [P, K, page_size, H]
    page_table: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,  # i32[B]
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    keys_transposed: bool = False,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    platform: str | None = None,  # where it runs: "cpu", "gpu", "tpu" (None: the default backend)
    sinks: jax.Array | None = None,  # f32[N] per-head attention sinks (an extra softmax logit)
) -> jax.Array:  # [B, N, H]
    """Dispatch: the Pallas kernel on TPU/GPU or with interpret=True, else the reference."""
    fn = paged_attention_kernel if use_kernel(interpret, platform) else paged_attention_reference
    return fn(
        q,
        k_pages,
        v_pages,
        page_table,
        lengths,
        scale=scale,
        window=window,
        softcap=softcap,
        keys_transposed=keys_transposed,
        block_sizes=block_sizes,
        interpret=interpret,
        platform=platform,
        sinks=sinks,
    )
