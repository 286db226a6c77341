"""Pure-JAX paged decode attention: gather each sequence's pages, then one masked softmax.

Also the production path where the kernel does not compile (XLA CPU): the G query heads of
a kv head are rows of one batched matmul over (B, K).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import masked_attention
from pallas_kernels.paged_attention.common import BlockSizes, validate, visible


def paged_attention_reference(
    q: jax.Array,  # [B, N, H] the one new token of each sequence, at position lengths[b]-1
    k_pages: jax.Array,  # [P, K, page_size, H] the key page pool ([P, K, H, page_size] transposed)
    v_pages: jax.Array,  # [P, K, page_size, H] the value page pool
    page_table: jax.Array,  # i32[B, pages_per_seq] page ids of each sequence, in order
    lengths: jax.Array,  # i32[B] tokens cached per sequence (<= pages_per_seq * page_size)
    *,
    scale: float | None = None,  # default H**-0.5
    window: int | None = None,  # see only the last `window` tokens
    softcap: float | None = None,  # logits -> softcap * tanh(logits / softcap)
    keys_transposed: bool = False,  # k_pages is [P, K, H, page_size]
    block_sizes: BlockSizes | None = None,  # unused: same signature as the kernel
    interpret: bool = False,  # unused
    platform: str | None = None,  # unused
    sinks: jax.Array | None = None,  # f32[N] one more logit per head in each softmax denominator
) -> jax.Array:  # [B, N, H], q.dtype
    """Decode attention over the first lengths[b] tokens of each sequence's pages.

    Token s of sequence b lives in page page_table[b, s // page_size] at slot
    s % page_size. Softmax in float32; a row with length 0 is zero. Slots at or past the
    length are never used, even if they hold NaN. With ``sinks`` (gpt-oss's attention sinks)
    head n's softmax has the extra logit sinks[n], which weighs no value.
    """
    del block_sizes, interpret, platform
    scale = validate(
        q,
        k_pages,
        v_pages,
        page_table,
        lengths,
        scale=scale,
        window=window,
        softcap=softcap,
        keys_transposed=keys_transposed,
        sinks=sinks,
    )
    B, N, H = q.shape
    _, K, page_size, _ = v_pages.shape
    G, S = N // K, page_table.shape[1] * page_size
    with jax.named_scope("paged_attention_reference"):
        qg = q.reshape(B, K, G, H).astype(jnp.float32)
        kg = k_pages[page_table].astype(jnp.float32)  # [B, pages, K, ...]
        if keys_transposed:  # [B, pages, K, H, ps] -> [B, K, H, S]
            kg = kg.transpose(0, 2, 3, 1, 4).reshape(B, K, H, S)
            s = jnp.einsum("BKGH,BKHS->BKGS", qg, kg) * scale
        else:  # [B, pages, K, ps, H] -> [B, K, S, H]
            kg = kg.transpose(0, 2, 1, 3, 4).reshape(B, K, S, H)
            s = jnp.einsum("BKGH,BKSH->BKGS", qg, kg) * scale
        vg = v_pages[page_table].astype(jnp.float32).transpose(0, 2, 1, 3, 4).reshape(B, K, S, H)
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        ok = visible(jnp.arange(S, dtype=jnp.int32)[None, :], lengths[:, None], window)  # [B, S]
        return masked_attention(s, ok, vg, sinks).reshape(B, N, H).astype(q.dtype)
