"""Pure-JAX ragged paged attention: each query token gathers its segment's pages, then one
masked softmax. Memory grows as T x pages_per_seq x page_size: a reference for tests and the
fallback where no kernel variant exists, not a production path (jaxinfer's CPU path is
``models.packed``'s blockwise gather)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import masked_attention
from pallas_kernels.ragged_paged_attention.common import BlockSizes, validate


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, N, H] packed query tokens of every segment
    k_pages: jax.Array,  # [P, K, page_size, H] key page pool ([P, K, H, page_size] transposed)
    v_pages: jax.Array,  # [P, K, page_size, H] value page pool
    page_table: jax.Array,  # i32[S, pages_per_seq] page ids of each segment's sequence, in order
    q_start: jax.Array,  # i32[S] first token of segment s in q
    q_len: jax.Array,  # i32[S] its query tokens (0: an unused segment)
    kv_len: jax.Array,  # i32[S] tokens in its pages, its own queries' included
    *,
    scale: float | None = None,  # default H**-0.5
    window: int | None = None,  # see only the last `window` positions (own included)
    softcap: float | None = None,  # logits -> softcap * tanh(logits / softcap)
    sinks: jax.Array | None = None,  # f32[N] one more logit per head in each softmax denominator
    keys_transposed: bool = False,  # k_pages is [P, K, H, page_size]
    block_sizes: BlockSizes | None = None,  # unused: same signature as the kernel
    interpret: bool = False,  # unused
    platform: str | None = None,  # unused
) -> jax.Array:  # [T, N, H], q.dtype
    """Attention of a ragged set of query segments over their sequences' pages.

    Query i of segment s (token q_start[s] + i) sits at position kv_len[s] - q_len[s] + i
    and sees positions 0 .. its own (the last ``window`` of them with a window) of the
    sequence whose token p lives in page page_table[s, p // page_size], slot
    p % page_size. Segments must not overlap; tokens in no segment give 0, as does a query
    that sees nothing. Softmax in float32. Slots past what a query sees are never used,
    even if they hold NaN. With ``sinks`` (gpt-oss's attention sinks) head n's softmax has the
    extra logit sinks[n], which weighs no value.
    """
    del block_sizes, interpret, platform
    scale = validate(q, k_pages, v_pages, page_table, q_start, q_len, kv_len, scale=scale,
                     window=window, softcap=softcap, keys_transposed=keys_transposed, sinks=sinks)
    T, N, H = q.shape
    _, K, page_size, _ = v_pages.shape
    S, pps = page_table.shape
    G, L = N // K, pps * page_size
    with jax.named_scope("ragged_paged_attention_reference"):
        # token -> (segment, position); tokens outside every segment keep seg = S (dropped)
        t = jnp.arange(T, dtype=jnp.int32)
        inside = (t[None, :] >= q_start[:, None]) & (t[None, :] < (q_start + q_len)[:, None])  # [S, T]
        seg = jnp.where(inside.any(0), jnp.argmax(inside, axis=0), S).astype(jnp.int32)
        segc = jnp.minimum(seg, S - 1)
        qpos = kv_len[segc] - q_len[segc] + t - q_start[segc]  # i32[T]
        kg = k_pages[page_table].astype(jnp.float32)  # [S, pps, K, ...]
        if keys_transposed:  # [S, pps, K, H, ps] -> [S, K, L, H]
            kg = kg.transpose(0, 2, 1, 4, 3)
        else:  # [S, pps, K, ps, H] -> [S, K, L, H]
            kg = kg.transpose(0, 2, 1, 3, 4)
        kg = kg.reshape(S, K, L, H)[segc]  # [T, K, L, H]
        vg = v_pages[page_table].astype(jnp.float32).transpose(0, 2, 1, 3, 4).reshape(S, K, L, H)[segc]
        qg = q.reshape(T, K, G, H).astype(jnp.float32)
        s = jnp.einsum("TKGH,TKLH->TKGL", qg, kg) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        kpos = jnp.arange(L, dtype=jnp.int32)[None, :]
        ok = (kpos <= qpos[:, None]) & (seg < S)[:, None]  # [T, L]
        if window is not None:
            ok &= kpos > qpos[:, None] - window
        return masked_attention(s, ok, vg, sinks).reshape(T, N, H).astype(q.dtype)
