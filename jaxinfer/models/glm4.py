"""The GLM-4 family (Glm4ForCausalLM) as plain functions over pytrees.

What sets it apart from Llama, layer by layer:
  h = attn_norm(x); q, k, v = h wq + bq, h wk + bk, h wv + bv    (``attention_bias``, default on)
  x = x + post_attn_norm(attention(h))       (a norm on the block's output, before the add)
  x = x + post_mlp_norm(SwiGLU(mlp_norm(x)))  (gate and up fused in one gate_up_proj, gate first)
Rotary turns only the first R = partial_rotary_factor * H dims of each head (half of them by
default), in the interleaved layout: dims 2i and 2i + 1 form pair i. The half-split rotary of
``layers.apply_rope`` pairs dim i with i + R/2, so q and k are first reordered (even dims of the
rotary part, then its odd ones, then the rest): the same reordering of both leaves every score as
it was, and the values are never reordered.

weights = {"embed": [V, D], "layers": [one dict per layer], "final_norm": [D],
           "lm_head": [D, V] (untied models only)}
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError
from jaxinfer.models import llama
from jaxinfer.models.family import LayerAt, ModelFamily, decoder, layer_loop
from jaxinfer.models.layers import attend_layer, dot, dot_many, gated_mlp, rms_norm, silu
from jaxinfer.models.llama import embed, unembed
from jaxinfer.specs import WeightSpec


def weight_specs(cfg: ModelConfig) -> dict:
    """Llama's weights plus a norm [D] on each block's output."""
    specs = llama.weight_specs(cfg)
    D = cfg.d_model
    layer = specs["layers"][0] | {"post_attn_norm": WeightSpec((D,), ("embed",), "ones"),
                                  "post_mlp_norm": WeightSpec((D,), ("embed",), "ones")}
    return specs | {"layers": [layer] * cfg.n_layers}


def interleaved_order(head_dim: int, rotary_dim: int) -> np.ndarray:
    """i32[H]: the head dims reordered so that interleaved rotary pairs (2i, 2i + 1) of the
    first rotary_dim dims become half-split ones (i, i + R/2); the rest stay in place."""
    return np.concatenate([np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2),
                           np.arange(rotary_dim, head_dim)]).astype(np.int32)


def layer(w: dict, x: jax.Array, cache, at: LayerAt):
    """One layer over hidden x [B, T, D] -> (x, cache) (the module docstring's)."""
    cfg, i = at.cfg, at.i
    order = interleaved_order(cfg.head_dim, cfg.rope.rotary_dim or cfg.head_dim)
    with jax.named_scope(f"layer{i}/attention"):
        h = rms_norm(x, w["attn_norm"], cfg.norm_eps)
        q, k, v = dot_many(h, ("BTD,DNH->BTNH", w["wq"]), ("BTD,DKH->BTKH", w["wk"]), ("BTD,DKH->BTKH", w["wv"]))
        if cfg.qkv_bias:
            q, k, v = q + w["bq"].astype(q.dtype), k + w["bk"].astype(k.dtype), v + w["bv"].astype(v.dtype)
        o, cache = attend_layer(cache, at.j, q[..., order], k[..., order], v, at.positions, at.start, at.rope(),
                                read_cache=at.read_cache, scale=cfg.head_dim**-0.5, window=cfg.layer_window(i))
        x = x + rms_norm(dot("BTNH,NHD->BTD", o, w["wo"]), w["post_attn_norm"], cfg.norm_eps)
    with jax.named_scope(f"layer{i}/mlp"):
        h = rms_norm(x, w["mlp_norm"], cfg.norm_eps)
        x = x + rms_norm(gated_mlp(h, w["w_gate"], w["w_up"], w["w_down"], silu), w["post_mlp_norm"], cfg.norm_eps)
    return x, cache


decoder_layers = layer_loop(layer)


forward = decoder(embed, decoder_layers)

# Where each weight lives: our path -> (HF name, GGUF name (llama.cpp's glm4), transpose).
# "name[j]" is row block j of a fused tensor (``loaders.common.fused_block``): gate before up.
CHECKPOINT_NAMES = {k: v for k, v in llama.CHECKPOINT_NAMES.items()
                    if k not in {("layers", "w_gate"), ("layers", "w_up")}} | {
    ("layers", "w_gate"): ("model.layers.{i}.mlp.gate_up_proj.weight[0]", "blk.{i}.ffn_up.weight[0]", True),
    ("layers", "w_up"): ("model.layers.{i}.mlp.gate_up_proj.weight[1]", "blk.{i}.ffn_up.weight[1]", True),
    ("layers", "post_attn_norm"): ("model.layers.{i}.post_self_attn_layernorm.weight",
                                   "blk.{i}.post_attention_norm.weight", False),
    ("layers", "post_mlp_norm"): ("model.layers.{i}.post_mlp_layernorm.weight", "blk.{i}.post_ffw_norm.weight", False),
}

# Glm4Config's defaults, for keys a config.json leaves out.
HF_DEFAULTS = {"rms_norm_eps": 1.5625e-07, "tie_word_embeddings": False, "max_position_embeddings": 131072,
               "head_dim": 128, "attention_bias": True, "partial_rotary_factor": 0.5}


def config_from_hf(hf: dict, *, dtype: str) -> ModelConfig:
    """A Glm4ForCausalLM config.json: Llama's keys (its rotary scaling included) with the
    rotary part of each head from ``partial_rotary_factor``."""
    hf = HF_DEFAULTS | hf
    cfg = llama.config_from_hf(hf, dtype=dtype)
    rs = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    partial = float(rs.get("partial_rotary_factor", hf["partial_rotary_factor"]))
    rotary_dim = int(cfg.head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= cfg.head_dim:
        raise CheckpointError(f"partial_rotary_factor {partial} gives {rotary_dim} rotary dims of {cfg.head_dim}: "
                              "need an even number in (0, head_dim]")
    rope = dataclasses.replace(cfg.rope, rotary_dim=rotary_dim if rotary_dim < cfg.head_dim else None)
    return dataclasses.replace(cfg, family="glm4", rope=rope, qkv_bias=bool(hf["attention_bias"]))


FAMILY = ModelFamily(
    name="glm4", weight_specs=weight_specs, embed=embed, decoder_layers=decoder_layers, forward=forward,
    unembed=unembed, checkpoint_names=CHECKPOINT_NAMES,
    hf_architectures=frozenset({"Glm4ForCausalLM"}), config_from_hf=config_from_hf,
)
