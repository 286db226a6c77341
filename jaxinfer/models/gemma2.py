"""The Gemma 2 family as plain functions over pytrees.

Gemma 3's layer without the q/k head norms, with its scores soft-capped:
  x = embed(tokens) * sqrt(D)                      (``gemma3.embed``)
  h = attn_norm(x)
  x = x + post_attn_norm(attention(h))             (scores scaled by query_pre_attn_scalar**-0.5,
                                                    then s -> cap * tanh(s / cap), cap 50)
  x = x + post_mlp_norm(GeGLU(mlp_norm(x)))        (gelu tanh)
  logits = cap * tanh(head(final_norm(x)) / cap)   (``gemma3.unembed``, cap 30)
Every RMSNorm scales by (1 + w); weights hold HF's w (GGUF stores 1 + w, ``gguf_tensor``).
Layers alternate LOCAL (even: the last ``sliding_window`` positions) and GLOBAL (odd), all with
one rotary base (10k).

weights = {"embed": [V, D], "layers": [one dict per layer], "final_norm": [D],
           "lm_head": [D, V] (untied models only; every published Gemma 2 is tied)}
"""

from __future__ import annotations

import functools

import jax

from jaxinfer.config import AttentionKind, ModelConfig, RopeConfig
from jaxinfer.errors import CheckpointError
from jaxinfer.models import gemma3
from jaxinfer.models.family import LayerAt, ModelFamily, decoder, layer_loop
from jaxinfer.models.layers import (
    attend_layer,
    dot,
    dot_many,
    gated_mlp,
    gelu_tanh,
    rms_norm,
)
from jaxinfer.specs import WeightSpec

# Gemma 3 shares the embedding scale, the soft-capped head and llama.cpp's 1 + w norms.
embed = gemma3.embed
unembed = gemma3.unembed
gguf_tensor = gemma3.gguf_tensor


def weight_specs(cfg: ModelConfig) -> dict:
    """The one declaration of every weight. Norm weights start at zero: a scale of 1 + 0."""
    D, N, K, H, F, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size
    norm = WeightSpec((D,), ("embed",), "zeros")
    layer = {
        "attn_norm": norm,
        "wq": WeightSpec((D, N, H), ("embed", "q_heads", "head_dim"), contract=("embed",)),
        "wk": WeightSpec((D, K, H), ("embed", "kv_heads", "head_dim"), contract=("embed",)),
        "wv": WeightSpec((D, K, H), ("embed", "kv_heads", "head_dim"), contract=("embed",)),
        "wo": WeightSpec((N, H, D), ("q_heads", "head_dim", "embed"), contract=("q_heads", "head_dim")),
        "post_attn_norm": norm,
        "mlp_norm": norm,
        "w_gate": WeightSpec((D, F), ("embed", "mlp"), contract=("embed",)),
        "w_up": WeightSpec((D, F), ("embed", "mlp"), contract=("embed",)),
        "w_down": WeightSpec((F, D), ("mlp", "embed"), contract=("mlp",)),
        "post_mlp_norm": norm,
    }
    specs = {"embed": WeightSpec((V, D), ("vocab", "embed"), contract=("embed",)), "layers": [layer] * cfg.n_layers,
             "final_norm": norm}
    if not cfg.tie_embeddings:
        specs["lm_head"] = WeightSpec((D, V), ("embed", "vocab"), contract=("embed",))
    return specs


def layer(w: dict, x: jax.Array, cache, at: LayerAt):
    """One layer over hidden x [B, T, D] -> (x, cache) (the module docstring's); its window is
    the model layer's."""
    cfg, i = at.cfg, at.i
    norm = functools.partial(rms_norm, eps=cfg.norm_eps, plus_one=True)
    window = cfg.layer_window(i)
    with jax.named_scope(f"layer{i}/{'local' if window else 'global'}_attention"):
        h = norm(x, w["attn_norm"])
        q, k, v = dot_many(h, ("BTD,DNH->BTNH", w["wq"]), ("BTD,DKH->BTKH", w["wk"]), ("BTD,DKH->BTKH", w["wv"]))
        o, cache = attend_layer(cache, at.j, q, k, v, at.positions, at.start, at.rope(cfg.rope),
                                read_cache=at.read_cache, scale=cfg.attn_scale, window=window,
                                softcap=cfg.attn_logit_softcap)
        x = x + norm(dot("BTNH,NHD->BTD", o, w["wo"]), w["post_attn_norm"])
    with jax.named_scope(f"layer{i}/mlp"):
        h = norm(x, w["mlp_norm"])
        x = x + norm(gated_mlp(h, w["w_gate"], w["w_up"], w["w_down"], gelu_tanh), w["post_mlp_norm"])
    return x, cache


decoder_layers = layer_loop(layer)
forward = decoder(embed, decoder_layers)


# Where each weight lives in the two external formats: Gemma 3's names, less its head norms.
CHECKPOINT_NAMES = {key: names for key, names in gemma3.CHECKPOINT_NAMES.items()
                    if key not in (("layers", "q_norm"), ("layers", "k_norm"))}

GGUF_ARCHITECTURES = frozenset({"gemma2"})  # llama.cpp keeps HF's rotary layout: no Q/K permutation
HF_ARCHITECTURES = frozenset({"Gemma2ForCausalLM"})
HF_ACTIVATIONS = frozenset({"gelu_pytorch_tanh"})

# Gemma2Config's defaults, which llama.cpp also assumes where a GGUF leaves them out.
ATTN_SOFTCAP, FINAL_SOFTCAP, THETA = 50.0, 30.0, 10000.0


def layer_kinds(n_layers: int) -> tuple[AttentionKind, ...]:
    """Gemma 2's interleaving: LOCAL, GLOBAL, LOCAL, ... (transformers' default layer_types,
    llama.cpp's swa pattern 2)."""
    return gemma3.layer_kinds(n_layers, pattern=2)


def config_from_gguf(meta: dict, tensor_names, *, dtype: str, load_tensor=None) -> ModelConfig:
    """llama.cpp's reading of a gemma2 GGUF: the window and both soft-caps from the file (50
    and 30 where absent), the 1:1 pattern fixed, and the query scale by size: the 27B (46
    layers) scales by (D / N)**-0.5, the others by head_dim**-0.5."""
    arch = meta["general.architecture"]
    g = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    n_heads = int(g("attention.head_count"))
    d_model = int(g("embedding_length"))
    n_layers = int(g("block_count"))
    head_dim = int(g("attention.key_length", d_model // n_heads))
    if g("rope.scaling.type") not in (None, "none"):
        raise CheckpointError(f"unsupported GGUF {arch}.rope.scaling.type {g('rope.scaling.type')!r} for Gemma 2")
    window = int(g("attention.sliding_window", 0) or 0)
    return ModelConfig(
        family="gemma2",
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(g("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=int(g("feed_forward_length")),
        norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope=RopeConfig(theta=float(g("rope.freq_base", THETA))),
        max_position=int(g("context_length", 8192)),
        tie_embeddings="output.weight" not in tensor_names,
        dtype=dtype,
        name=str(meta.get("general.name", arch)),
        layer_kinds=layer_kinds(n_layers) if window else (),
        sliding_window=window or None,
        query_pre_attn_scalar=d_model / n_heads if n_layers == 46 else float(head_dim),
        attn_logit_softcap=float(g("attn_logit_softcapping", ATTN_SOFTCAP)) or None,
        final_logit_softcap=float(g("final_logit_softcapping", FINAL_SOFTCAP)) or None,
    )


def config_from_hf(hf: dict, *, dtype: str) -> ModelConfig:
    """A Gemma2ForCausalLM config.json (transformers 4: rope_theta; transformers 5:
    rope_parameters, layer_types). Defaults are Gemma2Config's."""
    if hf.get("attention_bias") or hf.get("use_bidirectional_attention"):
        raise CheckpointError("unsupported Gemma 2 variant: attention_bias / use_bidirectional_attention")
    n_heads = hf.get("num_attention_heads", 8)
    n_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types:
        kinds = tuple(AttentionKind.LOCAL if t == "sliding_attention" else AttentionKind.GLOBAL for t in types)
    else:
        kinds = layer_kinds(n_layers)
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind != "default":
        raise CheckpointError(f"unsupported rope type {kind!r} for Gemma 2 (supported: default)")
    window = hf.get("sliding_window", 4096)
    if AttentionKind.LOCAL not in kinds or not window:
        kinds, window = (), None
    return ModelConfig(
        family="gemma2",
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or 256,
        d_ff=hf["intermediate_size"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=RopeConfig(theta=float(params.get("rope_theta", hf.get("rope_theta", THETA)))),
        max_position=int(hf.get("max_position_embeddings", 8192)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        dtype=dtype,
        name=hf.get("_name_or_path", "") or hf.get("model_type", ""),
        layer_kinds=kinds,
        sliding_window=window,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        attn_logit_softcap=hf.get("attn_logit_softcapping", ATTN_SOFTCAP),
        final_logit_softcap=hf.get("final_logit_softcapping", FINAL_SOFTCAP),
    )

FAMILY = ModelFamily(
    name="gemma2", weight_specs=weight_specs, embed=embed, decoder_layers=decoder_layers, forward=forward,
    unembed=unembed, checkpoint_names=CHECKPOINT_NAMES,
    hf_architectures=HF_ARCHITECTURES, config_from_hf=config_from_hf, hf_activations=HF_ACTIVATIONS,
    gguf_architectures=GGUF_ARCHITECTURES, config_from_gguf=config_from_gguf, gguf_tensor=gguf_tensor,
    norm_offset=1.0,
)
