"""Flash attention for prefill as Pallas kernels: online softmax over key/value blocks.

Two lowerings of the same algorithm:

* TPU (Mosaic). Grid (B, K, query blocks, key blocks); the key-block axis is the sequential
  ("arbitrary") reduction, with the running max, sum and output in VMEM scratch. The G query
  heads that share a kv head are packed into the rows of one [G*block_q, H] tile, so each
  key/value block is fetched once per kv head. q_start and kv_len are scalar-prefetched into
  SMEM: the key index maps clamp to the blocks a query block can see, so blocks past the
  diagonal, past kv_len or before the window are neither fetched nor computed.
* GPU (Triton). Grid (B, N, query blocks); each program loops over just its visible key
  blocks (dynamic loop bounds), keys and values read straight from the [B, S, K, H] layout.

Wrappers pad T and S up to block multiples (padded keys are past kv_len, padded queries are
dropped), so no kernel ever reads out of bounds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    MASK_VALUE,
    check,
    is_pow2,
    next_pow2,
    pad_axis,
    pick_variant,
    round_up,
    sublane,
)
from pallas_kernels.flash_attention.common import BlockSizes, kv_block_range, validate, visible


def _online_softmax_step(s, mask, v, m_prev, l_prev, acc_prev):
    """One block of the online softmax: logits s [R, bk] (masked where ~mask), values v
    [bk, H]. Returns the new (max [R, 1], sum [R, 1], unnormalised output [R, H])."""
    s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    # where, not just exp: a row with every key masked so far has m_new == MASK_VALUE.
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    l_new = alpha * l_prev + p.sum(axis=1, keepdims=True)
    pv = lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    return m_new, l_new, alpha * acc_prev + pv


def _logits(q, k, scale, softcap):
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = s * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    return s


def _finish(l, acc):
    return acc / jnp.where(l == 0.0, 1.0, l)


# ----------------------------------------------------------------------------- TPU (Mosaic)
def _tpu_kernel(
    qs_ref,
    kl_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    m_ref,
    l_ref,
    acc_ref,
    *,
    scale,
    causal,
    window,
    softcap,
    G,
    bq,
    bk,
):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    q0, kv_len = qs_ref[b] + i * bq, kl_ref[b]
    first, last, any_visible = kv_block_range(
        q0, q0 + bq - 1, kv_len, bk, causal=causal, window=window
    )
    R, H = G * bq, q_ref.shape[-1]

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(any_visible & (j >= first) & (j <= last))
    def _step():
        q = q_ref[...].reshape(R, H)  # rows g-major: row r is head r // bq, token r % bq
        s = _logits(q, k_ref[...], scale, softcap)  # [R, bk]
        rows = lax.broadcasted_iota(jnp.int32, (R, bk), 0)
        qpos = q0 + (rows % bq if G > 1 else rows)
        kpos = j * bk + lax.broadcasted_iota(jnp.int32, (R, bk), 1)
        mask = visible(qpos, kpos, kv_len, causal=causal, window=window)
        # Values past kv_len may be anything (NaN in tests): 0 * NaN would poison p @ v.
        live = j * bk + lax.broadcasted_iota(jnp.int32, (bk, H), 0) < kv_len
        v = jnp.where(live, v_ref[...], jnp.zeros((), v_ref.dtype))
        m, l, acc = _online_softmax_step(s, mask, v, m_ref[...], l_ref[...], acc_ref[...])
        m_ref[...], l_ref[...], acc_ref[...] = m, l, acc

    @pl.when(j == pl.num_programs(3) - 1)
    def _write():
        o_ref[...] = _finish(l_ref[...], acc_ref[...]).reshape(G, bq, H).astype(o_ref.dtype)


def flash_attention_tpu(
    q,
    k,
    v,
    q_start=None,
    kv_len=None,
    *,
    scale=None,
    causal=True,
    window=None,
    softcap=None,
    block_sizes=None,
    interpret=False,
):
    """The Mosaic variant (also what interpret mode runs on CPU); see flash_attention_kernel."""
    from jax.experimental.pallas import tpu as pltpu

    q_start, kv_len, scale = validate(
        q, k, v, q_start, kv_len, scale=scale, causal=causal, window=window, softcap=softcap
    )
    bs = block_sizes or BlockSizes()
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G, sub = N // K, sublane(q.dtype)
    for name, size in (("block_q", bs.block_q), ("block_kv", bs.block_kv)):
        check(size % sub == 0, f"{name}={size} must be a multiple of {sub} for {q.dtype} on TPU")
    bq, bk = min(bs.block_q, round_up(T, sub)), min(bs.block_kv, round_up(S, sub))
    Tp, Sp = round_up(T, bq), round_up(S, bk)
    # [B, K, G, T, H]: one block holds the G heads of a kv head; [B, K, S, H] for keys.
    qt = pad_axis(q.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4), 3, Tp)
    kt = pad_axis(k.transpose(0, 2, 1, 3), 2, Sp)
    vt = pad_axis(v.transpose(0, 2, 1, 3), 2, Sp)

    def kv_map(b, h, i, j, qs_ref, kl_ref):
        q0 = qs_ref[b] + i * bq
        first, last, _ = kv_block_range(
            q0, q0 + bq - 1, kl_ref[b], bk, causal=causal, window=window
        )
        return b, h, jnp.minimum(jnp.maximum(j, first), last), 0

    q_spec = pl.BlockSpec((None, None, G, bq, H), lambda b, h, i, j, *_: (b, h, 0, i, 0))
    kv_spec = pl.BlockSpec((None, None, bk, H), kv_map)
    kernel = functools.partial(
        _tpu_kernel, scale=scale, causal=causal, window=window, softcap=softcap, G=G, bq=bq, bk=bk
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, K, Tp // bq, Sp // bk),
            in_specs=[q_spec, kv_spec, kv_spec],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((G * bq, 1), jnp.float32),
                pltpu.VMEM((G * bq, 1), jnp.float32),
                pltpu.VMEM((G * bq, H), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="flash_attention_tpu",
    )(q_start, kv_len, qt, kt, vt)
    return out[:, :, :, :T].transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)


# ----------------------------------------------------------------------------- GPU (Triton)
def _gpu_kernel(
    qs_ref, kl_ref, q_ref, k_ref, v_ref, o_ref, *, scale, causal, window, softcap, bq, bk
):
    i = pl.program_id(2)
    q0, kv_len = qs_ref[0] + i * bq, kl_ref[0]
    first, last, any_visible = kv_block_range(
        q0, q0 + bq - 1, kv_len, bk, causal=causal, window=window
    )
    q = q_ref[...]  # [bq, H]
    H = q.shape[-1]

    def body(j, carry):
        ks = pl.ds(pl.multiple_of(j * bk, bk), bk)
        s = _logits(q, k_ref[ks, :], scale, softcap)  # [bq, bk]
        qpos = q0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
        kpos = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        mask = visible(qpos, kpos, kv_len, causal=causal, window=window)
        live = j * bk + lax.broadcasted_iota(jnp.int32, (bk, H), 0) < kv_len
        v = jnp.where(live, v_ref[ks, :], jnp.zeros((), v_ref.dtype))
        return _online_softmax_step(s, mask, v, *carry)

    init = (
        jnp.full((bq, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((bq, 1), jnp.float32),
        jnp.zeros((bq, H), jnp.float32),
    )
    stop = jnp.where(any_visible, last + 1, first)
    _, l, acc = lax.fori_loop(first, stop, body, init)
    o_ref[...] = _finish(l, acc).astype(o_ref.dtype)


def flash_attention_gpu(
    q,
    k,
    v,
    q_start=None,
    kv_len=None,
    *,
    scale=None,
    causal=True,
    window=None,
    softcap=None,
    block_sizes=None,
    interpret=False,
):
    """The Triton variant; see flash_attention_kernel."""
    from jax.experimental.pallas import triton as plgpu

    q_start, kv_len, scale = validate(
        q, k, v, q_start, kv_len, scale=scale, causal=causal, window=window, softcap=softcap
    )
    # Triton default: 64 keys per step. The TPU default of 256 asked an H100 for 288 KB of
    # shared memory at head dim 128 (it has 227 KB per block).
    bs = block_sizes or BlockSizes(block_q=128, block_kv=64)
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    for name, size in (("block_q", bs.block_q), ("block_kv", bs.block_kv)):
        check(is_pow2(size) and size >= 16, f"{name}={size} must be a power of 2 >= 16 on GPU")
    bq, bk = min(bs.block_q, max(16, next_pow2(T))), min(bs.block_kv, max(16, next_pow2(S)))
    Tp, Sp, Hp = round_up(T, bq), round_up(S, bk), max(16, next_pow2(H))
    # Triton tiles are powers of two: zero head-dim padding changes no logit.
    qp = pad_axis(pad_axis(q, 1, Tp), 3, Hp)
    kp = pad_axis(pad_axis(k, 1, Sp), 3, Hp)
    vp = pad_axis(pad_axis(v, 1, Sp), 3, Hp)
    kernel = functools.partial(
        _gpu_kernel, scale=scale, causal=causal, window=window, softcap=softcap, bq=bq, bk=bk
    )
    q_spec = pl.BlockSpec((None, bq, None, Hp), lambda b, n, i: (b, i, n, 0))
    kv_spec = pl.BlockSpec((None, Sp, None, Hp), lambda b, n, i: (b, 0, n // G, 0))
    row_spec = pl.BlockSpec((1,), lambda b, n, i: (b,))
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        grid=(B, N, Tp // bq),
        in_specs=[row_spec, row_spec, q_spec, kv_spec, kv_spec],
        out_specs=q_spec,
        compiler_params=plgpu.CompilerParams(num_warps=4 if Hp <= 64 else 8, num_stages=2),
        interpret=interpret,
        name="flash_attention_gpu",
    )(q_start, kv_len, qp, kp, vp)
    return out[:, :T, :, :H]


VARIANTS = {"tpu": flash_attention_tpu, "gpu": flash_attention_gpu}


def flash_attention_kernel(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H]
    v: jax.Array,  # [B, S, K, H]
    q_start: jax.Array | None = None,  # i32[B] position of q[b, 0]; default 0
    kv_len: jax.Array | None = None,  # i32[B] keys 0..kv_len[b]-1 exist; default S
    *,
    scale: float | None = None,
    causal: bool = True,
    window: int | None = None,
    softcap: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:  # [B, T, N, H]
    """Pallas flash attention; same contract as flash_attention_reference. The variant is
    the platform's (Mosaic on TPU, Triton on GPU); on CPU pass interpret=True (TPU variant)."""
    fn = pick_variant(VARIANTS, "flash_attention")
    return fn(
        q,
        k,
        v,
        q_start,
        kv_len,
        scale=scale,
        causal=causal,
        window=window,
        softcap=softcap,
        block_sizes=block_sizes,
        interpret=interpret,
    )
