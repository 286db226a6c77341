"""The Gemma 3 family (text decoder) as plain functions over pytrees.

What sets it apart from Llama, layer by layer:
  x = embed(tokens) * sqrt(D)                      (the scale rounded to the model dtype, as HF)
  h = attn_norm(x); q, k = q_norm(q), k_norm(k)    (RMSNorm on each head before rotary)
  x = x + post_attn_norm(attention(h))             (scores scaled by query_pre_attn_scalar**-0.5)
  x = x + post_mlp_norm(GeGLU(mlp_norm(x)))        (gelu tanh)
Every RMSNorm scales by (1 + w), so weights hold HF's w (GGUF stores 1 + w; see
``gguf_tensor``). LOCAL layers attend to the last ``sliding_window`` positions and use the local
rotary base (10k); GLOBAL layers see everything and use the global base (1M, linear scaling x8
on 4B and up). Gemma 2 style soft-capping of scores and logits applies where configured.

weights = {"embed": [V, D], "layers": [one dict per layer], "final_norm": [D],
           "lm_head": [D, V] (untied models only; every published Gemma 3 is tied)}
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import AttentionKind, ModelConfig, RopeConfig, RopeKind
from jaxinfer.models import siglip
from jaxinfer.models.family import LayerAt, ModelFamily, TextTower, decoder, layer_loop
from jaxinfer.models.layers import (
    attend_layer,
    dot,
    dot_many,
    gated_mlp,
    gelu_tanh,
    rms_norm,
    take,
)
from jaxinfer.specs import WeightSpec


def weight_specs(cfg: ModelConfig) -> dict:
    """The one declaration of every weight. Norm weights start at zero: a scale of 1 + 0."""
    D, N, K, H, F, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size
    norm = WeightSpec((D,), ("embed",), "zeros")
    head_norm = WeightSpec((H,), ("head_dim",), "zeros")
    layer = {
        "attn_norm": norm,
        "wq": WeightSpec((D, N, H), ("embed", "q_heads", "head_dim"), contract=("embed",)),
        "wk": WeightSpec((D, K, H), ("embed", "kv_heads", "head_dim"), contract=("embed",)),
        "wv": WeightSpec((D, K, H), ("embed", "kv_heads", "head_dim"), contract=("embed",)),
        "q_norm": head_norm,
        "k_norm": head_norm,
        "wo": WeightSpec((N, H, D), ("q_heads", "head_dim", "embed"), contract=("q_heads", "head_dim")),
        "post_attn_norm": norm,
        "mlp_norm": norm,
        "w_gate": WeightSpec((D, F), ("embed", "mlp"), contract=("embed",)),
        "w_up": WeightSpec((D, F), ("embed", "mlp"), contract=("embed",)),
        "w_down": WeightSpec((F, D), ("mlp", "embed"), contract=("mlp",)),
        "post_mlp_norm": norm,
    }
    specs = {"embed": WeightSpec((V, D), ("vocab", "embed"), contract=("embed",)), "layers": [layer] * cfg.n_layers, "final_norm": norm}
    if not cfg.tie_embeddings:
        specs["lm_head"] = WeightSpec((D, V), ("embed", "vocab"), contract=("embed",))
    return specs


def embed(weights, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Token embeddings times sqrt(D): [B, T, D]. HF rounds sqrt(D) to float32 and then to the
    model dtype before multiplying; so do we (in bfloat16, sqrt(640) becomes 25.25)."""
    dt = cfg.jnp_dtype
    scale = jnp.asarray(np.float32(math.sqrt(cfg.d_model))).astype(dt)
    return take(weights["embed"], tokens).astype(dt) * scale


def unembed(weights, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final norm, output projection (tied) and optional soft-cap: float32 logits [B, T, V]."""
    x = rms_norm(x, weights["final_norm"], cfg.norm_eps, plus_one=True)
    if cfg.tie_embeddings:
        logits = dot("BTD,VD->BTV", x, weights["embed"]).astype(jnp.float32)
    else:
        logits = dot("BTD,DV->BTV", x, weights["lm_head"]).astype(jnp.float32)
    if cfg.final_logit_softcap:
        logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
    return logits


def layer(w: dict, x: jax.Array, cache, at: LayerAt):
    """One layer over hidden x [B, T, D] -> (x, cache) (the module docstring's), with its
    kind's window and rotary."""
    cfg, i = at.cfg, at.i
    norm = functools.partial(rms_norm, eps=cfg.norm_eps, plus_one=True)
    window = cfg.layer_window(i)
    with jax.named_scope(f"layer{i}/{'local' if window else 'global'}_attention"):
        h = norm(x, w["attn_norm"])
        q, k, v = dot_many(h, ("BTD,DNH->BTNH", w["wq"]), ("BTD,DKH->BTKH", w["wk"]), ("BTD,DKH->BTKH", w["wv"]))
        q, k = norm(q, w["q_norm"]), norm(k, w["k_norm"])
        o, cache = attend_layer(cache, at.j, q, k, v, at.positions, at.start, at.rope(), read_cache=at.read_cache,
                                scale=cfg.attn_scale, window=window, softcap=cfg.attn_logit_softcap,
                                attend_to=at.carry.get("attend_to"))
        x = x + norm(dot("BTNH,NHD->BTD", o, w["wo"]), w["post_attn_norm"])
    with jax.named_scope(f"layer{i}/mlp"):
        h = norm(x, w["mlp_norm"])
        x = x + norm(gated_mlp(h, w["w_gate"], w["w_up"], w["w_down"], gelu_tanh), w["post_mlp_norm"])
    return x, cache


decoder_layers = layer_loop(layer)
forward = decoder(embed, decoder_layers)


def image_attend_to(tokens: jax.Array, positions: jax.Array, image_token: int) -> jax.Array:
    """i32[B, T]: the last position each token attends to. A text token sees up to itself; an
    image's soft token (a run of ``image_token``) sees its whole image, as Gemma 3 attends
    bidirectionally among one image's tokens (and causally to everything before it)."""
    is_img = tokens == image_token
    last = is_img & ~jnp.concatenate([is_img[:, 1:], jnp.zeros_like(is_img[:, :1])], axis=1)
    ends = jax.lax.cummin(jnp.where(last, positions, jnp.iinfo(jnp.int32).max), axis=1, reverse=True)
    return jnp.where(is_img, ends, positions)


def scatter_images(x: jax.Array, tokens: jax.Array, soft: jax.Array, image_token: int) -> jax.Array:
    """The token embeddings x [B, T, D] with the soft tokens soft [I, M, D] of the batch's
    images put at its ``image_token``s, in order (row by row, left to right): a prompt
    holds M of them per image, as ``expand_images`` writes it. soft holds at least one image
    (a batch without any may pass zeros: nothing reads them)."""
    B, T, D = x.shape
    is_img = (tokens == image_token).reshape(-1)
    flat = soft.reshape(-1, D).astype(x.dtype)
    idx = jnp.clip(jnp.cumsum(is_img) - 1, 0, max(flat.shape[0] - 1, 0))
    return jnp.where(is_img[:, None], flat[idx], x.reshape(-1, D)).reshape(B, T, D)


def forward_with_images(weights: dict, tokens: jax.Array, soft: jax.Array, start: jax.Array, cache, *,
                        cfg: ModelConfig, image_token: int, read_cache: bool = True):
    """``forward`` of a prompt with images: tokens i32[B, T] hold M ``image_token``s per image
    (each image whole inside this call), soft [I, M, D] their soft tokens (``siglip.encode``),
    which replace those tokens' embeddings; the image tokens attend bidirectionally within
    their image -> (hidden [B, T, D], cache)."""
    positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    is_img = tokens == image_token
    x = scatter_images(embed(weights, jnp.where(is_img, 0, tokens), cfg), tokens, soft, image_token)
    return decoder_layers(weights["layers"], x, positions, start, cache, cfg=cfg, read_cache=read_cache,
                          attend_to=image_attend_to(tokens, positions, image_token))


# Gemma 3's image markers in prompt text (its tokenizer's special tokens)
BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"


def expand_images(text: str, mm_tokens: int, boi: str = BOI, image: str = IMAGE, eoi: str = EOI) -> str:
    """A prompt as Gemma 3's processor writes it before tokenizing: each ``<start_of_image>``
    (where the chat template puts an image) becomes "\n\n<start_of_image>", ``mm_tokens``
    ``<image_soft_token>``s, "<end_of_image>\n\n" (boi, image, eoi: the tokenizer's spelling
    of the three markers)."""
    return text.replace(boi, f"\n\n{boi}{image * mm_tokens}{eoi}\n\n")


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
    ("layers", "q_norm"): ("model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight", False),
    ("layers", "k_norm"): ("model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight", False),
    ("layers", "wo"): ("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight", True),
    ("layers", "post_attn_norm"): (
        "model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.post_attention_norm.weight", False),
    ("layers", "mlp_norm"): ("model.layers.{i}.pre_feedforward_layernorm.weight", "blk.{i}.ffn_norm.weight", False),
    ("layers", "w_gate"): ("model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight", True),
    ("layers", "w_up"): ("model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight", True),
    ("layers", "w_down"): ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight", True),
    ("layers", "post_mlp_norm"): (
        "model.layers.{i}.post_feedforward_layernorm.weight", "blk.{i}.post_ffw_norm.weight", False),
}

GGUF_ARCHITECTURES = frozenset({"gemma3"})  # llama.cpp keeps HF's rotary layout: no Q/K permutation
HF_ARCHITECTURES = frozenset({"Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"})
# The 4B, 12B and 27B checkpoints are Gemma3ForConditionalGeneration: the text decoder under
# language_model.model. as published (model.language_model. as transformers 4.5x re-saved
# them), its config in text_config, beside the SigLIP tower and the projector.
HF_TEXT_TOWERS = {"Gemma3ForConditionalGeneration": (TextTower("language_model.model.", "language_model.lm_head.weight"),
                                                     TextTower("model.language_model."))}
HF_ACTIVATIONS = frozenset({"gelu_pytorch_tanh"})


def gguf_tensor(name: str, a: np.ndarray) -> np.ndarray:
    """Undo what llama.cpp's converter changed: it stores every Gemma norm as 1 + w (its
    RMSNorm multiplies by the weight alone), ours holds HF's w. Exact in float32."""
    return a - np.float32(1.0) if name.endswith("norm.weight") else a


def layer_kinds(n_layers: int, pattern: int = 6) -> tuple[AttentionKind, ...]:
    """Gemma 3's interleaving: every ``pattern``-th layer GLOBAL, the rest LOCAL (5:1)."""
    return tuple(AttentionKind.GLOBAL if (i + 1) % pattern == 0 else AttentionKind.LOCAL for i in range(n_layers))


LOCAL_ROPE = RopeConfig(theta=10000.0)
GLOBAL_THETA = 1_000_000.0


def _preset(name, *, d_model, n_layers, n_heads, n_kv_heads, d_ff, window, head_dim=256,
            query_pre_attn_scalar=256.0, global_rope_factor=None, max_position=131072) -> ModelConfig:
    rope = RopeConfig(theta=GLOBAL_THETA)
    if global_rope_factor:
        rope = RopeConfig(theta=GLOBAL_THETA, kind=RopeKind.LINEAR, factor=global_rope_factor)
    return ModelConfig(
        family="gemma3", vocab_size=262144, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=n_kv_heads, head_dim=head_dim, d_ff=d_ff, norm_eps=1e-6, rope=rope,
        max_position=max_position, tie_embeddings=True, layer_kinds=layer_kinds(n_layers),
        sliding_window=window, rope_local=LOCAL_ROPE, query_pre_attn_scalar=query_pre_attn_scalar,
        name=name,
    )


# The published text decoders (Google's configs; the 4B+ multimodal checkpoints' text towers).
# vocab_size is the tokenizer's 262144: HF's 4B+ embeddings carry 64 extra image-token rows that
# llama.cpp's converter drops. The 27B scales queries by (D / N)**-0.5 = 168**-0.5, not head_dim.
PRESETS = {
    "gemma-3-270m": _preset("gemma-3-270m", d_model=640, n_layers=18, n_heads=4, n_kv_heads=1, d_ff=2048,
                            window=512, max_position=32768),
    "gemma-3-1b": _preset("gemma-3-1b", d_model=1152, n_layers=26, n_heads=4, n_kv_heads=1, d_ff=6912,
                          window=512, max_position=32768),
    "gemma-3-4b": _preset("gemma-3-4b", d_model=2560, n_layers=34, n_heads=8, n_kv_heads=4, d_ff=10240,
                          window=1024, global_rope_factor=8.0),
    "gemma-3-12b": _preset("gemma-3-12b", d_model=3840, n_layers=48, n_heads=16, n_kv_heads=8, d_ff=15360,
                           window=1024, global_rope_factor=8.0),
    "gemma-3-27b": _preset("gemma-3-27b", d_model=5376, n_layers=62, n_heads=32, n_kv_heads=16, d_ff=21504,
                           window=1024, head_dim=128, query_pre_attn_scalar=5376 / 32, global_rope_factor=8.0),
}


def config_from_gguf(meta: dict, tensor_names, *, dtype: str, load_tensor=None) -> ModelConfig:
    """llama.cpp's reading of a gemma3 GGUF: the file carries the global rotary base and
    scaling and the window; the local base (10k), the 5:1 pattern and the query scale are
    fixed by the architecture (llama.cpp: set_swa_pattern(6), rope_freq_base_train_swa)."""
    arch = meta["general.architecture"]
    g = lambda key, default=None: meta.get(f"{arch}.{key}", default)
    n_heads = int(g("attention.head_count"))
    d_model = int(g("embedding_length"))
    n_layers = int(g("block_count"))
    head_dim = int(g("attention.key_length", d_model // n_heads))
    rope = RopeConfig(theta=float(g("rope.freq_base", GLOBAL_THETA)))
    kind = g("rope.scaling.type")
    if kind == "linear":
        rope = dataclasses.replace(rope, kind=RopeKind.LINEAR, factor=float(g("rope.scaling.factor")))
    elif kind not in (None, "none"):
        from jaxinfer.errors import CheckpointError

        raise CheckpointError(f"unsupported GGUF {arch}.rope.scaling.type {kind!r} for Gemma 3 (supported: none, linear)")
    window = int(g("attention.sliding_window", 0) or 0)
    return ModelConfig(
        family="gemma3",
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(g("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=int(g("feed_forward_length")),
        norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope=rope,
        max_position=int(g("context_length", 131072)),
        tie_embeddings="output.weight" not in tensor_names,
        dtype=dtype,
        name=str(meta.get("general.name", arch)),
        layer_kinds=layer_kinds(n_layers) if window else (),
        sliding_window=window or None,
        rope_local=LOCAL_ROPE,
        # llama.cpp picks the 27B's scale by size (62 layers): D / N instead of head_dim
        query_pre_attn_scalar=d_model / n_heads if n_layers == 62 else float(head_dim),
        final_logit_softcap=float(g("final_logit_softcapping", 0.0)) or None,  # llama.cpp reads only this one
    )


def config_from_hf(hf: dict, *, dtype: str) -> ModelConfig:
    """A Gemma3ForCausalLM config.json (transformers 4: rope_theta, rope_local_base_freq,
    rope_scaling, sliding_window_pattern; transformers 5: rope_parameters per layer type,
    layer_types). Defaults are Gemma3TextConfig's."""
    from jaxinfer.errors import CheckpointError

    if hf.get("attention_bias") or hf.get("use_bidirectional_attention"):
        raise CheckpointError("unsupported Gemma 3 variant: attention_bias / use_bidirectional_attention")
    n_heads = hf.get("num_attention_heads", 8)
    n_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types:
        kinds = tuple(AttentionKind.LOCAL if t == "sliding_attention" else AttentionKind.GLOBAL for t in types)
    else:
        kinds = layer_kinds(n_layers, int(hf.get("sliding_window_pattern", 6)))

    def rope_of(params: dict, theta: float) -> RopeConfig:
        kind = params.get("rope_type", params.get("type")) or "default"
        theta = float(params.get("rope_theta", theta))
        if kind == "linear":
            return RopeConfig(theta=theta, kind=RopeKind.LINEAR, factor=float(params["factor"]))
        if kind != "default":
            raise CheckpointError(f"unsupported rope type {kind!r} for Gemma 3 (supported: linear)")
        return RopeConfig(theta=theta)

    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        rope = rope_of(params.get("full_attention") or {}, GLOBAL_THETA)
        rope_local = rope_of(params.get("sliding_attention") or {}, LOCAL_ROPE.theta)
    else:  # transformers 4: the scaling applies to global layers only
        rope = rope_of(hf.get("rope_scaling") or {}, float(hf.get("rope_theta", GLOBAL_THETA)))
        rope_local = RopeConfig(theta=float(hf.get("rope_local_base_freq", LOCAL_ROPE.theta)))
    head_dim = hf.get("head_dim") or 256
    return ModelConfig(
        family="gemma3",
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        d_ff=hf["intermediate_size"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=rope,
        max_position=int(hf.get("max_position_embeddings", 131072)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        qkv_bias=False,
        dtype=dtype,
        name=hf.get("_name_or_path", "") or hf.get("model_type", ""),
        layer_kinds=kinds,
        sliding_window=hf.get("sliding_window") if AttentionKind.LOCAL in kinds else None,
        rope_local=rope_local,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        # transformers' Gemma 3 keeps attn_logit_softcapping in its config but never applies it
        # (Gemma 2 did); llama.cpp's converter asserts it is unset. Follow the reference.
        attn_logit_softcap=None,
        final_logit_softcap=hf.get("final_logit_softcapping"),
    )

IMAGE_ENCODER = dataclasses.replace(siglip.ENCODER, expand=expand_images)

FAMILY = ModelFamily(
    name="gemma3", weight_specs=weight_specs, embed=embed, decoder_layers=decoder_layers, forward=forward,
    unembed=unembed, checkpoint_names=CHECKPOINT_NAMES,
    hf_architectures=HF_ARCHITECTURES, config_from_hf=config_from_hf, hf_activations=HF_ACTIVATIONS,
    hf_text_towers=HF_TEXT_TOWERS, image_encoders={"Gemma3ForConditionalGeneration": IMAGE_ENCODER},
    gguf_architectures=GGUF_ARCHITECTURES, config_from_gguf=config_from_gguf, gguf_tensor=gguf_tensor,
    norm_offset=1.0,
)
