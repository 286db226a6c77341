"""KV caches: fixed-shape buffers, updated in place and donated to every jitted step.

Dense cache: entry ``s`` of a row holds the keys and values of position ``s``. Each layer writes its new
tokens at each row's own positions with one scatter and then attends over the cache, so the
cache is never copied: the jitted steps donate it and XLA aliases input to output. The
layout, one buffer per layer (keys [B, K, H, S], values [B, K, S, H]), lets attention read a layer's cache in place
(slicing one stacked [L, ...] buffer copied it: 90 ms of a 500 ms step) and batch over
(B, K) without transposing it.

Sliding-window layers (Gemma's LOCAL layers) only ever attend to the last W positions, so
they need not keep the rest. In the dense cache such a layer may keep a ring of
R = W + max_chunk - 1 slots (position p in slot p % R; a chunk of T <= max_chunk queries
sees the W + T - 1 positions it needs) and the positions each slot holds ride along in
``ring_pos``. In the paged pools windowed layers have a page pool of their own and the
scheduler a second page table that covers only each sequence's window (``models.packed``); the
engine frees pages that fell out of every future query's window.

Latent pools (multi-head latent attention, ``ModelConfig.latent_attention``): a layer caches
one latent per token, [c_kv | k_rope], in its values buffer (one head of width C + R), and
has no keys buffer (None): the latent is both the key and, its first C entries, the value,
so it is stored once. Its reader hands back the keys as the values' transpose.

Key layout of the page pools (``PagedKVCache.keys_transposed``, chosen once per engine by
``dispatch.keys_transposed``): transposed, [P, K, H, page_size], where the CPU readers want it
(the native kernels and the XLA readers on CPU score a block of keys in one pass over H rows);
[P, K, page_size, H], as the values, everywhere else. A TPU tiles the two minor dimensions in
(8, 128) blocks, and a 16-token page as the minor one made XLA relay out (copy) the whole key
pool after every layer's write.

int8 KV (``dtype="int8"``): every buffer is a ``QuantKV`` pytree, int8 keys/values with one
float32 scale per (token, head) beside them (``quant.quantize_kv``), written quantized and
read back dequantized to float32, in both caches and both layer kinds. A page pool keeps its
scales flat, [P, K * page_size] (128 wide at 8 KV heads of 16-token pages), and readers split a
page's row back into [K, page_size] after gathering it: [P, K, page_size] has a minor dimension
of 16, and on a TPU XLA gave those pools a layout with the pages minor and copied the whole
scale pool to row-major and back around every layer's write and read. On CPU the split is free.
A row narrower than 128 on a chip (fewer than 8 KV heads a chip under tensor parallelism, at
16-token pages) would get that layout and those copies again, so on a TPU each head's slots in
the row are padded until a chip's part of it is a multiple of 128 wide ([P, K * w], w >= ps:
64 at 2 heads a chip, 128 at one; ``init_paged_cache``'s ``lanes`` and ``model_shards``).

Head dims padded on a TPU (``init_paged_cache``'s ``lanes``, ``dispatch.pool_lanes``): a pool
whose minor dimension is no multiple of 128 (64-wide heads, a 576-wide latent) half fills its
(8, 128) tiles, and XLA lays it out with the pages minor and copies it whole to row-major and
back around each layer's write and read. There the pools store the head dim padded to a
multiple of 128 (64 -> 128, 576 -> 640) with zeros in the padding, as vLLM's TPU backend does:
the step pads the queries and new keys/values and drops the padding of its output, and a zero
lane adds nothing to a score nor to a value. CPU pools keep the model's head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.errors import InvalidRequest
from jaxinfer.quant import dequantize_kv, quantize_kv

EMPTY_POS = 1 << 30  # position of a slot that holds no key: after every query, so masked
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")  # auto: the model's dtype


def kv_storage_dtype(kv_cache_dtype: str | None, cfg: ModelConfig) -> str:
    """The dtype a cache stores, from the user's choice; InvalidRequest names the valid ones."""
    if kv_cache_dtype in (None, "auto"):
        return cfg.dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InvalidRequest(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return kv_cache_dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantKV:
    """One int8 key or value buffer with a float32 scale per (token, head): the shape of
    the float buffer it replaces, and that shape without the head-dim ``axis``, or (a page
    pool's) with its last two dims merged: flat, [P, K * page_size] (module doc)."""

    values: jax.Array  # int8, e.g. keys [B, K, H, S] or values [P, K, ps, H]
    scale: jax.Array  # f32, e.g. [B, K, S] or [P, K, ps]; flat [P, K * ps]
    axis: int = dataclasses.field(metadata={"static": True})  # head-dim axis of values: -2 transposed keys, else -1

    @property
    def shape(self):
        return self.values.shape

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scale.nbytes

    @property
    def flat(self) -> bool:
        """Whether the scales' last two dims (K and the positions) are stored merged."""
        return self.scale.ndim == self.values.ndim - 2

    def unflatten(self, s: jax.Array) -> jax.Array:
        """Scales s (the leading entries of ``scale``, e.g. some pages of it) with their last
        dim split back into (K, positions) when flat: [..., K * w] -> [..., K, ps] (w >= ps:
        a head's slots padded so a chip's row fills whole lanes; module doc)."""
        if not self.flat:
            return s
        K, ps = _scale_shape(self.values.shape, self.axis)[-2:]
        s = s.reshape(*s.shape[:-1], K, -1)
        return s if s.shape[-1] == ps else s[..., :ps]

    def flatten(self, s: jax.Array) -> jax.Array:
        """``unflatten``'s inverse when flat: [..., K, ps] -> [..., K * w], the padding slots 1."""
        if not self.flat:
            return s
        K, ps = s.shape[-2:]
        w = self.scale.shape[-1] // K
        if w > ps:
            s = jnp.pad(s, [(0, 0)] * (s.ndim - 1) + [(0, w - ps)], constant_values=1.0)
        return s.reshape(*s.shape[:-2], K * w)


def _scale_shape(shape, axis: int, flat: bool = False, *, lanes: int = 1, model_shards: int = 1) -> tuple[int, ...]:
    """The scales' shape of an int8 buffer of ``shape``: without its head-dim ``axis``, and with
    the last two dims (K, positions) merged when ``flat``, each head's positions padded so that
    one chip's part of the row is a multiple of ``lanes`` wide: K / model_shards heads where the
    model axis divides K (``sharding.kv_heads_axis``), else all K."""
    out = tuple(n for i, n in enumerate(shape) if i != len(shape) + axis)
    if not flat:
        return out
    K, ps = out[-2:]
    per_chip = K // model_shards if K % model_shards == 0 else K
    return (*out[:-2], K * padded(ps, lanes // math.gcd(lanes, per_chip)))


def padded(n: int, multiple: int) -> int:
    """n rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def _zeros(shape, dt, axis: int, *, flat_scale: bool = False, lanes: int = 1, model_shards: int = 1):
    """A float buffer, or a QuantKV one when dt is int8 (head-dim ``axis`` scaled away, the
    scales flat with ``flat_scale``, a chip's row padded to ``lanes``: ``_scale_shape``)."""
    if dt == jnp.int8:
        scale = _scale_shape(shape, axis, flat_scale, lanes=lanes, model_shards=model_shards)
        return QuantKV(jnp.zeros(shape, jnp.int8), jnp.ones(scale, jnp.float32), axis)
    return jnp.zeros(shape, dt)


def _store(buf, index, new: jax.Array, mode=None):
    """buf.at[index].set(new) for new [B, T, K, H] whose (B, T) the index's two advanced
    entries select; a QuantKV stores the quantized values and their scales [B, T, K] (the
    index without its head-dim slice)."""
    if isinstance(buf, QuantKV):
        q, scale = quantize_kv(new, axis=-1)
        sindex = (index[0], slice(None), index[-1])
        scales = buf.flatten(buf.unflatten(buf.scale).at[sindex].set(scale, mode=mode))
        return QuantKV(buf.values.at[index].set(q, mode=mode), scales, buf.axis)
    return buf.at[index].set(new.astype(buf.dtype), mode=mode)


def _load(buf, table=None):
    """The buffer (its pages ``table`` when given) as floats: float32 for a QuantKV."""
    if isinstance(buf, QuantKV):
        values, scale = (buf.values, buf.scale) if table is None else (buf.values[table], buf.scale[table])
        return dequantize_kv(values, buf.unflatten(scale), jnp.float32, axis=buf.axis)
    return buf if table is None else buf[table]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: list[jax.Array]  # L x [B, K_l, H_l, S_l]  keys transposed: see models.layers.attention
    v: list[jax.Array]  # L x [B, K_l, S_l, H_l]  S_l: max_len, or R for a windowed (ring) layer
    # (None for a layer that attends over another's keys/values: ModelConfig.kv_source)
    ring_pos: jax.Array  # i32[B, R] position each ring slot holds (EMPTY_POS: none); R = 0: no rings
    windowed: tuple[bool, ...] = dataclasses.field(default=(), metadata={"static": True})

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return max(v.shape[2] for v in self.v if v is not None)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v if a is not None) + self.ring_pos.nbytes

    def is_ring(self, layer: int) -> bool:
        return bool(self.windowed) and self.windowed[layer]

    def write_layer(self, layer: int, k_new, v_new, start) -> KVCache:
        return write_layer(self, layer, k_new, v_new, start)

    def read_layer(self, layer: int, end: jax.Array):
        """(keys [B, K, H, S], values [B, K, S, H], kpos) of one layer: kpos i32[S] for a
        full-length layer, i32[B, R] (what each ring slot holds) for a ring. Values at
        positions >= end[b] (not written yet for row b, or EMPTY_POS) read as 0: see
        layers.attention. int8 buffers read back as float32."""
        kpos = self.ring_pos if self.is_ring(layer) else jnp.arange(self.v[layer].shape[2])
        values = _zero_unseen(_load(self.v[layer]), kpos, end)
        return _latent_keys(values) if self.k[layer] is None else _load(self.k[layer]), values, kpos


def _latent_keys(values: jax.Array) -> jax.Array:
    """A latent layer's keys [B, 1, C + R, S]: its values [B, 1, S, C + R] transposed (one
    buffer holds both; see the module doc)."""
    return values.swapaxes(-1, -2)



def _zero_unseen(values: jax.Array, kpos: jax.Array, end: jax.Array) -> jax.Array:
    """values [B, K, S, H] with the slots at kpos >= end[b] set to 0 (never NaN); kpos is
    i32[S] or per row i32[B, S]."""
    kpos = kpos if kpos.ndim == 2 else kpos[None, :]
    seen = kpos < end[:, None]  # bool[B, S]
    return jnp.where(seen[:, None, :, None], values, jnp.zeros((), values.dtype))


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None, *, max_chunk: int | None = None) -> KVCache:
    """Zeroed cache for ``batch`` rows of up to ``max_len`` positions. With ``max_chunk`` (the
    most query tokens any call that reads this cache brings), windowed layers keep a ring of
    W + max_chunk - 1 slots instead, when that is shorter. A call that does not read the
    cache (a fresh right-padded prefill) may bring more: its last R positions are kept, and
    R >= W + T - 1 keeps every real token a later query needs. Layer i's buffers are
    [batch, K_i, H_i, ...] (``layer_kv_heads``, ``layer_head_dim``); a layer that attends over
    another's keys/values (``kv_source``) has None."""
    dt = jnp.dtype(dtype or cfg.dtype)
    windows = [cfg.layer_window(i) for i in range(cfg.n_layers)]
    R = 0
    if max_chunk is not None and any(windows):
        R = max(w for w in windows if w) + max_chunk - 1
    windowed = tuple(bool(w) and 0 < R < max_len for w in windows)
    lens = [R if ring else max_len for ring in windowed]
    KH = [(cfg.layer_kv_heads(i), cfg.layer_head_dim(i)) if cfg.kv_source(i) == i else None
          for i in range(cfg.n_layers)]
    keys = not cfg.latent_attention  # a latent layer keeps only its values buffer (module doc)
    return KVCache([None if kh is None or not keys else _zeros((batch, kh[0], kh[1], n), dt, -2)
                    for kh, n in zip(KH, lens)],
                   [None if kh is None else _zeros((batch, kh[0], n, kh[1]), dt, -1) for kh, n in zip(KH, lens)],
                   jnp.full((batch, R if any(windowed) else 0), EMPTY_POS, jnp.int32), windowed)


def write_layer(cache: KVCache, layer: int, k_new: jax.Array, v_new: jax.Array, start: jax.Array) -> KVCache:
    """Write one layer's new keys/values [B, T, K, H] at positions start[b] + t.

    One scatter with explicit (row, position) indices into the donated buffer; XLA CPU
    lowers a vmapped dynamic_update_slice to a scatter ~500x slower than this. Positions past
    the cache end are dropped (only padding tokens of a right-padded prefill reach them). A
    ring layer writes position p to slot p % R, keeping only a chunk's last R positions (two
    positions of one scatter must never share a slot).
    """
    B, T = k_new.shape[:2]
    rows = jnp.arange(B)[:, None]
    pos = start[:, None] + jnp.arange(T)[None, :]  # i32[B, T]
    ring_pos = cache.ring_pos
    if cache.is_ring(layer):
        R = cache.v[layer].shape[2]
        idx = jnp.where(pos >= (start + T - R)[:, None], pos % R, R)  # R: out of range, dropped
        ring_pos = ring_pos.at[rows, idx].set(pos, mode="drop")
    else:
        idx = pos

    def put(cs, n, index):  # the indexed dims (B, T) lead the update: n is [B, T, K, H]
        cs = list(cs)
        if cs[layer] is not None:  # (a latent layer has no keys buffer)
            cs[layer] = _store(cs[layer], index, n, mode="drop")
        return cs

    slc = slice(None)
    return KVCache(put(cache.k, k_new, (rows, slc, slc, idx)), put(cache.v, v_new, (rows, slc, idx)),
                   ring_pos, cache.windowed)


# ----------------------------------------------------------------------------- paged
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    """A page pool per layer: the paged engine's KV storage, donated to every step, which reads
    and writes it through ``models.packed.PackedKV`` (a sequence's position p lives in page
    ``table[p // page_size]`` at offset ``p % page_size`` of the tables the scheduler builds).
    Windowed layers (``windowed[layer]``) draw on a pool of their own that holds only each
    sequence's current window, the pages before it having gone back to the allocator."""

    k: list[jax.Array]  # L x [P_l, K_l, H_l, page_size] if keys_transposed, else [P_l, K_l, page_size, H_l]
    v: list[jax.Array]  # L x [P_l, K_l, page_size, H_l]  P_l: pages of the layer's pool
    # (None for a layer that attends over another's pool: ModelConfig.kv_source)
    windowed: tuple[bool, ...] = dataclasses.field(default=(), metadata={"static": True})
    keys_transposed: bool = dataclasses.field(default=True, metadata={"static": True})  # module doc

    @property
    def page_size(self) -> int:
        return next(v for v in self.v if v is not None).shape[2]

    @property
    def num_pages(self) -> int:
        """Pages of the full-length layers' pool."""
        kinds = self.windowed or (False,) * len(self.v)
        return next((v.shape[0] for v, w in zip(self.v, kinds) if v is not None and not w),
                    next(v for v in self.v if v is not None).shape[0])

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v if a is not None)


def init_paged_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype=None, *,
                     num_window_pages: int | None = None, keys_transposed: bool = True, lanes: int = 1,
                     model_shards: int = 1) -> PagedKVCache:
    """Zeroed page pools: ``num_pages`` per full-length layer and, with ``num_window_pages``,
    a pool of that many per windowed (LOCAL) layer, which then keep only their window. Layer
    i's pools are [P, K_i, ...] (``layer_kv_heads``, ``layer_head_dim``), keys [P, K, H, ps]
    when ``keys_transposed`` else [P, K, ps, H] (``dispatch.keys_transposed`` decides); a layer
    that attends over another's keys/values (``kv_source``) has no pool (None), and a latent
    layer no keys pool (module doc).

    lanes (``dispatch.pool_lanes``: 128 on a TPU, else 1): the head dim is stored padded to a
    multiple of it (H_pool >= H; the padding holds zeros, ``models.packed.PackedKV.attend``),
    and so is each chip's part of an int8 pool's flat scale row, on a mesh whose "model" axis
    has ``model_shards`` devices (module doc)."""
    dt = jnp.dtype(dtype or cfg.dtype)
    windowed = tuple(num_window_pages is not None and cfg.layer_window(i) is not None for i in range(cfg.n_layers))
    pools = [(num_window_pages if w else num_pages, cfg.layer_kv_heads(i), padded(cfg.layer_head_dim(i), lanes))
             if cfg.kv_source(i) == i else None for i, w in enumerate(windowed)]
    keys = not cfg.latent_attention
    scales = dict(flat_scale=True, lanes=lanes, model_shards=model_shards)
    return PagedKVCache(
        [None if p is None or not keys else _zeros(key_pool_shape(*p, page_size, keys_transposed), dt,
                                                   -2 if keys_transposed else -1, **scales) for p in pools],
        [None if p is None else _zeros((p[0], p[1], page_size, p[2]), dt, -1, **scales) for p in pools],
        windowed=windowed, keys_transposed=keys_transposed,
    )


def key_pool_shape(P: int, K: int, H: int, page_size: int, transposed: bool) -> tuple[int, ...]:
    """A keys pool's shape: [P, K, H, page_size] transposed, else [P, K, page_size, H]."""
    return (P, K, H, page_size) if transposed else (P, K, page_size, H)


# traced once per shape and inlined: every layer of a step writes pools of one shape, and jnp's
# indexed update costs ~1.5 ms of Python per trace (the program is the same, op for op)
@functools.partial(jax.jit, static_argnames=("keys_transposed", "whole_pages"), inline=True)
def write_pages(pool, page: jax.Array, off: jax.Array, new: jax.Array, *, keys_transposed: bool = False,
                whole_pages: int | None = None):
    """``pool`` (float, or ``QuantKV``) with tokens new [1, N, K, H] written at slot off i32[N]
    of page i32[N]: a values pool, or a keys pool of either layout ([P, K, H, ps] when
    keys_transposed).

    whole_pages: None writes each token's [K, H] where it goes (one scatter over the page and
    slot dims). An int M (an upper bound on the distinct pages the tokens touch) rewrites the
    M pages whole instead: read, the new tokens merged in, written back by page alone. A TPU
    needs that: a scatter over two dims of [P, K, ps, H] wants P and ps next to each other in
    memory, so for a big write (a prompt chunk), or inside a loop (a chain of steps), XLA
    relays out the whole pool around it; whole pages scatter over P alone. Only for pools
    laid out [P, K, ps, ...] (keys not transposed)."""
    if whole_pages is not None:
        if keys_transposed:
            raise ValueError("whole_pages writes need pools laid out [P, K, page_size, H]")
        return _write_whole_pages(pool, page, off, new[0], whole_pages)
    s = slice(None)
    return _store(pool, (page[None], s, s, off[None]) if keys_transposed else (page[None], s, off[None]), new)


def _write_whole_pages(pool, page: jax.Array, off: jax.Array, new: jax.Array, M: int):
    """write_pages's whole-page write of new [N, K, H] (M: at most this many distinct pages)."""
    N = page.shape[0]
    P, ps = pool.shape[0], pool.shape[2]
    M = min(M, N)
    # the distinct pages, sorted; the unused entries hold P (no page), whose writes are dropped
    pages = jnp.unique(page, size=M, fill_value=P)
    slot = jnp.searchsorted(pages, page)
    src = jnp.full((M, ps), -1, jnp.int32).at[slot, off].set(jnp.arange(N, dtype=jnp.int32))  # token at each slot
    hit = src >= 0
    take = jnp.maximum(src, 0)

    def merge(buf, upd, view=lambda a: a, back=lambda a: a):
        """buf [P, K, ps, ...] (flat scales [P, K * w]: ``view`` splits a page's row into
        [K, ps], ``back`` merges it again), upd [N, K, ...] -> buf with its M pages rewritten"""
        old = view(buf.at[pages].get(mode="fill", fill_value=0))  # [M, K, ps, ...]
        put = jnp.moveaxis(upd[take], 1, 2)  # [M, ps, K, ...] -> [M, K, ps, ...]
        mask = hit.reshape(M, 1, ps, *(1,) * (old.ndim - 3))
        merged = back(jnp.where(mask, put.astype(buf.dtype), old))
        return buf.at[pages].set(merged, mode="drop", unique_indices=True)

    if isinstance(pool, QuantKV):
        q, scale = quantize_kv(new, axis=-1)
        return QuantKV(merge(pool.values, q), merge(pool.scale, scale, pool.unflatten, pool.flatten), pool.axis)
    return merge(pool, new)
