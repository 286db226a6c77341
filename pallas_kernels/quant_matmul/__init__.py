"""Quantized matmuls: int8 x int8 -> int32 (w8a8) and weight-only int8 / packed int4.

Layout: x [M, I] (rows are tokens), w [I, O] with the contracted axis first, as the
model's weights are stored. Scales: activations per row f32[M]; weights per output channel
f32[O], or per (group, output channel) f32[I/group, O] for int4. The int4 byte format is
defined in ``common`` (pack_int4 / unpack_int4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import use_kernel
from pallas_kernels.quant_matmul.common import BlockSizes, pack_int4, quantize_rows, unpack_int4
from pallas_kernels.quant_matmul.kernel import (
    int8_matmul_gpu,
    int8_matmul_kernel,
    int8_matmul_tpu,
    weight_only_matmul_gpu,
    weight_only_matmul_kernel,
    weight_only_matmul_tpu,
)
from pallas_kernels.quant_matmul.reference import (
    int8_matmul_reference,
    weight_only_matmul_reference,
)

__all__ = [
    "BlockSizes",
    "int8_matmul",
    "int8_matmul_gpu",
    "int8_matmul_kernel",
    "int8_matmul_reference",
    "int8_matmul_tpu",
    "pack_int4",
    "quantize_rows",
    "unpack_int4",
    "weight_only_matmul",
    "weight_only_matmul_gpu",
    "weight_only_matmul_kernel",
    "weight_only_matmul_reference",
    "weight_only_matmul_tpu",
]


def int8_matmul(
    x: jax.Array,  # int8[M, I]
    x_scale: jax.Array,  # f32[M]
    w: jax.Array,  # int8[I, O]
    w_scale: jax.Array,  # f32[O]
    *,
    out_dtype=jnp.float32,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    platform: str | None = None,  # where it runs: "cpu", "gpu", "tpu" (None: the default backend)
) -> jax.Array:  # out_dtype[M, O]
    """Dispatch: the Pallas kernel on TPU/GPU or with interpret=True, else the reference
    (XLA's native s8 x s8 -> s32 dot)."""
    fn = int8_matmul_kernel if use_kernel(interpret, platform) else int8_matmul_reference
    return fn(
        x, x_scale, w, w_scale, out_dtype=out_dtype, block_sizes=block_sizes, interpret=interpret,
        platform=platform,
    )


def weight_only_matmul(
    x: jax.Array,  # float[M, I]
    w: jax.Array,  # int8[I, O] or packed int4 int8[I/2, O]
    w_scale: jax.Array,  # f32[O] or f32[I/group, O]
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    platform: str | None = None,  # where it runs: "cpu", "gpu", "tpu" (None: the default backend)
) -> jax.Array:  # x.dtype[M, O]
    """Dispatch: the Pallas kernel on TPU/GPU or with interpret=True, else the reference."""
    fn = weight_only_matmul_kernel if use_kernel(interpret, platform) else weight_only_matmul_reference
    return fn(x, w, w_scale, block_sizes=block_sizes, interpret=interpret, platform=platform)
