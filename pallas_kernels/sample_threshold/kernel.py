"""The sampler's top-k and top-p thresholds as a Pallas TPU kernel: a block of rows is read
from HBM into VMEM once, and all 32 bisection steps run over it there.

The reference's bisection is one pass over f32[B, Vp] per step: at 256 rows of a 128,256-token
vocabulary XLA reads 131 MB 32 times per threshold. Here each program copies R = 8 whole rows
(fewer when B < 8) into VMEM, turns them into z = x / t in place, and each step sums over them
lane chunk by lane chunk (``BlockSizes.block_v`` logits at a time into per-lane partial sums,
then one reduction; a static tail when block_v does not divide Vp, as at V = 128,256).

* count (top-k): the largest c with sum(z >= c) >= k, exact integer logic, so the kernel's
  result equals the reference's bit for bit.
* mass (top-p): the largest c with sum(where(z >= c, exp(z - m), 0)) >= target. The sum runs
  in another order than XLA's, so where the mass at some float is within rounding of the
  target the two may settle one threshold apart; elsewhere they are equal.

Both are the reference's arithmetic in interpret mode (the tests hold them equal there). On a
chip Mosaic computes x / t and exp itself; where it rounds otherwise than XLA's fusion (XLA:CPU
already divides by an ulp otherwise inside a fusion than op by op) a threshold can move only
where a logit lies within that ulp of it. Not checked on a chip: none was at hand.

Why one copy and no double-buffered BlockSpec: a block's 32 steps take far longer than its
copy (each step is a pass over the block in VMEM), so overlapping the copy gains little, and a
second buffer would not fit: 8 rows of 262,144 logits are 8 MB, and two of them fill a v5e's
16 MB of scoped VMEM. VMEM per program: the rows as z (R x Vp x 4 bytes) and, for the mass,
exp(z - m) when it fits 3/4 of the chip's scoped VMEM (``plan``); otherwise each step
recomputes it from z (at V = 262,144 on a v5e or v5p; v6e's 32 MB stores it). A row block
that does not fit even alone is refused (``fits``: the dispatch then runs the reference).
Rows are tiled 8 to a sublane group, so R is 8, or B when B < 8, and must divide B.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import check, scoped_vmem_bytes
from pallas_kernels.sample_threshold.common import BlockSizes, bisect_threshold, validate

_ROWS = 8  # f32 rows of one TPU tile


def block_rows(B: int) -> int:
    return B if B < _ROWS else _ROWS


def fits(B: int, Vp: int, *, vmem_bytes: int | None = None) -> bool:
    """Whether the kernel takes f32[B, Vp]: whole row blocks, one that fits the scoped VMEM."""
    vmem = scoped_vmem_bytes() if vmem_bytes is None else vmem_bytes
    R = block_rows(B)
    return B % R == 0 and Vp % 128 == 0 and R * Vp * 4 <= vmem * 3 // 4


def plan(B: int, Vp: int, *, mass: bool, block_sizes: BlockSizes, vmem_bytes: int) -> tuple[int, bool]:
    """(rows per program, whether exp(z - m) is stored) for f32[B, Vp] under vmem_bytes of
    scoped VMEM (3/4 of it for the blocks: the compiler keeps its own scratch in the rest)."""
    R = block_rows(B)
    check(fits(B, Vp, vmem_bytes=vmem_bytes),
          f"rows of {B=} in blocks of {R} must divide B, and {R} rows of {Vp=} float32 "
          f"({R * Vp * 4} bytes) fit 3/4 of the scoped VMEM ({vmem_bytes} bytes)")
    store = block_sizes.store_exp
    if store is None:
        store = 2 * R * Vp * 4 <= vmem_bytes * 3 // 4
    return R, mass and store


def _block_sum(term, Vp: int, C: int, R: int, dtype) -> jax.Array:
    """The sum over a block's [R, Vp] entries of term(lane slice) -> [R, width], as [R, 1]:
    per-lane partial sums over the chunks of C lanes, a static tail, then one reduction."""
    full = Vp // C
    total = jnp.zeros((R, 1), dtype)
    if full:
        acc = lax.fori_loop(0, full, lambda i, acc: acc + term(pl.ds(pl.multiple_of(i * C, C), C)),
                            jnp.zeros((R, C), dtype))
        total = jnp.sum(acc, axis=1, keepdims=True)
    if Vp % C:
        total = total + jnp.sum(term(pl.ds(full * C, Vp % C)), axis=1, keepdims=True)
    return total


def _each_chunk(fn, Vp: int, C: int) -> None:
    """fn(lane slice) for every chunk of C lanes of Vp, then the static tail."""
    full = Vp // C

    def body(i, carry):
        fn(pl.ds(pl.multiple_of(i * C, C), C))
        return carry

    if full:
        lax.fori_loop(0, full, body, 0)
    if Vp % C:
        fn(pl.ds(full * C, Vp % C))


def _load(x_hbm, z_ref, sem):
    """The program's R rows of x f32[B, Vp] (in HBM) copied into z_ref f32[R, Vp] (VMEM)."""
    R, Vp = z_ref.shape
    # one block of fewer than 8 rows is the whole array: Mosaic slices HBM at whole tiles only
    rows = x_hbm if x_hbm.shape[0] == R else x_hbm.at[pl.ds(pl.multiple_of(pl.program_id(0) * R, R), R)]
    copy = pltpu.make_async_copy(rows, z_ref, sem)
    copy.start()
    copy.wait()
    return R, Vp


def _count_kernel(t_ref, k_ref, x_hbm, o_ref, z_ref, sem, *, C: int):
    t = t_ref[...]  # f32[R, 1]
    R, Vp = _load(x_hbm, z_ref, sem)  # then z = x / t in place

    def put(sl):
        z_ref[:, sl] = z_ref[:, sl] / t

    _each_chunk(put, Vp, C)
    k = k_ref[...]  # i32[R, 1]

    def count_ok(c):  # c f32[R, 1]
        return _block_sum(lambda sl: (z_ref[:, sl] >= c).astype(jnp.int32), Vp, C, R, jnp.int32) >= k

    o_ref[...] = bisect_threshold(count_ok, (R, 1))


def _mass_kernel(t_ref, m_ref, target_ref, x_hbm, o_ref, z_ref, sem, *e_ref, C: int):
    t, m = t_ref[...], m_ref[...]  # f32[R, 1]
    R, Vp = _load(x_hbm, z_ref, sem)  # then z = x / t in place

    def put(sl):
        z = z_ref[:, sl] / t
        z_ref[:, sl] = z
        if e_ref:
            e_ref[0][:, sl] = jnp.exp(z - m)

    _each_chunk(put, Vp, C)
    target = target_ref[...]

    def weight(sl, c):
        z = z_ref[:, sl]
        e = e_ref[0][:, sl] if e_ref else jnp.exp(z - m)
        return jnp.where(z >= c, e, 0.0)

    def mass_ok(c):
        return _block_sum(lambda sl: weight(sl, c), Vp, C, R, jnp.float32) >= target

    o_ref[...] = bisect_threshold(mass_ok, (R, 1))


def _call(kernel, scalars, x, *, mass: bool, block_sizes: BlockSizes | None, interpret: bool):
    bs = block_sizes or BlockSizes()
    B, Vp = x.shape
    R, store = plan(B, Vp, mass=mass, block_sizes=bs, vmem_bytes=scoped_vmem_bytes())
    col = pl.BlockSpec((R, 1), lambda b: (b, 0))
    scratch = [pltpu.VMEM((R, Vp), jnp.float32), pltpu.SemaphoreType.DMA(())]
    if store:
        scratch.append(pltpu.VMEM((R, Vp), jnp.float32))
    out = pl.pallas_call(
        functools.partial(kernel, C=min(bs.block_v, Vp)),
        grid=(B // R,),
        in_specs=[col] * len(scalars) + [pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=col,
        out_shape=jax.ShapeDtypeStruct((B, 1), jnp.float32),
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
    )(*[s.reshape(B, 1) for s in scalars], x)
    return out[:, 0]


def count_threshold_kernel(
    x: jax.Array,  # f32[B, Vp] logits, -inf padded (Vp a multiple of 128)
    t: jax.Array,  # f32[B] temperatures (> 0)
    k: jax.Array,  # i32[B]
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    platform: str | None = None,
) -> jax.Array:  # f32[B] the largest c with at least k entries of z = x / t >= c
    del platform  # a TPU kernel (interpreted elsewhere)
    validate(x, t, k)
    return _call(_count_kernel, [t.astype(jnp.float32), k.astype(jnp.int32)], x, mass=False,
                 block_sizes=block_sizes, interpret=interpret)


def mass_threshold_kernel(
    x: jax.Array,  # f32[B, Vp] logits, -inf padded (Vp a multiple of 128)
    t: jax.Array,  # f32[B] temperatures (> 0)
    m: jax.Array,  # f32[B] the row max of z = x / t (finite)
    target: jax.Array,  # f32[B]
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    platform: str | None = None,
) -> jax.Array:  # f32[B] the largest c with sum(exp(z - m) over z >= c) >= target
    del platform
    validate(x, t, target, m)
    return _call(_mass_kernel, [t.astype(jnp.float32), m.astype(jnp.float32), target.astype(jnp.float32)], x,
                 mass=True, block_sizes=block_sizes, interpret=interpret)
