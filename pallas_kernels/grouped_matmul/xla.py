"""The kernel's schedule in plain JAX, for XLA backends where Pallas does not compile (CPU).

A while loop over row windows (``common.group_windows``): each multiplies up to block_m
rows of one group, from any row on, by that group's whole weight [I, O] (quantized weights
dequantized slice by slice as they are read). Unlike the kernel's tiles, windows need not
be aligned (XLA slices anywhere), so a group of up to block_m rows is read in one window.
The loop runs ``count`` times: the weights read are those of the groups that have rows,
once each while a group fits a window: on XLA CPU, ``ragged_dot`` (the reference) computes every group for every row, 64x the
work at 64 experts (measured on a 2-core CPU, 128 rows over 64 groups of [512, 256]
float32 weights: 190 ms for ragged_dot, 12 ms for this loop).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import pad_axis
from pallas_kernels.grouped_matmul.common import BlockSizes, default_block_m, group_windows, validate
from pallas_kernels.quant_matmul.common import unpack_int4

_MATMUL = (((1,), (0,)), ((), ()))


def _weight_slice(w, w_scale, layout, g):
    """Group g's weight as (values [I, O], scale f32[O] or None): float [G, I, O] indexed;
    int8 [I, G*O] a column block; int4 [I/2, G*O] a column block unpacked and scaled per
    group of rows (its scale then None)."""
    O = layout.out_size
    if not layout.quant:
        return jax.lax.dynamic_index_in_dim(w, g, keepdims=False), None
    cols = jax.lax.dynamic_slice_in_dim(w, g * O, O, axis=1)
    scale = jax.lax.dynamic_slice_in_dim(w_scale, g * O, O, axis=-1).astype(jnp.float32)
    if layout.quant == "int8":
        return cols, scale
    values = unpack_int4(cols, layout.int4_group).astype(jnp.float32)
    return values * jnp.repeat(scale, layout.int4_group, axis=0), None


def grouped_matmul_xla(
    x: jax.Array,  # [M, I] rows sorted by group
    w: jax.Array,  # [G, I, O] float, or quantized [I, G*O] / [I/2, G*O] (see common.validate)
    group_sizes: jax.Array,  # i32[num_groups]
    *,
    w_scale: jax.Array | None = None,
    out_size: int | None = None,
    group_offset=0,
    block_sizes: BlockSizes | None = None,  # block_m only (the dots take whole weights)
    interpret: bool = False,  # unused: same signature as the kernel
    platform: str | None = None,  # unused
) -> jax.Array:  # x.dtype[M, O]
    """Same contract as ``grouped_matmul_reference``."""
    del interpret, platform
    layout = validate(x, w, group_sizes, w_scale, out_size)
    M, G, O = x.shape[0], layout.groups, layout.out_size
    bm = block_sizes.block_m if block_sizes is not None else default_block_m(M, G)
    win = group_windows(group_sizes, group_offset, G, M, bm)
    xp = pad_axis(x, 0, M + bm)  # a window may start at any row

    def body(i, out):
        g, r0 = win.group[i], win.start[i]
        values, scale = _weight_slice(w, w_scale, layout, g)
        rows = jax.lax.dynamic_slice_in_dim(xp, r0, bm)
        y = jax.lax.dot_general(rows, values.astype(x.dtype), _MATMUL, preferred_element_type=jnp.float32)
        if scale is not None:
            y = y * scale
        keep = r0 + jnp.arange(bm, dtype=jnp.int32) < win.end[i]
        cur = jax.lax.dynamic_slice_in_dim(out, r0, bm)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep[:, None], y.astype(out.dtype), cur), r0, 0)

    out = jax.lax.fori_loop(0, win.count, body, jnp.zeros((M + bm, O), x.dtype))
    return out[:M]
