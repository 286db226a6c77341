"""The packed step's view of the page pools: many sequences, one call, weights read once.

One engine step computes a ``PackedBatch`` of N = R * q + Tp tokens in one forward pass, so
every matmul sees all of them at once (one read of the weights, large M for the int8 dots):

* a **decode group** of R rows with q query tokens each (q = 1 for plain decoding; q > 1
  carries drafted or teacher-forced tokens to verify). Row r attends to the pages of its
  page-table row ``table[r]``, which already hold this step's keys (they are written first).
* one **packed prefill row** of Tp tokens holding prompt chunks of several sequences one
  after another (``seg`` numbers them, -1 marks padding). A token attends causally to the
  earlier tokens of its own segment in the row, and segment 0 (the only one that may
  continue an earlier chunk or a cached prefix) also to the positions before ``hist_end``
  held in the extra last table row ``table[R]``.

Which reader runs is the step's ``Kernels`` choice (``PackedKV.kernels``, decided by
``dispatch.paged_path``). With the native CPU kernels, over float32 or int8 pools, decode rows
and the prefill row are read by ``cpu_kernels.paged_rows`` and ``prefill_row`` (``native=True``
below), which walk the pages where they lie, all KV heads of a page together, prefetching
ahead: with them a 64-row w8a8 + int8 KV decode step of SmolLM2 takes 61 ms instead of 171 and
a 512-token prefill row 113 ms instead of 193 (``benchmarks/RESULTS.md``, "Native attention
kernels"). The XLA readers below are their references, and serve everywhere else (bfloat16
pools, deferred writes, several devices).

XLA's decode reader never builds a dense copy of every row's whole context. The rows are
taken ROW_GROUP at a time (a ``lax.map`` over groups), and each group's table a block of
page columns at a time (contiguous pages of ``page_size`` positions); each block's scores
are folded into a running softmax (max, sum, weighted values). What one group gathers for
one block (8 rows x ROW_BLOCK_POSITIONS: 3 MB at SmolLM2's heads) is read back from cache;
the whole step's gathered pages, 19-38 MB per layer, were not, and ran 2-4x slower (see
``benchmarks/RESULTS.md``, "Native attention kernels"). With few queries per KV head
(decode, short drafts) the scores are a multiply-add unrolled over the head dim, which XLA
CPU fuses into one pass over the keys: about twice as fast as its batched dot at M = 3.

Windowed layers (Gemma's LOCAL layers) read their own pool through ``wtable`` from logical
page ``wbase`` on; int8 pools dequantize each block as it is gathered. With the Pallas choice
(TPU/GPU, or Pallas interpret mode) a layer over float pools instead reads the pages in place
in one kernel call, windowed layers included (``jaxinfer.kernels``; int8 pools keep the
blockwise path). Which kernel is decided from the batch's shapes and the ``Kernels`` value,
so it is fixed for each executable:

* a step of decode rows of one query each and no prefill row (``PackedBatch.decode_only``:
  plain decoding, and every step of a chain of decode steps) runs the paged decode kernel,
  one [G, H] tile per row and kv head (``decode_kernel_attention``), which reads a decode
  step's pages closer to the copy bandwidth than the ragged kernel, whose query blocks
  hold one real query per row there (``benchmarks/RESULTS.md``, "GPU kernels");
* every other step (verification rows of q > 1 queries, a prefill row) runs the ragged
  kernel over every decode row and prefill segment (``ragged_kernel_attention``).

Both take attention sinks.

Keys pools come in the layout the engine chose (``PackedKV.keys_transposed``, see the ``cache``
module doc): transposed, [P, K, H, ps], for the native kernels and the XLA readers on CPU;
[P, K, ps, H], as the values, for the Pallas kernels and on TPU/GPU. Every reader here takes
both; the native kernels are never handed the second.

On a TPU the pools' head dim is padded to a multiple of 128 (``cache`` module doc): ``attend``
pads the queries and the new keys and values to it, and every reader below sees one head dim.

Latent pools (multi-head latent attention: ``cache`` module doc) have no keys pool (None): the
XLA readers here take the keys as the values pool's transpose, block by block as they gather
it. The native CPU kernels and the Pallas kernels read separate key and value pools, so a
latent layer always runs the XLA readers, whatever the choice.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxinfer import cpu_kernels, dispatch
from jaxinfer import kernels as ops
from jaxinfer.cache import QuantKV, _load, write_pages
from jaxinfer.einsum import einsum
from jaxinfer.models.layers import sink_rows
from jaxinfer.quant import dequantize_kv, quantize_kv

BLOCK_POSITIONS = 256  # key positions per block of the prefill row's history
ROW_BLOCK_POSITIONS = 512  # key positions per block of a group of decode rows
ROW_GROUP = 8  # decode rows attended together (their gathered blocks stay in cache)
PREFILL_QUERY_BLOCK = 128  # prefill-row queries attended together
# scores as unrolled multiply-adds up to this many queries per KV head and this head dim
UNROLL_QUERIES = 16
UNROLL_HEAD_DIM = 128
_NEG = -1e30  # masked score: finite, so a block with nothing visible keeps the max finite


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PackedBatch:
    """Everything one packed step needs to know about its tokens. Built on the host by the
    scheduler (``engine.batch``); shapes are bucketed so executables are few."""

    tokens: jax.Array  # i32[N] decode rows first (R x q, row-major), then the prefill row
    positions: jax.Array  # i32[N]
    write_page: jax.Array  # i32[N] page of the full-length pools each token's key/value goes to (0: scratch)
    write_wpage: jax.Array  # i32[N] likewise in the windowed pools
    active: jax.Array  # bool[R] rows that decode a sequence (the others are idle slots below the top one)
    use_prev: jax.Array  # bool[R] the row's first token is the one the previous step sampled (on device)
    last_q: jax.Array  # i32[R] index of each decode row's last real query
    table: jax.Array  # i32[R + 1, w] full-length pages; row R: the prefill row's segment 0
    wtable: jax.Array  # i32[R + 1, ww] windowed pages from logical page wbase
    wbase: jax.Array  # i32[R + 1]
    seg: jax.Array  # i32[Tp] segment of each prefill-row token, -1: padding
    hist_end: jax.Array  # i32[] positions < hist_end of segment 0 are read from table[R]
    targets: jax.Array  # i32[Tp] next prompt token of each prefill-row token (-1: none): prompt logprobs
    rows: int = dataclasses.field(metadata={"static": True})  # R
    q: int = dataclasses.field(metadata={"static": True})
    # most segments the prefill row may hold (0: Tp); the kernel path sizes its work list by it
    max_segments: int = dataclasses.field(default=0, metadata={"static": True})
    # i32[n] the LoRA device slots the step's tokens use, padded to a bucket n of 1, 2, 4, ...,
    # max_loras (``engine.batch.lora_arrays``); None: no token uses an adapter (no adapter work)
    lora_active: jax.Array | None = None
    # i32[N] each token's index into lora_active (-1: none); None with lora_active
    lora_index: jax.Array | None = None
    # images (``engine.multimodal``): the step's image soft tokens [Tp, D] (in their tokens'
    # order, zero-padded to the prefill row's size: one image variant per shape), each token's
    # row in them i32[N] (-1: a text token, its own embedding), and attend_to i32[Tp],
    # the last position each prefill-row token sees (its own, or its image's last for an image's
    # token: bidirectional within an image, which lies whole in one chunk). All None in a step
    # without images: no extra work, and the executable of a text-only step.
    image_embeds: jax.Array | None = None
    image_index: jax.Array | None = None
    attend_to: jax.Array | None = None

    @property
    def prefill_len(self) -> int:  # Tp
        return self.seg.shape[0]

    def pages_written(self, page_size: int) -> int:
        """At most how many distinct pages (of one pool) the step's tokens write: each decode
        row's q consecutive positions, each prefill segment's run of positions, and the
        scratch page of the padding."""
        R, Q, Tp = self.rows, self.q, self.prefill_len
        segments = self.max_segments or Tp
        per_row = min(Q, -(-(Q - 1) // page_size) + 1)
        prefill = min(Tp, -(-Tp // page_size) + 2 * segments) + 1 if Tp else 0
        return R * per_row + prefill + 1

    @property
    def decode_only(self) -> bool:
        """Decode rows of one query each and no prefill row (from shapes alone, so static):
        plain decoding and chained decode steps, which the Pallas choice runs through the
        paged decode kernel."""
        return self.rows > 0 and self.q == 1 and self.prefill_len == 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PackedKV:
    """Page pools plus the batch that reads and writes them in this step."""

    k: list  # L x [P_l, K_l, H_l, ps] if keys_transposed, else [P_l, K_l, ps, H_l] (None: a layer with no pool)
    v: list  # L x [P_l, K_l, ps, H_l]
    batch: PackedBatch
    windowed: tuple[bool, ...] = dataclasses.field(default=(), metadata={"static": True})
    kernels: dispatch.Kernels = dataclasses.field(default=dispatch.XLA, metadata={"static": True})
    # defer_writes: the pools are only read; each layer's new keys/values are collected in
    # ``written`` (one (k, v) [1, N, K, H] per layer, None for a layer that writes nothing) for
    # the caller to store, and the decode rows see their own new tokens from them. A pipeline
    # stage runs its layers inside a conditional, where writing a pool in place would copy the
    # whole pool.
    defer_writes: bool = dataclasses.field(default=False, metadata={"static": True})
    written: tuple = ()
    # the keys pools' layout (cache.PagedKVCache.keys_transposed, dispatch.keys_transposed)
    keys_transposed: bool = dataclasses.field(default=True, metadata={"static": True})

    packed = True  # attend_layer hands the whole layer to ``attend``

    def _is_windowed(self, layer: int) -> bool:
        return bool(self.windowed) and self.windowed[layer]

    def attend(self, layer: int, q, k, v, *, scale, window=None, softcap=None, write: bool = True, sinks=None):
        """Write the layer's new keys/values k, v [1, N, K, H] at each token's page, then
        attend q [1, N, N_heads, H] as described in the module docstring -> (o, cache).
        write False: k, v are pool ``layer``'s own new keys/values, already written by the
        layer that owns it (a layer sharing them attends and writes nothing). sinks: f32[N]
        per-head attention sinks, or None; the native CPU kernels take none, so a layer with
        sinks reads its pages through the XLA readers instead. Pools whose head dim is padded
        (a TPU's: ``cache.init_paged_cache``'s ``lanes``) take q, k, v padded with zeros, which
        change no score and no weighted value, and the output comes back without the padding."""
        H, Hp = q.shape[-1], self.v[layer].shape[-1]
        if Hp > H:
            pad = lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, Hp - H)])  # noqa: E731
            o, cache = self.attend(layer, pad(q), pad(k), pad(v), scale=scale, window=window, softcap=softcap,
                                   write=write, sinks=sinks)
            return o[..., :H], cache
        b = self.batch
        ps = self.v[layer].shape[2]
        page = b.write_wpage if self._is_windowed(layer) else b.write_page
        ks, vs = list(self.k), list(self.v)
        if self.defer_writes:
            cache = dataclasses.replace(self, written=self.written + ((k, v) if write else None,))
        elif not write:
            cache = self
        else:
            off = b.positions % ps
            whole = b.pages_written(ps) if dispatch.whole_page_writes(self.kernels, self.keys_transposed) else None
            if ks[layer] is not None:  # (a latent pool: the latent is stored once, as the values)
                ks[layer] = write_pages(ks[layer], page, off, k, keys_transposed=self.keys_transposed,
                                        whole_pages=whole)
            vs[layer] = write_pages(vs[layer], page, off, v, whole_pages=whole)
            cache = PackedKV(ks, vs, b, self.windowed, self.kernels, keys_transposed=self.keys_transposed)
        R, Q, Tp = b.rows, b.q, b.prefill_len
        table, base = (b.wtable, b.wbase) if self._is_windowed(layer) else (b.table, None)
        opts = {"scale": scale, "window": window, "softcap": softcap, "sinks": sinks,
                "keys_transposed": self.keys_transposed}
        path = dispatch.paged_path(self.kernels, ks[layer], vs[layer], defer_writes=self.defer_writes,
                                   sinks=sinks is not None, decode_only=b.decode_only,
                                   keys_transposed=self.keys_transposed)
        if path == dispatch.PagedPath.DECODE:
            return decode_kernel_attention(q, ks[layer], vs[layer], b, table, base, kernels=self.kernels,
                                           **opts), cache
        if path == dispatch.PagedPath.RAGGED and b.attend_to is None:  # (the kernel has no image mask term)
            return ragged_kernel_attention(q, ks[layer], vs[layer], b, table, base, page, kernels=self.kernels,
                                           **opts), cache
        if path == dispatch.PagedPath.RAGGED and R and Q == 1 and dispatch.paged_path(
                self.kernels, ks[layer], vs[layer], defer_writes=self.defer_writes, sinks=sinks is not None,
                decode_only=True, keys_transposed=self.keys_transposed) == dispatch.PagedPath.DECODE:
            # a step with image tokens: its prefill row reads with XLA's reader (below), and its
            # decode rows keep a kernel, so text rows pay nothing for the images beside them
            od = decode_kernel_attention(q[:, :R], ks[layer], vs[layer], b, table, base, kernels=self.kernels,
                                         **opts)
            op = prefill_row_attention(q[:, R:], k[:, R:], v[:, R:], b.positions[R:], b.seg, ks[layer], vs[layer],
                                       table[R:], None if base is None else base[R:], b.hist_end,
                                       attend_to=b.attend_to, native=False, **opts)
            return jnp.concatenate([od, op], axis=1), cache
        native = path == dispatch.PagedPath.NATIVE
        outs = []
        if R:
            qd = q[0, : R * Q].reshape(R, Q, *q.shape[2:])
            pos = b.positions[: R * Q].reshape(R, Q)
            rbase = None if base is None else base[:R]
            if self.defer_writes:  # pages hold the positions before the row's first query; its own come from k, v
                own = tuple(a[0, : R * Q].reshape(R, Q, *a.shape[2:]) for a in (k, v))
                od = paged_rows_attention(qd, ks[layer], vs[layer], table[:R], rbase, pos, pos[:, 0], own=own,
                                          **opts)
            else:
                od = paged_rows_attention(qd, ks[layer], vs[layer], table[:R], rbase, pos, pos.max(axis=1) + 1,
                                          native=native, **opts)
            outs.append(od.reshape(1, R * Q, *q.shape[2:]))
        if Tp:
            qp, kp, vp = q[:, R * Q :], k[:, R * Q :], v[:, R * Q :]
            outs.append(prefill_row_attention(
                qp, kp, vp, b.positions[R * Q :], b.seg, ks[layer], vs[layer], table[R:],
                None if base is None else base[R:], b.hist_end, attend_to=b.attend_to,
                native=native and b.attend_to is None, **opts))
        return (outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)), cache


# ----------------------------------------------------------------------------- attention
def _fold_queries(q, K: int, scale: float):
    """q [B, T, N, H] -> f32[B, K, T*G, H] (row m = t*G + g) pre-scaled."""
    B, T, N, H = q.shape
    G = N // K
    return (q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, H)
            .astype(jnp.float32) * scale)


def _unfold(o, T: int, N: int, dtype):
    """f32[B, K, T*G, H] -> [B, T, N, H]."""
    B, K, M, H = o.shape
    return o.reshape(B, K, T, M // T, H).transpose(0, 2, 1, 3, 4).reshape(B, T, N, H).astype(dtype)


class _RunningSoftmax:
    """Softmax over key blocks seen one at a time: running max m, sum l, weighted values o."""

    def __init__(self):
        self.m = self.l = self.o = None

    def add(self, s, valid, values):
        """s f32[B, K, M, S] scores, valid bool[B or 1, 1 or K, M, S], values f32[B, K, S, H]."""
        s = jnp.where(valid, s, _NEG)
        m_blk = s.max(axis=-1, keepdims=True)
        m = m_blk if self.m is None else jnp.maximum(self.m, m_blk)
        p = jnp.where(valid, jnp.exp(s - m), 0.0)  # exactly 0 where masked: 0 * finite values
        pv = einsum("BKMS,BKSH->BKMH", p, values)
        if self.m is None:
            self.l, self.o = p.sum(axis=-1, keepdims=True), pv
        else:
            a = jnp.exp(self.m - m)
            self.l = self.l * a + p.sum(axis=-1, keepdims=True)
            self.o = self.o * a + pv
        self.m = m

    def start(self, B: int, K: int, M: int, H: int):
        """Begin from nothing seen (so that blocks may be skipped: see ``maybe_add``)."""
        self.m = jnp.full((B, K, M, 1), _NEG, jnp.float32)
        self.l = jnp.zeros((B, K, M, 1), jnp.float32)
        self.o = jnp.zeros((B, K, M, H), jnp.float32)

    def maybe_add(self, pred, block):
        """Fold in the block ``block()`` returns (s, valid, values) only where pred holds at
        run time; XLA runs the other branch, which leaves the state as it is."""

        def add(state):
            self.m, self.l, self.o = state
            self.add(*block())
            return self.m, self.l, self.o

        state = (self.m, self.l, self.o)
        self.m, self.l, self.o = jax.lax.cond(pred, add, lambda st: st, state)

    def result(self, sink=None):
        """The weighted values; with ``sink`` (f32[K, M, 1]: each row's attention-sink logit) one
        more term in the denominator, with no value."""
        if sink is None:
            return self.o / jnp.maximum(self.l, 1e-30)  # a query that sees nothing gives 0, not NaN
        m = jnp.maximum(self.m, sink)
        a = jnp.exp(self.m - m)
        return self.o * a / (self.l * a + jnp.exp(sink - m))


def _scores(qm, keys, softcap, keys_transposed: bool = True):
    """qm f32[B, K, M, H], keys [B, K, H, S] (keys_transposed) or [B, K, S, H] -> f32[B, K, M, S]."""
    keys = keys.astype(jnp.float32)
    M, H = qm.shape[2], qm.shape[3]
    if not keys_transposed:  # (the unrolled form wants rows of keys along S: the CPU layout)
        s = einsum("BKMH,BKSH->BKMS", qm, keys)
    elif M <= UNROLL_QUERIES and H <= UNROLL_HEAD_DIM:
        # one fused pass over the keys (XLA CPU's batched dot at M = 3 is 2x slower)
        s = qm[:, :, :, 0, None] * keys[:, :, None, 0, :]
        for h in range(1, H):
            s = s + qm[:, :, :, h, None] * keys[:, :, None, h, :]
    else:
        s = einsum("BKMH,BKHS->BKMS", qm, keys)
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def _page_blocks(table, ps: int, positions: int):
    """Static (first column, columns) of each block of about ``positions`` positions."""
    n = table.shape[1]
    per = max(1, positions // ps)
    return [(c, min(per, n - c)) for c in range(0, n, per)]


def _gather_block(kpool, vpool, cols, keys_transposed: bool = True):
    """Pages cols i32[B, c] of both pools as keys f32[B, K, H, c*ps] (keys_transposed: the
    pool's layout) or f32[B, K, c*ps, H], and values f32[B, K, c*ps, H] (one copy of just this
    block; int8 pages dequantized on the way). kpool None: a latent pool, whose keys are its
    values (transposed, where keys_transposed asks for it)."""
    vp = _load(vpool, cols)  # [B, c, K, ps, H]
    B, c, K, ps, H = vp.shape
    values = vp.transpose(0, 2, 1, 3, 4).reshape(B, K, c * ps, H)
    if kpool is None:
        return (values.swapaxes(-1, -2) if keys_transposed else values), values
    kp = _load(kpool, cols)  # [B, c, K, H, ps] or [B, c, K, ps, H]
    if keys_transposed:
        return kp.transpose(0, 2, 3, 1, 4).reshape(B, K, H, c * ps), values
    return kp.transpose(0, 2, 1, 3, 4).reshape(B, K, c * ps, H), values


def _visible(qpos, kpos, window):
    """bool[B, M, S]: key position kpos (i32[B, S]) is at or before qpos (i32[B, M]) and,
    with a window, fewer than ``window`` positions behind it."""
    delta = qpos[:, :, None] - kpos[:, None, :]
    ok = delta >= 0
    return ok if window is None else ok & (delta < window)


# The two readers are jitted with their options static: a layer calls them inside the step's
# trace, and JAX then traces (and lowers) each one once per shape, not once per layer. Traced
# 30 times over, their blocks made up most of a step's trace, and of start-up.
# ``native`` (static, so that the per-shape trace cache cannot hand back the other reader) picks
# the native kernel where the caller's dispatch found it applies (``dispatch.paged_path``).
_reader = functools.partial(jax.jit, static_argnames=("scale", "window", "softcap", "native", "keys_transposed"))


@_reader
def paged_rows_attention(q, kpool, vpool, table, base, qpos, end, *, scale, window=None, softcap=None, own=None,
                         native=False, sinks=None, keys_transposed=True):
    """Reference paged attention for rows of T queries: q [B, T, N, H] at positions
    qpos i32[B, T] over the pages table i32[B, n] (logical page base[b] + column, or the
    column itself when base is None) whose positions < end[b] are written -> [B, T, N, H].
    Pools kpool [P, K, H, ps] (keys_transposed; the native kernel's only layout) or
    [P, K, ps, H], vpool [P, K, ps, H].

    Takes the rows ROW_GROUP at a time, and each group's table one block of columns at a
    time into a running softmax; values at positions >= end are zeroed as they are
    gathered, so stale or NaN pages never leak. sinks: f32[N] per-head attention sinks (not
    taken by the native kernel), or None. own: None, or the rows' own new keys and
    values ([B, T, K, H] each, at positions qpos) not yet in the pages: keys at positions
    >= end are then masked in the pages and these are attended to as one more block (stored
    as the pool would store them)."""
    B = q.shape[0]
    if native and own is None and sinks is None:
        assert keys_transposed, "the native kernel reads transposed keys only"
        (k, v), scales = _kernel_pools(kpool, vpool)
        return cpu_kernels.paged_rows(q, k, v, table, base, qpos, end, scale=scale, window=window, softcap=softcap,
                                      **scales).astype(q.dtype)
    g = math.gcd(B, ROW_GROUP)
    opts = {"scale": scale, "window": window, "softcap": softcap, "keys_transposed": keys_transposed}
    if g == B:
        return _rows_attention(q, kpool, vpool, table, base, qpos, end, own=own, sinks=sinks, **opts)
    split = lambda a: None if a is None else a.reshape(B // g, g, *a.shape[1:])  # noqa: E731
    xs = (split(q), split(table), split(base), split(qpos), split(end),
          None if own is None else tuple(split(a) for a in own))
    out = jax.lax.map(lambda x: _rows_attention(x[0], kpool, vpool, *x[1:5], own=x[5], sinks=sinks, **opts), xs)
    return out.reshape(q.shape)


def _kernel_pools(kpool, vpool):
    """The pools as the native kernels take them: (k, v) arrays, and int8 pools' scales as
    keyword arguments (none for float pools)."""
    if isinstance(kpool, QuantKV):
        return (kpool.values, vpool.values), {"k_scale": kpool.unflatten(kpool.scale),
                                              "v_scale": vpool.unflatten(vpool.scale)}
    return (kpool, vpool), {}


def _rows_attention(q, kpool, vpool, table, base, qpos, end, *, scale, window, softcap, own, sinks=None,
                    keys_transposed=True):
    """paged_rows_attention for one group of rows."""
    B, T, N, _ = q.shape
    K, ps = vpool.shape[1], vpool.shape[2]
    G = N // K
    qm = _fold_queries(q, K, scale)
    qpos_m = jnp.repeat(qpos, G, axis=1)  # i32[B, T*G]
    acc = _RunningSoftmax()
    for c0, c in _page_blocks(table, ps, ROW_BLOCK_POSITIONS):
        keys, values = _gather_block(kpool, vpool, table[:, c0 : c0 + c], keys_transposed)
        kpos = (c0 * ps + jnp.arange(c * ps, dtype=jnp.int32))[None, :]  # i32[1 or B, S]
        if base is not None:
            kpos = kpos + base[:, None] * ps
        kpos = jnp.broadcast_to(kpos, (B, c * ps))
        written = kpos < end[:, None]
        values = jnp.where(written[:, None, :, None], values, 0.0)
        ok = _visible(qpos_m, kpos, window)
        if own is not None:
            ok = ok & written[:, None, :]
        acc.add(_scores(qm, keys, softcap, keys_transposed), ok[:, None], values)
    if own is not None:
        keys, values = (_as_stored(a, pool) for a, pool in zip(own, (vpool if kpool is None else kpool, vpool)))
        # a row's queries are its positions in order, then padding that repeats the last real
        # one (its keys bound for the scratch page): query j sees its own keys up to j only
        idx = jnp.arange(T, dtype=jnp.int32)
        ok = _visible(qpos_m, qpos, window) & (idx[None, None, :] <= jnp.repeat(idx, G)[None, :, None])
        acc.add(_scores(qm, keys.transpose(0, 2, 3, 1), softcap), ok[:, None], values.transpose(0, 2, 1, 3))
    return _unfold(acc.result(None if sinks is None else sink_rows(sinks, K, T)), T, N, q.dtype)


def _as_stored(a, pool):
    """New keys or values [B, T, K, H] as float32 after a round trip through the pool's
    storage (int8 and its scales, or the pool's dtype), so they read as if from the pages."""
    if isinstance(pool, QuantKV):
        values, scale = quantize_kv(a, axis=-1)
        return dequantize_kv(values, scale, jnp.float32, axis=-1)
    return a.astype(pool.dtype).astype(jnp.float32)


@_reader
def prefill_row_attention(q, k, v, pos, seg, kpool, vpool, table, base, hist_end, attend_to=None, *, scale,
                          window=None, softcap=None, native=False, sinks=None, keys_transposed=True):
    """The packed prefill row: q [1, T, N, H], its own keys/values k, v [1, T, K, H] at
    positions pos i32[T] in segments seg i32[T] (-1: padding). A token sees the earlier
    tokens of its segment, and segment 0 also the positions < hist_end of the pages in
    table i32[1, n] (from logical page base[0] when base is given) -> [1, T, N, H].

    The row is taken a block of queries at a time (``_query_block``). Segments lie one after
    another along the row and padding comes last, so a query block needs only the key blocks
    up to its own that still hold its first token's segment, and the pages only when that
    token is in segment 0; the rest is skipped at run time (``lax.cond``). sinks: f32[N]
    per-head attention sinks (not taken by the native kernel), or None. Pools as for
    ``paged_rows_attention``. attend_to: None, or i32[T] the last position each token sees
    where that is past its own (an image's tokens see their whole image, which lies in the
    row: ``PackedBatch.attend_to``); the window still counts back from the token's own
    position, as in ``layers.attention``. The native kernel takes none."""
    _, T, N, H = q.shape
    if native and sinks is None and attend_to is None and cpu_kernels.prefill_row_fits(T, H, vpool.shape[2]):
        assert keys_transposed, "the native kernel reads transposed keys only"
        pools, scales = _kernel_pools(kpool, vpool)
        out = cpu_kernels.prefill_row(q[0], k[0], v[0], pos, seg, *pools, table, None if base is None else base[0],
                                      hist_end, scale=scale, window=window, softcap=softcap, **scales)
        return out[None].astype(q.dtype)
    K = k.shape[2]
    G = N // K
    C = _query_block(T)
    qm = _fold_queries(q, K, scale)  # f32[1, K, T*G, H], row m = t*G + g
    keys = k.transpose(0, 2, 3, 1)  # [1, K, H, T]
    values = jnp.where((seg >= 0)[None, None, :, None], v.transpose(0, 2, 1, 3).astype(jnp.float32), 0.0)
    ps = vpool.shape[2]
    base0 = 0 if base is None else base[0]
    nb = T // C
    # one query block's body, traced once and mapped over the blocks (unrolled, the 30 layers'
    # blocks and their branches made the executable several times larger and slower to build)
    to = pos if attend_to is None else attend_to
    # the last key block each query block reads: its own, or a later one its image reaches into
    reach = jnp.arange(T, dtype=jnp.int32) + to - pos
    last = jnp.arange(nb) if attend_to is None else jnp.maximum(jnp.arange(nb), reach.reshape(nb, C).max(1) // C)
    xs = (jnp.arange(nb), qm.reshape(1, K, nb, C * G, H).transpose(2, 0, 1, 3, 4),
          jnp.repeat(pos.reshape(nb, 1, C), G, axis=2), jnp.repeat(seg.reshape(nb, C), G, axis=1), seg[::C],
          jnp.repeat(to.reshape(nb, 1, C), G, axis=2), last)

    def block(x):
        i, qc, qpos, qseg, first, qto, j_last = x  # first: the block's earliest segment (-1: all padding)
        acc = _RunningSoftmax()
        acc.start(1, K, C * G, H)
        # segment 0's earlier positions, from its pages
        for c0, c in _page_blocks(table, ps, BLOCK_POSITIONS):

            def history(c0=c0, c=c):
                kb, vb = _gather_block(kpool, vpool, table[:, c0 : c0 + c], keys_transposed)
                kpos = (c0 + base0) * ps + jnp.arange(c * ps, dtype=jnp.int32)
                seen = kpos < hist_end
                ok = _visible(qpos, kpos[None], window)[0] & seen[None, :] & (qseg == 0)[:, None]
                vb = jnp.where(seen[None, None, :, None], vb, 0.0)
                return _scores(qc, kb, softcap, keys_transposed), ok[None, None], vb

            acc.maybe_add((first == 0) & ((c0 + base0) * ps < hist_end), history)
        def local_block(j, state):  # the row's own tokens, causal within a segment: key block j

            def local():
                kseg, kpos = (jax.lax.dynamic_slice_in_dim(a, j * C, C) for a in (seg, pos))
                same = (qseg[:, None] == kseg[None, :]) & (kseg[None, :] >= 0)
                if attend_to is None:
                    ok = _visible(qpos, kpos[None], window)[0] & same
                else:
                    delta = qpos[0][:, None] - kpos[None, :]
                    ok = (qto[0][:, None] >= kpos[None, :]) & same
                    ok = ok if window is None else ok & (delta < window)
                kb = jax.lax.dynamic_slice_in_dim(keys, j * C, C, axis=3)
                vb = jax.lax.dynamic_slice_in_dim(values, j * C, C, axis=2)
                return _scores(qc, kb, softcap), ok[None, None], vb

            acc.m, acc.l, acc.o = state
            # a block that still holds the first segment (block i itself may end in padding;
            # an earlier one never does)
            acc.maybe_add((seg[(j + 1) * C - 1] >= first) | (j >= i), local)
            return acc.m, acc.l, acc.o

        # key blocks 0..i (or to the block its images end in), one traced body (unrolled, the blocks' branches in 30 layers made the
        # step's executable larger and slower to load); none when the query block is all padding
        acc.m, acc.l, acc.o = jax.lax.fori_loop(0, jnp.where(first >= 0, j_last + 1, 0), local_block,
                                                (acc.m, acc.l, acc.o))
        return acc.result(None if sinks is None else sink_rows(sinks, K, C))  # f32[1, K, C*G, H]

    out = jax.lax.map(block, xs)  # [nb, 1, K, C*G, H]
    return _unfold(out.transpose(1, 2, 0, 3, 4).reshape(1, K, T * G, H), T, N, q.dtype)


def _query_block(T: int) -> int:
    """Prefill-row tokens per query block: PREFILL_QUERY_BLOCK, or T / 8 for long rows (at
    most 8 blocks, 36 block pairs per layer), or T when neither divides it."""
    C = max(PREFILL_QUERY_BLOCK, T // 8)
    return C if T % C == 0 else T


# ----------------------------------------------------------------------------- kernel path
def _logical_table(table, base, width: int):
    """Page-table rows i32[S, n] whose column c holds logical page base[s] + c (or c when
    base is None) -> i32[S, width] indexed by logical page (0 where not held: the kernel
    never dereferences a page outside what its queries see)."""
    if base is None and table.shape[1] == width:
        return table
    S, n = table.shape
    cols = jnp.arange(n, dtype=jnp.int32)[None, :] + (0 if base is None else base[:, None])
    rows = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[:, None], (S, n))
    return jnp.zeros((S, width), jnp.int32).at[rows, cols].set(table, mode="drop")


def decode_kernel_attention(q, kpool, vpool, b: PackedBatch, table, base, *, scale, window=None, softcap=None,
                            sinks=None, kernels: dispatch.Kernels, keys_transposed: bool = True):
    """A decode-only step's attention (``PackedBatch.decode_only``: R rows of one query, no
    prefill row) in one paged decode kernel call (TPU/GPU, or Pallas interpret mode):
    q [1, R, N_heads, H] -> [1, R, N_heads, H]. Row r's query sits at positions[r] and reads
    the pages of its table row, which already hold this step's key; windowed tables are laid
    out by logical page as for the ragged kernel, so the window mask alone decides what is
    read (an idle row reads its scratch page and nothing reads its output). sinks: f32[N_heads]
    per-head attention sinks, or None. kernels: where it runs (platform, interpret mode, and
    the mesh, on which the call runs per shard of the pools' KV heads)."""
    R = b.rows
    logical = _logical_table(table[:R], None if base is None else base[:R], b.table.shape[1])
    out = ops.paged_attention(q[0], kpool, vpool, logical, b.positions[:R] + 1, scale=scale, window=window,
                              softcap=softcap, sinks=sinks, keys_transposed=keys_transposed, **_where(kernels))
    return out[None]


def ragged_kernel_attention(q, kpool, vpool, b: PackedBatch, table, base, page, *, scale, window=None,
                            softcap=None, sinks=None, kernels: dispatch.Kernels, keys_transposed: bool = True):
    """The whole packed step's attention in one ragged paged-attention call (TPU/GPU, or
    Pallas interpret mode): q [1, N, N_heads, H] -> [1, N, N_heads, H]. A decode-only step
    runs ``decode_kernel_attention`` instead (module docstring: the rule is
    ``dispatch.paged_path``'s, from the batch's shapes and the ``Kernels`` value); this one
    takes verification rows of q > 1 queries and the prefill row.

    Segments: each decode row (its real queries: positions p0 .. p_max; the padding queries
    that repeat p_max are left out, their output is 0 and nothing reads it), then each
    segment of the prefill row. Every segment reads its sequence's pages, which already hold
    this step's keys: a decode row its table row; a prefill segment the pages its tokens were
    just written to (``page``, by position), and segment 0 also its history in table[R].
    Windowed layers' tables start at logical page ``base``; they are laid out by logical page
    here, so the kernel's window mask alone decides what is read. The laid-out tables are as
    wide as the full-length table, which covers every logical page of every row (a windowed
    table's own width does not: its pages start at ``base``). kernels: as for
    ``decode_kernel_attention``."""
    R, Q, Tp = b.rows, b.q, b.prefill_len
    ps = vpool.shape[2]
    T = R * Q + Tp
    width = b.table.shape[1] + (-(-Tp // ps) if Tp else 0)  # the prefill row's chunks may pass the table
    tables, starts, lens, kv_lens = [], [], [], []
    if R:
        pos = b.positions[: R * Q].reshape(R, Q)
        last = pos.max(axis=1)
        tables.append(_logical_table(table[:R], None if base is None else base[:R], width))
        starts.append(jnp.arange(R, dtype=jnp.int32) * Q)
        lens.append(last - pos[:, 0] + 1)
        kv_lens.append(last + 1)
    if Tp:
        S = min(b.max_segments or Tp, Tp)
        ppos = b.positions[R * Q :]
        seg = jnp.where(b.seg >= 0, b.seg, S)  # padding tokens: out of range, dropped
        tok = R * Q + jnp.arange(Tp, dtype=jnp.int32)
        hist = _logical_table(table[R:], None if base is None else base[R:], width)
        seg_table = jnp.zeros((S, width), jnp.int32).at[0].set(hist[0])
        tables.append(seg_table.at[seg, ppos // ps].set(page[R * Q :], mode="drop"))
        starts.append(jnp.full(S, T, jnp.int32).at[seg].min(tok, mode="drop"))
        lens.append(jnp.zeros(S, jnp.int32).at[seg].add(1, mode="drop"))
        kv_lens.append(jnp.zeros(S, jnp.int32).at[seg].max(ppos + 1, mode="drop"))
    cat = lambda xs: jnp.concatenate(xs, axis=0)
    out = ops.ragged_paged_attention(q[0], kpool, vpool, cat(tables), cat(starts), cat(lens), cat(kv_lens),
                                     scale=scale, window=window, softcap=softcap, sinks=sinks,
                                     keys_transposed=keys_transposed, **_where(kernels))
    return out[None]


def _where(k: dispatch.Kernels) -> dict:
    """The kernel adapters' arguments saying where they run, from the step's choice."""
    return {"interpret": k.interpret, "platform": k.platform, "mesh": k.mesh}
