"""Pure-JAX flash attention reference: one dense masked softmax per (batch, kv head).

This is also the production path wherever the kernel does not compile (XLA CPU), so it
folds the G query heads of each kv head into the rows of one batched matmul.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import MASK_VALUE
from pallas_kernels.flash_attention.common import BlockSizes, positions, validate, visible


def flash_attention_reference(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H]
    v: jax.Array,  # [B, S, K, H]
    q_start: jax.Array | None = None,  # i32[B] position of q[b, 0]; default 0
    kv_len: jax.Array | None = None,  # i32[B] keys 0..kv_len[b]-1 exist; default S
    *,
    scale: float | None = None,  # default H**-0.5
    causal: bool = True,
    window: int | None = None,  # see only the last `window` positions (incl. own)
    softcap: float | None = None,  # logits -> softcap * tanh(logits / softcap)
    block_sizes: BlockSizes | None = None,  # unused: same signature as the kernel
    interpret: bool = False,  # unused
) -> jax.Array:  # [B, T, N, H], q.dtype
    """Attention of each query (position q_start[b] + t) over keys at positions 0..S-1.

    A key is visible if it is below kv_len[b], not after the query (causal) and within the
    window. Softmax in float32; rows that see no key are zero. Keys/values at or past
    kv_len are never used, even if they hold NaN.
    """
    del block_sizes, interpret
    q_start, kv_len, scale = validate(
        q, k, v, q_start, kv_len, scale=scale, causal=causal, window=window, softcap=softcap
    )
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    with jax.named_scope("flash_attention_reference"):
        qpos = positions(q_start, T)[:, :, None]  # [B, T, 1]
        kpos = jnp.arange(S, dtype=jnp.int32)[None, None, :]
        ok = visible(qpos, kpos, kv_len[:, None, None], causal=causal, window=window)  # [B,T,S]
        qg = q.reshape(B, T, K, G, H).astype(jnp.float32)
        s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k.astype(jnp.float32)) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        ok = ok[:, None, None]  # [B, 1, 1, T, S]
        s = jnp.where(ok, s, MASK_VALUE)
        p = jnp.where(ok, jnp.exp(s - s.max(axis=-1, keepdims=True)), 0.0)
        l = p.sum(axis=-1, keepdims=True)
        live = (jnp.arange(S) < kv_len[:, None])[:, :, None, None]  # [B, S, 1, 1]
        vf = jnp.where(live, v.astype(jnp.float32), 0.0)
        o = jnp.einsum("BKGTS,BSKH->BTKGH", p / jnp.where(l == 0, 1.0, l), vf)
        return o.reshape(B, T, N, H).astype(q.dtype)
