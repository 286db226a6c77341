"""An EAGLE draft head (Li et al., 2024): one decoder layer that runs over the target model's own
features and predicts the next feature, so drafting is autoregression at the feature level.

Entry p of the draft's sequence is ``fc([n(f_p); e(t_{p+1})])``: f_p is the target's hidden
state at position p (before its final norm), n() scales it to unit RMS, e() is the target's own
token embedding of the token that follows. One decoder layer of the target's family (its own
keys and values, causal attention over entries <= p, rotary position p) turns entry p into g_p,
an estimate of f_{p+1}; the target's final norm and LM head, restricted to a draft vocabulary
(the most frequent tokens of the model's own answers), read out t_{p+2}. Drafting k tokens
after a verified block: the block's entries with real features give g at the accepted position
and draft 1; each further draft feeds g back in place of f.

Entry p sits at position p, so the draft's keys and values live in pages addressed by the
target's own page tables, one entry per position the target computes. Only ``fc`` and the layer
train; the embedding, final norm and LM head are the target's, frozen. A heads directory is an
Orbax checkpoint of ``{"fc", "layer", "vocab"}`` plus ``eagle.json``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxinfer.config import AttentionKind
from jaxinfer.models.layers import dot, take
from jaxinfer.models.registry import model_family
from jaxinfer.specs import WeightSpec, init_weights

META_FILE = "eagle.json"
WEIGHTS_DIR = "head"
FORMAT = "jaxinfer-eagle"


def head_specs(cfg) -> dict:
    """One declaration per trained weight: the input projection and one layer of the family."""
    D = cfg.d_model
    return {"fc": WeightSpec((2 * D, D), ("embed2", "embed"), dtype="float32", contract=("embed2",)),
            "layer": model_family(cfg.family).weight_specs(cfg)["layers"][0]}


def layer_cfg(cfg):
    """The draft layer's configuration: one global-attention layer of the family, float32."""
    kinds = (AttentionKind.GLOBAL,) if cfg.layer_kinds else ()
    return dataclasses.replace(cfg, n_layers=1, layer_kinds=kinds, dtype="float32")


def init_head(cfg, key, *, from_layer: dict | None = None, scale: float = 0.02) -> dict:
    """Random fc and layer (or the layer copied from one of the target's, ``from_layer``)."""
    lcfg = layer_cfg(cfg)
    head = init_weights(head_specs(lcfg), lcfg, key, scale)
    if from_layer is not None:
        head["layer"] = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), from_layer)
    return head


def readout_rows(weights: dict, vocab: jax.Array, cfg) -> jax.Array:
    """f32[Vd, D]: the target's LM head rows of the draft vocabulary (computed once at load)."""
    if cfg.tie_embeddings:
        return take(weights["embed"], vocab).astype(jnp.float32)
    lm = weights["lm_head"]
    full = lm if isinstance(lm, jax.Array) else lm.dequantize()
    return jnp.take(full, vocab, axis=1).T.astype(jnp.float32)


def unit_rms(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def entries(head: dict, weights: dict, feats: jax.Array, next_tokens: jax.Array, cfg) -> jax.Array:
    """feats f32[..., D] (f_p), next_tokens i32[...] (t_{p+1}) -> entries f32[..., D]."""
    e = model_family(cfg.family).embed(weights, next_tokens, cfg).astype(jnp.float32)
    x = jnp.concatenate([unit_rms(feats), e], axis=-1)
    if isinstance(head["fc"], jax.Array):
        return x @ head["fc"]
    return dot("ME,ED->MD", x.reshape(-1, x.shape[-1]), head["fc"]).reshape(x.shape[:-1] + (-1,))


def run_layer(head: dict, x: jax.Array, positions: jax.Array, cache, cfg):
    """The draft layer over entries x f32[B, T, D] at positions i32[B, T] -> (g, cache)."""
    mod = model_family(cfg.family)
    return mod.decoder_layers([head["layer"]], x, positions, jnp.zeros(x.shape[0], jnp.int32), cache,
                              cfg=layer_cfg(cfg))


def draft_logits(weights: dict, rows: jax.Array, g: jax.Array, cfg) -> jax.Array:
    """g f32[..., D] -> f32[..., Vd] through the target's final norm and the draft rows."""
    mod = model_family(cfg.family)
    if isinstance(rows, jax.Array):
        w = {"final_norm": weights["final_norm"], "embed": rows, "lm_head": rows.T}
    else:  # quantized rows [Vd, D] (the engine's int8 head): read out as a tied head
        w, cfg = {"final_norm": weights["final_norm"], "embed": rows}, dataclasses.replace(cfg, tie_embeddings=True)
    lead = g.shape[:-1]
    return mod.unembed(w, g.reshape(1, -1, g.shape[-1]).astype(jnp.float32),
                       dataclasses.replace(cfg, dtype="float32")).reshape(lead + (-1,))


def save_head(dest, head: dict, vocab, cfg, extra: dict | None = None) -> Path:
    from jaxinfer.models.medusa import save_checkpoint

    meta = {"format": FORMAT, "hidden_size": cfg.d_model, "vocab_size": cfg.vocab_size, "family": cfg.family,
            "draft_vocab_size": int(len(vocab)), **(extra or {})}
    tree = {**jax.device_get(head), "vocab": jax.device_get(jnp.asarray(vocab, jnp.int32))}
    return save_checkpoint(dest, tree, WEIGHTS_DIR, META_FILE, meta)


def load_head(path, cfg) -> tuple[dict, jax.Array, dict]:
    """Read a head made for a model shaped like ``cfg`` -> (head, vocab i32[Vd], meta)."""
    from jaxinfer.models.medusa import read_checkpoint

    def abstract(meta):
        tree = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), head_specs(layer_cfg(cfg)),
                            is_leaf=lambda x: isinstance(x, WeightSpec))
        return {**tree, "vocab": jax.ShapeDtypeStruct((meta["draft_vocab_size"],), jnp.int32)}

    tree, meta = read_checkpoint(path, WEIGHTS_DIR, META_FILE, FORMAT, abstract, "an EAGLE head directory", "head",
                                 {"hidden_size": cfg.d_model, "vocab_size": cfg.vocab_size, "family": cfg.family})
    vocab = tree.pop("vocab")
    return tree, vocab, meta
