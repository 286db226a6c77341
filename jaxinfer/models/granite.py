"""The Granite family (GraniteForCausalLM) as plain functions over pytrees: Llama's layers and
weights with four scalars of its own (``GraniteConfig``, the model's ``family_config``):

  x = embed(tokens) * embedding_multiplier
  x = x + residual_multiplier * attention(attn_norm(x))    (scores scaled by attention_multiplier,
                                                            not head_dim**-0.5)
  x = x + residual_multiplier * SwiGLU(mlp_norm(x))
  logits = head(final_norm(x)) / logits_scaling
``attention_bias`` gives q, k, v and the output projection a bias each (``cfg.qkv_bias`` here
covers all four).

weights = {"embed": [V, D], "layers": [one dict per layer], "final_norm": [D],
           "lm_head": [D, V] (untied models only)}
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.models import llama
from jaxinfer.models.family import LayerAt, ModelFamily, decoder, layer_loop
from jaxinfer.models.layers import attend_layer, dot, dot_many, gated_mlp, rms_norm, silu
from jaxinfer.specs import WeightSpec


@dataclasses.dataclass(frozen=True)
class GraniteConfig:
    embedding_multiplier: float = 1.0  # the embedding's rows times this
    residual_multiplier: float = 1.0  # each block adds this times its output
    attention_multiplier: float = 1.0  # the attention scores' scale
    logits_scaling: float = 1.0  # the logits divided by this


def weight_specs(cfg: ModelConfig) -> dict:
    """Llama's weights (and the output bias with biases)."""
    specs = llama.weight_specs(cfg)
    if not cfg.qkv_bias:
        return specs
    layer = specs["layers"][0] | {"bo": WeightSpec((cfg.d_model,), ("embed",), "zeros")}
    return specs | {"layers": [layer] * cfg.n_layers}


def embed(weights, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    x = llama.embed(weights, tokens, cfg)  # [B, T, D]
    return x * jnp.asarray(cfg.family_config.embedding_multiplier, x.dtype)


def unembed(weights, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Llama's final norm and head, the float32 logits [B, T, V] divided by logits_scaling."""
    return llama.unembed(weights, x, cfg) / cfg.family_config.logits_scaling


def layer(w: dict, x: jax.Array, cache, at: LayerAt):
    """One layer over hidden x [B, T, D] -> (x, cache) (the module docstring's)."""
    cfg, i, own = at.cfg, at.i, at.cfg.family_config
    residual = jnp.asarray(own.residual_multiplier, x.dtype)
    with jax.named_scope(f"layer{i}/attention"):
        h = rms_norm(x, w["attn_norm"], cfg.norm_eps)
        q, k, v = dot_many(h, ("BTD,DNH->BTNH", w["wq"]), ("BTD,DKH->BTKH", w["wk"]), ("BTD,DKH->BTKH", w["wv"]))
        if cfg.qkv_bias:
            q, k, v = q + w["bq"].astype(q.dtype), k + w["bk"].astype(k.dtype), v + w["bv"].astype(v.dtype)
        o, cache = attend_layer(cache, at.j, q, k, v, at.positions, at.start, at.rope(), read_cache=at.read_cache,
                                scale=own.attention_multiplier, window=cfg.layer_window(i))
        o = dot("BTNH,NHD->BTD", o, w["wo"])
        x = x + residual * (o + w["bo"].astype(o.dtype) if cfg.qkv_bias else o)
    with jax.named_scope(f"layer{i}/mlp"):
        h = rms_norm(x, w["mlp_norm"], cfg.norm_eps)
        x = x + residual * gated_mlp(h, w["w_gate"], w["w_up"], w["w_down"], silu)
    return x, cache


decoder_layers = layer_loop(layer)


forward = decoder(embed, decoder_layers)

# Llama's names (GGUF: llama.cpp's granite), and the output bias.
CHECKPOINT_NAMES = llama.CHECKPOINT_NAMES | {
    ("layers", "bo"): ("model.layers.{i}.self_attn.o_proj.bias", "blk.{i}.attn_output.bias", False),
}


def config_from_hf(hf: dict, *, dtype: str) -> ModelConfig:
    """A GraniteForCausalLM config.json: Llama's keys and Granite's four scalars."""
    own = GraniteConfig(**{f.name: float(hf.get(f.name, f.default)) for f in dataclasses.fields(GraniteConfig)})
    cfg = llama.config_from_hf(hf, dtype=dtype)
    return dataclasses.replace(cfg, family="granite", family_config=own)


FAMILY = ModelFamily(
    name="granite", weight_specs=weight_specs, embed=embed, decoder_layers=decoder_layers, forward=forward,
    unembed=unembed, checkpoint_names=CHECKPOINT_NAMES,
    hf_architectures=frozenset({"GraniteForCausalLM"}), config_from_hf=config_from_hf, config_class=GraniteConfig,
)
