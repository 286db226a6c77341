"""The Phi-3 family (Phi-3, Phi-3.5-mini, Phi-4, Phi-4-mini) as plain functions over pytrees.

Llama's layer and weights, with three differences:
  * checkpoints fuse q/k/v into one ``qkv_proj`` [N*H + 2*K*H, D] and gate/up into one
    ``gate_up_proj`` [2F, D] (GGUF: ``attn_qkv``, and ``ffn_up`` holding both). Our weights stay
    separate (wq/wk/wv, w_gate/w_up) so tensor parallelism splits each along its own heads or
    features; the loaders read the row blocks (``loaders.common.fused_block``).
  * LongRoPE (the 128k models): each rotary frequency divided by a per-frequency factor, and
    cos/sin multiplied by sqrt(1 + ln(s) / ln(C0)), s = C / C0 the context over the original
    context C0. There are two factor sets, short (for contexts up to C0) and long. transformers
    picks one per forward pass by the sequence's length; we pick once, statically, by the
    checkpoint's configured context C (long where C > C0), as vLLM does at its default
    max_model_len and llama.cpp at the full context. A sequence shorter than C0 on a long
    model therefore sees the long factors here and the short ones in transformers.
  * partial rotary (Phi-4-mini: the first 3/4 of each head rotates) and, where configured
    below the context, a sliding window on every layer (Phi-3-mini-4k's 2047).

weights = {"embed": [V, D], "layers": [one dict per layer], "final_norm": [D],
           "lm_head": [D, V] (untied models only)}
"""

from __future__ import annotations

import math

import jax
import numpy as np

from jaxinfer.config import AttentionKind, ModelConfig, RopeConfig
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

# Llama's weights (no biases), embedding and head.
weight_specs = llama.weight_specs
embed = llama.embed
unembed = llama.unembed


def layer(w: dict, x: jax.Array, cache, at: LayerAt):
    """One layer over hidden x [B, T, D] -> (x, cache): Llama's, with LongRoPE's scaled
    (partial) rotary and the layer's window."""
    cfg, i = at.cfg, at.i
    with jax.named_scope(f"layer{i}/attention"):
        h = rms_norm(x, w["attn_norm"], cfg.norm_eps)
        q, k, v = dot_many(h, ("BTD,DNH->BTNH", w["wq"]), ("BTD,DKH->BTKH", w["wk"]), ("BTD,DKH->BTKH", w["wv"]))
        o, cache = attend_layer(cache, at.j, q, k, v, at.positions, at.start, at.rope(cfg.rope),
                                read_cache=at.read_cache, scale=cfg.head_dim**-0.5, window=cfg.layer_window(i))
        x = x + dot("BTNH,NHD->BTD", o, w["wo"])
    with jax.named_scope(f"layer{i}/mlp"):
        h = rms_norm(x, w["mlp_norm"], cfg.norm_eps)
        x = x + gated_mlp(h, w["w_gate"], w["w_up"], w["w_down"], silu)
    return x, cache


decoder_layers = layer_loop(layer)
forward = decoder(embed, decoder_layers)


# Where each weight lives in the two external formats: our path -> (HF name, GGUF name,
# transpose). "name[j]" is row block j of a fused tensor (``loaders.common.fused_block``):
# q, k, v in that order in qkv_proj, gate before up in gate_up_proj (HF's chunk(2) and
# llama.cpp's fused SwiGLU both take the gate from the first half).
CHECKPOINT_NAMES = {
    ("embed",): ("model.embed_tokens.weight", "token_embd.weight", False),
    ("final_norm",): ("model.norm.weight", "output_norm.weight", False),
    ("lm_head",): ("lm_head.weight", "output.weight", True),
    ("layers", "attn_norm"): ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight", False),
    ("layers", "wq"): ("model.layers.{i}.self_attn.qkv_proj.weight[0]", "blk.{i}.attn_qkv.weight[0]", True),
    ("layers", "wk"): ("model.layers.{i}.self_attn.qkv_proj.weight[1]", "blk.{i}.attn_qkv.weight[1]", True),
    ("layers", "wv"): ("model.layers.{i}.self_attn.qkv_proj.weight[2]", "blk.{i}.attn_qkv.weight[2]", True),
    ("layers", "wo"): ("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight", True),
    ("layers", "mlp_norm"): ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight", False),
    ("layers", "w_gate"): ("model.layers.{i}.mlp.gate_up_proj.weight[0]", "blk.{i}.ffn_up.weight[0]", True),
    ("layers", "w_up"): ("model.layers.{i}.mlp.gate_up_proj.weight[1]", "blk.{i}.ffn_up.weight[1]", True),
    ("layers", "w_down"): ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight", True),
}

GGUF_ARCHITECTURES = frozenset({"phi3"})  # llama.cpp keeps HF's rotary layout: no Q/K permutation
HF_ARCHITECTURES = frozenset({"Phi3ForCausalLM"})
# LongRoPE's factor sets, which llama.cpp's converter stores as tensors.
GGUF_CONFIG_TENSORS = frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})


def longrope_attention_factor(s: float, original: int) -> float:
    """LongRoPE's cos/sin scale for a context s times the original one: sqrt(1 + ln(s) /
    ln(original)), 1 where the context is not extended (transformers'
    ``_compute_longrope_parameters``, llama.cpp's converter)."""
    return 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(original))


def _factors(values, rotary_dim: int, what: str) -> tuple[float, ...]:
    f = np.asarray(values, np.float64).reshape(-1)
    if f.shape[0] != rotary_dim // 2:
        raise CheckpointError(f"{what} has {f.shape[0]} factors, expected rotary dims / 2 = {rotary_dim // 2}")
    if not np.all(np.isfinite(f)) or np.any(f <= 0):
        raise CheckpointError(f"{what} holds non-positive or non-finite factors")
    return tuple(float(x) for x in f)


def _window_kinds(window, n_layers: int, context: int) -> dict:
    """A window on every layer, where it is below the context (at or above it, it hides nothing)."""
    if window and 0 < int(window) < context:
        return {"layer_kinds": (AttentionKind.LOCAL,) * n_layers, "sliding_window": int(window)}
    return {}


def config_from_hf(hf: dict, *, dtype: str) -> ModelConfig:
    """A Phi3ForCausalLM config.json (transformers 4: rope_theta, rope_scaling with type
    "longrope" or "su"; transformers 5: rope_parameters). As in transformers, the top-level
    original_max_position_embeddings (Phi3Config's default 4096) is the original context, and
    LongRoPE's ``factor`` and ``attention_factor``, where given, win over the derived ones."""
    n_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    context = int(hf.get("max_position_embeddings", 4096))
    rs = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    partial = float(rs.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise CheckpointError(f"partial_rotary_factor {partial} gives {rotary_dim} rotary dims of {head_dim}: "
                              "need an even number in 2 .. head_dim")
    rope = RopeConfig(theta=float(rs.get("rope_theta", hf.get("rope_theta", 10000.0))),
                      rotary_dim=rotary_dim if rotary_dim < head_dim else None)
    kind = rs.get("rope_type", rs.get("type")) or "default"
    if kind in ("longrope", "su"):
        original = int(hf.get("original_max_position_embeddings")
                       or rs.get("original_max_position_embeddings") or 4096)
        s = float(rs.get("factor") or context / original)
        attention = rs.get("attention_factor")
        attention = float(attention) if attention is not None else longrope_attention_factor(s, original)
        which = "long_factor" if context > original else "short_factor"
        rope = RopeConfig(theta=rope.theta, rotary_dim=rope.rotary_dim, attention_factor=attention,
                          freq_factors=_factors(rs[which], rotary_dim, f"rope {which}"))
    elif kind != "default":
        raise CheckpointError(f"unsupported rope type {kind!r} for Phi-3 (supported: default, longrope)")
    return ModelConfig(
        family="phi3",
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        d_ff=hf["intermediate_size"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rope=rope,
        max_position=context,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=dtype,
        name=hf.get("_name_or_path", "") or hf.get("model_type", ""),
        **_window_kinds(hf.get("sliding_window"), hf["num_hidden_layers"], context),
    )


def config_from_gguf(meta: dict, tensor_names, *, dtype: str, load_tensor=None) -> ModelConfig:
    """A phi3 GGUF as llama.cpp's converter writes it: rope.dimension_count (partial rotary),
    LongRoPE as the tensors rope_factors_long/short.weight with rope.scaling.attn_factor and
    rope.scaling.original_context_length, and the sliding window (llama.cpp itself leaves the
    window off; transformers, the reference, applies it, and so do we)."""
    arch = meta["general.architecture"]
    g = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    n_heads = int(g("attention.head_count"))
    d_model = int(g("embedding_length"))
    n_layers = int(g("block_count"))
    head_dim = int(g("attention.key_length", d_model // n_heads))
    context = int(g("context_length", 4096))
    rotary_dim = int(g("rope.dimension_count", head_dim))
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise CheckpointError(f"GGUF {arch}.rope.dimension_count {rotary_dim} must be even and in 2 .. {head_dim}")
    if g("rope.scaling.type") not in (None, "none"):
        raise CheckpointError(f"unsupported GGUF {arch}.rope.scaling.type {g('rope.scaling.type')!r} for Phi-3")
    rope = RopeConfig(theta=float(g("rope.freq_base", 10000.0)),
                      rotary_dim=rotary_dim if rotary_dim < head_dim else None)
    if "rope_factors_long.weight" in tensor_names or "rope_factors_short.weight" in tensor_names:
        if load_tensor is None:
            raise CheckpointError("the GGUF carries LongRoPE factor tensors but no tensor reader was given")
        original = int(g("rope.scaling.original_context_length", context))
        which = "rope_factors_long.weight" if context > original else "rope_factors_short.weight"
        if which not in tensor_names:
            raise CheckpointError(f"the GGUF's LongRoPE needs {which} for its context {context} (original {original})")
        attention = g("rope.scaling.attn_factor")
        rope = RopeConfig(
            theta=rope.theta, rotary_dim=rope.rotary_dim,
            attention_factor=(float(attention) if attention is not None
                              else longrope_attention_factor(context / original, original)),
            freq_factors=_factors(load_tensor(which), rotary_dim, f"GGUF {which}"))
    return ModelConfig(
        family="phi3",
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(g("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=int(g("feed_forward_length")),
        norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope=rope,
        max_position=context,
        tie_embeddings="output.weight" not in tensor_names,
        dtype=dtype,
        name=str(meta.get("general.name", arch)),
        **_window_kinds(g("attention.sliding_window"), n_layers, context),
    )

FAMILY = ModelFamily(
    name="phi3", weight_specs=weight_specs, embed=embed, decoder_layers=decoder_layers, forward=forward,
    unembed=unembed, checkpoint_names=CHECKPOINT_NAMES,
    hf_architectures=HF_ARCHITECTURES, config_from_hf=config_from_hf, gguf_architectures=GGUF_ARCHITECTURES,
    config_from_gguf=config_from_gguf, gguf_config_tensors=GGUF_CONFIG_TENSORS,
)
