"""Flash attention for prefill: causal, GQA/MQA, sliding window, soft-cap, ragged rows.

Layout (the model's): q [B, T, N, H], k and v [B, S, K, H]; query head n uses kv head
n // (N // K). Query t of row b sits at position q_start[b] + t (a prefill chunk may start
past 0); key s sits at position s and exists while s < kv_len[b].
"""

from __future__ import annotations

import jax

from pallas_kernels._common import use_kernel
from pallas_kernels.flash_attention.common import BlockSizes
from pallas_kernels.flash_attention.kernel import (
    flash_attention_gpu,
    flash_attention_kernel,
    flash_attention_tpu,
)
from pallas_kernels.flash_attention.reference import flash_attention_reference

__all__ = [
    "BlockSizes",
    "flash_attention",
    "flash_attention_gpu",
    "flash_attention_kernel",
    "flash_attention_reference",
    "flash_attention_tpu",
]


def flash_attention(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H]
    v: jax.Array,  # [B, S, K, H]
    q_start: jax.Array | None = None,  # i32[B]
    kv_len: jax.Array | None = None,  # i32[B]
    *,
    scale: float | None = None,
    causal: bool = True,
    window: int | None = None,
    softcap: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:  # [B, T, N, H]
    """Dispatch: the Pallas kernel on TPU/GPU or with interpret=True, else the reference."""
    fn = flash_attention_kernel if use_kernel(interpret) else flash_attention_reference
    return fn(
        q,
        k,
        v,
        q_start,
        kv_len,
        scale=scale,
        causal=causal,
        window=window,
        softcap=softcap,
        block_sizes=block_sizes,
        interpret=interpret,
    )
