"""Grouped matmul: rows sorted by group, each group's rows times its own weight.

The expert computation of a mixture-of-experts layer: tokens sorted by the expert they go
to, then one call per projection, ``y[r] = x[r] @ w[g]`` for row r of group g. Layout:
x [M, I] with group g's rows at [offsets[g], offsets[g + 1]) (offsets the running sum of
``group_sizes``); w [G, I, O], or quantized as ``jaxinfer.quant`` stores a weight whose group
axis is not contracted: the int8 matrix [I, G*O] with one scale per (group, output channel)
f32[G*O], or packed int4 [I/2, G*O] with scales f32[I/int4_group, G*O]. ``group_offset``
names the first group w holds (expert parallelism: each device its own experts); rows of
other groups come out 0.

Exports, besides the usual ``grouped_matmul`` (dispatch), ``grouped_matmul_kernel`` (Pallas;
megablox's schedule), ``grouped_matmul_reference`` (``jax.lax.ragged_dot``) and
``BlockSizes``: ``grouped_matmul_xla``, the kernel's schedule as a plain JAX loop, for XLA
backends without Pallas, where ragged_dot computes every group for every row.
"""

from __future__ import annotations

import jax

from pallas_kernels._common import use_kernel
from pallas_kernels.grouped_matmul.common import BlockSizes, WorkItems, default_block_m, work_items
from pallas_kernels.grouped_matmul.kernel import (
    grouped_matmul_gpu,
    grouped_matmul_kernel,
    grouped_matmul_tpu,
    kernel_fits,
)
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference
from pallas_kernels.grouped_matmul.xla import grouped_matmul_xla

__all__ = [
    "BlockSizes",
    "WorkItems",
    "default_block_m",
    "grouped_matmul",
    "grouped_matmul_gpu",
    "grouped_matmul_kernel",
    "grouped_matmul_reference",
    "grouped_matmul_tpu",
    "grouped_matmul_xla",
    "kernel_fits",
    "work_items",
]


def grouped_matmul(
    x: jax.Array,  # [M, I] rows sorted by group
    w: jax.Array,  # [G, I, O] float, or quantized [I, G*O] / [I/2, G*O]
    group_sizes: jax.Array,  # i32[num_groups]
    *,
    w_scale: jax.Array | None = None,
    out_size: int | None = None,
    group_offset=0,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    platform: str | None = None,  # where it runs: "cpu", "gpu", "tpu" (None: the default backend)
) -> jax.Array:  # x.dtype[M, O]
    """Dispatch: the Pallas kernel on TPU/GPU or with interpret=True (packed int4 there: the
    XLA loop), else the reference; the platform is the caller's (``platform``)."""
    if use_kernel(interpret, platform):
        fn = grouped_matmul_kernel if kernel_fits(w, x.shape[1]) else grouped_matmul_xla
    else:
        fn = grouped_matmul_reference
    return fn(x, w, group_sizes, w_scale=w_scale, out_size=out_size, group_offset=group_offset,
              block_sizes=block_sizes, interpret=interpret, platform=platform)
