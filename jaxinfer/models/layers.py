"""Pieces every decoder family shares: weight declarations, norms, rotary, attention, MLPs.

Shape glossary (used in einsum strings and comments everywhere):
  B batch, T query tokens, S key/value length, D model width, F MLP width, V vocab,
  N query heads, K kv heads, G query heads per kv head (N = K*G), H head dim, L layers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig, RopeConfig, RopeKind


# ----------------------------------------------------------------------------- declarations
@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """One declaration per weight: initialisation, eval_shape, sharding and loading derive
    from it."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, one per dim ("embed", "q_heads", ...)
    init: str = "normal"  # "normal" | "ones" | "zeros"
    dtype: str | None = None  # None: the model's dtype

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"{self.shape=} and {self.axes=} differ in rank")


def is_spec(x) -> bool:
    return isinstance(x, WeightSpec)


def spec_dtype(spec: WeightSpec, cfg: ModelConfig):
    return jnp.dtype(spec.dtype or cfg.dtype)


def abstract_weights(specs, cfg: ModelConfig):
    """ShapeDtypeStructs for every weight (what jax.eval_shape of init would give)."""
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, spec_dtype(s, cfg)), specs, is_leaf=is_spec
    )


def init_weights(specs, cfg: ModelConfig, key: jax.Array, scale: float = 0.02):
    """Random weights for tests and tiny configs: normal(0, scale), ones or zeros per spec."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))
    out = []
    for spec, k in zip(leaves, keys):
        dt = spec_dtype(spec, cfg)
        if spec.init == "ones":
            out.append(jnp.ones(spec.shape, dt))
        elif spec.init == "zeros":
            out.append(jnp.zeros(spec.shape, dt))
        else:
            out.append((scale * jax.random.normal(k, spec.shape, jnp.float32)).astype(dt))
    return jax.tree.unflatten(treedef, out)


# ----------------------------------------------------------------------------- matmul
def dot(eq: str, x: jax.Array, w) -> jax.Array:
    """einsum of an activation with a weight; the one place quantized weights plug in."""
    if hasattr(w, "einsum"):  # QuantArray and friends implement their own contraction
        return w.einsum(eq, x)
    return jnp.einsum(eq, x, w.astype(x.dtype) if w.dtype != x.dtype else w)


# ----------------------------------------------------------------------------- norms
def rms_norm(x: jax.Array, w: jax.Array, eps: float, *, plus_one: bool = False) -> jax.Array:
    """RMSNorm in float32 (Gemma scales by 1 + w)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    wf = w.astype(jnp.float32)
    return (xf * (1.0 + wf if plus_one else wf)).astype(x.dtype)


# ----------------------------------------------------------------------------- rotary
def rope_inv_freq(head_dim: int, rope: RopeConfig) -> np.ndarray:
    """Inverse frequencies f32[H/2], with linear or Llama 3 scaling applied."""
    inv = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if rope.kind == RopeKind.LINEAR:
        inv = inv / rope.factor
    elif rope.kind == RopeKind.LLAMA3:
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        mid = (1 - smooth) * inv / rope.factor + smooth * inv
        inv = np.where(wavelen > low_wavelen, inv / rope.factor, np.where(wavelen < high_wavelen, inv, mid))
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding in the half-split layout. x: [B, T, n, H], positions: i32[B, T]."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # f32[B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------- attention
def attention(
    q: jax.Array,  # [B, T, N, H] queries at positions start + t
    k: jax.Array,  # [B, T, K, H] keys of the same tokens
    v: jax.Array,  # [B, T, K, H]
    start: jax.Array,  # i32[B] position of the first query token of each row
    k_cache: jax.Array | None = None,  # [B, S, K, H] entry s holds position s
    v_cache: jax.Array | None = None,
    *,
    scale: float,
    window: jax.Array | int | None = None,  # attend to the last `window` positions only
    softcap: float | None = None,
) -> jax.Array:  # [B, T, N, H]
    """Reference attention over a dense cache plus the new tokens, causal, GQA.

    The cache part covers positions < start (what earlier calls wrote); the new part is
    causal among the T tokens. Softmax runs in float32 over both parts together, so the
    result is exactly full causal attention over positions <= start + t.
    """
    B, T, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, N // K, H).astype(jnp.float32) * scale
    qpos = start[:, None] + jnp.arange(T)  # i32[B, T]

    def scores(keys, kpos, valid):  # keys [B, S, K, H], kpos i32[B?, S], valid bool[B, T, S]
        s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, keys.astype(jnp.float32))
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        if window is not None:
            valid = valid & (qpos[:, :, None] - kpos < window)
        return jnp.where(valid[:, None, None], s, -jnp.inf)

    t = jnp.arange(T)
    kpos_new = qpos  # i32[B, T]
    parts = [scores(k, kpos_new[:, None, :], jnp.broadcast_to(t[None, :, None] >= t[None, None, :], (B, T, T)))]
    values = [v]
    if k_cache is not None:
        S = k_cache.shape[1]
        kpos_c = jnp.arange(S)
        valid_c = jnp.broadcast_to(kpos_c[None, None, :] < start[:, None, None], (B, T, S))
        parts.insert(0, scores(k_cache, kpos_c[None, None, :], valid_c))
        values.insert(0, v_cache)
    s = jnp.concatenate(parts, axis=-1)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - m)
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    vals = jnp.concatenate(values, axis=1).astype(jnp.float32)  # [B, S+T, K, H]
    out = jnp.einsum("BKGTS,BSKH->BTKGH", p, vals)
    return out.reshape(B, T, N, H).astype(q.dtype)


# ----------------------------------------------------------------------------- MLPs
def gated_mlp(x: jax.Array, w_gate, w_up, w_down, act: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """SwiGLU (act=silu) or GeGLU (act=gelu tanh): down(act(x@gate) * (x@up))."""
    g = dot("BTD,DF->BTF", x, w_gate)
    u = dot("BTD,DF->BTF", x, w_up)
    return dot("BTF,FD->BTD", act(g) * u, w_down)


def silu(x):
    return x * jax.nn.sigmoid(x)


def gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)
