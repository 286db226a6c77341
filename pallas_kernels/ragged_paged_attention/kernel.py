"""Ragged paged attention as Pallas kernels: query segments of any length over their pages.

The wrapper splits every segment into *work items* of at most bq = queries_per_block query
tokens (``common.work_items``) and gathers each item's queries into one [bq * G, H] tile
per kv head (row t * G + g: token t, head g of the kv head's group), so the G query heads
that share a kv head read each page once. A decode row of one token is one item; a 100-token
prompt chunk is ceil(100 / bq) items. The item count is a static bound (T / bq + S), and
items past the last real one have no queries: they skip every page. After the kernel the
item rows are scattered back to their packed tokens (a copy of q and o, small beside the
pages an item reads).

With ``sinks`` (gpt-oss's attention sinks, one logit per query head) each kv head's tile
rows get their head's logit as one more term of the softmax denominator when the item is
finished (``_common.with_sink``); it weighs no value.

Each item reads only the pages of its segment that hold keys some of its queries see: from
the page of its first query's window start (page 0 without a window) to the page of its
last query. Inside that range the mask is causal per row (a key at or before the row's own
position, inside its window).

* TPU (Mosaic). Grid (items, K, page blocks); the item tables and the (flattened) page table
  are scalar-prefetched into SMEM and used by the index maps, so the pipeline DMAs exactly
  the pages each item needs. A block of pages_per_block pages is that many inputs (the same
  pool again, each with its own index map), so that many page DMAs are in flight per step.
  Outside an item's range the index maps repeat its first or last page: the pipeline skips
  the copy and the kernel skips the math (pl.when).
* GPU (Triton). Grid (items, K); each program loops over its page range (dynamic bounds),
  reading pages by id from the pool.
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
from pallas_kernels.ragged_paged_attention.common import (
    BlockSizes,
    live,
    max_items,
    page_range,
    sink_tiles,
    validate,
    visible,
    work_items,
)


def _update(q, k, v, start, qpos0, nq, carry, *, G, scale, window, softcap, keys_transposed):
    """Online-softmax update of item rows q [M, H] with one page holding positions
    start .. start + bk - 1: keys k [bk, H] ([H, bk] if keys_transposed), values v [bk, H]."""
    m_prev, l_prev, acc_prev = carry
    M, bk = q.shape[0], v.shape[0]
    k_dim = 0 if keys_transposed else 1
    s = lax.dot_general(q, k, (((1,), (k_dim,)), ((), ())), preferred_element_type=jnp.float32)
    s = s * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    rows = lax.broadcasted_iota(jnp.int32, (M, bk), 0)
    row_token = rows // G if G > 1 else rows  # rows token-major: row r is token r // G, head r % G
    kpos = start + lax.broadcasted_iota(jnp.int32, (M, bk), 1)
    mask = visible(row_token, kpos, qpos0, nq, window)
    s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    # Slots no query of the item sees may hold anything (NaN in tests): 0 * NaN would poison
    # p @ v. (The mask as a column from its own iota: no lane-to-sublane relayout.)
    col = live(start + lax.broadcasted_iota(jnp.int32, (bk, 1), 0), qpos0, nq, window)
    v = jnp.where(col, v, jnp.zeros((), v.dtype))
    pv = lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    return m_new, alpha * l_prev + p.sum(axis=1, keepdims=True), alpha * acc_prev + pv


def _prepare(q, page_table, q_start, q_len, kv_len, *, K, block_sizes):
    """Work items and the queries gathered into item tiles f32/bf16[I, K, bq * G, H]."""
    T, N, H = q.shape
    G = N // K
    S = page_table.shape[0]
    bq = (block_sizes or BlockSizes()).queries_per_block
    items = work_items(q_len, kv_len, n_items=max_items(T, S, bq), bq=bq)
    tok = items.tokens(q_start.astype(jnp.int32), T, bq)  # i32[I, bq], T: no token
    qi = jnp.where((tok < T)[:, :, None, None], q[jnp.minimum(tok, T - 1)], 0)  # [I, bq, N, H]
    qi = qi.reshape(-1, bq, K, G, H).transpose(0, 2, 1, 3, 4).reshape(-1, K, bq * G, H)
    return items, tok, qi.astype(q.dtype)


def _scatter_back(o, tok, T, N, H, dtype):
    """Item tiles o [I, K, bq * G, H] back to the packed tokens [T, N, H] (0 where none)."""
    I, K, _, _ = o.shape
    bq = tok.shape[1]
    o = o[:, :, : bq * (N // K)].reshape(I, K, bq, N // K, H).transpose(0, 2, 1, 3, 4)
    out = jnp.zeros((T, N, H), dtype)
    return out.at[tok.reshape(-1)].set(o.reshape(I * bq, N, H).astype(dtype), mode="drop")


# ----------------------------------------------------------------------------- TPU (Mosaic)
def _tpu_kernel(seq_ref, qpos_ref, nq_ref, pt_ref, q_ref, *refs, ppb, page_size, pps, G, scale,
                window, softcap, keys_transposed, has_sinks):
    k_refs, v_refs = refs[:ppb], refs[ppb : 2 * ppb]
    sink_ref = refs[2 * ppb] if has_sinks else None
    o_ref, m_ref, l_ref, acc_ref = refs[2 * ppb + has_sinks :]
    it, i = pl.program_id(0), pl.program_id(2)
    qpos0, nq = qpos_ref[it], nq_ref[it]
    first, last, any_query = page_range(qpos0, nq, page_size, pps, window)

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def step(page, k_ref, v_ref):
        carry = (m_ref[...], l_ref[...], acc_ref[...])
        m, l, acc = _update(q_ref[...], k_ref[...], v_ref[...], page * page_size, qpos0, nq, carry,
                            G=G, scale=scale, window=window, softcap=softcap,
                            keys_transposed=keys_transposed)
        m_ref[...], l_ref[...], acc_ref[...] = m, l, acc

    for jj in range(ppb):  # unrolled: each page of the block is its own pipelined input
        page = i * ppb + jj
        pl.when(any_query & (page >= first) & (page <= last))(
            functools.partial(step, page, k_refs[jj], v_refs[jj])
        )

    @pl.when(i == pl.num_programs(2) - 1)
    def _write():
        m, l, acc = m_ref[...], l_ref[...], acc_ref[...]
        if has_sinks:
            m, l, acc = with_sink(m, l, acc, sink_ref[...])
        o_ref[...] = finish_softmax(l, acc).astype(o_ref.dtype)


def ragged_paged_attention_tpu(q, k_pages, v_pages, page_table, q_start, q_len, kv_len, *,
                               scale=None, window=None, softcap=None, keys_transposed=False,
                               block_sizes=None, interpret=False, sinks=None):
    """The Mosaic variant (also what interpret mode runs on CPU); see
    ragged_paged_attention_kernel."""
    from jax.experimental.pallas import tpu as pltpu

    scale = validate(q, k_pages, v_pages, page_table, q_start, q_len, kv_len, scale=scale,
                     window=window, softcap=softcap, keys_transposed=keys_transposed, sinks=sinks)
    T, N, H = q.shape
    _, K, page_size, _ = v_pages.shape
    G, pps = N // K, page_table.shape[1]
    sub = sublane(q.dtype)
    check(page_size % sub == 0, f"{page_size=} must be a multiple of {sub} for {q.dtype} on TPU")
    ppb = min((block_sizes or BlockSizes()).pages_per_block, pps)
    items, tok, qi = _prepare(q, page_table, q_start, q_len, kv_len, K=K, block_sizes=block_sizes)
    I, _, M, _ = qi.shape

    def page_spec(jj, tile):
        def index_map(it, h, i, seq_ref, qpos_ref, nq_ref, pt_ref):
            first, last, _ = page_range(qpos_ref[it], nq_ref[it], page_size, pps, window)
            page = jnp.minimum(jnp.maximum(i * ppb + jj, first), last)
            return pt_ref[seq_ref[it] * pps + page], h, 0, 0

        return pl.BlockSpec((None, None, *tile), index_map)

    k_tile = (H, page_size) if keys_transposed else (page_size, H)
    q_spec = pl.BlockSpec((None, None, M, H), lambda it, h, i, *_: (it, h, 0, 0))
    kernel = functools.partial(_tpu_kernel, ppb=ppb, page_size=page_size, pps=pps, G=G, scale=scale,
                               window=window, softcap=softcap, keys_transposed=keys_transposed,
                               has_sinks=sinks is not None)
    sink_in, sink_specs = [], []
    if sinks is not None:  # each kv head's rows' logits, a column [M, 1] per head
        sink_in = [sink_tiles(sinks, K, M // G, M)[..., None]]
        sink_specs = [pl.BlockSpec((None, M, 1), lambda it, h, i, *_: (h, 0, 0))]
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(qi.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(I, K, cdiv(pps, ppb)),
            in_specs=[
                q_spec,
                *[page_spec(jj, k_tile) for jj in range(ppb)],
                *[page_spec(jj, (page_size, H)) for jj in range(ppb)],
                *sink_specs,
            ],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((M, 1), jnp.float32),
                pltpu.VMEM((M, 1), jnp.float32),
                pltpu.VMEM((M, H), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(
        items.seq,
        items.qpos0,
        items.nq,
        page_table.astype(jnp.int32).reshape(-1),
        qi,
        *[k_pages] * ppb,
        *[v_pages] * ppb,
        *sink_in,
    )
    return _scatter_back(out, tok, T, N, H, q.dtype)


# ----------------------------------------------------------------------------- GPU (Triton)
def _gpu_kernel(qpos_ref, nq_ref, pt_ref, q_ref, k_ref, v_ref, *refs, ppb, page_size, pps, G,
                scale, window, softcap, keys_transposed, has_sinks):
    sink_ref, o_ref = refs if has_sinks else (None, *refs)
    qpos0, nq = qpos_ref[0], nq_ref[0]
    first, last, any_query = page_range(qpos0, nq, page_size, pps, window)
    q = q_ref[...]  # [Mp, Hp]

    def body(blk, carry):
        for jj in range(ppb):  # unrolled; pages outside the range leave the carry as it is
            page = blk * ppb + jj
            use = (page >= first) & (page <= last)
            # Entries outside the range may be garbage: never turn them into addresses.
            pid = jnp.where(use, pt_ref[jnp.minimum(page, pps - 1)], pt_ref[first])
            new = _update(q, k_ref[pid], v_ref[pid], page * page_size, qpos0, nq, carry, G=G,
                          scale=scale, window=window, softcap=softcap,
                          keys_transposed=keys_transposed)
            carry = tuple(jnp.where(use, n, c) for n, c in zip(new, carry))
        return carry

    Mp, Hp = q.shape
    init = (
        jnp.full((Mp, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((Mp, 1), jnp.float32),
        jnp.zeros((Mp, Hp), jnp.float32),
    )
    stop = jnp.where(any_query, last // ppb + 1, first // ppb)
    m, l, acc = lax.fori_loop(first // ppb, stop, body, init)
    if has_sinks:
        m, l, acc = with_sink(m, l, acc, sink_ref[...][:, None])
    o_ref[...] = finish_softmax(l, acc).astype(o_ref.dtype)


def ragged_paged_attention_gpu(q, k_pages, v_pages, page_table, q_start, q_len, kv_len, *,
                               scale=None, window=None, softcap=None, keys_transposed=False,
                               block_sizes=None, interpret=False, sinks=None):
    """The Triton variant; see ragged_paged_attention_kernel."""
    from jax.experimental.pallas import triton as plgpu

    scale = validate(q, k_pages, v_pages, page_table, q_start, q_len, kv_len, scale=scale,
                     window=window, softcap=softcap, keys_transposed=keys_transposed, sinks=sinks)
    T, N, H = q.shape
    P, K, page_size, _ = v_pages.shape
    G, pps = N // K, page_table.shape[1]
    ppb = min((block_sizes or BlockSizes()).pages_per_block, pps)
    check(
        is_pow2(page_size) and page_size >= 16,
        f"{page_size=} must be a power of 2 >= 16 on GPU (Triton dot tiles)",
    )
    items, tok, qi = _prepare(q, page_table, q_start, q_len, kv_len, K=K, block_sizes=block_sizes)
    I, _, M, _ = qi.shape
    # Triton tiles are powers of two >= 16: pad the item rows, the head dim and the table.
    Mp, Hp, ppsp = max(16, next_pow2(M)), max(16, next_pow2(H)), next_pow2(pps)
    qp = pad_axis(pad_axis(qi, 2, Mp), 3, Hp)
    kp = pad_axis(k_pages, 2 if keys_transposed else 3, Hp)
    vp = pad_axis(v_pages, 3, Hp)
    item_table = pad_axis(page_table.astype(jnp.int32)[items.seq], 1, ppsp)  # i32[I, ppsp]
    k_tile = (Hp, page_size) if keys_transposed else (page_size, Hp)
    kernel = functools.partial(_gpu_kernel, ppb=ppb, page_size=page_size, pps=pps, G=G, scale=scale,
                               window=window, softcap=softcap, keys_transposed=keys_transposed,
                               has_sinks=sinks is not None)
    q_spec = pl.BlockSpec((None, None, Mp, Hp), lambda it, h: (it, h, 0, 0))
    sink_in, sink_specs = [], []
    if sinks is not None:  # each kv head's rows' logits [Mp] (padding rows repeat the last)
        sink_in = [sink_tiles(sinks, K, M // G, Mp)]
        sink_specs = [pl.BlockSpec((None, Mp), lambda it, h: (h, 0))]
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        grid=(I, K),
        in_specs=[
            pl.BlockSpec((1,), lambda it, h: (it,)),
            pl.BlockSpec((1,), lambda it, h: (it,)),
            pl.BlockSpec((None, ppsp), lambda it, h: (it, 0)),
            q_spec,
            pl.BlockSpec((P, None, *k_tile), lambda it, h: (0, h, 0, 0)),
            pl.BlockSpec((P, None, page_size, Hp), lambda it, h: (0, h, 0, 0)),
            *sink_specs,
        ],
        out_specs=q_spec,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(items.qpos0, items.nq, item_table, qp, kp, vp, *sink_in)
    return _scatter_back(out[:, :, :M, :H], tok, T, N, H, q.dtype)


VARIANTS = {"tpu": ragged_paged_attention_tpu, "gpu": ragged_paged_attention_gpu}


def ragged_paged_attention_kernel(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [P, K, page_size, H] ([P, K, H, page_size] if keys_transposed)
    v_pages: jax.Array,  # [P, K, page_size, H]
    page_table: jax.Array,  # i32[S, pages_per_seq]
    q_start: jax.Array,  # i32[S]
    q_len: jax.Array,  # i32[S]
    kv_len: jax.Array,  # i32[S]
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    keys_transposed: bool = False,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    platform: str | None = None,  # where it runs (None: the default backend)
    sinks: jax.Array | None = None,  # f32[N]
) -> jax.Array:  # [T, N, H]
    """Pallas ragged paged attention; same contract as ragged_paged_attention_reference. The
    variant is the platform's (Mosaic on TPU, Triton on GPU); on CPU pass interpret=True."""
    fn = pick_variant(VARIANTS, "ragged_paged_attention", platform)
    return fn(q, k_pages, v_pages, page_table, q_start, q_len, kv_len, scale=scale, window=window,
              softcap=softcap, keys_transposed=keys_transposed, block_sizes=block_sizes,
              interpret=interpret, sinks=sinks)
