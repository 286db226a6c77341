"""Dense KV cache: fixed-shape buffers, updated in place and donated to every jitted step.

Entry ``s`` of a row holds the keys and values of position ``s``. Each layer writes its new
tokens at each row's own positions with one scatter and then attends over the cache, so the
cache is never copied: the jitted steps donate it and XLA aliases input to output. The
layout, one buffer per layer (keys [B, K, H, S], values [B, K, S, H]), lets attention read a layer's cache in place
(slicing one stacked [L, ...] buffer copied it: 90 ms of a 500 ms step) and batch over
(B, K) without transposing it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: list[jax.Array]  # L x [B, K, H, S]  keys transposed: see models.layers.attention
    v: list[jax.Array]  # L x [B, K, S, H]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.v[0].shape[2]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)

    def write_layer(self, layer: int, k_new, v_new, start) -> "KVCache":
        return write_layer(self, layer, k_new, v_new, start)

    def read_layer(self, layer: int, end: jax.Array):
        """(keys [B, K, H, S], values [B, K, S, H], kpos i32[S]) of one layer. Values at
        positions >= end[b] (not written yet for row b) read as 0: see layers.attention."""
        kpos = jnp.arange(self.max_len)
        return self.k[layer], _zero_unseen(self.v[layer], kpos, end), kpos


def _zero_unseen(values: jax.Array, kpos: jax.Array, end: jax.Array) -> jax.Array:
    """values [B, K, S, H] with the slots at kpos >= end[b] set to 0 (never NaN)."""
    seen = kpos[None, :] < end[:, None]  # bool[B, S]
    return jnp.where(seen[:, None, :, None], values, jnp.zeros((), values.dtype))


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    K, H = cfg.n_kv_heads, cfg.head_dim
    dt = jnp.dtype(dtype or cfg.dtype)
    return KVCache([jnp.zeros((batch, K, H, max_len), dt) for _ in range(cfg.n_layers)],
                   [jnp.zeros((batch, K, max_len, H), dt) for _ in range(cfg.n_layers)])


def write_layer(cache: KVCache, layer: int, k_new: jax.Array, v_new: jax.Array, start: jax.Array) -> KVCache:
    """Write one layer's new keys/values [B, T, K, H] at positions start[b] + t.

    One scatter with explicit (row, position) indices into the donated buffer; XLA CPU
    lowers a vmapped dynamic_update_slice to a scatter ~500x slower than this. Positions past
    the cache end are dropped (only padding tokens of a right-padded prefill reach them).
    """
    B, T = k_new.shape[:2]
    rows = jnp.arange(B)[:, None]
    pos = start[:, None] + jnp.arange(T)[None, :]  # i32[B, T]

    def put(cs, n, index):  # the indexed dims (B, T) lead the update: n is [B, T, K, H]
        cs = list(cs)
        cs[layer] = cs[layer].at[index].set(n.astype(cs[layer].dtype), mode="drop")
        return cs

    slc = slice(None)
    return KVCache(put(cache.k, k_new, (rows, slc, slc, pos)), put(cache.v, v_new, (rows, slc, pos)))


# ----------------------------------------------------------------------------- paged
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    """A page pool per layer plus the page tables of the rows in this call.

    Row b's position p lives in page ``page_table[b, p // page_size]`` at offset
    ``p % page_size``. The pools are donated to every step; the page table is small and
    comes from the host allocator each call (its width is bucketed by the longest row).
    """

    k: list[jax.Array]  # L x [P, K, H, page_size]  keys transposed, as in KVCache
    v: list[jax.Array]  # L x [P, K, page_size, H]
    page_table: jax.Array  # i32[B, n] pages of each row; unused entries are page 0 (scratch)

    @property
    def page_size(self) -> int:
        return self.v[0].shape[2]

    @property
    def num_pages(self) -> int:
        return self.v[0].shape[0]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)

    def with_page_table(self, page_table) -> "PagedKVCache":
        return PagedKVCache(self.k, self.v, page_table)

    def write_layer(self, layer: int, k_new, v_new, start) -> "PagedKVCache":
        """Scatter one layer's new keys/values [B, T, K, H] into the rows' pages."""
        B, T = k_new.shape[:2]
        ps, n = self.page_size, self.page_table.shape[1]
        pos = start[:, None] + jnp.arange(T)[None, :]  # i32[B, T]
        slot = pos // ps
        # positions past the table (padding of a right-padded chunk) go to the scratch page
        page = jnp.where(slot < n, jnp.take_along_axis(self.page_table, jnp.minimum(slot, n - 1), axis=1), 0)
        off = pos % ps
        s = slice(None)
        k, v = list(self.k), list(self.v)
        k[layer] = k[layer].at[page, s, s, off].set(k_new.astype(k[layer].dtype))
        v[layer] = v[layer].at[page, s, off].set(v_new.astype(v[layer].dtype))
        return PagedKVCache(k, v, self.page_table)

    def read_layer(self, layer: int, end: jax.Array):
        """Gather the rows' pages into dense views (keys [B, K, H, n*ps], values
        [B, K, n*ps, H], kpos); only the n page-table columns of this call are read. Values
        at positions >= end[b] read as 0 (XLA fuses that into the gather's copy)."""
        B, n = self.page_table.shape
        kp = self.k[layer][self.page_table]  # [B, n, K, H, ps]
        vp = self.v[layer][self.page_table]  # [B, n, K, ps, H]
        K, H, ps = kp.shape[2], kp.shape[3], kp.shape[4]
        keys = kp.transpose(0, 2, 3, 1, 4).reshape(B, K, H, n * ps)
        values = vp.transpose(0, 2, 1, 3, 4).reshape(B, K, n * ps, H)
        kpos = jnp.arange(n * ps)
        return keys, _zero_unseen(values, kpos, end), kpos


def init_paged_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype=None) -> PagedKVCache:
    K, H = cfg.n_kv_heads, cfg.head_dim
    dt = jnp.dtype(dtype or cfg.dtype)
    return PagedKVCache(
        [jnp.zeros((num_pages, K, H, page_size), dt) for _ in range(cfg.n_layers)],
        [jnp.zeros((num_pages, K, page_size, H), dt) for _ in range(cfg.n_layers)],
        jnp.zeros((1, 1), jnp.int32),
    )
