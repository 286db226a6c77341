"""The OLMo 2 family (Olmo2ForCausalLM) as plain functions over pytrees.

What sets it apart from Llama, layer by layer:
  q, k = q_norm(x @ wq), k_norm(x @ wk)            (no norm before attention or MLP; RMSNorm over
                                                    the WHOLE projection, all heads together,
                                                    before rotary: q_norm [N, H], k_norm [K, H])
  x = x + post_attn_norm(attention(q, k, v))       (norms on the block outputs, before the add)
  x = x + post_mlp_norm(SwiGLU(x))
``attention_bias`` gives q, k, v (before their norms) and the output projection a bias each
(``cfg.qkv_bias`` here covers all four).

weights = {"embed": [V, D], "layers": [one dict per layer], "final_norm": [D],
           "lm_head": [D, V] (untied models only)}
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError
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
    """Llama's weights without the two pre-norms; q/k norms over every head and two
    post-norms per layer (and the output bias with biases). The q/k norms are declared per
    head, [N, H] and [K, H] (the checkpoints' [N*H] and [K*H]), so they split over devices
    with the heads they scale."""
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    specs = llama.weight_specs(cfg)
    layer = {n: s for n, s in specs["layers"][0].items() if n not in ("attn_norm", "mlp_norm")} | {
        "q_norm": WeightSpec((N, H), ("q_heads", "head_dim"), "ones"),
        "k_norm": WeightSpec((K, H), ("kv_heads", "head_dim"), "ones"),
        "post_attn_norm": WeightSpec((D,), ("embed",), "ones"),
        "post_mlp_norm": WeightSpec((D,), ("embed",), "ones"),
    }
    if cfg.qkv_bias:
        layer["bo"] = WeightSpec((D,), ("embed",), "zeros")
    return specs | {"layers": [layer] * cfg.n_layers}


def heads_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm of x [B, T, n, H] over all n*H values of each token at once; w [n, H]."""
    return rms_norm(x.reshape(*x.shape[:2], -1), w.reshape(-1), eps).reshape(x.shape)


def layer(w: dict, x: jax.Array, cache, at: LayerAt):
    """One layer over hidden x [B, T, D] -> (x, cache) (the module docstring's)."""
    cfg, i = at.cfg, at.i
    norm = functools.partial(rms_norm, eps=cfg.norm_eps)
    with jax.named_scope(f"layer{i}/attention"):
        q, k, v = dot_many(x, ("BTD,DNH->BTNH", w["wq"]), ("BTD,DKH->BTKH", w["wk"]), ("BTD,DKH->BTKH", w["wv"]))
        if cfg.qkv_bias:
            q, k, v = q + w["bq"].astype(q.dtype), k + w["bk"].astype(k.dtype), v + w["bv"].astype(v.dtype)
        q, k = heads_norm(q, w["q_norm"], cfg.norm_eps), heads_norm(k, w["k_norm"], cfg.norm_eps)
        o, cache = attend_layer(cache, at.j, q, k, v, at.positions, at.start, at.rope(), read_cache=at.read_cache,
                                scale=cfg.head_dim**-0.5)
        o = dot("BTNH,NHD->BTD", o, w["wo"])
        x = x + norm(o + w["bo"].astype(o.dtype) if cfg.qkv_bias else o, w["post_attn_norm"])
    with jax.named_scope(f"layer{i}/mlp"):
        x = x + norm(gated_mlp(x, w["w_gate"], w["w_up"], w["w_down"], silu), w["post_mlp_norm"])
    return x, cache


decoder_layers = layer_loop(layer)
forward = decoder(embed, decoder_layers)


# Where each weight lives in the two external formats: our path -> (HF name, GGUF name, transpose).
CHECKPOINT_NAMES = {k: v for k, v in llama.CHECKPOINT_NAMES.items()
                    if k not in (("layers", "attn_norm"), ("layers", "mlp_norm"))} | {
    ("layers", "q_norm"): ("model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight", False),
    ("layers", "k_norm"): ("model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight", False),
    ("layers", "bo"): ("model.layers.{i}.self_attn.o_proj.bias", "blk.{i}.attn_output.bias", False),
    ("layers", "post_attn_norm"): (
        "model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.post_attention_norm.weight", False),
    ("layers", "post_mlp_norm"): (
        "model.layers.{i}.post_feedforward_layernorm.weight", "blk.{i}.post_ffw_norm.weight", False),
}

GGUF_ARCHITECTURES = frozenset({"olmo2"})  # llama.cpp keeps HF's (NeoX) rotary layout: no Q/K permutation
HF_ARCHITECTURES = frozenset({"Olmo2ForCausalLM"})

# Olmo2Config's defaults, for keys a config.json leaves out.
HF_DEFAULTS = {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "max_position_embeddings": 2048,
               "rope_theta": 10000.0}


def config_from_hf(hf: dict, *, dtype: str) -> ModelConfig:
    """An Olmo2ForCausalLM config.json."""
    hf = HF_DEFAULTS | hf
    if hf.get("sliding_window") or "sliding_attention" in (hf.get("layer_types") or ()):
        raise CheckpointError("unsupported OLMo 2 variant: sliding-window layers (OLMo 3)")
    return dataclasses.replace(llama.config_from_hf(hf, dtype=dtype), family="olmo2",
                               qkv_bias=bool(hf.get("attention_bias", False)))


def config_from_gguf(meta: dict, tensor_names, *, dtype: str, load_tensor=None) -> ModelConfig:
    """llama.cpp's reading of an olmo2 GGUF: Llama's keys. llama.cpp's converter writes OLMo 3
    (sliding-window layers) as olmo2 too; such files are refused."""
    arch = meta["general.architecture"]
    if meta.get(f"{arch}.attention.sliding_window"):
        raise CheckpointError(f"unsupported {arch} GGUF with {arch}.attention.sliding_window (OLMo 3)")
    cfg = llama.config_from_gguf(meta, tensor_names, dtype=dtype, load_tensor=load_tensor)
    return dataclasses.replace(cfg, family="olmo2")

FAMILY = ModelFamily(
    name="olmo2", weight_specs=weight_specs, embed=embed, decoder_layers=decoder_layers, forward=forward,
    unembed=unembed, checkpoint_names=CHECKPOINT_NAMES,
    hf_architectures=HF_ARCHITECTURES, config_from_hf=config_from_hf, gguf_architectures=GGUF_ARCHITECTURES,
    config_from_gguf=config_from_gguf,
)
