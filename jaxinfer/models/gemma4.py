"""The Gemma 4 family (text decoder) as plain functions over pytrees.

What sets it apart from Gemma 3, layer by layer (E: per-layer input width, L: layers):
  x = embed(tokens) * sqrt(D)
  pl = (norm(x @ ple_model_proj / sqrt(D)) + ple_embed(tokens) * sqrt(E)) / sqrt(2)   [B, T, L, E]
  h = attn_norm(x); q, k = q_norm(h wq), k_norm(h wk); v = v_norm(h wv)   (v_norm has no weight)
  x = x + post_attn_norm(attention(h))            (scores unscaled: the q/k norms set their size)
  x = x + post_mlp_norm(GeGLU(mlp_norm(x)))
  x = x + ple_norm(ple_proj(gelu(x ple_gate) * pl[i]))      (per-layer inputs, "PLE")
  x = x * layer_scalar
Every RMSNorm scales by w itself (Gemma 3's were 1 + w). LOCAL layers attend to the last
``sliding_window`` positions with the local rotary (10k) over head_dim; GLOBAL layers see
everything, with their own head dim (``global_head_dim``), and "proportional" rotary: only the
first ``partial_rotary_factor`` of the frequencies turn. With ``values_from_keys``
(transformers' attention_k_eq_v) GLOBAL layers have no value projection (v = h wk, before
k_norm) and ``global_kv_heads`` KV heads. KV sharing: the last ``kv_shared_layers`` layers
compute no keys or values; each attends over those of the last earlier layer of its kind
(``ModelConfig.kv_source``) and has no cache of its own. With the double-wide MLP those layers
have ``shared_kv_d_ff`` instead of d_ff.

weights = {"embed": [V, D], "layers": [one dict per layer], "final_norm": [D],
           "ple_embed": [Vp, L*E], "ple_model_proj": [D, L, E], "ple_model_norm": [E]  (E > 0),
           "lm_head": [D, V] (untied models only)}
"""

from __future__ import annotations

import dataclasses

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import AttentionKind, ModelConfig, RopeConfig, RopeKind
from jaxinfer.errors import CheckpointError
from jaxinfer.models.family import LayerAt, ModelFamily, TextTower, layer_loop
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

# Gemma 4 runs its layers from the tokens as well as the hidden state (the per-layer inputs),
# which pipeline stages do not carry (engine.pipeline.check_pipeline).
PIPELINE_STAGES = False
# w8a8 calibrates one layer at a time from the hidden state alone (loaders.quantize): not these layers.
W8A8_CALIBRATION = False


@dataclasses.dataclass(frozen=True)
class Gemma4Config:
    """Gemma 4's own knobs (its per-layer attention shapes and KV sharing stay in ModelConfig,
    which the engine reads to lay out the cache)."""

    per_layer_input_dim: int = 0  # E: each layer adds a gated projection of its own E-wide input (0: none)
    per_layer_vocab_size: int = 0  # rows of the per-layer input table (0: vocab_size)
    values_from_keys: bool = False  # GLOBAL layers' values are their keys' projection (no value weights)
    shared_kv_d_ff: int | None = None  # F of the layers that share keys/values (None: d_ff)


def _has_values(cfg: ModelConfig, layer: int) -> bool:
    """Whether layer ``layer`` projects values of its own (not with values_from_keys on GLOBAL layers)."""
    return not (cfg.family_config.values_from_keys and cfg.layer_kind(layer) == AttentionKind.GLOBAL)


def _d_ff(cfg: ModelConfig, layer: int) -> int:
    wide = cfg.family_config.shared_kv_d_ff
    return wide if wide and cfg.kv_source(layer) != layer else cfg.d_ff


def weight_specs(cfg: ModelConfig) -> dict:
    """The one declaration of every weight. Norm weights start at one (a scale of w)."""
    D, N, V, E, L = cfg.d_model, cfg.n_heads, cfg.vocab_size, cfg.family_config.per_layer_input_dim, cfg.n_layers
    norm = WeightSpec((D,), ("embed",), "ones")
    layers = []
    for i in range(L):
        K, H, F = cfg.layer_kv_heads(i), cfg.layer_head_dim(i), _d_ff(cfg, i)
        head_norm = WeightSpec((H,), ("head_dim",), "ones")
        kv = WeightSpec((D, K, H), ("embed", "kv_heads", "head_dim"), contract=("embed",))
        layer = {"attn_norm": norm,
                 "wq": WeightSpec((D, N, H), ("embed", "q_heads", "head_dim"), contract=("embed",)),
                 "q_norm": head_norm}
        if cfg.kv_source(i) == i:  # a layer that shares another's keys/values has no projections for them
            layer |= {"wk": kv, "k_norm": head_norm} | ({"wv": kv} if _has_values(cfg, i) else {})
        layer |= {
            "wo": WeightSpec((N, H, D), ("q_heads", "head_dim", "embed"), contract=("q_heads", "head_dim")),
            "post_attn_norm": norm,
            "mlp_norm": norm,
            "w_gate": WeightSpec((D, F), ("embed", "mlp"), contract=("embed",)),
            "w_up": WeightSpec((D, F), ("embed", "mlp"), contract=("embed",)),
            "w_down": WeightSpec((F, D), ("mlp", "embed"), contract=("mlp",)),
            "post_mlp_norm": norm,
        }
        if E:
            layer |= {"ple_gate": WeightSpec((D, E), ("embed", "per_layer"), contract=("embed",)),
                      "ple_proj": WeightSpec((E, D), ("per_layer", "embed"), contract=("per_layer",)),
                      "ple_norm": norm}
        layer["layer_scalar"] = WeightSpec((1,), (None,), "ones")
        layers.append(layer)
    specs = {"embed": WeightSpec((V, D), ("vocab", "embed"), contract=("embed",)), "layers": layers,
             "final_norm": norm}
    if E:
        specs |= {
            "ple_embed": WeightSpec((cfg.family_config.per_layer_vocab_size or V, L * E), ("vocab", "per_layer"),
                                    contract=("per_layer",)),
            "ple_model_proj": WeightSpec((D, L, E), ("embed", "per_layer_slot", "per_layer"), contract=("embed",)),
            "ple_model_norm": WeightSpec((E,), ("per_layer",), "ones"),
        }
    if not cfg.tie_embeddings:
        specs["lm_head"] = WeightSpec((D, V), ("embed", "vocab"), contract=("embed",))
    return specs


def _scale(value: float, dt) -> jax.Array:
    """A python scale as transformers applies it to a table: float32, then the model dtype."""
    return jnp.asarray(np.float32(value)).astype(dt)


def embed(weights, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Token embeddings times sqrt(D): [B, T, D] (the scale rounded to the model dtype, as HF)."""
    dt = cfg.jnp_dtype
    return take(weights["embed"], tokens).astype(dt) * _scale(math.sqrt(cfg.d_model), dt)


def per_layer_inputs(weights, tokens: jax.Array, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Every layer's own input [B, T, L, E]: a projection of the embedded tokens x [B, T, D]
    (normed per layer) plus the tokens' rows of the per-layer table, over sqrt(2)."""
    B, T = tokens.shape
    L, E, dt = cfg.n_layers, cfg.family_config.per_layer_input_dim, cfg.jnp_dtype
    with jax.named_scope("per_layer_inputs"):
        ids = take(weights["ple_embed"], tokens).astype(dt) * _scale(math.sqrt(E), dt)
        proj = dot("BTD,DLE->BTLE", x, weights["ple_model_proj"]) * cfg.d_model ** -0.5
        proj = rms_norm(proj, weights["ple_model_norm"], cfg.norm_eps)
        return (proj + ids.reshape(B, T, L, E)) * 2.0 ** -0.5


def unembed(weights, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final norm, output projection and optional soft-cap: float32 logits [B, T, V]."""
    x = rms_norm(x, weights["final_norm"], cfg.norm_eps)
    if cfg.tie_embeddings:
        logits = dot("BTD,VD->BTV", x, weights["embed"]).astype(jnp.float32)
    else:
        logits = dot("BTD,DV->BTV", x, weights["lm_head"]).astype(jnp.float32)
    if cfg.final_logit_softcap:
        logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
    return logits


def forward(
    weights: dict,
    tokens: jax.Array,  # i32[B, T]
    start: jax.Array,  # i32[B] position of tokens[:, 0]
    cache,  # kv.KVCache | kv.PagedKVCache | PackedKV | None
    *,
    cfg: ModelConfig,
    read_cache: bool = True,  # False when every row starts at 0: attend over the new tokens only
    positions: jax.Array | None = None,  # i32[B, T] explicit positions (a packed step's); default start + t
) -> tuple[jax.Array, object]:  # hidden [B, T, D] before the final norm, cache
    """The decoder over T new tokens per row (see ``decoder_layers``)."""
    T = tokens.shape[1]
    if positions is None:
        positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)  # i32[B, T]
    x = embed(weights, tokens, cfg)
    pl = per_layer_inputs(weights, tokens, x, cfg) if cfg.family_config.per_layer_input_dim else None
    return decoder_layers(weights["layers"], x, positions, start, cache, cfg=cfg, read_cache=read_cache,
                          per_layer=pl)


def layer(w: dict, x: jax.Array, cache, at: LayerAt):
    """One layer over hidden x [B, T, D] -> (x, cache). ``at.carry``: "per_layer", the
    ``per_layer_inputs`` [B, T, L, E] (absent when E = 0), and each earlier layer's (k, v)
    [B, T, K, H] by layer, for the layers that share them. A layer that owns keys/values writes
    them to its cache layer and attends over it; a layer sharing them attends over its source's
    cache layer (written earlier in this same pass) and writes nothing."""
    cfg, i = at.cfg, at.i
    norm = functools.partial(rms_norm, eps=cfg.norm_eps)
    own = at.carry.setdefault("kv", {})
    H, window, src = cfg.layer_head_dim(i), cfg.layer_window(i), cfg.kv_source(i)
    with jax.named_scope(f"layer{i}/{cfg.layer_kind(i).value}_attention"):
        h = norm(x, w["attn_norm"])
        if src == i:
            qk = ("BTD,DNH->BTNH", w["wq"]), ("BTD,DKH->BTKH", w["wk"])
            if "wv" in w:
                q, k, v = dot_many(h, *qk, ("BTD,DKH->BTKH", w["wv"]))
            else:  # values_from_keys: the values are the keys' projection, before k_norm
                q, k = dot_many(h, *qk)
                v = k
            k, v = norm(k, w["k_norm"]), norm(v, None)
            own[i] = k, v
        else:
            q = dot("BTD,DNH->BTNH", h, w["wq"])
            k, v = own[src]
        q = norm(q, w["q_norm"])
        o, cache = attend_layer(cache, src - at.first, q, k, v, at.positions, at.start, at.rope(dim=H),
                                read_cache=at.read_cache, scale=cfg.attn_scale, window=window,
                                softcap=cfg.attn_logit_softcap, shared=src != i)
        x = x + norm(dot("BTNH,NHD->BTD", o, w["wo"]), w["post_attn_norm"])
    with jax.named_scope(f"layer{i}/mlp"):
        h = norm(x, w["mlp_norm"])
        x = x + norm(gated_mlp(h, w["w_gate"], w["w_up"], w["w_down"], gelu_tanh), w["post_mlp_norm"])
    per_layer = at.carry.get("per_layer")
    if per_layer is not None:
        with jax.named_scope(f"layer{i}/per_layer_input"):
            g = gelu_tanh(dot("BTD,DE->BTE", x, w["ple_gate"])) * per_layer[:, :, i]
            x = x + norm(dot("BTE,ED->BTD", g, w["ple_proj"]), w["ple_norm"])
    return x * w["layer_scalar"].astype(x.dtype), cache


decoder_layers = layer_loop(layer)


# Where each weight lives in the two external formats: our path -> (HF name, GGUF name,
# transpose). Torch Linear weights are [out, in]; ours put the contracted axis first.
CHECKPOINT_NAMES = {
    ("embed",): ("model.embed_tokens.weight", "token_embd.weight", False),
    ("final_norm",): ("model.norm.weight", "output_norm.weight", False),
    ("lm_head",): ("lm_head.weight", "output.weight", True),
    ("ple_embed",): ("model.embed_tokens_per_layer.weight", "per_layer_token_embd.weight", False),
    ("ple_model_proj",): ("model.per_layer_model_projection.weight", "per_layer_model_proj.weight", True),
    ("ple_model_norm",): ("model.per_layer_projection_norm.weight", "per_layer_proj_norm.weight", False),
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
    ("layers", "ple_gate"): ("model.layers.{i}.per_layer_input_gate.weight", "blk.{i}.inp_gate.weight", True),
    ("layers", "ple_proj"): ("model.layers.{i}.per_layer_projection.weight", "blk.{i}.proj.weight", True),
    ("layers", "ple_norm"): ("model.layers.{i}.post_per_layer_input_norm.weight", "blk.{i}.post_norm.weight", False),
    ("layers", "layer_scalar"): ("model.layers.{i}.layer_scalar", "blk.{i}.layer_output_scale.weight", False),
}

HF_ARCHITECTURES = frozenset({"Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"})
# The multimodal checkpoint keeps the text decoder under model.language_model. (its config under
# text_config) beside the vision and audio towers, which a text decoder does not read.
HF_TEXT_TOWERS = {"Gemma4ForConditionalGeneration": (TextTower("model.language_model."),)}
HF_ACTIVATIONS = frozenset({"gelu_pytorch_tanh"})
GGUF_ARCHITECTURES = frozenset({"gemma4"})  # norms stored as HF's w (no 1 + w), rotary in HF's layout
GGUF_CONFIG_TENSORS = frozenset({"rope_freqs.weight"})

LOCAL_ROPE = RopeConfig(theta=10000.0)
GLOBAL_ROPE = RopeConfig(theta=1_000_000.0, kind=RopeKind.PROPORTIONAL, partial_rotary_factor=0.25)


def default_layer_kinds(n_layers: int, pattern: int = 6) -> tuple[AttentionKind, ...]:
    """transformers' default when a config names no layer_types: every ``pattern``-th layer
    GLOBAL, and the last one always."""
    return tuple(AttentionKind.GLOBAL if (i + 1) % pattern == 0 or i == n_layers - 1 else AttentionKind.LOCAL
                 for i in range(n_layers))


def _per_kind(values: list, kinds, what: str) -> dict:
    """{kind: its one value} from one value per layer; refuse two values within a kind."""
    out: dict = {}
    for kind, value in zip(kinds, values):
        if out.setdefault(kind, value) != value:
            raise CheckpointError(f"Gemma 4 {what} differs between {kind.value} layers ({out[kind]} and {value}); "
                                  "only one per layer kind is supported")
    return out


def config_from_hf(hf: dict, *, dtype: str) -> ModelConfig:
    """A Gemma4ForCausalLM config.json, or a multimodal checkpoint's text_config. Defaults are
    Gemma4TextConfig's. Global layers take global_head_dim (and, with attention_k_eq_v,
    num_global_key_value_heads) unless the config carries transformers' explicit
    per_layer_config (sparse per-layer overrides of head_dim / num_key_value_heads)."""
    if hf.get("enable_moe_block"):
        raise CheckpointError("the Gemma 4 mixture-of-experts variant (enable_moe_block=true) is not supported")
    for key in ("attention_bias", "use_bidirectional_attention"):
        if hf.get(key):
            raise CheckpointError(f"unsupported Gemma 4 variant: {key}={hf[key]!r}")
    n_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types:
        kinds = [AttentionKind.LOCAL if t == "sliding_attention" else AttentionKind.GLOBAL for t in types]
        kinds[-1] = AttentionKind.GLOBAL  # transformers forces the last layer to full attention
        kinds = tuple(kinds)
    else:
        kinds = default_layer_kinds(n_layers)
    n_heads = hf.get("num_attention_heads", 8)
    head_dim, n_kv = hf.get("head_dim", 256), hf.get("num_key_value_heads", 4)
    k_eq_v = bool(hf.get("attention_k_eq_v", False))
    per_layer = hf.get("per_layer_config")
    if per_layer is None:
        glob_kv = hf.get("num_global_key_value_heads") if k_eq_v else None
        shapes = [(hf.get("global_head_dim", 512), glob_kv or n_kv) if k == AttentionKind.GLOBAL else (head_dim, n_kv)
                  for k in kinds]
    else:
        overrides = {int(i): o for i, o in per_layer.items()}
        unknown = {key for o in overrides.values() for key in o} - {"head_dim", "num_key_value_heads"}
        if unknown:
            raise CheckpointError(f"unsupported Gemma 4 per_layer_config keys: {', '.join(sorted(unknown))}")
        shapes = [(overrides.get(i, {}).get("head_dim", head_dim), overrides.get(i, {}).get("num_key_value_heads", n_kv))
                  for i in range(n_layers)]
    by_kind = _per_kind(shapes, kinds, "(head_dim, num_key_value_heads)")
    local = by_kind.get(AttentionKind.LOCAL, (head_dim, n_kv))
    glob = by_kind.get(AttentionKind.GLOBAL, local)

    def rope_of(params: dict, default: RopeConfig) -> RopeConfig:
        kind = params.get("rope_type", default.kind.value)
        theta = float(params.get("rope_theta", default.theta))
        if kind == "proportional":
            return RopeConfig(theta=theta, kind=RopeKind.PROPORTIONAL, factor=float(params.get("factor", 1.0)),
                              partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)))
        if kind == "linear":
            return RopeConfig(theta=theta, kind=RopeKind.LINEAR, factor=float(params["factor"]))
        if kind != "default":
            raise CheckpointError(f"unsupported rope type {kind!r} for Gemma 4 (supported: default, linear, "
                                  "proportional)")
        return RopeConfig(theta=theta)

    params = hf.get("rope_parameters") or {}
    n_shared = int(hf.get("num_kv_shared_layers", 0))
    if n_shared >= n_layers:
        raise CheckpointError(f"num_kv_shared_layers={n_shared}: every layer reads keys/values from outside the "
                              "model (a draft model for another); not supported")
    d_ff = hf["intermediate_size"]
    return ModelConfig(
        family="gemma4",
        vocab_size=hf.get("vocab_size", 262144),
        d_model=hf["hidden_size"],
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=local[1],
        head_dim=local[0],
        d_ff=d_ff,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=rope_of(params.get("full_attention") or {}, GLOBAL_ROPE),
        max_position=int(hf.get("max_position_embeddings", 131072)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        dtype=dtype,
        name=hf.get("_name_or_path", "") or hf.get("model_type", ""),
        layer_kinds=kinds,
        sliding_window=int(hf.get("sliding_window", 512)) if AttentionKind.LOCAL in kinds else None,
        rope_local=rope_of(params.get("sliding_attention") or {}, LOCAL_ROPE),
        query_pre_attn_scalar=1.0,  # transformers scales Gemma 4's scores by 1
        final_logit_softcap=hf.get("final_logit_softcapping"),
        global_head_dim=glob[0],
        global_kv_heads=glob[1],
        kv_shared_layers=n_shared,
        family_config=Gemma4Config(
            per_layer_input_dim=int(hf.get("hidden_size_per_layer_input", 256) or 0),
            per_layer_vocab_size=int(hf.get("vocab_size_per_layer_input", 262144)), values_from_keys=k_eq_v,
            shared_kv_d_ff=2 * d_ff if hf.get("use_double_wide_mlp") and n_shared else None),
    )


def config_from_gguf(meta: dict, tensors, *, dtype: str, load_tensor=None) -> ModelConfig:
    """llama.cpp's gemma4 GGUF: per-layer arrays for the sliding pattern (true: sliding), the KV
    heads and the MLP width where they differ; key_length (GLOBAL layers) and key_length_swa;
    rope.freq_base (GLOBAL) and freq_base_swa; the proportional rotary of GLOBAL layers as the
    divisors in ``rope_freqs.weight`` (1 for a turning frequency, 1e30 for a still one); the
    token embedding cut to the tokenizer's vocabulary. No value projection on GLOBAL layers
    marks attention_k_eq_v."""
    arch = meta["general.architecture"]
    g = lambda key, default=None: meta.get(f"{arch}.{key}", default)
    n_layers = int(g("block_count"))

    def per_layer(key, default=None) -> list:
        v = g(key, default)
        return [int(x) for x in v] if isinstance(v, list) else [int(v)] * n_layers

    pattern = g("attention.sliding_window_pattern")
    kinds = (tuple(AttentionKind.LOCAL if s else AttentionKind.GLOBAL for s in pattern) if isinstance(pattern, list)
             else default_layer_kinds(n_layers))
    n_heads = int(g("attention.head_count"))
    kv = _per_kind(per_layer("attention.head_count_kv"), kinds, "head_count_kv")
    glob_hd, local_hd = int(g("attention.key_length")), int(g("attention.key_length_swa", g("attention.key_length")))
    for key, want in (("rope.dimension_count", glob_hd), ("rope.dimension_count_swa", local_hd)):
        if int(g(key, want)) != want:
            raise CheckpointError(f"GGUF {arch}.{key}={g(key)}: rotary over part of the head is not supported "
                                  f"(expected {want})")
    n_shared = int(g("attention.shared_kv_layers", 0))
    ff = per_layer("feed_forward_length")
    first = n_layers - n_shared
    if len(set(ff[:first])) > 1 or len(set(ff[first:])) > 1:
        raise CheckpointError(f"GGUF {arch}.feed_forward_length: only one width for the layers with keys/values "
                              "and one for those sharing them are supported")
    rope = RopeConfig(theta=float(g("rope.freq_base", GLOBAL_ROPE.theta)))
    if "rope_freqs.weight" in tensors:
        factors = np.asarray(load_tensor("rope_freqs.weight"), np.float32).reshape(-1)
        if len(factors) != glob_hd // 2 or not np.all(np.isfinite(factors)) or np.any(factors <= 0):
            raise CheckpointError(f"GGUF rope_freqs.weight: expected {glob_hd // 2} positive factors")
        rope = RopeConfig(theta=rope.theta, freq_factors=tuple(float(f) for f in factors))
    glob = next((i for i in range(first) if kinds[i] == AttentionKind.GLOBAL), None)
    E = int(g("embedding_length_per_layer_input", 0))
    window = int(g("attention.sliding_window", 0) or 0)
    return ModelConfig(
        family="gemma4",
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        d_model=int(g("embedding_length")),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=kv.get(AttentionKind.LOCAL, kv[AttentionKind.GLOBAL]),
        head_dim=local_hd,
        d_ff=ff[0],
        norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope=rope,
        max_position=int(g("context_length", 131072)),
        tie_embeddings="output.weight" not in tensors,
        dtype=dtype,
        name=str(meta.get("general.name", arch)),
        layer_kinds=kinds,
        sliding_window=window if AttentionKind.LOCAL in kinds else None,
        rope_local=RopeConfig(theta=float(g("rope.freq_base_swa", LOCAL_ROPE.theta))),
        query_pre_attn_scalar=1.0,
        final_logit_softcap=float(g("final_logit_softcapping", 0.0)) or None,
        global_head_dim=glob_hd,
        global_kv_heads=kv[AttentionKind.GLOBAL],
        kv_shared_layers=n_shared,
        family_config=Gemma4Config(
            per_layer_input_dim=E, per_layer_vocab_size=tensors["per_layer_token_embd.weight"].shape[0] if E else 0,
            values_from_keys=glob is not None and f"blk.{glob}.attn_v.weight" not in tensors,
            shared_kv_d_ff=ff[-1] if n_shared and ff[-1] != ff[0] else None),
    )

FAMILY = ModelFamily(
    name="gemma4", weight_specs=weight_specs, embed=embed, decoder_layers=decoder_layers, forward=forward,
    unembed=unembed, checkpoint_names=CHECKPOINT_NAMES,
    hf_architectures=HF_ARCHITECTURES, config_from_hf=config_from_hf, hf_activations=HF_ACTIVATIONS,
    hf_text_towers=HF_TEXT_TOWERS, gguf_architectures=GGUF_ARCHITECTURES, config_from_gguf=config_from_gguf,
    gguf_config_tensors=GGUF_CONFIG_TENSORS, pipeline_stages=PIPELINE_STAGES, w8a8_calibration=W8A8_CALIBRATION,
    config_class=Gemma4Config,
)
