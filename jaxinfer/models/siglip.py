"""Gemma 3's image encoder: the SigLIP vision tower and the multimodal projector that turns
its patches into the text model's soft tokens.

One image, resized to S x S (``images.ImageProcessor``), is cut into (S / p)^2 patches of p x p
pixels; the tower (a pre-LayerNorm ViT with learned positions and bidirectional attention)
encodes them; the projector average-pools them down to ``mm_tokens`` (256 for the published
checkpoints), RMS-normalises them (1 + w, as Gemma does) and maps them to the text model's
width. Those ``mm_tokens`` rows replace the prompt's ``<image_soft_token>`` embeddings.

    cfg, weights = loaders.hf.load_image_encoder(path, dtype="float32")   # Gemma3ForConditionalGeneration
    soft = encode_images(weights, pixels, cfg=cfg)   # f32[n, 3, S, S] -> [n, M, E]

Shapes: B images, P patches, D the tower's width, N heads, H head dim, F MLP width,
M soft tokens per image, E the text model's width.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxinfer.einsum import einsum
from jaxinfer.errors import CheckpointError
from jaxinfer.models.family import ImageEncoder
from jaxinfer.specs import WeightSpec

HF_ARCHITECTURES = frozenset({"Gemma3ForConditionalGeneration"})
HF_ACTIVATIONS = frozenset({"gelu_pytorch_tanh"})


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    d_model: int  # D
    n_layers: int
    n_heads: int  # N
    d_ff: int  # F
    image_size: int  # S: images are resized to S x S
    patch_size: int  # p
    mm_tokens: int  # M: soft tokens per image (a square: pooled sqrt(M) x sqrt(M))
    text_d_model: int  # E
    norm_eps: float = 1e-6
    channels: int = 3
    dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens)

    def __post_init__(self):
        side = self.patches_per_side
        if self.image_size % self.patch_size:
            raise ValueError(f"{self.patch_size=} must divide {self.image_size=}")
        if self.tokens_per_side ** 2 != self.mm_tokens or side % self.tokens_per_side:
            raise ValueError(f"{self.mm_tokens=} must be a square whose side divides the {side} patches per side")
        if self.d_model % self.n_heads:
            raise ValueError(f"{self.n_heads=} must divide {self.d_model=}")


def config_from_hf(hf: dict, *, dtype: str) -> VisionConfig:
    """The vision tower of a Gemma3ForConditionalGeneration config.json (``vision_config``,
    ``mm_tokens_per_image``, the text width from ``text_config``)."""
    v, text = hf.get("vision_config"), hf.get("text_config")
    if not isinstance(v, dict) or not isinstance(text, dict):
        raise CheckpointError("a Gemma 3 multimodal config needs vision_config and text_config")
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in HF_ACTIVATIONS:
        raise CheckpointError(f"unsupported vision hidden_act {act!r} (supported: {', '.join(sorted(HF_ACTIVATIONS))})")
    # a pooling head (vision_use_head) is never run: Gemma 3 reads the tower's patches
    try:
        return VisionConfig(
            d_model=int(v.get("hidden_size", 1152)), n_layers=int(v.get("num_hidden_layers", 27)),
            n_heads=int(v.get("num_attention_heads", 16)), d_ff=int(v.get("intermediate_size", 4304)),
            image_size=int(v.get("image_size", 896)), patch_size=int(v.get("patch_size", 14)),
            mm_tokens=int(hf.get("mm_tokens_per_image", 256)), text_d_model=int(text["hidden_size"]),
            norm_eps=float(v.get("layer_norm_eps", 1e-6)), channels=int(v.get("num_channels", 3)), dtype=dtype)
    except ValueError as e:
        raise CheckpointError(f"vision_config: {e}") from None


def weight_specs(cfg: VisionConfig) -> dict:
    D, F, N, H, C, p = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.head_dim, cfg.channels, cfg.patch_size
    norm = lambda init: WeightSpec((D,), ("embed",), init)  # noqa: E731
    layer = {
        "attn_norm": norm("ones"), "attn_norm_bias": norm("zeros"),
        "wq": WeightSpec((D, N, H), ("embed", "q_heads", "head_dim"), contract=("embed",)),
        "bq": WeightSpec((N, H), ("q_heads", "head_dim"), "zeros"),
        "wk": WeightSpec((D, N, H), ("embed", "q_heads", "head_dim"), contract=("embed",)),
        "bk": WeightSpec((N, H), ("q_heads", "head_dim"), "zeros"),
        "wv": WeightSpec((D, N, H), ("embed", "q_heads", "head_dim"), contract=("embed",)),
        "bv": WeightSpec((N, H), ("q_heads", "head_dim"), "zeros"),
        "wo": WeightSpec((N, H, D), ("q_heads", "head_dim", "embed"), contract=("q_heads", "head_dim")),
        "bo": norm("zeros"),
        "mlp_norm": norm("ones"), "mlp_norm_bias": norm("zeros"),
        "w_up": WeightSpec((D, F), ("embed", "mlp"), contract=("embed",)),
        "b_up": WeightSpec((F,), ("mlp",), "zeros"),
        "w_down": WeightSpec((F, D), ("mlp", "embed"), contract=("mlp",)),
        "b_down": norm("zeros"),
    }
    return {
        # the patch convolution as stored (D, C, p, p): one einsum over each patch's pixels
        "patch": WeightSpec((D, C, p, p), ("embed", None, None, None)),
        "patch_bias": norm("zeros"),
        "positions": WeightSpec((cfg.patches_per_side ** 2, D), (None, "embed")),
        "layers": [dict(layer) for _ in range(cfg.n_layers)],
        "final_norm": norm("ones"), "final_norm_bias": norm("zeros"),
        "mm_norm": norm("zeros"),  # RMSNorm scaled by 1 + w
        "mm_proj": WeightSpec((D, cfg.text_d_model), ("embed", None), contract=("embed",)),
    }


_T = "vision_tower.vision_model."  # as published; transformers 4.5x re-saved it under model.vision_tower.
# our weight path -> (HF tensor name, unused GGUF name, transpose)
CHECKPOINT_NAMES = {
    ("patch",): (_T + "embeddings.patch_embedding.weight", "", False),
    ("patch_bias",): (_T + "embeddings.patch_embedding.bias", "", False),
    ("positions",): (_T + "embeddings.position_embedding.weight", "", False),
    ("final_norm",): (_T + "post_layernorm.weight", "", False),
    ("final_norm_bias",): (_T + "post_layernorm.bias", "", False),
    ("mm_norm",): ("multi_modal_projector.mm_soft_emb_norm.weight", "", False),
    ("mm_proj",): ("multi_modal_projector.mm_input_projection_weight", "", False),
}
for _ours, _hf, _t in [
    ("attn_norm", "layer_norm1.weight", False), ("attn_norm_bias", "layer_norm1.bias", False),
    ("wq", "self_attn.q_proj.weight", True), ("bq", "self_attn.q_proj.bias", False),
    ("wk", "self_attn.k_proj.weight", True), ("bk", "self_attn.k_proj.bias", False),
    ("wv", "self_attn.v_proj.weight", True), ("bv", "self_attn.v_proj.bias", False),
    ("wo", "self_attn.out_proj.weight", True), ("bo", "self_attn.out_proj.bias", False),
    ("mlp_norm", "layer_norm2.weight", False), ("mlp_norm_bias", "layer_norm2.bias", False),
    ("w_up", "mlp.fc1.weight", True), ("b_up", "mlp.fc1.bias", False),
    ("w_down", "mlp.fc2.weight", True), ("b_down", "mlp.fc2.bias", False),
]:
    CHECKPOINT_NAMES[("layers", _ours)] = (_T + "encoder.layers.{i}." + _hf, "", _t)
# where the checkpoint keeps the tower: as published, as transformers writes it today (its
# vision_model. folded away), and as transformers 4.5x re-saved it
TOWER_PREFIXES = ("vision_tower.vision_model.", "vision_tower.", "model.vision_tower.vision_model.")


def _layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, -1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), -1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


QUERY_BLOCK = 512  # queries attended together: 4,096 patches' scores at once were 2 GB per 2 images


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float) -> jax.Array:
    """Full (bidirectional) attention of q, k, v [B, P, N, H] in float32, QUERY_BLOCK queries at a
    time (where that divides P) so the scores held at once stay [B, N, QUERY_BLOCK, P]."""
    B, P, N, H = q.shape
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)

    def block(qb):  # [B, T, N, H]
        s = einsum("BTNH,BSNH->BNTS", qb.astype(jnp.float32) * scale, kf)
        return einsum("BNTS,BSNH->BTNH", jax.nn.softmax(s, -1), vf)

    if P <= QUERY_BLOCK or P % QUERY_BLOCK:
        return block(q)
    qb = q.reshape(B, P // QUERY_BLOCK, QUERY_BLOCK, N, H).transpose(1, 0, 2, 3, 4)
    return jax.lax.map(block, qb).transpose(1, 0, 2, 3, 4).reshape(B, P, N, H)


def _layer(w: dict, x: jax.Array, cfg: VisionConfig) -> jax.Array:
    """One pre-LayerNorm encoder layer: every patch attends to every patch of its image."""
    with jax.named_scope("vision_attention"):
        h = _layer_norm(x, w["attn_norm"], w["attn_norm_bias"], cfg.norm_eps)
        q = einsum("BPD,DNH->BPNH", h, w["wq"]) + w["bq"]
        k = einsum("BPD,DNH->BPNH", h, w["wk"]) + w["bk"]
        v = einsum("BPD,DNH->BPNH", h, w["wv"]) + w["bv"]
        a = _attention(q, k, v, cfg.head_dim ** -0.5).astype(x.dtype)
        x = x + einsum("BPNH,NHD->BPD", a, w["wo"]) + w["bo"]
    with jax.named_scope("vision_mlp"):
        h = _layer_norm(x, w["mlp_norm"], w["mlp_norm_bias"], cfg.norm_eps)
        h = jax.nn.gelu(einsum("BPD,DF->BPF", h, w["w_up"]) + w["b_up"], approximate=True)
        return x + einsum("BPF,FD->BPD", h, w["w_down"]) + w["b_down"]


def encode(weights: dict, pixels: jax.Array, *, cfg: VisionConfig) -> jax.Array:
    """Soft tokens of a batch of images: pixels f32[B, C, S, S] (normalised) -> [B, M, E]."""
    B, C, S, _ = pixels.shape
    p, side, dt = cfg.patch_size, cfg.patches_per_side, jnp.dtype(cfg.dtype)
    with jax.named_scope("vision_patches"):
        # [B, C, side, p, side, p] -> [B, side * side, C, p, p], patches in row-major order
        patches = pixels.astype(dt).reshape(B, C, side, p, side, p).transpose(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(B, side * side, C, p, p)
        x = einsum("BPCHW,DCHW->BPD", patches, weights["patch"]) + weights["patch_bias"] + weights["positions"]
    for w in weights["layers"]:
        x = _layer(w, x, cfg)
    x = _layer_norm(x, weights["final_norm"], weights["final_norm_bias"], cfg.norm_eps)
    with jax.named_scope("vision_projector"):
        t = cfg.tokens_per_side
        k = side // t  # each soft token averages k x k patches
        pooled = x.astype(jnp.float32).reshape(B, t, k, t, k, cfg.d_model).mean((2, 4)).reshape(B, t * t, cfg.d_model)
        pooled = pooled * jax.lax.rsqrt(jnp.mean(pooled * pooled, -1, keepdims=True) + cfg.norm_eps)
        pooled = (pooled * (1.0 + weights["mm_norm"].astype(jnp.float32))).astype(dt)
        return einsum("BMD,DE->BME", pooled, weights["mm_proj"])


@functools.partial(jax.jit, static_argnames=("cfg",))
def encode_jit(weights: dict, pixels: jax.Array, *, cfg: VisionConfig) -> jax.Array:
    """``encode``, compiled once per (config, batch bucket)."""
    return encode(weights, pixels, cfg=cfg)


# images encoded in one call: a batch is padded up to the next of these
IMAGE_BUCKETS = (1, 2, 4, 8)


def encode_images(weights: dict, pixels, *, cfg: VisionConfig) -> jax.Array:
    """Soft tokens of any number of images, f32[n, C, S, S] -> [n, M, E], encoded in
    batches padded to ``IMAGE_BUCKETS`` so the number of compilations stays bounded."""
    n = len(pixels)
    out = []
    i = 0
    while i < n:
        take = min(n - i, IMAGE_BUCKETS[-1])
        bucket = next(b for b in IMAGE_BUCKETS if b >= take)
        batch = jnp.asarray(pixels[i:i + take], jnp.float32)
        if bucket > take:
            batch = jnp.concatenate([batch, jnp.zeros((bucket - take, *batch.shape[1:]), batch.dtype)])
        out.append(encode_jit(weights, batch, cfg=cfg)[:take])
        i += take
    if not out:
        return jnp.zeros((0, cfg.mm_tokens, cfg.text_d_model), jnp.dtype(cfg.dtype))
    return jnp.concatenate(out)


def checkpoint_names(stored) -> dict:
    """Our names of the tower's and projector's tensors in the layout ``stored`` (the
    checkpoint's tensor names) was written in."""
    for prefix in TOWER_PREFIXES:
        if prefix + "embeddings.patch_embedding.weight" in stored:
            break
    else:
        raise CheckpointError(f"no vision tower in the checkpoint (looked under {', '.join(TOWER_PREFIXES)})")
    mm = "multi_modal_projector." if "multi_modal_projector.mm_input_projection_weight" in stored \
        else "model.multi_modal_projector."
    return {key: (name.replace(_T, prefix, 1).replace("multi_modal_projector.", mm, 1), *rest)
            for key, (name, *rest) in CHECKPOINT_NAMES.items()}


ENCODER = ImageEncoder(config_from_hf=config_from_hf, weight_specs=weight_specs, checkpoint_names=checkpoint_names,
                       encode=encode)
