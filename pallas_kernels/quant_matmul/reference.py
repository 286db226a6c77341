"""Pure-JAX quantized matmuls. On XLA CPU the int8 one is the native s8 x s8 -> s32 dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quant_matmul.common import (
    BlockSizes,
    unpack_int4,
    validate_int8,
    validate_weight_only,
)

_MATMUL = (((1,), (0,)), ((), ()))


def int8_matmul_reference(
    x: jax.Array,  # int8[M, I] activations (see quantize_rows)
    x_scale: jax.Array,  # f32[M] per-row (per-token) scales
    w: jax.Array,  # int8[I, O] weights
    w_scale: jax.Array,  # f32[O] per-output-channel scales
    *,
    out_dtype=jnp.float32,
    block_sizes: BlockSizes | None = None,  # unused: same signature as the kernel
    interpret: bool = False,  # unused
    platform: str | None = None,  # unused
) -> jax.Array:  # out_dtype[M, O]
    """(x @ w) accumulated exactly in int32, then scaled: x_scale[m] * w_scale[o]."""
    del block_sizes, interpret, platform
    validate_int8(x, x_scale, w, w_scale)
    acc = jax.lax.dot_general(x, w, _MATMUL, preferred_element_type=jnp.int32)
    out = (
        acc.astype(jnp.float32) * x_scale[:, None].astype(jnp.float32) * w_scale.astype(jnp.float32)
    )
    return out.astype(out_dtype)


def dequantize_weight(w: jax.Array, w_scale: jax.Array, group: int, dtype) -> jax.Array:
    """Packed int4 [I/2, O] with group scales [I/group, O] -> dtype[I, O]."""
    values = unpack_int4(w, group).astype(jnp.float32)
    scale = jnp.repeat(w_scale.astype(jnp.float32), group, axis=0)
    return (values * scale).astype(dtype)


def weight_only_matmul_reference(
    x: jax.Array,  # float[M, I]
    w: jax.Array,  # int8[I, O], or int8[I/2, O] packed int4 (see pack_int4)
    w_scale: jax.Array,  # f32[O] for int8; f32[I/group, O] for int4
    *,
    block_sizes: BlockSizes | None = None,  # unused: same signature as the kernel
    interpret: bool = False,  # unused
    platform: str | None = None,  # unused
) -> jax.Array:  # x.dtype[M, O]
    """x @ dequantized(w), accumulated in float32. int8: (x @ w) * w_scale (the per-channel
    scale commutes with the sum); int4: every group dequantized with its own scale first."""
    del block_sizes, interpret, platform
    group = validate_weight_only(x, w, w_scale)
    if group:
        acc = jax.lax.dot_general(
            x,
            dequantize_weight(w, w_scale, group, x.dtype),
            _MATMUL,
            preferred_element_type=jnp.float32,
        )
    else:
        acc = jax.lax.dot_general(x, w.astype(x.dtype), _MATMUL, preferred_element_type=jnp.float32)
        acc = acc * w_scale.astype(jnp.float32)
    return acc.astype(x.dtype)
