"""Frozen configuration dataclasses, split by concern.

A ``ModelConfig`` is built from a checkpoint's own metadata (GGUF keys or HF ``config.json``)
and changed with ``dataclasses.replace``; it never reads the environment.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp


class Family(str, enum.Enum):
    LLAMA = "llama"  # Llama 1/2/3, SmolLM, Mistral (no SWA), Qwen2 (q/k/v bias)
    GEMMA3 = "gemma3"


class RopeKind(str, enum.Enum):
    DEFAULT = "default"
    LINEAR = "linear"  # positions divided by factor
    LLAMA3 = "llama3"  # Llama 3.1 frequency-dependent scaling


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: RopeKind = RopeKind.DEFAULT
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position: int = 8192  # llama3 only


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: Family
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

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.n_heads=} must be a multiple of {self.n_kv_heads=}")
        if self.head_dim % 2:
            raise ValueError(f"{self.head_dim=} must be even for rotary embeddings")

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    def num_params(self) -> int:
        from jaxinfer.models.registry import family_module

        specs = family_module(self.family).weight_specs(self)
        return sum(_prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=_is_spec))

    def kv_bytes_per_token(self, kv_dtype: str | None = None) -> int:
        itemsize = jnp.dtype(kv_dtype or self.dtype).itemsize
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * itemsize


def default_dtype() -> str:
    """float32 on CPU (XLA CPU runs bf16 ~5x slower), bfloat16 on TPU/GPU."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def _is_spec(x) -> bool:
    from jaxinfer.models.layers import WeightSpec

    return isinstance(x, WeightSpec)
