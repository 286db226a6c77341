"""Grouped matmul as Pallas kernels (megablox's schedule).

TPU (Mosaic): grid (O/bn, W, I/bk) over the work list (``common.work_items``), which rides in
as scalar prefetch: item w multiplies row tile ``tile[w]`` of x by group ``group[w]``'s weight,
both fetched by their BlockSpecs' index maps, and keeps the rows of that group when it writes
its output tile. Items that share a row tile are consecutive, so that output tile stays in
VMEM while they fill in their rows (the item axis is "arbitrary"). Padding items of the
static work list compute nothing and keep their predecessor's blocks.

GPU (Triton): grid (M/bm, O/bn): each output tile loops over the items of its row tile (a
range of the same work list) and, in each, over the contraction, with the rows of other
groups masked out of x; it writes its tile once, so programs never share an output.

Both take the float weight [G, I, O] and the int8 matrix [I, G*O] of a quantized one (one
scale per group and output channel, applied after the sum). Packed int4 is left to
``xla.grouped_matmul_xla`` (``kernel_fits`` says so). Rows of groups the weight does not
hold, and padding rows, come out 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import check, is_pow2, next_pow2, pad_axis, pick_variant, round_up, sublane
from pallas_kernels.grouped_matmul.common import (
    BlockSizes,
    default_block_m,
    local_row_mask,
    validate,
    work_items,
)
from pallas_kernels.quant_matmul.common import fit_block

_MATMUL = (((1,), (0,)), ((), ()))


def _tile(dim: int, want: int, align: int, name: str, given: bool) -> int:
    """A tile for an unpadded dimension: checked if the caller chose it, else fitted."""
    if not given:
        return fit_block(dim, want, align)
    b = min(want, dim)
    check(dim % b == 0, f"{name}={b} must divide {dim}")
    check(b % align == 0 or b == dim, f"{name}={b} must be a multiple of {align} (or {dim})")
    return b


def _finish(y, x, group_sizes, group_offset, groups: int, M: int):
    """The kernel's padded output -> [M, O], rows outside the weight's groups 0 (the TPU
    variant never writes those rows)."""
    keep = local_row_mask(group_sizes, group_offset, groups, M)
    return jnp.where(keep[:, None], y[:M], jnp.zeros((), x.dtype))


# ----------------------------------------------------------------------------- TPU (Mosaic)
def _tpu_kernel(group_ref, tile_ref, lo_ref, hi_ref, x_ref, w_ref, *rest, bm: int, quant: bool):
    s_ref, o_ref, acc_ref = rest if quant else (None, *rest)
    it, kk = pl.program_id(1), pl.program_id(2)
    lo, hi = lo_ref[it], hi_ref[it]

    @pl.when(kk == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(hi > lo)
    def _dot():
        x = x_ref[...]
        acc_ref[...] += lax.dot_general(x, w_ref[...].astype(x.dtype), _MATMUL, preferred_element_type=jnp.float32)

    @pl.when(kk == pl.num_programs(2) - 1)
    def _write():
        rows = tile_ref[it] * bm + lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0)
        keep = (rows >= lo) & (rows < hi)
        out = acc_ref[...] * s_ref[...] if quant else acc_ref[...]
        o_ref[...] = jnp.where(keep, out.astype(o_ref.dtype), o_ref[...])


def grouped_matmul_tpu(x, w, group_sizes, *, w_scale=None, out_size=None, group_offset=0, block_sizes=None,
                       interpret=False):
    """The Mosaic variant (also what interpret mode runs on CPU); see grouped_matmul_kernel."""
    from jax.experimental.pallas import tpu as pltpu

    layout = validate(x, w, group_sizes, w_scale, out_size)
    check(layout.quant != "int4", "the grouped matmul kernel takes float or int8 weights; int4 runs "
                                  "grouped_matmul_xla")
    bs, given = block_sizes or BlockSizes(), block_sizes is not None
    (M, I), G, O = x.shape, layout.groups, layout.out_size
    sub = sublane(x.dtype)
    bm = bs.block_m if given else default_block_m(M, G, lo=sub)
    check(bm % sub == 0, f"block_m={bm} must be a multiple of {sub} for {x.dtype} on TPU")
    quant = bool(layout.quant)
    bn = _tile(O, bs.block_n, 128, "block_n", given)
    if not (given or quant) and bn == O > bs.block_n:
        # no multiple of 128 divides O (gpt-oss's 2,880): a whole-O block of a wide contraction
        # overflows scoped VMEM (2 x 2880 x 2880 bf16, 33 MB), so the last block runs past O
        # instead; Pallas pads its reads and drops its writes there. (An int8 weight's groups
        # sit side by side in its columns, so its blocks must divide O.)
        bn = max(128, bs.block_n - bs.block_n % 128)
    bk = _tile(I, bs.block_k, 128, "block_k", given)
    items = work_items(group_sizes, group_offset, G, M, bm)
    W = items.group.shape[0]
    Mp = round_up(M, bm)
    nb = -(-O // bn)
    if quant:  # [I, G*O]: group g's output tile j is column block g * O/bn + j
        w_spec = pl.BlockSpec((bk, bn), lambda j, it, kk, g, t, lo, hi: (kk, g[it] * nb + j))
        extra = ([pl.BlockSpec((1, bn), lambda j, it, kk, g, t, lo, hi: (0, g[it] * nb + j))],
                 [w_scale.astype(jnp.float32).reshape(1, -1)])
    else:
        w_spec = pl.BlockSpec((None, bk, bn), lambda j, it, kk, g, t, lo, hi: (g[it], kk, j))
        extra = ([], [])
    out = pl.pallas_call(
        functools.partial(_tpu_kernel, bm=bm, quant=quant),
        out_shape=jax.ShapeDtypeStruct((Mp, O), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(nb, W, I // bk),
            in_specs=[pl.BlockSpec((bm, bk), lambda j, it, kk, g, t, lo, hi: (t[it], kk)), w_spec, *extra[0]],
            out_specs=pl.BlockSpec((bm, bn), lambda j, it, kk, g, t, lo, hi: (t[it], j)),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        name="grouped_matmul_tpu",
    )(items.group, items.tile, items.lo, items.hi, pad_axis(x, 0, Mp), w, *extra[1])
    return _finish(out, x, group_sizes, group_offset, G, M)


# ----------------------------------------------------------------------------- GPU (Triton)
def _gpu_kernel(first_ref, end_ref, group_ref, lo_ref, hi_ref, x_ref, w_ref, *rest, bm: int, bk: int, nk: int,
                quant: bool):
    s_ref, o_ref = rest if quant else (None, *rest)
    rows = pl.program_id(0) * bm + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    dt = x_ref.dtype

    def item(it, acc):
        g = group_ref[it]
        keep = (rows >= lo_ref[it]) & (rows < hi_ref[it])

        def step(kk, part):
            ks = pl.ds(pl.multiple_of(kk * bk, bk), bk)
            xs = jnp.where(keep, x_ref[:, ks], jnp.zeros((), dt))
            wt = w_ref[ks, g, :] if quant else w_ref[g, ks, :]
            return part + lax.dot_general(xs, wt.astype(dt), _MATMUL, preferred_element_type=jnp.float32)

        part = lax.fori_loop(0, nk, step, jnp.zeros(o_ref.shape, jnp.float32))
        return acc + (part * s_ref[g] if quant else part)

    acc = lax.fori_loop(first_ref[0], end_ref[0], item, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


# Triton defaults (block_m follows the mean group size): an output tile of [bm, 64] and a
# [64, 64] weight slice per step stay far under an H100's shared memory at any bm <= 128.
GPU_BLOCK_SIZES = BlockSizes(block_m=16, block_n=64, block_k=64)


def _gpu_tile(dim: int, want: int, name: str, given: bool) -> int:
    """A power-of-two tile >= 16 dividing an unpadded dimension: checked if the caller chose
    it, else the largest one <= want."""
    b = min(want, dim)
    while not given and b > 16 and (dim % b or not is_pow2(b)):
        b = 1 << (b.bit_length() - 1) if not is_pow2(b) else b // 2
    check(is_pow2(b) and b >= 16 and dim % b == 0, f"{name}={b} must be a power of 2 >= 16 dividing {dim} on GPU")
    return b


def grouped_matmul_gpu(x, w, group_sizes, *, w_scale=None, out_size=None, group_offset=0, block_sizes=None,
                       interpret=False):
    """The Triton variant; see grouped_matmul_kernel."""
    from jax.experimental.pallas import triton as plgpu

    layout = validate(x, w, group_sizes, w_scale, out_size)
    check(layout.quant != "int4", "the grouped matmul kernel takes float or int8 weights; int4 runs "
                                  "grouped_matmul_xla")
    given, bs = block_sizes is not None, block_sizes or GPU_BLOCK_SIZES
    (M, I), G, O = x.shape, layout.groups, layout.out_size
    bm = bs.block_m if given else default_block_m(M, G, lo=16)
    check(is_pow2(bm) and bm >= 16, f"block_m={bm} must be a power of 2 >= 16 on GPU")
    bn = _gpu_tile(O, bs.block_n, "block_n", given)
    bk = _gpu_tile(I, bs.block_k, "block_k", given)
    items = work_items(group_sizes, group_offset, G, M, bm)
    W = items.group.shape[0]
    tiles = round_up(M, bm) // bm
    # each row tile's items: a range of the list (items of one tile are consecutive)
    key = jnp.where(jnp.arange(W) < items.count, items.tile, tiles)
    t = jnp.arange(tiles, dtype=jnp.int32)
    first = jnp.searchsorted(key, t, side="left").astype(jnp.int32)
    end = jnp.searchsorted(key, t, side="right").astype(jnp.int32)
    Wp = next_pow2(W)  # Triton blocks are powers of two
    meta = [pad_axis(a, 0, Wp) for a in (items.group, items.lo, items.hi)]
    quant = bool(layout.quant)
    if quant:  # [I, G*O] viewed [I, G, O]; scales [G, 1, O]
        w_in = w.reshape(I, G, O)
        w_spec = pl.BlockSpec((I, G, bn), lambda i, j: (0, 0, j))
        extra_specs = [pl.BlockSpec((G, 1, bn), lambda i, j: (0, 0, j))]
        extra = [w_scale.astype(jnp.float32).reshape(G, 1, O)]
    else:
        w_in, w_spec = w, pl.BlockSpec((G, I, bn), lambda i, j: (0, 0, j))
        extra_specs, extra = [], []
    Mp = tiles * bm
    out = pl.pallas_call(
        functools.partial(_gpu_kernel, bm=bm, bk=bk, nk=I // bk, quant=quant),
        out_shape=jax.ShapeDtypeStruct((Mp, O), x.dtype),
        grid=(tiles, O // bn),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (i,)),
            pl.BlockSpec((1,), lambda i, j: (i,)),
            *[pl.BlockSpec((Wp,), lambda i, j: (0,))] * 3,
            pl.BlockSpec((bm, I), lambda i, j: (i, 0)),
            w_spec,
            *extra_specs,
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="grouped_matmul_gpu",
    )(first, end, *meta, pad_axis(x, 0, Mp), w_in, *extra)
    return _finish(out, x, group_sizes, group_offset, G, M)


# ----------------------------------------------------------------------------- public
VARIANTS = {"tpu": grouped_matmul_tpu, "gpu": grouped_matmul_gpu}


def kernel_fits(w: jax.Array, in_size: int) -> bool:
    """Whether the kernel takes this weight of a contraction over in_size (float [G, I, O]
    or int8 [I, G*O]); packed int4 [I/2, G*O] goes to ``xla.grouped_matmul_xla``."""
    return w.ndim == 3 or (w.ndim == 2 and w.shape[0] == in_size)


def grouped_matmul_kernel(
    x: jax.Array,  # [M, I] rows sorted by group
    w: jax.Array,  # [G, I, O] float, or int8 [I, G*O]
    group_sizes: jax.Array,  # i32[num_groups]
    *,
    w_scale: jax.Array | None = None,  # f32[G*O] for int8
    out_size: int | None = None,  # O, for int8
    group_offset=0,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    platform: str | None = None,  # where it runs (None: the default backend)
) -> jax.Array:  # x.dtype[M, O]
    """Pallas grouped matmul; same contract as grouped_matmul_reference."""
    fn = pick_variant(VARIANTS, "grouped_matmul", platform)
    return fn(x, w, group_sizes, w_scale=w_scale, out_size=out_size, group_offset=group_offset,
              block_sizes=block_sizes, interpret=interpret)
