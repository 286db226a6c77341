"""Pieces every decoder family shares: norms, rotary, attention, MLPs (weight declarations:
``jaxinfer.specs``).

Shape glossary (used in einsum strings and comments everywhere):
  B batch, T query tokens, S key/value length, D model width, F MLP width, V vocab,
  N query heads, K kv heads, G query heads per kv head (N = K*G), H head dim, L layers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import dispatch
from jaxinfer.config import RopeConfig, RopeKind
from jaxinfer.einsum import einsum

# The weight declarations live in jaxinfer.specs; re-exported for existing importers.
from jaxinfer.specs import WeightSpec, init_weights, is_spec, spec_dtype, weight_key  # noqa: F401


# ----------------------------------------------------------------------------- matmul
def dot(eq: str, x: jax.Array, w) -> jax.Array:
    """einsum of an activation with a weight; the one place quantized weights and kernels plug
    in: the weight carries its kernel choice (``dispatch.bind``), plain arrays run XLA's dot."""
    return dispatch.einsum(eq, x, w)


def dot_many(x: jax.Array, *pairs: tuple[str, object]) -> tuple[jax.Array, ...]:
    """Several ``dot(eq, x, w)`` of one activation, e.g. q/k/v from one normed h:
    ``q, k, v = dot_many(h, ("BTD,DNH->BTNH", wq), ("BTD,DKH->BTKH", wk), ...)``. w8a8
    weights (smoothing folded away) share one quantization of x; anything else runs dot by dot."""
    return dispatch.einsum_many(x, *pairs)


def take(w, tokens: jax.Array) -> jax.Array:
    """Embedding rows ``w[tokens]`` -> [*tokens.shape, D]; a quantized table [V, D]
    dequantizes only the rows it looks up."""
    if isinstance(w, (jax.Array, np.ndarray)):  # (arrays have a .take of their own)
        return jnp.take(w, tokens, axis=0)
    return w.take(tokens)  # QuantArray


# ----------------------------------------------------------------------------- norms
# rms_norm and apply_rope are traced once per shape and inlined (jax.jit(inline=True)): a step
# calls each twice or more per layer, and tracing jnp's ops anew costs ~10x a cached trace; the
# program is the same, op for op
@functools.partial(jax.jit, static_argnames=("eps", "plus_one"), inline=True)
def rms_norm(x: jax.Array, w: jax.Array | None, eps: float, *, plus_one: bool = False) -> jax.Array:
    """RMSNorm in float32 (Gemma 2/3 scale by 1 + w; w None: no scale, Gemma 4's value norm)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if w is None:
        return xf.astype(x.dtype)
    wf = w.astype(jnp.float32)
    return (xf * (1.0 + wf if plus_one else wf)).astype(x.dtype)


# ----------------------------------------------------------------------------- rotary
def rope_inv_freq(head_dim: int, rope: RopeConfig) -> np.ndarray:
    """Inverse frequencies f32[R/2] (R: ``rope.rotary_dim``, head_dim unless partial), with
    linear, Llama 3, proportional or YaRN scaling and explicit per-frequency divisors
    (``rope.freq_factors``) applied."""
    dim = rope.rotary_dim or head_dim
    inv = 1.0 / (rope.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if rope.kind == RopeKind.LINEAR:
        inv = inv / rope.factor
    elif rope.kind == RopeKind.PROPORTIONAL:
        # transformers' "proportional": the first partial * H/2 frequencies keep their exponents
        # over the whole head dim, the rest are 0 (an angle of 0 leaves the pair as it is)
        rotated = int(rope.partial_rotary_factor * head_dim // 2)
        inv = np.where(np.arange(inv.shape[0]) < rotated, inv, 0.0) / rope.factor
    elif rope.kind == RopeKind.LLAMA3:
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        mid = (1 - smooth) * inv / rope.factor + smooth * inv
        inv = np.where(wavelen > low_wavelen, inv / rope.factor, np.where(wavelen < high_wavelen, inv, mid))
    elif rope.kind == RopeKind.YARN:
        inv = _yarn_inv_freq(inv, dim, rope)
    if rope.freq_factors is not None:
        if len(rope.freq_factors) != inv.shape[0]:
            raise ValueError(f"{len(rope.freq_factors)=} must equal {dim // 2=}")
        inv = inv / np.asarray(rope.freq_factors, np.float64)
    return inv.astype(np.float32)


def _yarn_inv_freq(inv: np.ndarray, dim: int, rope: RopeConfig) -> np.ndarray:
    """YaRN's frequencies, as transformers' ``_compute_yarn_parameters``: below the dim that
    turns beta_fast times over the original context they are kept, above the one that turns
    beta_slow times divided by ``factor``, linearly blended in between."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # share of each frequency left as it is
    return (inv / rope.factor) * (1 - keep) + inv * keep


def rope_table(positions: jax.Array, inv_freq: jax.Array, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) f32[B, T, R/2] of the rotary angles at positions i32[B, T], each times
    ``scale`` (``RopeConfig.attention_factor``), computed once per forward pass for every
    layer's q and k.

    XLA CPU fused sin and cos into each of their uses, evaluating them 120 times per step (3%
    of a 64-row decode step's samples), and drops an optimization barrier before fusion. A
    conditional's result cannot be fused into its users, so on CPU the table is computed inside
    one. Positions are never below -2^30, so its first branch runs; the second (sin as a
    shifted cos) is there to keep the branches apart, so that XLA does not merge them, and
    would give the same table to float32 rounding. (On GPU a conditional waits on the host.)"""
    def scaled(cos, sin):
        return (cos, sin) if scale == 1.0 else (cos * np.float32(scale), sin * np.float32(scale))

    def table(p):
        angles = p.astype(jnp.float32)[..., None] * inv_freq
        return scaled(jnp.cos(angles), jnp.sin(angles))

    def shifted(p):
        angles = p.astype(jnp.float32)[..., None] * inv_freq
        return scaled(jnp.cos(angles), jnp.cos(angles - np.float32(np.pi / 2)))

    if jax.default_backend() != "cpu":
        return table(positions)
    return jax.lax.cond(jnp.min(positions, initial=0) >= -(1 << 30), table, shifted, positions)


@functools.partial(jax.jit, inline=True)
def apply_rope(x: jax.Array, table: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotary embedding in the half-split layout. x: [B, T, n, H], table: ``rope_table``
    with R/2 angles: the first R dims of each head rotate (dim i with i + R/2), the last
    H - R pass through (partial rotary)."""
    cos, sin = (a[:, :, None, :] for a in table)
    R = 2 * cos.shape[-1]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf[..., :R], 2, axis=-1)
    rest = [xf[..., R:]] if R < x.shape[-1] else []
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, *rest], axis=-1)
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------- attention
def attention(
    q: jax.Array,  # [B, T, N, H] queries
    k: jax.Array,  # [B, K, H, S] keys, transposed; key s sits at position kpos[s]
    v: jax.Array,  # [B, K, S, H] values
    qpos: jax.Array,  # i32[B, T] position of each query
    kpos: jax.Array,  # i32[S] or i32[B, S] position of each key slot
    *,
    scale: float,
    window: jax.Array | int | None = None,  # attend to the last `window` positions only
    softcap: float | None = None,
    sinks: jax.Array | None = None,  # f32[N] a learned logit per head in every softmax denominator
    attend_to: jax.Array | None = None,  # i32[B, T] the last position each query sees (default qpos)
) -> jax.Array:  # [B, T, N, H]
    """Reference causal GQA attention: query t attends to every key with kpos <= qpos[t]
    (kpos <= attend_to[t] where given: Gemma 3's image tokens see their whole image; the
    window still counts back from qpos[t]).

    kpos is shared by every row ([S]: a dense cache) or per row ([B, S]: a ring or a
    windowed page table, where each row's slots hold different positions). A slot that holds
    no position carries ``cache.EMPTY_POS``, far in every query's future, so it is masked;
    the caches' readers zero the values of such slots (a masked weight is 0, but 0 * NaN is not).

    Keys are stored [B, K, H, S] so both contractions batch over (B, K) and stream the cache
    with S contiguous: with keys [B, K, S, H], XLA CPU's decode-time score contraction
    reduced along the minor axis and ran 6x slower. Softmax runs in float32.
    """
    B, T, N, H = q.shape
    K, G = k.shape[1], N // k.shape[1]
    # (T, G) fold into one row axis M so both contractions are plain batched matmuls over
    # (B, K); with T and G apart XLA CPU fell back to a slow generic dot.
    qm = q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, H)
    s = einsum("BKMH,BKHS->BKMS", qm.astype(jnp.float32) * scale, k.astype(jnp.float32))
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    kpos = kpos if kpos.ndim == 2 else kpos[None, :]  # i32[B or 1, S]
    delta = qpos[:, :, None] - kpos[:, None, :]  # i32[B, T, S]
    valid = delta >= 0 if attend_to is None else attend_to[:, :, None] - kpos[:, None, :] >= 0
    if window is not None:
        valid &= delta < window
    valid = jnp.repeat(valid, G, axis=1)  # bool[B, M, S], row m = t * G + g
    s = jnp.where(valid[:, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1) if sinks is None else sink_softmax(s, sink_rows(sinks, K, T))
    # A masked score's weight is exactly 0, but 0 * NaN is NaN: values in slots no query may
    # see must be finite. The caches' read_layer zeroes them inside the copy they make anyway
    # (zeroing here copied V once more: 4x the cost of the whole decode attention).
    out = einsum("BKMS,BKSH->BKMH", p, v.astype(jnp.float32))
    return out.reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4).reshape(B, T, N, H).astype(q.dtype)


def sink_rows(sinks: jax.Array, K: int, T: int) -> jax.Array:
    """Per-head sinks f32[N] as f32[K, T*G, 1], matching scores folded to rows m = t*G + g."""
    return jnp.tile(sinks.astype(jnp.float32).reshape(K, -1), (1, T))[..., None]


def sink_softmax(s: jax.Array, sink: jax.Array) -> jax.Array:
    """softmax over the last axis of scores s f32[..., S] with one more logit ``sink``
    (f32[..., 1], broadcast) in the denominator and no value of its own (gpt-oss's attention
    sinks): the weights sum to less than 1. A row whose scores are all masked gives 0."""
    m = jnp.maximum(s.max(axis=-1, keepdims=True), sink)
    p = jnp.exp(s - m)
    return p / (p.sum(axis=-1, keepdims=True) + jnp.exp(sink - m))


def cache_attention(cache, layer: int, q, qpos, end, *, scale, window=None, softcap=None, sinks=None,
                    attend_to=None):
    """Attention of q [B, T, N, H] at positions qpos over one layer of a dense KV cache
    (``cache.KVCache``) written up to end[b] -> [B, T, N, H]: the cache's reader gathers the
    rows' keys/values and the reference above runs."""
    keys, values, kpos = cache.read_layer(layer, end)
    return attention(q, keys, values, qpos, kpos, scale=scale, window=window, softcap=softcap, sinks=sinks,
                     attend_to=attend_to)


def attend_layer(cache, layer: int, q, k, v, positions, start, rope, *, read_cache: bool = True,
                 scale, window=None, softcap=None, shared: bool = False, sinks=None, attend_to=None):
    """One layer's attention for every model family: rotary (``rope``: the positions'
    ``rope_table``; None for a layer without position embeddings) on q [B, T, N, H] and k
    [B, T, K, H] at positions i32[B, T], the new keys/values written into the cache (if any) at
    start i32[B], then attention over the cache up to start + T, or, without a cache or with
    read_cache False (every row a fresh prompt from 0), over the new tokens alone.
    shared: k, v are those an earlier layer, cache layer ``layer``, computed and wrote in this
    same pass (Gemma 4's KV sharing; rotated again here, to the same numbers): attend over that
    layer's cache and write nothing. sinks: f32[N] per-head attention sinks (gpt-oss), or None.
    attend_to: i32[B, T], the last position each query sees where that is not its own (Gemma 3's
    image tokens see their whole image: ``attention``); the dense paths only.
    Returns (o [B, T, N, H], cache)."""
    if rope is not None:
        q = apply_rope(q, rope)
        k = apply_rope(k, rope)
    opts = {"scale": scale, "window": window, "softcap": softcap}
    if sinks is not None:  # only to readers that take them (a cache's ``attend`` may not)
        opts["sinks"] = sinks
    if getattr(cache, "packed", False):  # models.packed.PackedKV: a packed engine step
        if attend_to is not None:
            raise ValueError("the packed step's attention is causal: attend_to is for the dense paths")
        return cache.attend(layer, q, k, v, write=not shared, **opts)
    if attend_to is not None:
        opts["attend_to"] = attend_to
    if cache is not None:
        if not shared:
            cache = cache.write_layer(layer, k, v, start)
        if read_cache:
            return cache_attention(cache, layer, q, positions, start + q.shape[1], **opts), cache
    return attention(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), positions, positions[0], **opts), cache


def attend_latent(cache, layer: int, q, latent, positions, start, *, read_cache: bool = True, scale):
    """Multi-head latent attention of one layer in its absorbed form, as MQA over one shared
    head: queries q [B, T, N, L] (already in latent space and rotated) attend over the latent
    of every position, latent [B, T, 1, L] (L = C + R: normed c_kv, then the rotated k_rope),
    which is the key and, its first C entries, the value. The new latents are written into the
    cache's latent pool (``cache`` module doc) at start i32[B], then attention runs over the
    cache up to start + T or, as ``attend_layer``, over the new tokens alone.
    Returns (o [B, T, N, L], cache): o[..., :C] is the attention's output in latent space, the
    rest weighs the rotated keys and is dropped by the caller.
    Always the XLA readers: the native CPU and Pallas kernels read separate key and value pools."""
    if getattr(cache, "packed", False):  # models.packed.PackedKV
        return cache.attend(layer, q, latent, latent, scale=scale)
    if cache is not None:
        cache = cache.write_layer(layer, latent, latent, start)
        if read_cache:
            keys, values, kpos = cache.read_layer(layer, start + q.shape[1])
            return attention(q, keys, values, positions, kpos, scale=scale), cache
    return attention(q, latent.transpose(0, 2, 3, 1), latent.transpose(0, 2, 1, 3), positions, positions[0],
                     scale=scale), cache


# ----------------------------------------------------------------------------- MLPs
def gated_mlp(x: jax.Array, w_gate, w_up, w_down, act: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """SwiGLU (act=silu) or GeGLU (act=gelu tanh): down(act(x@gate) * (x@up))."""
    g, u = dot_many(x, ("BTD,DF->BTF", w_gate), ("BTD,DF->BTF", w_up))
    return dot("BTF,FD->BTD", act(g) * u, w_down)


def silu(x):
    return x * jax.nn.sigmoid(x)


def gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)
