"""LoRA deltas of a batch whose rows use different adapters: ``y[m] = (x[m] @ A[s]) @ B[s]``
for row m's adapter slot s = active[index[m]] (index -1: no adapter, a zero row).

Layout: x [M, I]; the adapters' stacked down-projections a [I, S, R] (slot s's A at
a[:, s, :]) and up-projections b [S, R, O] (the LoRA scale already folded in), S every device
slot; active i32[n] the slots this batch uses (n <= S, a small bucket; padding entries repeat a
real slot and no row points at them); index i32[M] each row's position in active. The n active
slots' A and B are gathered once per call ([I, n*R] and [n*R, O]: n/S of the stacks; read in
place when n == S), each row's
product with all of those A is masked to its own slot's R columns, then one matmul with the
gathered B [n*R, O] sums only its own adapter's term: two dense matmuls of width n*R, so the
cost follows the adapters in use, not S, and no per-row copy of the adapters (which for 64 rows
of SmolLM2 would copy 1.2 GB a step).

Exports ``lora_delta`` (dispatch), ``lora_delta_kernel`` (Pallas, the TPU program, run in
interpret mode on CPU), ``lora_delta_reference`` (XLA) with the same signature, and
``BlockSizes``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import check, pad_axis, round_up, use_kernel

__all__ = ["BlockSizes", "gather_active", "lora_delta", "lora_delta_kernel", "lora_delta_reference", "validate"]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_m: int = 128  # rows per program
    block_n: int = 512  # output columns per program


def validate(x, a, b, active, index) -> None:
    """One message per thing wrong with the operands' shapes."""
    check(x.ndim == 2, f"x must be [M, I], got {x.shape=}")
    check(a.ndim == 3 and b.ndim == 3, f"a must be [I, S, R] and b [S, R, O], got {a.shape=} {b.shape=}")
    I, S, R = a.shape
    check(x.shape[1] == I, f"{x.shape[1]=} must equal {I=} of a")
    check(b.shape[:2] == (S, R), f"{b.shape[:2]=} must equal (S, R) = {(S, R)} of a")
    check(active.ndim == 1 and 1 <= active.shape[0] <= S, f"{active.shape=} must be (n,) with 1 <= n <= {S=}")
    check(index.shape == (x.shape[0],), f"{index.shape=} must be ({x.shape[0]},)")


def gather_active(a: jax.Array, b: jax.Array, active: jax.Array,
                  index: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The columns a call works over: a [I, S, R], b [S, R, O], active i32[n], index i32[M] ->
    (A [I, n*R], B [n*R, O], each row's block of R columns i32[M], -1: none). With n < S the
    active slots' A and B are gathered (n/S of the stacks); with n == S every slot is in use
    and the stacks are read in place, each row pointed at its own slot (no copy of them)."""
    (I, S, R), O, n = a.shape, b.shape[2], active.shape[0]
    if n == S:
        slot = jnp.where(index >= 0, jnp.take(active, jnp.maximum(index, 0), mode="clip"), -1)
        return a.reshape(I, S * R), b.reshape(S * R, O), slot.astype(index.dtype)
    an = jnp.take(a, active, axis=1, mode="clip").reshape(I, n * R)
    bn = jnp.take(b, active, axis=0, mode="clip").reshape(n * R, O)
    return an, bn, index


def lora_delta_reference(x: jax.Array, a: jax.Array, b: jax.Array, active: jax.Array, index: jax.Array, *,
                         block_sizes: BlockSizes | None = None, interpret: bool = False) -> jax.Array:
    """XLA: x [M, I], a [I, S, R], b [S, R, O], active i32[n], index i32[M] -> [M, O] in
    x.dtype; block_sizes and interpret are the kernel's, taken and ignored."""
    validate(x, a, b, active, index)
    R, n = a.shape[2], active.shape[0]
    an, bn, col = gather_active(a, b, active, index)
    h = jnp.dot(x, an.astype(x.dtype), preferred_element_type=jnp.float32).reshape(-1, n, R)
    h = jnp.where((col[:, None] == jnp.arange(n, dtype=col.dtype)[None, :])[:, :, None], h, 0.0)
    return jnp.dot(h.reshape(-1, n * R).astype(x.dtype), bn.astype(x.dtype),
                   preferred_element_type=jnp.float32).astype(x.dtype)


def _kernel(index_ref, x_ref, a_ref, b_ref, o_ref, *, R: int):
    x = x_ref[...]
    h = jax.lax.dot_general(x, a_ref[...].astype(x.dtype), (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)  # [bm, S*R]
    col_slot = jax.lax.broadcasted_iota(jnp.int32, h.shape, 1) // R  # the column's block: its entry of active
    h = jnp.where(col_slot == index_ref[...], h, 0.0)
    out = jax.lax.dot_general(h.astype(x.dtype), b_ref[...].astype(x.dtype), (((1,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)
    o_ref[...] = out.astype(o_ref.dtype)


def _fit(dim: int, want: int, align: int) -> int:
    """The largest multiple of ``align`` <= want dividing dim, or dim itself."""
    b = (min(want, dim) // align) * align
    while b >= align and dim % b:
        b -= align
    return b if b >= align else dim


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def lora_delta_kernel(x: jax.Array, a: jax.Array, b: jax.Array, active: jax.Array, index: jax.Array, *,
                      block_sizes: BlockSizes | None = None, interpret: bool = False) -> jax.Array:
    """Pallas (the TPU program; interpret=True on CPU): as ``lora_delta_reference``. XLA
    gathers the n active slots first when n < S (``gather_active``: a slot's A is a [I, 1, R]
    slab of the stack, which a TPU block cannot tile); then a program takes block_m rows and block_n output
    columns: x's rows times every active slot's A ([I, n*R], held in VMEM), masked to each
    row's slot, times B's columns."""
    validate(x, a, b, active, index)
    bs = block_sizes or BlockSizes()
    (M, I), R, O, n = x.shape, a.shape[2], b.shape[2], active.shape[0]
    bm = min(bs.block_m, round_up(M, 8))
    bn = _fit(O, bs.block_n, 128)
    Mp = round_up(M, bm)
    a2, b2, col = gather_active(a, b, active, index)
    out = pl.pallas_call(
        functools.partial(_kernel, R=R),
        out_shape=jax.ShapeDtypeStruct((Mp, O), x.dtype),
        grid=(Mp // bm, O // bn),
        in_specs=[
            pl.BlockSpec((bm, 1), lambda i, j: (i, 0)),
            pl.BlockSpec((bm, I), lambda i, j: (i, 0)),
            pl.BlockSpec((I, n * R), lambda i, j: (0, 0)),
            pl.BlockSpec((n * R, bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret,
        name="lora_delta",
    )(pad_axis(col.astype(jnp.int32)[:, None], 0, Mp, value=-1), pad_axis(x, 0, Mp), a2, b2)
    return out[:M]


def lora_delta(x, a, b, active, index, *, block_sizes: BlockSizes | None = None, interpret: bool = False,
               platform: str | None = None) -> jax.Array:
    """Dispatch: the kernel on TPU/GPU or with interpret=True, else the reference."""
    fn = lora_delta_kernel if use_kernel(interpret, platform) else lora_delta_reference
    return fn(x, a, b, active, index, block_sizes=block_sizes, interpret=interpret)
