"""The reference grouped matmul: ``jax.lax.ragged_dot``.

ragged_dot multiplies the rows of group g by weight g for groups 0 .. G-1 laid out from row
0; a weight holding groups group_offset .. + G - 1 is handled by rolling those groups' rows
to the top first and back after. int8 weights are multiplied as integers in x's dtype and scaled after the sum (the
per-channel scale commutes with it); int4 ones are dequantized whole to [G, I, O] first.

XLA CPU lowers ragged_dot to one dense dot over every group with the rows masked, G times
the work of the product itself: the reference to hold implementations to, not a fast path
there (see ``xla.grouped_matmul_xla``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul.common import BlockSizes, local_bounds, local_row_mask, validate
from pallas_kernels.quant_matmul.common import unpack_int4


def dequantize_groups(w: jax.Array, w_scale: jax.Array, layout, dtype) -> jax.Array:
    """A quantized [I, G*O] (int8) or [I/2, G*O] (packed int4) weight -> dtype[G, I, O]."""
    G, I, O = layout.groups, layout.in_size, layout.out_size
    if layout.quant == "int4":
        values = unpack_int4(w, layout.int4_group).astype(jnp.float32)
        dense = values * jnp.repeat(w_scale.astype(jnp.float32), layout.int4_group, axis=0)
    else:
        dense = w.astype(jnp.float32) * w_scale.astype(jnp.float32)
    return dense.reshape(I, G, O).transpose(1, 0, 2).astype(dtype)


def grouped_matmul_reference(
    x: jax.Array,  # [M, I] rows sorted by group
    w: jax.Array,  # [G, I, O] float, or quantized [I, G*O] / [I/2, G*O] (see common.validate)
    group_sizes: jax.Array,  # i32[num_groups] rows of each group, in order
    *,
    w_scale: jax.Array | None = None,  # f32[G*O] (int8) or f32[I/int4_group, G*O] (int4)
    out_size: int | None = None,  # O, for the quantized forms
    group_offset=0,  # i32[]: the weight's group 0 is group group_offset of group_sizes
    block_sizes: BlockSizes | None = None,  # unused: same signature as the kernel
    interpret: bool = False,  # unused
    platform: str | None = None,  # unused
) -> jax.Array:  # x.dtype[M, O]; rows of groups the weight does not hold are 0
    """y[r] = x[r] @ w[g - group_offset] for row r of group g, in float32, cast to x.dtype."""
    del block_sizes, interpret, platform
    layout = validate(x, w, group_sizes, w_scale, out_size)
    G, I, O = layout.groups, layout.in_size, layout.out_size
    if layout.quant == "int8":  # the per-channel scale commutes with the sum: applied after it
        dense = w.reshape(I, G, O).transpose(1, 0, 2)
    else:
        dense = w if not layout.quant else dequantize_groups(w, w_scale, layout, x.dtype)
    M = x.shape[0]
    starts, ends = local_bounds(group_sizes, group_offset, G)
    local = ends - starts
    shift = starts[0]
    # rows of the weight's groups first; ragged_dot gives 0 past the last of them
    y = jax.lax.ragged_dot(jnp.roll(x, -shift, axis=0), dense.astype(x.dtype), local,
                           preferred_element_type=jnp.float32)
    y = jnp.roll(y, shift, axis=0)
    if layout.quant == "int8":
        g = jnp.minimum(jnp.searchsorted(ends, jnp.arange(M, dtype=jnp.int32), side="right"), G - 1)
        y = y * w_scale.astype(jnp.float32).reshape(G, O)[g]
    y = jnp.where(local_row_mask(group_sizes, group_offset, G, M)[:, None], y, 0.0)
    return y.astype(x.dtype)
