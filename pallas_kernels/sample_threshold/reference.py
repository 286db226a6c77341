"""The sampler's top-k and top-p thresholds in plain JAX: the exact 32-step bisection, each step
a pass over every row's logits (XLA reads them from HBM each time; the kernel once)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.sample_threshold.common import BlockSizes, bisect_threshold, validate


def count_threshold_reference(
    x: jax.Array,  # f32[B, Vp] logits, -inf padded
    t: jax.Array,  # f32[B] temperatures (> 0)
    k: jax.Array,  # i32[B]
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    platform: str | None = None,
) -> jax.Array:  # f32[B] the largest c with at least k entries of z = x / t >= c
    del block_sizes, interpret, platform
    validate(x, t, k)
    z = x / t[:, None]  # once rather than in each of 32 steps

    def count_ok(c):
        return jnp.sum(z >= c[:, None], axis=1) >= k

    return bisect_threshold(count_ok, t.shape)


def mass_threshold_reference(
    x: jax.Array,  # f32[B, Vp] logits, -inf padded
    t: jax.Array,  # f32[B] temperatures (> 0)
    m: jax.Array,  # f32[B] the row max of z = x / t (finite)
    target: jax.Array,  # f32[B]
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    platform: str | None = None,
) -> jax.Array:  # f32[B] the largest c with sum(exp(z - m) over z >= c) >= target
    del block_sizes, interpret, platform
    validate(x, t, target, m)
    z = x / t[:, None]
    e = jnp.exp(z - m[:, None])  # f32[B, Vp], once rather than in each of 32 steps

    def mass_ok(c):
        return jnp.sum(jnp.where(z >= c[:, None], e, 0.0), axis=1) >= target

    return bisect_threshold(mass_ok, t.shape)
