"""Quantized matmuls as Pallas kernels.

* int8 x int8: int32 accumulation over the whole contraction, scaled once at the end by
  the per-row activation scale and the per-column weight scale.
* weight-only: float activations times int8 (per-channel scale, applied after the sum) or
  packed int4 (group scales, applied while dequantizing each tile, before the dot). Weights
  stay int8/int4 in HBM and are dequantized in VMEM/registers, which is the point: decode
  is bound by reading the weights.

TPU (Mosaic): grid (M/bm, O/bn, I/bk) with the contraction last ("arbitrary") and the
accumulator in VMEM scratch. int4 weights are viewed as [I/group, group/2, O] and group
scales as [I/group, 1, O], so every block is tile-aligned and unpacking needs no reshape of
the packed tile. GPU (Triton): grid (M/bm, O/bn), the contraction is a loop in the kernel;
int4 is one group per step, its two halves multiplied by the matching halves of x.

Rows (M) are padded to the tile; weights are never padded (block_n, block_k must divide).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import check, is_pow2, pad_axis, pick_variant, round_up, scoped_vmem_bytes, sublane
from pallas_kernels.quant_matmul.common import (
    BlockSizes,
    fit_block,
    fit_vmem,
    unpack_halves,
    validate_int8,
    validate_weight_only,
)

_MATMUL = (((1,), (0,)), ((), ()))


def _tile(dim: int, want: int, align: int, name: str, given: bool) -> int:
    """A tile for an unpadded dimension: checked if the caller chose it, else fitted."""
    if not given:
        return fit_block(dim, want, align)
    b = min(want, dim)
    check(dim % b == 0, f"{name}={b} must divide {dim}")
    check(b % align == 0 or b == dim, f"{name}={b} must be a multiple of {align} (or {dim})")
    return b


def _gpu_tile(dim: int, want: int, name: str, given: bool = True) -> int:
    """A power-of-two tile of an unpadded dimension: checked if the caller chose it, else the
    largest power of two <= want that divides dim (576 -> 64)."""
    b = min(want, dim)
    while not given and b > 16 and (dim % b or not is_pow2(b)):
        b = 1 << (b.bit_length() - 1) if not is_pow2(b) else b // 2
    check(
        is_pow2(b) and b >= 16 and dim % b == 0,
        f"{name}={b} must be a power of 2 >= 16 dividing {dim} on GPU",
    )
    return b


def gpu_block_sizes(M: int) -> BlockSizes:
    """Triton defaults that fit an H100's 227 KB of shared memory per block (the TPU defaults
    asked for 288-917 KB there): skinny decode rows (M <= 16) stream the weight in [256, 64]
    tiles, so even a 4096 -> 14336 projection spreads over 224 blocks; larger M takes output
    tiles of up to [128, 128], 64 deep."""
    if M <= 16:
        return BlockSizes(block_m=16, block_n=64, block_k=256)
    return BlockSizes(block_m=min(128, max(16, 1 << (M - 1).bit_length())), block_n=128, block_k=64)


def _gpu_rows(M: int, want: int) -> int:
    check(is_pow2(want) and want >= 16, f"block_m={want} must be a power of 2 >= 16 on GPU")
    return min(want, max(16, 1 << (M - 1).bit_length()))


# ----------------------------------------------------------------------------- int8 x int8
def _int8_tpu_kernel(x_ref, xs_ref, w_ref, ws_ref, o_ref, acc_ref):
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.int32)

    acc_ref[...] += lax.dot_general(
        x_ref[...], w_ref[...], _MATMUL, preferred_element_type=jnp.int32
    )

    @pl.when(kk == pl.num_programs(2) - 1)
    def _write():
        out = acc_ref[...].astype(jnp.float32) * xs_ref[...] * ws_ref[...]
        o_ref[...] = out.astype(o_ref.dtype)


def _budget() -> int:
    """VMEM the automatic block sizes may fill: the chip's default scoped VMEM less room for
    Mosaic's own scratch."""
    return scoped_vmem_bytes() * 3 // 4


def int8_matmul_tpu(
    x, x_scale, w, w_scale, *, out_dtype=jnp.float32, block_sizes=None, interpret=False
):
    """The Mosaic variant (also what interpret mode runs on CPU); see int8_matmul_kernel."""
    from jax.experimental.pallas import tpu as pltpu

    validate_int8(x, x_scale, w, w_scale)
    bs, given = block_sizes or BlockSizes(), block_sizes is not None
    (M, I), O = x.shape, w.shape[1]
    check(bs.block_m % 32 == 0, f"block_m={bs.block_m} must be a multiple of 32 for int8 on TPU")
    bm = min(bs.block_m, round_up(M, 32))
    bn = _tile(O, bs.block_n, 128, "block_n", given)
    bk = _tile(I, bs.block_k, 128, "block_k", given)
    if not given:
        ob = jnp.dtype(out_dtype).itemsize
        bm, bk = fit_vmem(bm, bk, I=I, k_align=128, m_align=32, budget=_budget(),
                          footprint=lambda m, k: 2 * (m * k + m * 128 * 4 + k * bn + 8 * bn * 4 + m * bn * ob)
                          + m * bn * 4)
    Mp = round_up(M, bm)
    out = pl.pallas_call(
        _int8_tpu_kernel,
        out_shape=jax.ShapeDtypeStruct((Mp, O), out_dtype),
        grid=(Mp // bm, O // bn, I // bk),
        in_specs=[
            pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((bm, 1), lambda i, j, kk: (i, 0)),
            pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
            pl.BlockSpec((1, bn), lambda i, j, kk: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.int32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="int8_matmul_tpu",
    )(
        pad_axis(x, 0, Mp),
        pad_axis(x_scale.astype(jnp.float32)[:, None], 0, Mp),
        w,
        w_scale.astype(jnp.float32)[None, :],
    )
    return out[:M]


def _int8_gpu_kernel(x_ref, xs_ref, w_ref, ws_ref, o_ref, *, bk, nk):
    def body(kk, acc):
        ks = pl.ds(pl.multiple_of(kk * bk, bk), bk)
        return acc + lax.dot_general(
            x_ref[:, ks], w_ref[ks, :], _MATMUL, preferred_element_type=jnp.int32
        )

    acc = lax.fori_loop(0, nk, body, jnp.zeros(o_ref.shape, jnp.int32))
    o_ref[...] = (acc.astype(jnp.float32) * xs_ref[...] * ws_ref[...]).astype(o_ref.dtype)


def int8_matmul_gpu(
    x, x_scale, w, w_scale, *, out_dtype=jnp.float32, block_sizes=None, interpret=False
):
    """The Triton variant; see int8_matmul_kernel."""
    from jax.experimental.pallas import triton as plgpu

    validate_int8(x, x_scale, w, w_scale)
    (M, I), O = x.shape, w.shape[1]
    bs = block_sizes or gpu_block_sizes(M)
    bm = _gpu_rows(M, bs.block_m)
    given = block_sizes is not None
    bn, bk = _gpu_tile(O, bs.block_n, "block_n", given), _gpu_tile(I, bs.block_k, "block_k", given)
    Mp = round_up(M, bm)
    out = pl.pallas_call(
        functools.partial(_int8_gpu_kernel, bk=bk, nk=I // bk),
        out_shape=jax.ShapeDtypeStruct((Mp, O), out_dtype),
        grid=(Mp // bm, O // bn),
        in_specs=[
            pl.BlockSpec((bm, I), lambda i, j: (i, 0)),
            pl.BlockSpec((bm, 1), lambda i, j: (i, 0)),
            pl.BlockSpec((I, bn), lambda i, j: (0, j)),
            pl.BlockSpec((1, bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="int8_matmul_gpu",
    )(
        pad_axis(x, 0, Mp),
        pad_axis(x_scale.astype(jnp.float32)[:, None], 0, Mp),
        w,
        w_scale.astype(jnp.float32)[None, :],
    )
    return out[:M]


# ----------------------------------------------------------------------------- weight-only
def _wo_tpu_kernel(x_ref, w_ref, s_ref, o_ref, acc_ref, *, group):
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    x = x_ref[...]
    if group:  # w_ref [bk/group, group/2, bn] packed bytes, s_ref [bk/group, 1, bn]
        low, high = unpack_halves(w_ref[...])
        s = s_ref[...]
        w = jnp.concatenate([low.astype(jnp.float32) * s, high.astype(jnp.float32) * s], axis=1)
        w = w.reshape(x.shape[1], w.shape[-1]).astype(x.dtype)
    else:  # w_ref [bk, bn] int8; its per-channel scale waits for the end
        w = w_ref[...].astype(x.dtype)
    acc_ref[...] += lax.dot_general(x, w, _MATMUL, preferred_element_type=jnp.float32)

    @pl.when(kk == pl.num_programs(2) - 1)
    def _write():
        out = acc_ref[...] if group else acc_ref[...] * s_ref[...]
        o_ref[...] = out.astype(o_ref.dtype)


def weight_only_matmul_tpu(x, w, w_scale, *, block_sizes=None, interpret=False):
    """The Mosaic variant (also what interpret mode runs on CPU); see weight_only_matmul_kernel."""
    from jax.experimental.pallas import tpu as pltpu

    group = validate_weight_only(x, w, w_scale)
    bs, given = block_sizes or BlockSizes(), block_sizes is not None
    (M, I), O = x.shape, w_scale.shape[-1]
    sub = sublane(x.dtype)
    check(
        bs.block_m % sub == 0,
        f"block_m={bs.block_m} must be a multiple of {sub} for {x.dtype} on TPU",
    )
    bm = min(bs.block_m, round_up(M, sub))
    bn = _tile(O, bs.block_n, 128, "block_n", given)
    if group:
        check(group % 64 == 0, f"int4 {group=} must be a multiple of 64 on TPU (int8 tiles)")
        bk = _tile(I, bs.block_k, math.lcm(128, group), "block_k", given)
        check(bk % group == 0, f"block_k={bk} must be a multiple of {group=}")
        nb = bk // group
        w_in = w.reshape(I // group, group // 2, O)
        s_in = w_scale.astype(jnp.float32).reshape(I // group, 1, O)
        w_spec = pl.BlockSpec((nb, group // 2, bn), lambda i, j, kk: (kk, 0, j))
        s_spec = pl.BlockSpec((nb, 1, bn), lambda i, j, kk: (kk, 0, j))
    else:
        bk = _tile(I, bs.block_k, 128, "block_k", given)
        if not given:
            xb = x.dtype.itemsize
            bm, bk = fit_vmem(bm, bk, I=I, k_align=128, m_align=sub, budget=_budget(),
                              footprint=lambda m, k: 2 * (m * k * xb + k * bn + 8 * bn * 4 + m * bn * xb)
                              + m * bn * 4)
        w_in, s_in = w, w_scale.astype(jnp.float32)[None, :]
        w_spec = pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))
        s_spec = pl.BlockSpec((1, bn), lambda i, j, kk: (0, j))
    Mp = round_up(M, bm)
    out = pl.pallas_call(
        functools.partial(_wo_tpu_kernel, group=group),
        out_shape=jax.ShapeDtypeStruct((Mp, O), x.dtype),
        grid=(Mp // bm, O // bn, I // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)), w_spec, s_spec],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="weight_only_matmul_tpu",
    )(pad_axis(x, 0, Mp), w_in, s_in)
    return out[:M]


def _wo_gpu_kernel(x_ref, w_ref, s_ref, o_ref, *, group, bk):
    dt = x_ref.dtype
    if group:
        h = group // 2

        def body(g, acc):  # one group: bytes [h, bn], low nibbles rows 0..h-1, high h..2h-1
            low, high = unpack_halves(w_ref[pl.ds(pl.multiple_of(g * h, h), h), :])
            s = s_ref[pl.ds(g, 1), :]  # [1, bn]
            x_lo = x_ref[:, pl.ds(pl.multiple_of(g * group, h), h)]
            x_hi = x_ref[:, pl.ds(pl.multiple_of(g * group + h, h), h)]
            acc += lax.dot_general(
                x_lo,
                (low.astype(jnp.float32) * s).astype(dt),
                _MATMUL,
                preferred_element_type=jnp.float32,
            )
            return acc + lax.dot_general(
                x_hi,
                (high.astype(jnp.float32) * s).astype(dt),
                _MATMUL,
                preferred_element_type=jnp.float32,
            )

        steps = x_ref.shape[1] // group
    else:

        def body(kk, acc):
            ks = pl.ds(pl.multiple_of(kk * bk, bk), bk)
            return acc + lax.dot_general(
                x_ref[:, ks], w_ref[ks, :].astype(dt), _MATMUL, preferred_element_type=jnp.float32
            )

        steps = x_ref.shape[1] // bk
    acc = lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = (acc if group else acc * s_ref[...]).astype(o_ref.dtype)


def weight_only_matmul_gpu(x, w, w_scale, *, block_sizes=None, interpret=False):
    """The Triton variant; see weight_only_matmul_kernel."""
    from jax.experimental.pallas import triton as plgpu

    group = validate_weight_only(x, w, w_scale)
    (M, I), O = x.shape, w_scale.shape[-1]
    bs = block_sizes or gpu_block_sizes(M)
    bm = _gpu_rows(M, bs.block_m)
    bn = _gpu_tile(O, bs.block_n, "block_n", block_sizes is not None)
    if group:
        check(is_pow2(group) and group >= 32, f"int4 {group=} must be a power of 2 >= 32 on GPU")
        bk, s_in = group, w_scale.astype(jnp.float32)
    else:
        bk, s_in = _gpu_tile(I, bs.block_k, "block_k", block_sizes is not None), w_scale.astype(jnp.float32)[None, :]
    Mp = round_up(M, bm)
    out = pl.pallas_call(
        functools.partial(_wo_gpu_kernel, group=group, bk=bk),
        out_shape=jax.ShapeDtypeStruct((Mp, O), x.dtype),
        grid=(Mp // bm, O // bn),
        in_specs=[
            pl.BlockSpec((bm, I), lambda i, j: (i, 0)),
            pl.BlockSpec((w.shape[0], bn), lambda i, j: (0, j)),
            pl.BlockSpec((s_in.shape[0], bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="weight_only_matmul_gpu",
    )(pad_axis(x, 0, Mp), w, s_in)
    return out[:M]


# ----------------------------------------------------------------------------- public
INT8_VARIANTS = {"tpu": int8_matmul_tpu, "gpu": int8_matmul_gpu}
WEIGHT_ONLY_VARIANTS = {"tpu": weight_only_matmul_tpu, "gpu": weight_only_matmul_gpu}


def int8_matmul_kernel(
    x: jax.Array,  # int8[M, I]
    x_scale: jax.Array,  # f32[M]
    w: jax.Array,  # int8[I, O]
    w_scale: jax.Array,  # f32[O]
    *,
    out_dtype=jnp.float32,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    platform: str | None = None,  # where it runs (None: the default backend)
) -> jax.Array:  # out_dtype[M, O]
    """Pallas int8 x int8 -> int32 matmul; same contract as int8_matmul_reference."""
    fn = pick_variant(INT8_VARIANTS, "int8_matmul", platform)
    return fn(
        x, x_scale, w, w_scale, out_dtype=out_dtype, block_sizes=block_sizes, interpret=interpret
    )


def weight_only_matmul_kernel(
    x: jax.Array,  # float[M, I]
    w: jax.Array,  # int8[I, O] or packed int4 int8[I/2, O]
    w_scale: jax.Array,  # f32[O] or f32[I/group, O]
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    platform: str | None = None,  # where it runs (None: the default backend)
) -> jax.Array:  # x.dtype[M, O]
    """Pallas weight-only matmul; same contract as weight_only_matmul_reference."""
    fn = pick_variant(WEIGHT_ONLY_VARIANTS, "weight_only_matmul", platform)
    return fn(x, w, w_scale, block_sizes=block_sizes, interpret=interpret)
