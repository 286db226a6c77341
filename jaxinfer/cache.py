"""Dense KV cache: fixed-shape buffers, updated in place and donated to every jitted step.

Entry ``s`` of a row holds the keys and values of position ``s``. Calls write their new
tokens at each row's own start position with one scatter after the layer scan, so the
cache is never copied: the jitted steps donate it and XLA aliases input to output.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [L, B, S, K, H]
    v: jax.Array  # [L, B, S, K, H]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim)
    dt = jnp.dtype(dtype or cfg.dtype)
    return KVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt))


def write(cache: KVCache, k_new: jax.Array, v_new: jax.Array, start: jax.Array) -> KVCache:
    """Write [L, B, T, K, H] new keys/values at each row's start position (i32[B])."""

    def put(c, n):  # c [L, B, S, K, H], n [L, B, T, K, H]
        row = lambda cb, nb, s: jax.lax.dynamic_update_slice(cb, nb.astype(cb.dtype), (0, s, 0, 0))
        return jax.vmap(row, in_axes=(1, 1, 0), out_axes=1)(c, n, start)

    return KVCache(put(cache.k, k_new), put(cache.v, v_new))
