"""Quantized matmuls' shared pieces: block sizes, validation, the int4 packing format and
dynamic per-row int8 quantization of activations.

int4 format (two values per byte, along the contracted axis, in groups): within each group
of ``group`` rows, byte i (i < group/2) holds row i in its low nibble and row i + group/2
in its high nibble, both two's-complement in [-8, 7]. Unpacking a tile of whole groups is
then two shifts and a concatenation per group, with no interleaving of rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels._common import check


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Output tile [block_m, block_n], contracted in steps of block_k. block_n and block_k
    must divide O and I (weights are never padded per call); on TPU they are multiples of
    128 (or the whole dimension), on GPU powers of two >= 16. block_m is clipped to M."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 512

    def __post_init__(self):
        check(
            min(self.block_m, self.block_n, self.block_k) > 0,
            f"block sizes must be positive: {self}",
        )


# ----------------------------------------------------------------------------- int4 format
def pack_int4(values: jax.Array, group: int) -> jax.Array:
    """int8[I, O] values in [-8, 7] -> int8[I/2, O] packed as described in the module doc."""
    I, O = values.shape
    check(group % 2 == 0 and I % group == 0, f"{group=} must be even and divide {I=}")
    v = values.astype(jnp.int32).reshape(I // group, 2, group // 2, O)
    low, high = v[:, 0], v[:, 1]
    packed = (low & 0xF) | ((high & 0xF) << 4)  # in [0, 255]
    return jnp.where(packed > 127, packed - 256, packed).astype(jnp.int8).reshape(I // 2, O)


def unpack_halves(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """int8 bytes -> (low, high) nibbles as sign-extended int32 (shifts on int32 only)."""
    b = packed.astype(jnp.int32)
    low = jax.lax.shift_right_arithmetic(jax.lax.shift_left(b, 28), 28)
    high = jax.lax.shift_right_arithmetic(b, 4)
    return low, high


def unpack_int4(packed: jax.Array, group: int) -> jax.Array:
    """int8[I/2, O] packed -> int8[I, O] values; inverse of pack_int4."""
    half, O = packed.shape
    low, high = unpack_halves(packed.reshape(2 * half // group, group // 2, O))
    return jnp.concatenate([low, high], axis=1).reshape(2 * half, O).astype(jnp.int8)


# ----------------------------------------------------------------------------- activations
def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Dynamic symmetric per-row int8: x [M, I] -> (int8[M, I], f32[M] scales), x ~ q * s."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(xf / scale[..., None]), -127, 127).astype(jnp.int8)
    return q, scale


# ----------------------------------------------------------------------------- validation
def validate_int8(x, x_scale, w, w_scale):
    check(x.ndim == 2 and w.ndim == 2, f"x must be [M, I] and w [I, O]; got {x.shape=} {w.shape=}")
    check(x.dtype == jnp.int8 and w.dtype == jnp.int8, f"{x.dtype=} and {w.dtype=} must be int8")
    check(x.shape[1] == w.shape[0], f"contracted sizes differ: {x.shape=} {w.shape=}")
    check(x_scale.shape == (x.shape[0],), f"x_scale must be [M]={x.shape[0]}; got {x_scale.shape}")
    check(w_scale.shape == (w.shape[1],), f"w_scale must be [O]={w.shape[1]}; got {w_scale.shape}")


def validate_weight_only(x, w, w_scale) -> int:
    """Checks a weight-only call; returns the int4 group size, or 0 for int8 per channel."""
    check(x.ndim == 2 and w.ndim == 2, f"x must be [M, I] and w [I, O]; got {x.shape=} {w.shape=}")
    check(jnp.issubdtype(x.dtype, jnp.floating), f"{x.dtype=} must be floating point")
    check(w.dtype == jnp.int8, f"{w.dtype=} must be int8 (int4 comes packed in int8 bytes)")
    I, (rows, O) = x.shape[1], w.shape
    if rows == I:  # int8, one scale per output channel
        check(
            w_scale.shape == (O,), f"int8 weights [I, O] need w_scale [O]={O}; got {w_scale.shape}"
        )
        return 0
    check(2 * rows == I, f"w has {rows} rows: need I={I} (int8) or I/2 (packed int4)")
    check(
        w_scale.ndim == 2
        and w_scale.shape[1] == O
        and w_scale.shape[0] > 0
        and I % w_scale.shape[0] == 0,
        f"packed int4 weights need w_scale [I/group, O]; got {w_scale.shape} for {I=} {O=}",
    )
    group = I // w_scale.shape[0]
    check(group % 2 == 0, f"int4 {group=} must be even")
    return group


def fit_vmem(bm: int, bk: int, *, I: int, k_align: int, m_align: int, footprint, budget: int) -> tuple[int, int]:
    """(bm, bk) shrunk until ``footprint(bm, bk)`` (the kernel's VMEM bytes: double-buffered
    blocks and scratch) fits in ``budget``: first the contraction step (still dividing I,
    in multiples of k_align), then the rows. A whole-dimension block_n (an O no multiple of
    128 divides, like a vocabulary split over chips) is what overflows: the LM head of a 70B
    model on v5e needed 19.8 MB against 16."""
    while footprint(bm, bk) > budget:
        smaller = fit_block(I, bk // 2, k_align) if bk // 2 >= k_align else bk
        if smaller < bk:
            bk = smaller
        elif bm // 2 >= m_align and bm % 2 == 0:
            bm //= 2
        else:
            break
    return bm, bk


def fit_block(dim: int, want: int, align: int) -> int:
    """A tile size for a dimension that is never padded: the whole dimension if it fits in
    `want`, else the largest multiple of `align` <= want that divides it, else the whole
    dimension (always a legal block)."""
    if dim <= want:
        return dim
    for b in range(want - want % align, 0, -align):
        if dim % b == 0:
            return b
    return dim
