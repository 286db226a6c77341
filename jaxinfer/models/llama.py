"""The Llama family (Llama 1-3, SmolLM, Qwen2 with q/k/v bias) as plain functions over pytrees.
Layers listed in ``cfg.nope_layers`` apply no rotary embedding, and LOCAL layers (``cfg.layer_kinds``)
attend to the last ``cfg.sliding_window`` positions only (SmolLM3 reuses these layers).

weights = {"embed": [V, D], "layers": [one dict per layer], "final_norm": [D],
           "lm_head": [D, V] (untied models only)}
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import AttentionKind, ModelConfig, RopeConfig, RopeKind
from jaxinfer.errors import CheckpointError
from jaxinfer.models.family import LayerAt, ModelFamily, TextTower, decoder, layer_loop
from jaxinfer.models.layers import (
    attend_layer,
    dot,
    dot_many,
    gated_mlp,
    rms_norm,
    silu,
    take,
)
from jaxinfer.specs import WeightSpec


def weight_specs(cfg: ModelConfig) -> dict:
    """The one declaration of every weight: shape, logical axes, initialisation."""
    D, N, K, H, F, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size
    layer = {
        "attn_norm": WeightSpec((D,), ("embed",), "ones"),
        "wq": WeightSpec((D, N, H), ("embed", "q_heads", "head_dim"), contract=("embed",)),
        "wk": WeightSpec((D, K, H), ("embed", "kv_heads", "head_dim"), contract=("embed",)),
        "wv": WeightSpec((D, K, H), ("embed", "kv_heads", "head_dim"), contract=("embed",)),
        "wo": WeightSpec((N, H, D), ("q_heads", "head_dim", "embed"), contract=("q_heads", "head_dim")),
        "mlp_norm": WeightSpec((D,), ("embed",), "ones"),
        "w_gate": WeightSpec((D, F), ("embed", "mlp"), contract=("embed",)),
        "w_up": WeightSpec((D, F), ("embed", "mlp"), contract=("embed",)),
        "w_down": WeightSpec((F, D), ("mlp", "embed"), contract=("mlp",)),
    }
    if cfg.qkv_bias:
        layer["bq"] = WeightSpec((N, H), ("q_heads", "head_dim"), "zeros")
        layer["bk"] = WeightSpec((K, H), ("kv_heads", "head_dim"), "zeros")
        layer["bv"] = WeightSpec((K, H), ("kv_heads", "head_dim"), "zeros")
    specs = {
        "embed": WeightSpec((V, D), ("vocab", "embed"), contract=("embed",)),
        "layers": [layer] * cfg.n_layers,
        "final_norm": WeightSpec((D,), ("embed",), "ones"),
    }
    if not cfg.tie_embeddings:
        specs["lm_head"] = WeightSpec((D, V), ("embed", "vocab"), contract=("embed",))
    return specs


def embed(weights, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    return take(weights["embed"], tokens).astype(cfg.jnp_dtype)  # [B, T, D]


def unembed(weights, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final norm and output projection to float32 logits [B, T, V]."""
    x = rms_norm(x, weights["final_norm"], cfg.norm_eps)
    if cfg.tie_embeddings:
        return dot("BTD,VD->BTV", x, weights["embed"]).astype(jnp.float32)
    return dot("BTD,DV->BTV", x, weights["lm_head"]).astype(jnp.float32)


def layer(w: dict, x: jax.Array, cache, at: LayerAt):
    """One layer over hidden x [B, T, D] -> (x, cache): attention (no rotary on the layers
    ``cfg.nope_layers`` lists), then the SwiGLU MLP."""
    cfg, i = at.cfg, at.i
    rope = None if i in cfg.nope_layers else at.rope()
    with jax.named_scope(f"layer{i}/attention"):
        x, cache = attention_block(w, x, cache, at.j, at.positions, at.start, rope, cfg=cfg, layer=i,
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
    pre-norm, q/k/v (with Qwen2's biases), rotary, attention (over the last sliding_window
    positions where the config makes the layer LOCAL), output projection."""
    h = rms_norm(x, w["attn_norm"], cfg.norm_eps)
    q, k, v = dot_many(h, ("BTD,DNH->BTNH", w["wq"]), ("BTD,DKH->BTKH", w["wk"]), ("BTD,DKH->BTKH", w["wv"]))
    if cfg.qkv_bias:
        q, k, v = q + w["bq"].astype(q.dtype), k + w["bk"].astype(k.dtype), v + w["bv"].astype(v.dtype)
    o, cache = attend_layer(cache, j, q, k, v, positions, start, rope, read_cache=read_cache,
                            scale=cfg.head_dim**-0.5, window=cfg.layer_window(layer))
    return x + dot("BTNH,NHD->BTD", o, w["wo"]), cache


# Where each weight lives in the two external formats: our path -> (HF name, GGUF name,
# transpose). Torch Linear weights are [out, in]; ours put the contracted axis first.
CHECKPOINT_NAMES = {
    ("embed",): ("model.embed_tokens.weight", "token_embd.weight", False),
    ("final_norm",): ("model.norm.weight", "output_norm.weight", False),
    ("lm_head",): ("lm_head.weight", "output.weight", True),
    ("layers", "attn_norm"): ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight", False),
    ("layers", "wq"): ("model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight", True),
    ("layers", "wk"): ("model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight", True),
    ("layers", "wv"): ("model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight", True),
    ("layers", "wo"): ("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight", True),
    ("layers", "bq"): ("model.layers.{i}.self_attn.q_proj.bias", "blk.{i}.attn_q.bias", False),
    ("layers", "bk"): ("model.layers.{i}.self_attn.k_proj.bias", "blk.{i}.attn_k.bias", False),
    ("layers", "bv"): ("model.layers.{i}.self_attn.v_proj.bias", "blk.{i}.attn_v.bias", False),
    ("layers", "mlp_norm"): ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight", False),
    ("layers", "w_gate"): ("model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight", True),
    ("layers", "w_up"): ("model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight", True),
    ("layers", "w_down"): ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight", True),
}

# GGUF architectures of this family whose converter permuted Q/K rows into llama.cpp's
# interleaved rotary layout (Qwen2 uses the NeoX layout and was left alone).
GGUF_PERMUTED_QK = frozenset({"llama", "mistral"})
GGUF_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2"})
HF_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                              "Mistral3ForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"})
# The text decoders of multimodal checkpoints: Mistral Small 3.1's is a Mistral under
# language_model.model.; Qwen2.5-VL's a Qwen2 under model. beside the ViT under visual.
# (model.language_model. as transformers 4.5x re-saved either).
HF_TEXT_TOWERS = {
    "Mistral3ForConditionalGeneration": (TextTower("language_model.model.", "language_model.lm_head.weight"),
                                         TextTower("model.language_model.")),
    "Qwen2_5_VLForConditionalGeneration": (TextTower("model."), TextTower("model.language_model.")),
}
# Qwen2 and Qwen2.5-VL's text decoder carry Q/K/V biases whatever attention_bias says
_QKV_BIAS = frozenset({"Qwen2ForCausalLM", "Qwen2_5_VLForConditionalGeneration"})


# Tensors a GGUF of this family carries that configure the model rather than being weights.
GGUF_CONFIG_TENSORS = frozenset({"rope_freqs.weight"})


def rope_from_gguf(meta: dict, arch: str, tensor_names, load_tensor) -> RopeConfig:
    """The rotary of a llama-family GGUF. llama.cpp's converter stores Llama 3 scaling as the
    tensor ``rope_freqs.weight`` (f32[H/2], the divisor of each inverse frequency) and may
    add ``{arch}.rope.scaling.*`` keys; the tensor is applied exactly as stored, on top of any
    linear scaling, as llama.cpp does. A scaling type we do not implement is refused."""
    g = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    rope = RopeConfig(theta=float(g("rope.freq_base", 10000.0)))
    kind = g("rope.scaling.type")
    if kind == "linear":
        rope = dataclasses.replace(rope, kind=RopeKind.LINEAR, factor=float(g("rope.scaling.factor")))
    elif kind not in (None, "none"):
        raise CheckpointError(f"unsupported GGUF {arch}.rope.scaling.type {kind!r} (supported: none, linear)")
    if "rope_freqs.weight" in tensor_names:
        if load_tensor is None:
            raise CheckpointError("the GGUF carries rope_freqs.weight but no tensor reader was given")
        factors = np.asarray(load_tensor("rope_freqs.weight"), np.float32).reshape(-1)
        if not np.all(np.isfinite(factors)) or np.any(factors <= 0):
            raise CheckpointError("GGUF rope_freqs.weight holds non-positive or non-finite factors")
        rope = dataclasses.replace(rope, freq_factors=tuple(float(f) for f in factors))
    return rope


def config_from_gguf(meta: dict, tensor_names, *, dtype: str, load_tensor=None) -> ModelConfig:
    """load_tensor: name -> np.ndarray, to read config tensors (``GGUF_CONFIG_TENSORS``)."""
    arch = meta["general.architecture"]
    g = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    n_heads = int(g("attention.head_count"))
    d_model = int(g("embedding_length"))
    rope = rope_from_gguf(meta, arch, tensor_names, load_tensor)
    head_dim = int(g("attention.key_length", d_model // n_heads))
    if rope.freq_factors is not None and len(rope.freq_factors) != head_dim // 2:
        raise CheckpointError(
            f"GGUF rope_freqs.weight has {len(rope.freq_factors)} factors, expected head_dim / 2 = {head_dim // 2}")
    return ModelConfig(
        family="llama",
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        d_model=d_model,
        n_layers=int(g("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(g("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=int(g("feed_forward_length")),
        norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope=rope,
        max_position=int(g("context_length", 2048)),
        tie_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        dtype=dtype,
        name=str(meta.get("general.name", arch)),
    )


def sliding_kinds(types, n_layers: int, window: int | None) -> tuple[AttentionKind, ...]:
    """transformers' ``layer_types`` as layer kinds ("sliding_attention" -> LOCAL); () when no
    layer slides. A sliding layer without a window is refused: transformers cannot build its
    mask either."""
    if len(types) != n_layers:
        raise CheckpointError(f"layer_types lists {len(types)} layers, the model has {n_layers}")
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise CheckpointError(f"unsupported layer_types {sorted(unknown)} (supported: full_attention, "
                              "sliding_attention)")
    if "sliding_attention" not in types:
        return ()
    if not window:
        raise CheckpointError("layer_types has sliding_attention layers but no sliding_window is set "
                              "(with use_sliding_window)")
    return tuple(AttentionKind.LOCAL if t == "sliding_attention" else AttentionKind.GLOBAL for t in types)


def hf_layer_kinds(hf: dict) -> tuple[tuple[AttentionKind, ...], int | None]:
    """(layer kinds, window) as transformers decides which layers slide: Mistral slides every
    layer by ``sliding_window`` when it is set; Qwen 2/3 only with ``use_sliding_window``, on
    the layers ``layer_types`` names (or from ``max_window_layers`` on)."""
    n_layers = hf["num_hidden_layers"]
    if hf.get("model_type") == "mistral" or "MistralForCausalLM" in (hf.get("architectures") or ()):
        window = hf.get("sliding_window")
        if not window or window >= int(hf.get("max_position_embeddings", 2048)):
            return (), None  # a window past the context slides nothing
        return (AttentionKind.LOCAL,) * n_layers, int(window)
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    types = hf.get("layer_types") or [
        "sliding_attention" if window is not None and i >= hf.get("max_window_layers", 28) else "full_attention"
        for i in range(n_layers)]
    kinds = sliding_kinds(types, n_layers, window)
    return kinds, (int(window) if kinds else None)


def config_from_hf(hf: dict, *, dtype: str) -> ModelConfig:
    n_heads = hf["num_attention_heads"]
    kinds, window = hf_layer_kinds(hf)
    # transformers >= 5 writes rope_parameters (theta inside); older configs rope_theta + rope_scaling
    rs = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope = RopeConfig(theta=float(rs.get("rope_theta", hf.get("rope_theta", 10000.0))))
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        rope = RopeConfig(theta=rope.theta, kind=RopeKind.LINEAR, factor=float(rs["factor"]))
    elif kind == "llama3":
        rope = RopeConfig(
            theta=rope.theta, kind=RopeKind.LLAMA3, factor=float(rs["factor"]),
            low_freq_factor=float(rs["low_freq_factor"]), high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position=int(rs["original_max_position_embeddings"]),
        )
    elif kind not in (None, "default", "mrope"):
        raise CheckpointError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")
    # Qwen2.5-VL's M-RoPE (mrope_section) turns each section of frequencies by its own axis
    # (time, height, width) of the position; a text token's three are equal, so it is the 1-D
    # rotary exactly. Images, whose axes differ, are refused before they reach the model.
    return ModelConfig(
        family="llama",
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        d_ff=hf["intermediate_size"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rope=rope,
        max_position=int(hf.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=bool(hf.get("attention_bias", False)) or bool(_QKV_BIAS & set(hf.get("architectures", []))),
        dtype=dtype,
        name=hf.get("_name_or_path", "") or hf.get("model_type", ""),
        layer_kinds=kinds,
        sliding_window=window,
    )


FAMILY = ModelFamily(
    name="llama", weight_specs=weight_specs, embed=embed, decoder_layers=decoder_layers, forward=forward,
    unembed=unembed, checkpoint_names=CHECKPOINT_NAMES,
    hf_architectures=HF_ARCHITECTURES, config_from_hf=config_from_hf, hf_text_towers=HF_TEXT_TOWERS,
    gguf_architectures=GGUF_ARCHITECTURES, config_from_gguf=config_from_gguf, gguf_permuted_qk=GGUF_PERMUTED_QK,
    gguf_config_tensors=GGUF_CONFIG_TENSORS,
)
