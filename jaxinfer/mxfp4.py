"""MXFP4 (OCP microscaling FP4), as gpt-oss checkpoints store their expert weights.

Each block of 32 consecutive values along a weight's input axis is 16 bytes of FP4 (E2M1)
codes, two a byte, the low nibble first, and one uint8 E8M0 scale: the block's values are the
codes' values times 2**(scale - 127). Hugging Face checkpoints keep a projection ``p`` as
``p_blocks`` u8[..., O, I/32, 16] and ``p_scales`` u8[..., O, I/32] (the output axis before the
input axis, as torch's Linear stores it).
"""

from __future__ import annotations

import numpy as np

from jaxinfer.errors import CheckpointError

# the value of each 4-bit E2M1 code (sign bit highest)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCK = 32  # values per scale


def dequantize(blocks: np.ndarray, scales: np.ndarray, *, name: str = "") -> np.ndarray:
    """blocks u8[..., G, 16] and scales u8[..., G] -> f32[..., G * 32] (exact: every value is
    a small integer multiple of a power of two)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise CheckpointError(f"MXFP4 tensor {name!r}: blocks and scales must be uint8, got {blocks.dtype} and "
                              f"{scales.dtype}")
    if blocks.shape[-1:] != (BLOCK // 2,) or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(f"MXFP4 tensor {name!r}: blocks {blocks.shape} do not match scales {scales.shape} "
                              f"(want blocks [..., G, {BLOCK // 2}] and scales [..., G])")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*scales.shape, BLOCK)
    values = np.ldexp(FP4_VALUES[codes], scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*scales.shape[:-1], -1)
