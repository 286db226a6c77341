"""Llama-family model on tiny random configs: prefill and each decode step equal the full
forward pass (which uses no cache), across GQA ratios, MQA, rotary scaling and q/k/v bias."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import cache as kv
from jaxinfer.config import ModelConfig, RopeConfig, RopeKind
from jaxinfer.models import llama
from jaxinfer.specs import init_weights

_forward = jax.jit(llama.forward, static_argnames=("cfg", "read_cache"))
_unembed = jax.jit(llama.unembed, static_argnames=("cfg",))

BASE = ModelConfig(family="llama", vocab_size=97, d_model=48, n_layers=2, n_heads=6,
                   n_kv_heads=2, head_dim=8, d_ff=64, norm_eps=1e-5)

CONFIGS = {
    "gqa3": BASE,
    "mha": dataclasses.replace(BASE, n_kv_heads=6),
    "mqa": dataclasses.replace(BASE, n_kv_heads=1),
    "llama3_rope": dataclasses.replace(BASE, rope=RopeConfig(theta=500000.0, kind=RopeKind.LLAMA3, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=16)),
    "linear_rope_bias_untied": dataclasses.replace(BASE, rope=RopeConfig(kind=RopeKind.LINEAR, factor=2.0), qkv_bias=True, tie_embeddings=False),
}


def _setup(cfg):
    w = init_weights(llama.weight_specs(cfg), cfg, jax.random.key(0), scale=0.2)
    if cfg.qkv_bias:  # biases are zeros by default; make them matter
        for i, layer in enumerate(w["layers"]):
            for b in ("bq", "bk", "bv"):
                layer[b] = 0.3 * jax.random.normal(jax.random.key(i), layer[b].shape)
    return w


def _full_logits(w, tokens, cfg):
    h, _ = _forward(w, tokens, jnp.zeros(tokens.shape[0], jnp.int32), None, cfg=cfg)
    return _unembed(w, h, cfg)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_and_decode_match_full_forward(name):
    cfg = CONFIGS[name]
    w = _setup(cfg)
    B, T, P = 3, 12, 5
    tokens = jax.random.randint(jax.random.key(2), (B, T), 0, cfg.vocab_size)
    full = np.asarray(_full_logits(w, tokens, cfg))

    cache = kv.init_cache(cfg, B, 16)
    h, cache = _forward(w, tokens[:, :P], jnp.zeros(B, jnp.int32), cache, cfg=cfg, read_cache=False)
    np.testing.assert_allclose(np.asarray(_unembed(w, h, cfg)), full[:, :P], rtol=1e-5, atol=1e-5)
    for t in range(P, T):
        h, cache = _forward(w, tokens[:, t : t + 1], jnp.full(B, t, jnp.int32), cache, cfg=cfg)
        np.testing.assert_allclose(np.asarray(_unembed(w, h, cfg))[:, 0], full[:, t], rtol=1e-5, atol=1e-5)


def test_ragged_rows_decode_at_their_own_positions():
    """Right-padded prefill of rows with different lengths, then per-row decode positions."""
    cfg = CONFIGS["gqa3"]
    w = _setup(cfg)
    lens = [3, 7, 5]
    seqs = [np.asarray(jax.random.randint(jax.random.key(10 + i), (n + 4,), 0, cfg.vocab_size)) for i, n in enumerate(lens)]
    Tb = 8
    padded = np.zeros((3, Tb), np.int32)
    for i, n in enumerate(lens):
        padded[i, :n] = seqs[i][:n]
    cache = kv.init_cache(cfg, 3, 16)
    _, cache = _forward(w, jnp.asarray(padded), jnp.zeros(3, jnp.int32), cache, cfg=cfg, read_cache=False)
    for step in range(4):
        toks = jnp.asarray([[s[n + step]] for s, n in zip(seqs, lens)], jnp.int32)
        start = jnp.asarray([n + step for n in lens], jnp.int32)
        h, cache = _forward(w, toks, start, cache, cfg=cfg)
        got = np.asarray(_unembed(w, h, cfg))[:, 0]
        for i, (s, n) in enumerate(zip(seqs, lens)):
            ref = np.asarray(_full_logits(w, jnp.asarray(s[None, : n + step + 1]), cfg))[0, -1]
            np.testing.assert_allclose(got[i], ref, rtol=1e-5, atol=1e-5)


def test_chunked_prefill_equals_one_prefill():
    cfg = CONFIGS["gqa3"]
    w = _setup(cfg)
    tokens = jax.random.randint(jax.random.key(3), (2, 12), 0, cfg.vocab_size)
    full = np.asarray(_full_logits(w, tokens, cfg))
    cache = kv.init_cache(cfg, 2, 16)
    for c in range(3):
        h, cache = _forward(w, tokens[:, 4 * c : 4 * c + 4], jnp.full(2, 4 * c, jnp.int32), cache, cfg=cfg)
        np.testing.assert_allclose(np.asarray(_unembed(w, h, cfg)), full[:, 4 * c : 4 * c + 4], rtol=1e-5, atol=1e-5)
