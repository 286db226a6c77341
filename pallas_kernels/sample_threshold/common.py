"""The sampler's thresholds' shared pieces: the exact bisection over the float ordering (the
reference's loop, and the kernel's over its block of rows), block sizes, input validation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels._common import check


def to_ordered(x: jax.Array) -> jax.Array:
    """f32 -> i32 whose signed order is the float order (the map is its own inverse)."""
    b = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(b >= 0, b, b ^ 0x7FFFFFFF)


def from_ordered(k: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(jnp.where(k >= 0, k, k ^ 0x7FFFFFFF), jnp.float32)


def bisect_threshold(pred, shape: tuple[int, ...]) -> jax.Array:
    """f32[shape]: the largest float c with pred(c) true, for pred (f32[shape] -> bool[shape])
    non-increasing with pred(-inf) true.

    Exact: a binary search over the ordered int image of all non-NaN floats, 32 steps."""
    lo = jnp.full(shape, to_ordered(jnp.float32(-jnp.inf)), jnp.int32)
    hi = jnp.full(shape, to_ordered(jnp.float32(jnp.inf)), jnp.int32)

    def step(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        ok = pred(from_ordered(mid))
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 32, step, (lo, hi))
    return from_ordered(lo)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """block_v: logits per inner-loop chunk of a step's pass over a row block (per-lane
    partial sums of this width; a multiple of 128). store_exp: whether the mass kernel keeps
    exp(z - m) in VMEM rather than recompute it in each of the 32 steps (None: when it fits;
    ``kernel.plan``)."""

    block_v: int = 1024
    store_exp: bool | None = None

    def __post_init__(self):
        check(self.block_v > 0 and self.block_v % 128 == 0, f"block_v={self.block_v} must be a positive multiple of 128")


def validate(x, t, bound, m=None) -> None:
    """x f32[B, Vp] (Vp a multiple of 128, padded with -inf), t f32[B] temperatures > 0, bound
    the per-row k i32[B] (count) or target f32[B] (mass), m f32[B] the row max of x / t (mass)."""
    check(x.ndim == 2, f"x must be [B, Vp]; got {x.shape=}")
    B, Vp = x.shape
    check(Vp % 128 == 0, f"the vocabulary {Vp=} must be a multiple of 128 (pad with -inf)")
    check(x.dtype == jnp.float32, f"x must be float32; got {x.dtype}")
    check(t.shape == (B,), f"t must be [B]={B}; got {t.shape}")
    check(bound.shape == (B,), f"the bound (k or target) must be [B]={B}; got {bound.shape}")
    if m is not None:
        check(m.shape == (B,), f"m must be [B]={B}; got {m.shape}")
