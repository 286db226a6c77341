"""The Qwen 3 family (dense Qwen3ForCausalLM) as plain functions over pytrees.

What sets it apart from Llama, layer by layer:
  h = attn_norm(x); q, k = q_norm(q), k_norm(k)    (RMSNorm over each head's H values, scaled
                                                    by w, before rotary; shared by all heads)
  x = x + attention(h)                             (SLIDING layers: the last ``sliding_window``)
  x = x + SwiGLU(mlp_norm(x))
Sliding-window layers are those transformers' ``layer_types`` names "sliding_attention"; a
config without ``layer_types`` slides on layers max_window_layers .. L-1 when
``use_sliding_window`` is set (no published Qwen 3 sets it). ``attention_bias`` gives q, k, v
and the output projection a bias each (``cfg.qkv_bias`` here covers all four).

weights = {"embed": [V, D], "layers": [one dict per layer], "final_norm": [D],
           "lm_head": [D, V] (untied models only)}
"""

from __future__ import annotations

import dataclasses

import jax

from jaxinfer.config import ModelConfig
from jaxinfer.models import llama
from jaxinfer.models.family import LayerAt, ModelFamily, decoder, layer_loop
from jaxinfer.models.layers import (
    attend_layer,
    dot,
    dot_many,
    gated_mlp,
    rms_norm,
    silu,
)
from jaxinfer.models.llama import embed, unembed  # noqa: F401 (this family's, unchanged)
from jaxinfer.specs import WeightSpec


def weight_specs(cfg: ModelConfig) -> dict:
    """Llama's weights, plus a q and a k norm [H] per layer (and the output bias with biases)."""
    specs = llama.weight_specs(cfg)
    layer = specs["layers"][0] | {
        "q_norm": WeightSpec((cfg.head_dim,), ("head_dim",), "ones"),
        "k_norm": WeightSpec((cfg.head_dim,), ("head_dim",), "ones"),
    }
    if cfg.qkv_bias:
        layer["bo"] = WeightSpec((cfg.d_model,), ("embed",), "zeros")
    return specs | {"layers": [layer] * cfg.n_layers}


def layer(w: dict, x: jax.Array, cache, at: LayerAt):
    """One layer over hidden x [B, T, D] -> (x, cache): Qwen 3's attention, the SwiGLU MLP."""
    cfg, i = at.cfg, at.i
    with jax.named_scope(f"layer{i}/{'local' if cfg.layer_window(i) else 'global'}_attention"):
        x, cache = attention_block(w, x, cache, at.j, at.positions, at.start, at.rope(), cfg=cfg, layer=i,
                                   read_cache=at.read_cache)
    with jax.named_scope(f"layer{i}/mlp"):
        h = rms_norm(x, w["mlp_norm"], cfg.norm_eps)
        x = x + gated_mlp(h, w["w_gate"], w["w_up"], w["w_down"], silu)
    return x, cache



decoder_layers = layer_loop(layer)
forward = decoder(embed, decoder_layers)


def attention_block(w: dict, x: jax.Array, cache, j: int, positions, start, rope, *, cfg: ModelConfig, layer: int,
                    read_cache: bool = True):
    """x [B, T, D] + the attention of model layer ``layer`` (cache layer j) -> (x, cache):
    Llama's (``llama.attention_block``) with each query and key head RMS-normed over its head
    dim (weights q_norm, k_norm [H]) before rotary, and ``attention_bias`` on q, k, v and the
    output. Qwen3-MoE's layers use it too."""
    h = rms_norm(x, w["attn_norm"], cfg.norm_eps)
    q, k, v = dot_many(h, ("BTD,DNH->BTNH", w["wq"]), ("BTD,DKH->BTKH", w["wk"]), ("BTD,DKH->BTKH", w["wv"]))
    if cfg.qkv_bias:
        q, k, v = q + w["bq"].astype(q.dtype), k + w["bk"].astype(k.dtype), v + w["bv"].astype(v.dtype)
    q, k = rms_norm(q, w["q_norm"], cfg.norm_eps), rms_norm(k, w["k_norm"], cfg.norm_eps)
    o, cache = attend_layer(cache, j, q, k, v, positions, start, rope, read_cache=read_cache,
                            scale=cfg.head_dim**-0.5, window=cfg.layer_window(layer))
    o = dot("BTNH,NHD->BTD", o, w["wo"])
    return x + (o + w["bo"].astype(o.dtype) if cfg.qkv_bias else o), cache

# Where each weight lives in the two external formats: our path -> (HF name, GGUF name, transpose).
CHECKPOINT_NAMES = llama.CHECKPOINT_NAMES | {
    ("layers", "q_norm"): ("model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight", False),
    ("layers", "k_norm"): ("model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight", False),
    ("layers", "bo"): ("model.layers.{i}.self_attn.o_proj.bias", "blk.{i}.attn_output.bias", False),
}

GGUF_ARCHITECTURES = frozenset({"qwen3"})  # llama.cpp keeps HF's (NeoX) rotary layout: no Q/K permutation
GGUF_CONFIG_TENSORS = llama.GGUF_CONFIG_TENSORS
HF_ARCHITECTURES = frozenset({"Qwen3ForCausalLM"})

# Qwen3Config's defaults, for keys a config.json leaves out.
HF_DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 32768,
               "head_dim": 128, "rope_theta": 10000.0}


def config_from_hf(hf: dict, *, dtype: str) -> ModelConfig:
    """A Qwen3ForCausalLM config.json. The window counts only with ``use_sliding_window`` (as
    Qwen3Config drops it otherwise)."""
    hf = HF_DEFAULTS | hf
    return dataclasses.replace(llama.config_from_hf(hf, dtype=dtype), family="qwen3",
                               qkv_bias=bool(hf.get("attention_bias", False)))


def config_from_gguf(meta: dict, tensor_names, *, dtype: str, load_tensor=None) -> ModelConfig:
    """llama.cpp's reading of a qwen3 GGUF: Llama's keys; every layer global (llama.cpp has no
    sliding window for qwen3)."""
    cfg = llama.config_from_gguf(meta, tensor_names, dtype=dtype, load_tensor=load_tensor)
    return dataclasses.replace(cfg, family="qwen3")

FAMILY = ModelFamily(
    name="qwen3", weight_specs=weight_specs, embed=embed, decoder_layers=decoder_layers, forward=forward,
    unembed=unembed, checkpoint_names=CHECKPOINT_NAMES,
    hf_architectures=HF_ARCHITECTURES, config_from_hf=config_from_hf, gguf_architectures=GGUF_ARCHITECTURES,
    config_from_gguf=config_from_gguf, gguf_config_tensors=GGUF_CONFIG_TENSORS,
)
