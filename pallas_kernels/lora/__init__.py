"""LoRA deltas of a batch whose rows use different adapters: ``y[m] = (x[m] @ A[s]) @ B[s]``
for row m's adapter slot s = slots[m] (-1: no adapter, a zero row).

Layout: x [M, I]; the adapters' stacked down-projections a [I, S, R] (slot s's A at
a[:, s, :], so that every slot is one matmul with x: [M, I] @ [I, S*R]) and up-projections
b [S, R, O] (the LoRA scale already folded in); slots i32[M]. Each row's product with every
slot's A is masked to its own slot's R columns, then one matmul with all of B [S*R, O] sums
only its own adapter's term: two dense matmuls of width S*R, read once per step, no gather of
a per-row copy of the adapters (which for 64 rows of SmolLM2 would copy 1.2 GB a step).

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

__all__ = ["BlockSizes", "lora_delta", "lora_delta_kernel", "lora_delta_reference", "validate"]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_m: int = 128  # rows per program
    block_n: int = 512  # output columns per program


def validate(x, a, b, slots) -> None:
    """One message per thing wrong with the operands' shapes."""
    check(x.ndim == 2, f"x must be [M, I], got {x.shape=}")
    check(a.ndim == 3 and b.ndim == 3, f"a must be [I, S, R] and b [S, R, O], got {a.shape=} {b.shape=}")
    I, S, R = a.shape
    check(x.shape[1] == I, f"{x.shape[1]=} must equal {I=} of a")
    check(b.shape[:2] == (S, R), f"{b.shape[:2]=} must equal (S, R) = {(S, R)} of a")
    check(slots.shape == (x.shape[0],), f"{slots.shape=} must be ({x.shape[0]},)")


def lora_delta_reference(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array, *,
                         block_sizes: BlockSizes | None = None, interpret: bool = False) -> jax.Array:
    """XLA: x [M, I], a [I, S, R], b [S, R, O], slots i32[M] -> [M, O] in x.dtype; block_sizes
    and interpret are the kernel's, taken and ignored."""
    validate(x, a, b, slots)
    S = a.shape[1]
    h = jnp.einsum("MI,ISR->MSR", x, a.astype(x.dtype), preferred_element_type=jnp.float32)
    h = jnp.where((slots[:, None] == jnp.arange(S, dtype=slots.dtype)[None, :])[:, :, None], h, 0.0)
    return jnp.einsum("MSR,SRO->MO", h.astype(x.dtype), b.astype(x.dtype),
                      preferred_element_type=jnp.float32).astype(x.dtype)


def _kernel(slots_ref, x_ref, a_ref, b_ref, o_ref, *, R: int):
    x = x_ref[...]
    h = jax.lax.dot_general(x, a_ref[...].astype(x.dtype), (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)  # [bm, S*R]
    col_slot = jax.lax.broadcasted_iota(jnp.int32, h.shape, 1) // R
    h = jnp.where(col_slot == slots_ref[...], h, 0.0)
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
def lora_delta_kernel(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array, *,
                      block_sizes: BlockSizes | None = None, interpret: bool = False) -> jax.Array:
    """Pallas (the TPU program; interpret=True on CPU): as ``lora_delta_reference``. A program
    takes block_m rows and block_n output columns: x's rows times every slot's A (all of a,
    [I, S*R], held in VMEM), masked to each row's slot, times B's columns."""
    validate(x, a, b, slots)
    bs = block_sizes or BlockSizes()
    (M, I), (_, S, R), O = x.shape, a.shape, b.shape[2]
    bm = min(bs.block_m, round_up(M, 8))
    bn = _fit(O, bs.block_n, 128)
    Mp = round_up(M, bm)
    a2, b2 = a.reshape(I, S * R), b.reshape(S * R, O)
    out = pl.pallas_call(
        functools.partial(_kernel, R=R),
        out_shape=jax.ShapeDtypeStruct((Mp, O), x.dtype),
        grid=(Mp // bm, O // bn),
        in_specs=[
            pl.BlockSpec((bm, 1), lambda i, j: (i, 0)),
            pl.BlockSpec((bm, I), lambda i, j: (i, 0)),
            pl.BlockSpec((I, S * R), lambda i, j: (0, 0)),
            pl.BlockSpec((S * R, bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret,
        name="lora_delta",
    )(pad_axis(slots.astype(jnp.int32)[:, None], 0, Mp, value=-1), pad_axis(x, 0, Mp), a2, b2)
    return out[:M]


def lora_delta(x, a, b, slots, *, block_sizes: BlockSizes | None = None, interpret: bool = False,
               platform: str | None = None) -> jax.Array:
    """Dispatch: the kernel on TPU/GPU or with interpret=True, else the reference."""
    fn = lora_delta_kernel if use_kernel(interpret, platform) else lora_delta_reference
    return fn(x, a, b, slots, block_sizes=block_sizes, interpret=interpret)
