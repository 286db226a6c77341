"""Frozen configuration dataclasses, split by concern.

A ``ModelConfig`` is built from a checkpoint's own metadata (GGUF keys or HF ``config.json``)
and changed with ``dataclasses.replace``; it never reads the environment.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import jax
import jax.numpy as jnp

from jaxinfer.errors import CheckpointError


class RopeKind(str, enum.Enum):
    DEFAULT = "default"
    LINEAR = "linear"  # positions divided by factor
    LLAMA3 = "llama3"  # Llama 3.1 frequency-dependent scaling
    PROPORTIONAL = "proportional"  # only the first partial_rotary_factor of the frequencies rotate (Gemma 4)
    YARN = "yarn"  # YaRN: low frequencies interpolated by factor, high ones kept, a linear ramp between


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: RopeKind = RopeKind.DEFAULT
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position: int = 8192  # llama3 and yarn
    partial_rotary_factor: float = 1.0  # proportional only: share of the H/2 frequencies that rotate
    # Explicit per-frequency divisors f32[H/2] (a GGUF's rope_freqs.weight, as llama.cpp's
    # converter writes Llama 3 scaling): inverse frequency i is divided by freq_factors[i],
    # after ``kind``'s own scaling. A tuple so the config stays hashable (a jit static).
    freq_factors: tuple[float, ...] | None = None
    # Partial rotary (Phi-4-mini's partial_rotary_factor): only the first rotary_dim dims of each
    # head rotate, half-split among themselves; the rest pass through. None: all of head_dim.
    rotary_dim: int | None = None
    # cos and sin multiplied by this (LongRoPE's sqrt(1 + ln(s) / ln(original context))), so the
    # rotated part of every score grows by its square.
    attention_factor: float = 1.0
    # YaRN (``kind`` YARN, with ``factor`` and ``original_max_position``): the ramp runs between
    # the dims that turn beta_fast and beta_slow times over the original context, rounded
    # outwards unless truncate is False (transformers' ``_compute_yarn_parameters``)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_or_default_rope(rs: dict, *, theta: float, max_position: int, family: str) -> RopeConfig:
    """Plain or YaRN rotary from a checkpoint's ``rope_parameters``/``rope_scaling`` dict, with
    transformers' defaults (``_compute_yarn_parameters``): beta_fast 32, beta_slow 1, truncate
    true, factor max_position / original when absent, and the attention factor
    0.1 ln(factor) + 1, or the ratio of mscale and mscale_all_dim's when both are given."""
    kind = rs.get("rope_type", rs.get("type")) or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind != "yarn":
        raise CheckpointError(f"unsupported rope_scaling type {kind!r} for {family} (supported: default, yarn)")
    original = int(rs["original_max_position_embeddings"])
    factor = float(rs["factor"]) if rs.get("factor") is not None else max_position / original
    attention = rs.get("attention_factor")
    if attention is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attention = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    return RopeConfig(theta=theta, kind=RopeKind.YARN, factor=factor, original_max_position=original,
                      attention_factor=float(attention), beta_fast=float(rs.get("beta_fast") or 32),
                      beta_slow=float(rs.get("beta_slow") or 1), truncate=bool(rs.get("truncate", True)))


class AttentionKind(str, enum.Enum):
    GLOBAL = "global"  # attends to every earlier position
    LOCAL = "local"  # attends to the last ``sliding_window`` positions only (Gemma 2/3)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What the engine and the shared layers read of a model. ``family`` names the family
    (``models.registry``); ``family_config`` holds that family's own knobs (its config class,
    ``ModelFamily.config_class``; None when it has none)."""

    family: str
    vocab_size: int  # V
    d_model: int  # D
    n_layers: int  # L
    n_heads: int  # N
    n_kv_heads: int  # K
    head_dim: int  # H
    d_ff: int  # F
    norm_eps: float = 1e-5
    rope: RopeConfig = RopeConfig()
    max_position: int = 2048  # the checkpoint's trained context length
    tie_embeddings: bool = True
    qkv_bias: bool = False
    dtype: str = "float32"  # weights and activations; attention softmax is always float32
    name: str = ""
    # Attention variants (Gemma 2/3); the defaults are plain global causal attention.
    layer_kinds: tuple[AttentionKind, ...] = ()  # one per layer; () means all GLOBAL
    sliding_window: int | None = None  # W: a LOCAL layer's query at p sees keys p-W+1 .. p
    rope_local: RopeConfig | None = None  # rotary of LOCAL layers (None: the same as ``rope``)
    query_pre_attn_scalar: float | None = None  # scores scaled by this**-0.5 (None: head_dim)
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # output logits -> cap * tanh(logits / cap)
    # Layers that apply no rotary embedding to q and k (SmolLM3's NoPE layers): model layer indices.
    nope_layers: tuple[int, ...] = ()
    # Mixture of experts (Mixtral, Qwen3-MoE): each layer's MLP is n_experts experts of width
    # moe_d_ff (models.moe), n_experts_per_tok of them per token. 0 experts: a dense MLP.
    n_experts: int = 0  # E
    n_experts_per_tok: int = 0  # k
    moe_d_ff: int = 0  # F of one expert
    norm_topk_prob: bool = True  # the k routing weights rescaled to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP of width d_ff instead (Qwen3-MoE)
    # Per-layer attention shapes and shared keys/values (Gemma 4); the defaults give every layer
    # n_kv_heads x head_dim and a cache of its own. The engine reads them through layer_head_dim,
    # layer_kv_heads and kv_source.
    global_head_dim: int | None = None  # H of GLOBAL layers (None: head_dim)
    global_kv_heads: int | None = None  # K of GLOBAL layers (None: n_kv_heads)
    # the last kv_shared_layers layers compute no keys/values: each attends over those of the last
    # earlier layer of its own kind, and has no cache of its own
    kv_shared_layers: int = 0
    # Multi-head latent attention (DeepSeek-V3, models.deepseek_v3). kv_lora_rank C > 0: every
    # layer caches one latent per token, C normed values and the qk_rope_head_dim R roped key
    # values shared by all heads, instead of per-head keys and values (the cache's one KV "head"
    # of width C + R); heads' keys are qk_nope_head_dim + R wide, their values v_head_dim.
    kv_lora_rank: int = 0  # C
    qk_rope_head_dim: int = 0  # R
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # the family's own knobs: an instance of its ModelFamily.config_class (frozen, hashable)
    family_config: object = None

    def __post_init__(self):
        if self.n_experts and not 0 < self.n_experts_per_tok <= self.n_experts:
            raise ValueError(f"{self.n_experts_per_tok=} must be in [1, {self.n_experts=}]")
        if self.layer_kinds:
            if len(self.layer_kinds) != self.n_layers:
                raise ValueError(f"{len(self.layer_kinds)=} must equal {self.n_layers=}")
            object.__setattr__(self, "layer_kinds", tuple(AttentionKind(k) for k in self.layer_kinds))
            if AttentionKind.LOCAL in self.layer_kinds and not (self.sliding_window or 0) > 0:
                raise ValueError(f"LOCAL layers need a positive sliding_window, got {self.sliding_window=}")
        for K, H in {(self.layer_kv_heads(i), self.layer_head_dim(i)) for i in range(self.n_layers)}:
            if self.n_heads % K:
                raise ValueError(f"{self.n_heads=} must be a multiple of every layer's KV heads, got {K}")
            if H % 2:
                raise ValueError(f"head dim {H} must be even for rotary embeddings")
        if not 0 <= self.kv_shared_layers < self.n_layers:
            raise ValueError(f"{self.kv_shared_layers=} must be in [0, {self.n_layers=})")
        first = self.n_layers - self.kv_shared_layers
        owners = {self.layer_kind(i) for i in range(first)}
        if any(self.layer_kind(i) not in owners for i in range(first, self.n_layers)):
            raise ValueError(f"each of the last {self.kv_shared_layers} layers needs an earlier layer of its kind "
                             "to share keys/values with")

    def layer_kind(self, layer: int) -> AttentionKind:
        return self.layer_kinds[layer] if self.layer_kinds else AttentionKind.GLOBAL

    def layer_window(self, layer: int) -> int | None:
        """How many trailing positions layer ``layer`` attends to (None: all of them). A cache
        may keep only this many positions of such a layer."""
        return self.sliding_window if self.layer_kind(layer) == AttentionKind.LOCAL else None

    @property
    def latent_attention(self) -> bool:
        """Multi-head latent attention: each layer caches one latent head of
        kv_lora_rank + qk_rope_head_dim values per token (``kv_lora_rank``)."""
        return self.kv_lora_rank > 0

    def layer_head_dim(self, layer: int) -> int:
        """H of layer ``layer``'s queries, keys and values (with latent attention: of the
        latent the cache holds, which the absorbed queries match)."""
        if self.latent_attention:
            return self.kv_lora_rank + self.qk_rope_head_dim
        if self.global_head_dim and self.layer_kind(layer) == AttentionKind.GLOBAL:
            return self.global_head_dim
        return self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        """K of layer ``layer`` (its query heads are always n_heads; one latent head with
        latent attention)."""
        if self.latent_attention:
            return 1
        if self.global_kv_heads and self.layer_kind(layer) == AttentionKind.GLOBAL:
            return self.global_kv_heads
        return self.n_kv_heads

    def kv_source(self, layer: int) -> int:
        """The layer whose keys/values (and cache) layer ``layer`` attends over: itself, or for
        one of the last ``kv_shared_layers``, the last earlier layer of its kind. A layer whose
        source is another has no cache of its own."""
        first = self.n_layers - self.kv_shared_layers
        if layer < first:
            return layer
        kind = self.layer_kind(layer)
        return max(j for j in range(first) if self.layer_kind(j) == kind)

    def layer_rope(self, layer: int) -> RopeConfig:
        if self.layer_kind(layer) == AttentionKind.LOCAL and self.rope_local is not None:
            return self.rope_local
        return self.rope

    @property
    def attn_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    def kv_bytes_per_token(self, kv_dtype: str | None = None, *, kind: AttentionKind | None = None,
                           lanes: int = 1) -> int:
        """KV bytes one token adds to a cache that keeps every position of every layer (or,
        with ``kind``, of the layers of that kind only); a layer that shares another's keys
        and values adds none. int8 KV stores a float32 scale per (token, head) beside the
        head_dim int8 values. lanes: the head dim as the pools store it, padded to a multiple
        of this (``cache.init_paged_cache``; 128 on a TPU)."""
        return sum(self._layer_kv_bytes(i, kv_dtype, lanes) for i in range(self.n_layers)
                   if kind is None or self.layer_kind(i) == kind)

    def _layer_kv_bytes(self, layer: int, kv_dtype: str | None, lanes: int = 1) -> int:
        """KV bytes one token adds to layer ``layer``'s own cache (0: it shares another's)."""
        if self.kv_source(layer) != layer:
            return 0
        if kv_dtype in (None, "auto"):
            kv_dtype = self.dtype
        H = -(-self.layer_head_dim(layer) // lanes) * lanes
        per_head = H + 4 if kv_dtype == "int8" else H * jnp.dtype(kv_dtype).itemsize
        # latent attention stores its one latent once: the values are its first C entries
        return (1 if self.latent_attention else 2) * self.layer_kv_heads(layer) * per_head

    def kv_values_per_token(self, layer: int = 0, *, expanded: bool = False) -> int:
        """Values one token adds to layer ``layer``'s cache: K * H keys and as many values
        (one latent of C + R with latent attention); expanded: what a latent layer's keys and
        values would take per head, n_heads * (qk_nope_head_dim + R + v_head_dim)."""
        if not self.latent_attention:
            return 2 * self.layer_kv_heads(layer) * self.layer_head_dim(layer)
        if expanded:
            return self.n_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        return self.kv_lora_rank + self.qk_rope_head_dim

    def latent_kv_report(self, kv_dtype: str | None = None) -> dict | None:
        """What latent attention saves (``LLM.memory_report``'s "kv_latent"; None without it):
        values and bytes one token adds to one layer's cache, as the latent and as the per-head
        keys and values it stands for."""
        if not self.latent_attention:
            return None
        expanded = self.kv_values_per_token(expanded=True)
        dt = self.dtype if kv_dtype in (None, "auto") else kv_dtype
        # int8: a float32 scale per (token, head) of keys and of values
        per_layer = expanded + 4 * 2 * self.n_heads if dt == "int8" else expanded * jnp.dtype(dt).itemsize
        return {"values_per_token_layer": self.kv_values_per_token(), "expanded_values_per_token_layer": expanded,
                "bytes_per_token": self.kv_bytes_per_token(kv_dtype),
                "expanded_bytes_per_token": self.n_layers * per_layer}

    def kv_bytes(self, seq_len: int, kv_dtype: str | None = None, *, windowed: bool = True) -> int:
        """KV bytes one sequence of ``seq_len`` tokens needs when every layer keeps only the
        positions it can still attend to (``windowed``: LOCAL layers the last W), or every
        position (a dense cache). The paged engine's windowed pool holds this plus page
        rounding: up to two pages per LOCAL layer (see engine.scheduler.window_pool_pages)."""
        total = 0
        for i in range(self.n_layers):
            w = self.layer_window(i) if windowed else None
            total += (seq_len if w is None else min(seq_len, w)) * self._layer_kv_bytes(i, kv_dtype)
        return total


def default_dtype() -> str:
    """float32 on CPU (XLA CPU runs bf16 ~5x slower), bfloat16 on TPU/GPU."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"
