"""Ragged paged decode attention as Pallas kernels: one query token per sequence.

The G query heads that share a kv head are packed into the rows of one [G, H] tile, so a
page is read once per kv head, not once per query head. Each sequence visits only its own
pages (through its page table) up to its length, and only those inside the window. With
``sinks`` (one logit per query head) each row gets its head's logit as one more term of the
softmax denominator when the sequence is finished (``_common.with_sink``); it weighs no value.

The pools are page-major, [P, K, page_size, H] (one page holds every kv head: what the
allocator hands out), and the kernel reads one [page_size, H] tile (or [H, page_size] with
keys_transposed) per (page, kv head).

* TPU (Mosaic). Grid (B, K, page blocks); lengths and the (flattened) page table are
  scalar-prefetched into SMEM and used by the index maps, so the pipeline DMAs exactly the
  pages each sequence owns. A block of pages_per_block pages is pages_per_block separate
  inputs (the same pool passed again, each with its own index map), so that many page DMAs
  are in flight per step. Past a sequence's last page the index maps repeat that page; the
  pipeline then skips the copy and the kernel skips the math (pl.when).
* GPU (Triton). Grid (B, K); each program loops over its page blocks up to the length
  (dynamic bounds), reading pages by id from the pool.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    MASK_VALUE,
    cdiv,
    check,
    finish_softmax,
    is_pow2,
    next_pow2,
    pad_axis,
    pick_variant,
    sublane,
    with_sink,
)
from pallas_kernels.paged_attention.common import BlockSizes, page_range, validate, visible


def _update(q, k, v, start, length, carry, *, scale, window, softcap, keys_transposed):
    """Online-softmax update with one page holding positions start .. start + bk - 1: keys
    k [bk, H] ([H, bk] if keys_transposed), values v [bk, H]."""
    m_prev, l_prev, acc_prev = carry
    bk = v.shape[0]
    k_dim = 0 if keys_transposed else 1
    s = lax.dot_general(q, k, (((1,), (k_dim,)), ((), ())), preferred_element_type=jnp.float32)
    s = s * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    # [1, bk]: every head row shares the token's mask.
    mask = visible(start + lax.broadcasted_iota(jnp.int32, (1, bk), 1), length, window)
    s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    # Slots past the length may hold anything (NaN in tests): 0 * NaN would poison p @ v.
    # (The same mask built as a column by its own iota: no lane-to-sublane relayout.)
    live = visible(start + lax.broadcasted_iota(jnp.int32, (bk, 1), 0), length, window)
    v = jnp.where(live, v, jnp.zeros((), v.dtype))
    pv = lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    return m_new, alpha * l_prev + p.sum(axis=1, keepdims=True), alpha * acc_prev + pv


def _pad_edge(x, size: int):
    """x [K, G] padded along its last axis to size by repeating the last column."""
    return jnp.pad(x, ((0, 0), (0, size - x.shape[1])), mode="edge")


# ----------------------------------------------------------------------------- TPU (Mosaic)
def _tpu_kernel(
    len_ref, pt_ref, q_ref, *refs, ppb, page_size, pps, scale, window, softcap, keys_transposed, has_sinks
):
    k_refs, v_refs = refs[:ppb], refs[ppb : 2 * ppb]
    sink_ref = refs[2 * ppb] if has_sinks else None
    o_ref, m_ref, l_ref, acc_ref = refs[2 * ppb + has_sinks :]
    b, i = pl.program_id(0), pl.program_id(2)
    length = len_ref[b]
    first, last, any_visible = page_range(length, page_size, pps, window)

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def step(page, k_ref, v_ref):
        carry = (m_ref[...], l_ref[...], acc_ref[...])
        m, l, acc = _update(
            q_ref[...],
            k_ref[...],
            v_ref[...],
            page * page_size,
            length,
            carry,
            scale=scale,
            window=window,
            softcap=softcap,
            keys_transposed=keys_transposed,
        )
        m_ref[...], l_ref[...], acc_ref[...] = m, l, acc

    for jj in range(ppb):  # unrolled: each page of the block is its own pipelined input
        page = i * ppb + jj
        pl.when(any_visible & (page >= first) & (page <= last))(
            functools.partial(step, page, k_refs[jj], v_refs[jj])
        )

    @pl.when(i == pl.num_programs(2) - 1)
    def _write():
        m, l, acc = m_ref[...], l_ref[...], acc_ref[...]
        if has_sinks:
            m, l, acc = with_sink(m, l, acc, sink_ref[...])
        o_ref[...] = finish_softmax(l, acc).astype(o_ref.dtype)


def paged_attention_tpu(
    q,
    k_pages,
    v_pages,
    page_table,
    lengths,
    *,
    scale=None,
    window=None,
    softcap=None,
    keys_transposed=False,
    block_sizes=None,
    interpret=False,
    sinks=None,
):
    """The Mosaic variant (also what interpret mode runs on CPU); see paged_attention_kernel."""
    from jax.experimental.pallas import tpu as pltpu

    scale = validate(
        q,
        k_pages,
        v_pages,
        page_table,
        lengths,
        scale=scale,
        window=window,
        softcap=softcap,
        keys_transposed=keys_transposed,
        sinks=sinks,
    )
    B, N, H = q.shape
    _, K, page_size, _ = v_pages.shape
    G, pps = N // K, page_table.shape[1]
    sub = sublane(q.dtype)
    check(page_size % sub == 0, f"{page_size=} must be a multiple of {sub} for {q.dtype} on TPU")
    ppb = min((block_sizes or BlockSizes()).pages_per_block, pps)

    def page_spec(jj, tile):
        def index_map(b, h, i, len_ref, pt_ref):
            first, last, _ = page_range(len_ref[b], page_size, pps, window)
            page = jnp.minimum(jnp.maximum(i * ppb + jj, first), last)
            return pt_ref[b * pps + page], h, 0, 0

        return pl.BlockSpec((None, None, *tile), index_map)

    k_tile = (H, page_size) if keys_transposed else (page_size, H)
    q_spec = pl.BlockSpec((None, None, G, H), lambda b, h, i, *_: (b, h, 0, 0))
    kernel = functools.partial(
        _tpu_kernel,
        ppb=ppb,
        page_size=page_size,
        pps=pps,
        scale=scale,
        window=window,
        softcap=softcap,
        keys_transposed=keys_transposed,
        has_sinks=sinks is not None,
    )
    sink_in, sink_specs = [], []
    if sinks is not None:  # each kv head's G logits as a column [G, 1]
        sink_in = [sinks.astype(jnp.float32).reshape(K, G, 1)]
        sink_specs = [pl.BlockSpec((None, G, 1), lambda b, h, i, *_: (h, 0, 0))]
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((B, K, G, H), q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, K, cdiv(pps, ppb)),
            in_specs=[
                q_spec,
                *[page_spec(jj, k_tile) for jj in range(ppb)],
                *[page_spec(jj, (page_size, H)) for jj in range(ppb)],
                *sink_specs,
            ],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((G, 1), jnp.float32),
                pltpu.VMEM((G, 1), jnp.float32),
                pltpu.VMEM((G, H), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="paged_attention_tpu",
    )(
        lengths.astype(jnp.int32),
        page_table.astype(jnp.int32).reshape(-1),
        q.reshape(B, K, G, H),
        *[k_pages] * ppb,
        *[v_pages] * ppb,
        *sink_in,
    )
    return out.reshape(B, N, H)


# ----------------------------------------------------------------------------- GPU (Triton)
def _gpu_kernel(
    len_ref,
    pt_ref,
    q_ref,
    k_ref,
    v_ref,
    *refs,
    ppb,
    page_size,
    pps,
    scale,
    window,
    softcap,
    keys_transposed,
    has_sinks,
):
    sink_ref, o_ref = refs if has_sinks else (None, *refs)
    length = len_ref[0]
    first, last, any_visible = page_range(length, page_size, pps, window)
    q = q_ref[...]  # [Gp, Hp]

    def body(blk, carry):
        for jj in range(ppb):  # unrolled; pages past the sequence leave the carry as it is
            page = blk * ppb + jj
            use = (page >= first) & (page <= last)
            # Entries past the sequence's pages may be garbage: never turn them into addresses.
            pid = jnp.where(use, pt_ref[jnp.minimum(page, pps - 1)], pt_ref[first])
            new = _update(
                q,
                k_ref[pid],
                v_ref[pid],
                page * page_size,
                length,
                carry,
                scale=scale,
                window=window,
                softcap=softcap,
                keys_transposed=keys_transposed,
            )
            carry = tuple(jnp.where(use, n, c) for n, c in zip(new, carry))
        return carry

    Gp, H = q.shape
    init = (
        jnp.full((Gp, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((Gp, 1), jnp.float32),
        jnp.zeros((Gp, H), jnp.float32),
    )
    stop = jnp.where(any_visible, last // ppb + 1, first // ppb)
    m, l, acc = lax.fori_loop(first // ppb, stop, body, init)
    if has_sinks:
        m, l, acc = with_sink(m, l, acc, sink_ref[...][:, None])
    o_ref[...] = finish_softmax(l, acc).astype(o_ref.dtype)


def paged_attention_gpu(
    q,
    k_pages,
    v_pages,
    page_table,
    lengths,
    *,
    scale=None,
    window=None,
    softcap=None,
    keys_transposed=False,
    block_sizes=None,
    interpret=False,
    sinks=None,
):
    """The Triton variant; see paged_attention_kernel."""
    from jax.experimental.pallas import triton as plgpu

    scale = validate(
        q,
        k_pages,
        v_pages,
        page_table,
        lengths,
        scale=scale,
        window=window,
        softcap=softcap,
        keys_transposed=keys_transposed,
        sinks=sinks,
    )
    B, N, H = q.shape
    P, K, page_size, _ = v_pages.shape
    G, pps = N // K, page_table.shape[1]
    ppb = min((block_sizes or BlockSizes()).pages_per_block, pps)
    check(
        is_pow2(page_size) and page_size >= 16,
        f"{page_size=} must be a power of 2 >= 16 on GPU (Triton dot tiles)",
    )
    # Triton tiles are powers of two >= 16: pad the head rows, the head dim and the table.
    Gp, Hp, ppsp = max(16, next_pow2(G)), max(16, next_pow2(H)), next_pow2(pps)
    qp = pad_axis(pad_axis(q.reshape(B, K, G, H), 2, Gp), 3, Hp)
    table = pad_axis(page_table.astype(jnp.int32), 1, ppsp)
    kp = pad_axis(k_pages, 2 if keys_transposed else 3, Hp)
    vp = pad_axis(v_pages, 3, Hp)
    k_tile = (Hp, page_size) if keys_transposed else (page_size, Hp)
    kernel = functools.partial(
        _gpu_kernel,
        ppb=ppb,
        page_size=page_size,
        pps=pps,
        scale=scale,
        window=window,
        softcap=softcap,
        keys_transposed=keys_transposed,
        has_sinks=sinks is not None,
    )
    q_spec = pl.BlockSpec((None, None, Gp, Hp), lambda b, h: (b, h, 0, 0))
    sink_in, sink_specs = [], []
    if sinks is not None:  # each kv head's logits [Gp] (padding rows repeat the last)
        sink_in = [_pad_edge(sinks.astype(jnp.float32).reshape(K, G), Gp)]
        sink_specs = [pl.BlockSpec((None, Gp), lambda b, h: (h, 0))]
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        grid=(B, K),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h: (b,)),
            pl.BlockSpec((None, ppsp), lambda b, h: (b, 0)),
            q_spec,
            pl.BlockSpec((P, None, *k_tile), lambda b, h: (0, h, 0, 0)),
            pl.BlockSpec((P, None, page_size, Hp), lambda b, h: (0, h, 0, 0)),
            *sink_specs,
        ],
        out_specs=q_spec,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="paged_attention_gpu",
    )(lengths.astype(jnp.int32), table, qp, kp, vp, *sink_in)
    return out[:, :, :G, :H].reshape(B, N, H)


VARIANTS = {"tpu": paged_attention_tpu, "gpu": paged_attention_gpu}


def paged_attention_kernel(
    q: jax.Array,  # [B, N, H]
    k_pages: jax.Array,  # [P, K, page_size, H] ([P, K, H, page_size] if keys_transposed)
    v_pages: jax.Array,  # [P, K, page_size, H]
    page_table: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,  # i32[B]
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    keys_transposed: bool = False,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    platform: str | None = None,  # where it runs (None: the default backend)
    sinks: jax.Array | None = None,  # f32[N]
) -> jax.Array:  # [B, N, H]
    """Pallas paged decode attention; same contract as paged_attention_reference. The
    variant is the platform's (Mosaic on TPU, Triton on GPU); on CPU pass interpret=True."""
    fn = pick_variant(VARIANTS, "paged_attention", platform)
    return fn(
        q,
        k_pages,
        v_pages,
        page_table,
        lengths,
        scale=scale,
        window=window,
        softcap=softcap,
        keys_transposed=keys_transposed,
        block_sizes=block_sizes,
        interpret=interpret,
        sinks=sinks,
    )
