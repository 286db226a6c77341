"""Blockwise speculative verification in plain JAX: the specification the kernel is tested
against. Materialises every position's probabilities, which the kernel never does."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.spec_verify.common import BlockSizes, leading, pick, validate


def spec_verify_reference(
    z: jax.Array,  # f32[B, J, V] shaped logits (J = k + 1 positions; temperature applied, -inf padded)
    thr: jax.Array,  # f32[B, J] entries with z < thr are filtered out (top-k / top-p / min-p)
    drafts: jax.Array,  # i32[B, k]
    num_drafts: jax.Array,  # i32[B] valid drafts per row (0..k)
    uniforms: jax.Array,  # f32[B, J, 3] per position: accept test, residual chunk, entry in chunk
    greedy: jax.Array,  # bool[B]
    draft_probs: jax.Array | None = None,  # f32[B, k, V] the draft's distribution; None: point mass
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    platform: str | None = None,
) -> tuple[jax.Array, jax.Array]:  # (accepted i32[B], next token i32[B])
    del interpret, platform
    bs = block_sizes or BlockSizes()
    validate(z, thr, drafts, num_drafts, uniforms, greedy, draft_probs, bs)
    B, J, V = z.shape
    k = J - 1
    C = bs.block_v
    keep = z >= thr[..., None]
    m = jnp.max(z, axis=-1)  # f32[B, J] (the maximum always survives the filters)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(keep, jnp.exp(z - m[..., None]), 0.0)
    p = e / jnp.sum(e, axis=-1, keepdims=True)  # f32[B, J, V]
    amax = jnp.argmax(z, axis=-1).astype(jnp.int32)  # first maximum, as the sampler's argmax

    x = drafts
    px = jnp.take_along_axis(p[:, :k], x[..., None], axis=-1)[..., 0]
    qx = (jnp.ones_like(px) if draft_probs is None
          else jnp.take_along_axis(draft_probs, x[..., None], axis=-1)[..., 0])
    valid = jnp.arange(k)[None] < num_drafts[:, None]
    ok = jnp.where(greedy[:, None], x == amax[:, :k], uniforms[:, :k, 0] * qx < px) & valid
    a = leading(ok)  # i32[B]

    at = lambda arr: jnp.take_along_axis(arr, a[:, None, None], axis=1)[:, 0]  # noqa: E731  [B, J, ...] -> [B, ...]
    p_a = at(p)  # f32[B, V]
    rejected = a < num_drafts
    ai = jnp.minimum(a, k - 1)
    if draft_probs is None:
        q_a = (jnp.arange(V)[None] == jnp.take_along_axis(x, ai[:, None], axis=1)).astype(p.dtype)
    else:
        q_a = jnp.take_along_axis(draft_probs, ai[:, None, None], axis=1)[:, 0]
    r = jnp.where(rejected[:, None], jnp.maximum(p_a - q_a, 0.0), p_a)  # f32[B, V]
    u = at(uniforms)  # f32[B, 3]
    chunks = r.reshape(B, V // C, C)
    c = pick(jnp.sum(chunks, axis=-1), u[:, 1])
    inside = jnp.take_along_axis(chunks, c[:, None, None], axis=1)[:, 0]
    tok = c * C + pick(inside, u[:, 2])
    nxt = jnp.where(greedy, jnp.take_along_axis(amax, a[:, None], axis=1)[:, 0], tok)
    return a, nxt.astype(jnp.int32)
