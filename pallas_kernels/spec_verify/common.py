"""Speculative verification's shared pieces: block sizes, input validation, the inverse-CDF
pick both the kernel and the reference use."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels._common import check


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """block_v: vocabulary entries per chunk. The kernel streams a row's logits through chunks
    of this many entries (running max and sum, then the residual's chunk masses), and a
    residual draw picks a chunk by its mass, then an entry inside it, so float32 cumulative
    sums stay short. Must divide the (padded) vocabulary."""

    block_v: int = 2048

    def __post_init__(self):
        check(self.block_v > 0 and self.block_v % 128 == 0, f"block_v={self.block_v} must be a positive multiple of 128")


def validate(z, thr, drafts, num_drafts, uniforms, greedy, draft_probs, block_sizes: BlockSizes) -> None:
    check(z.ndim == 3, f"z must be [B, k+1, V]; got {z.shape=}")
    B, J, V = z.shape
    check(J >= 2, f"z must hold k+1 >= 2 positions; got {z.shape=}")
    check(V % block_sizes.block_v == 0, f"block_v={block_sizes.block_v} must divide the vocabulary {V=} (pad with -inf)")
    check(thr.shape == (B, J), f"thr must be [B, k+1]={(B, J)}; got {thr.shape}")
    check(drafts.shape == (B, J - 1), f"drafts must be [B, k]={(B, J - 1)}; got {drafts.shape}")
    check(num_drafts.shape == (B,), f"num_drafts must be [B]={B}; got {num_drafts.shape}")
    check(uniforms.shape == (B, J, 3), f"uniforms must be [B, k+1, 3]={(B, J, 3)}; got {uniforms.shape}")
    check(greedy.shape == (B,), f"greedy must be [B]={B}; got {greedy.shape}")
    check(z.dtype == jnp.float32, f"z must be float32; got {z.dtype}")
    if draft_probs is not None:
        check(draft_probs.shape == (B, J - 1, V), f"draft_probs must be [B, k, V]={(B, J - 1, V)}; got {draft_probs.shape}")


def pick(mass: jax.Array, r: jax.Array) -> jax.Array:
    """Index of the inverse CDF of mass f32[..., N] >= 0 at r f32[...] in [0, 1); never an entry
    with zero mass (r * total can round up to the total: the last entry with mass serves)."""
    cum = jnp.cumsum(mass, axis=-1)
    i = jnp.sum(cum <= (r * cum[..., -1])[..., None], axis=-1)
    last = jnp.max(jnp.where(mass > 0, jnp.arange(mass.shape[-1]), 0), axis=-1)
    return jnp.minimum(i, last).astype(jnp.int32)


def leading(ok: jax.Array) -> jax.Array:
    """i32[B]: how many leading entries of ok bool[B, k] are true."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)
