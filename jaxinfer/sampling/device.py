"""The jitted side of sampling: ``SamplingState`` holds every row's parameters on device, so
one ``sample`` serves a batch whose rows all sample differently, plus penalties, log-probs and
the ``min_tokens`` mask. See the package docstring for the order of the transforms and why
nothing here sorts."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxinfer.errors import InvalidRequest
from jaxinfer.sampling.params import SamplingParams
from jaxinfer.sharding import per_model_shard
from pallas_kernels import sample_threshold as st

# Rows whose top-k, or whose top-p nucleus, fits in this many tokens get their threshold from a
# cheap lax.top_k; the rest fall back to bisection (~32 passes over the row).
FAST_TOPK = 64
# logits per block for block maxima (argmax, top-k candidates): one 128-lane tile of a TPU's
# (8, 128) tiling, so that blocks are read in the logits' own layout (``_block_view``)
_FINE = 128
_BLOCK = 256  # logits per block in the two-level inverse-CDF sampler; a multiple of _FINE


@dataclasses.dataclass(frozen=True)
class SamplerKernels:
    """Where the sampler's wide top-k / top-p bisections run (hashable: a static argument, so
    part of every sampler executable's cache key). pallas: the ``sample_threshold`` kernel,
    which reads a row block once for all 32 steps, instead of XLA's 32 passes over the logits
    (the engine sets it on TPU, ``dispatch.sampler_kernels``); interpret: that kernel in Pallas
    interpret mode (CPU tests); mesh: the engine's mesh, or None on one device (the kernel then
    runs inside ``shard_map`` over "model", each device on its share of the rows)."""

    pallas: bool = False
    interpret: bool = False
    mesh: Mesh | None = None


XLA_SAMPLER = SamplerKernels()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingState:
    """Per-row sampling parameters and token statistics; one row per sequence slot."""

    temperature: jax.Array  # f32[B]  0 => greedy
    top_k: jax.Array  # i32[B]  0 => off
    top_p: jax.Array  # f32[B]  1 => off
    min_p: jax.Array  # f32[B]  0 => off
    presence_penalty: jax.Array  # f32[B]
    frequency_penalty: jax.Array  # f32[B]
    repetition_penalty: jax.Array  # f32[B]
    key: jax.Array  # u32[B, 2]  raw threefry key data, a function of the row's seed only
    # The vocabulary-sized statistics only penalties read: None when no row of the batch has
    # any (``needs_vocab_state``), so a plain batch carries, reads and writes no [B, V] state.
    # None and arrays are different pytrees: each gets its own executable.
    prompt_mask: jax.Array | None  # bool[B, V]  tokens present in the prompt
    output_counts: jax.Array | None  # i32[B, V]  how often each token has been generated

    @property
    def has_vocab_state(self) -> bool:
        return self.output_counts is not None


def needs_vocab_state(p: SamplingParams) -> bool:
    """Whether a request's sampling reads the [V] token statistics (penalties)."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def with_vocab_state(state: SamplingState, vocab_size: int) -> SamplingState:
    """``state`` with zeroed [B, V] statistics added when it has none (host zeros, one transfer)."""
    if state.has_vocab_state:
        return state
    shape = state.temperature.shape + (vocab_size,)  # [B, V] (B: every replica's slots, folded)
    where = state.temperature.sharding  # placed as the rest of the state: one device, replicated or split
    mask, counts = jax.device_put((np.zeros(shape, np.bool_), np.zeros(shape, np.int32)), (where, where))
    return dataclasses.replace(state, prompt_mask=mask, output_counts=counts)


def without_vocab_state(state: SamplingState) -> SamplingState:
    return dataclasses.replace(state, prompt_mask=None, output_counts=None)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seed_to_key(seed: int) -> np.ndarray:
    """u32[2] threefry key data for a seed: [high 32 bits, low 32 bits] of ``seed mod 2**64``.

    For 0 <= seed < 2**32 this equals ``jax.random.key_data(jax.random.PRNGKey(seed))``; unlike
    PRNGKey without x64 it does not silently drop the high bits of larger seeds.
    """
    s = int(seed) & _MASK64
    return np.array([s >> 32, s & 0xFFFFFFFF], dtype=np.uint32)


def default_seed_for(default_seed: int, request_index: int) -> int:
    """The seed of a request that gave none: a hash of the engine seed and the request index."""
    return _splitmix64(_splitmix64(int(default_seed) & _MASK64) ^ (int(request_index) & _MASK64))


def make_sampling_state(
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]],
    vocab_size: int,
    *,
    default_seed: int,
    batch_size: int | None = None,
    request_indices: Sequence[int] | None = None,
    vocab_state: bool = True,
) -> SamplingState:
    """Builds the device state for a batch; rows ``len(params):batch_size`` are greedy padding.
    vocab_state False leaves out the [B, V] statistics (for rows none of which has penalties).

    A request with ``seed=None`` gets ``default_seed_for(default_seed, request_indices[i])``
    (``request_indices`` defaults to ``range(len(params))``; callers pass distinct indices), so
    its tokens depend on the request, never on the slot it lands in.
    """
    n = len(params)
    B = n if batch_size is None else batch_size
    if n > B:
        raise ValueError(f"{len(params)=} rows do not fit in {batch_size=}")
    if len(prompts) != n:
        raise ValueError(f"{len(prompts)=} must equal {len(params)=}")
    if request_indices is None:
        request_indices = range(n)
    if len(request_indices) != n:
        raise ValueError(f"{len(request_indices)=} must equal {len(params)=}")

    temperature = np.zeros(B, np.float32)
    top_k = np.zeros(B, np.int32)
    top_p = np.ones(B, np.float32)
    min_p = np.zeros(B, np.float32)
    presence = np.zeros(B, np.float32)
    frequency = np.zeros(B, np.float32)
    repetition = np.ones(B, np.float32)
    key = np.zeros((B, 2), np.uint32)
    prompt_mask = np.zeros((B, vocab_size), np.bool_) if vocab_state else None
    for row, (p, prompt, index) in enumerate(zip(params, prompts, request_indices)):
        if not p.greedy:  # greedy rows keep the neutral filters: they take the argmax anyway
            temperature[row] = p.temperature
            top_k[row] = max(p.top_k, 0)
            top_p[row] = p.top_p
            min_p[row] = p.min_p
        presence[row] = p.presence_penalty
        frequency[row] = p.frequency_penalty
        repetition[row] = p.repetition_penalty
        seed = p.seed if p.seed is not None else default_seed_for(default_seed, index)
        key[row] = seed_to_key(seed)
        ids = np.asarray(prompt, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size}), got {prompt}")
        if vocab_state:
            prompt_mask[row, ids] = True
    # built on the host and placed in one transfer: jnp.asarray / jnp.zeros would each compile
    # a small executable per shape (~30 ms apiece at start-up)
    return jax.device_put(SamplingState(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        key=key,
        prompt_mask=prompt_mask,
        output_counts=np.zeros((B, vocab_size), np.int32) if vocab_state else None,
    ))


def write_rows(state: SamplingState, rows: jax.Array, new: SamplingState) -> SamplingState:
    """Puts the rows of ``new`` (batch n) into slots ``rows`` (i32[n]) of ``state`` (batch B).

    For continuous batching: admit requests into free slots without rebuilding the batch.
    """
    return jax.tree.map(lambda old, x: old.at[rows].set(x), state, new)


# --------------------------------------------------------------------------------------------
# Device-side sampling
# --------------------------------------------------------------------------------------------


def apply_penalties(logits: jax.Array, state: SamplingState) -> jax.Array:
    """f32[B, V] -> f32[B, V] with vLLM's penalties.

    Repetition divides positive logits by the penalty and multiplies negative ones, for tokens
    seen in the prompt or the output; frequency subtracts penalty * count and presence subtracts
    the penalty once, both for output tokens only.
    """
    with jax.named_scope("penalties"):
        counts = state.output_counts  # i32[B, V]
        in_output = counts > 0  # bool[B, V]
        rp = jnp.where(state.prompt_mask | in_output, state.repetition_penalty[:, None], 1.0)
        logits = jnp.where(logits > 0, logits / rp, logits * rp)
        logits = logits - state.frequency_penalty[:, None] * counts.astype(logits.dtype)
        return logits - state.presence_penalty[:, None] * in_output.astype(logits.dtype)


def _has_penalties(state: SamplingState) -> jax.Array:
    if not state.has_vocab_state:  # no row has penalties: known when traced
        return jnp.bool_(False)
    return (
        jnp.any(state.repetition_penalty != 1.0)
        | jnp.any(state.presence_penalty != 0.0)
        | jnp.any(state.frequency_penalty != 0.0)
    )


def _rows(a: jax.Array, ndim: int) -> jax.Array:
    """Per-row values a[B] shaped to broadcast against an array of rank ndim."""
    return a.reshape(a.shape + (1,) * (ndim - 1))


def argmax_first(x: jax.Array) -> jax.Array:
    """i32[...]: first index of the maximum over x's last axis, as jnp.argmax for inputs without
    NaN, in two plain reductions: on XLA:CPU jnp.argmax's variadic (value, index) reduce is
    slower (over a 7,789-entry draft readout: ~0.1 ms of a 0.3 ms draft)."""
    n = x.shape[-1]
    m = jnp.max(x, axis=-1, keepdims=True)
    return jnp.minimum(jnp.min(jnp.where(x == m, jnp.arange(n, dtype=jnp.int32), n), axis=-1), n - 1)


def _row_group(B: int) -> int:
    """Rows of one tile in ``_block_view``: a TPU lays f32[B, V] out in tiles of 8 rows by 128
    lanes."""
    return B if B < 8 else math.gcd(B, 8)


def _block_view(xp: jax.Array, size: int = _FINE) -> jax.Array:
    """xp f32[B, Vp] as f32[B / g, Vp / size, g, size] (g = ``_row_group(B)``): block j of
    ``size`` logits (a multiple of 128) of row r at [r // g, j, r % g]. That is the order a
    TPU keeps the logits in (tile by tile, each 8 rows by 128 lanes), so reading blocks through
    it copies nothing; through [B, Vp / size, size] XLA copied all the logits into that
    layout first, once for the block maxima and once for the gathers."""
    B, Vp = xp.shape
    g = _row_group(B)
    return xp.reshape(B // g, g, Vp // size, size).transpose(0, 2, 1, 3)


def _block_sums(x: jax.Array, reduce, size: int = _FINE) -> jax.Array:
    """f32[B, Vp / size]: ``reduce`` (jnp.max, jnp.sum) over each block of x f32[B, Vp]."""
    return reduce(_block_view(x, size), axis=3).transpose(0, 2, 1).reshape(x.shape[0], -1)


def block_maxima(xp: jax.Array) -> jax.Array:
    """f32[B, Vp / _FINE]: the maximum of each block of _FINE logits of xp f32[B, Vp]. Held
    apart by an optimization barrier: XLA would otherwise fold a row maximum taken over them
    into a second pass over the logits."""
    return jax.lax.optimization_barrier(_block_sums(xp, jnp.max))


def _blocks(xp: jax.Array, blk: jax.Array, size: int = _FINE) -> jax.Array:
    """f32[B, n, size]: blocks blk i32[B, n] of ``size`` logits of each row of xp f32[B, Vp],
    gathered through ``_block_view``."""
    B = xp.shape[0]
    g = _row_group(B)
    at = blk.reshape(B // g, g, -1).transpose(0, 2, 1)[..., None]  # i32[B / g, n, g, 1]
    picked = jnp.take_along_axis(_block_view(xp, size), at, axis=1)  # f32[B / g, n, g, size]
    return picked.transpose(0, 2, 1, 3).reshape(B, -1, size)


def _argmax(xp: jax.Array, bmax: jax.Array, vocab_size: int, banned: jax.Array | None = None) -> jax.Array:
    """i32[B]: first index of the row maximum, as jnp.argmax, from the block maxima.

    xp f32[B, Vp] (padded with -inf), bmax f32[B, Vp / _FINE]. On XLA:CPU jnp.argmax's
    variadic (value, index) reduce over V is ~10x slower than this: the block maxima are needed
    anyway, and only one block per row is searched. banned: None, or i32[B, S] ids read as -inf
    (``banned_ids``; bmax must already leave them out, as ``_ban_block_maxima`` does).
    """
    m = jnp.max(bmax, axis=1, keepdims=True)  # f32[B, 1]
    NB = bmax.shape[1]
    blk = jnp.min(jnp.where(bmax == m, jnp.arange(NB), NB), axis=1)  # i32[B]
    blk = jnp.minimum(blk, NB - 1)
    inside = _blocks(xp, blk[:, None])[:, 0]
    if banned is not None:
        idx = blk[:, None] * _FINE + jnp.arange(_FINE)  # i32[B, _FINE]
        inside = jnp.where(jnp.any(idx[:, :, None] == banned[:, None, :], axis=2), -jnp.inf, inside)
    i = jnp.min(jnp.where(inside == m, jnp.arange(_FINE), _FINE), axis=1)
    return jnp.minimum(blk * _FINE + i, vocab_size - 1).astype(jnp.int32)


def _ban_block_maxima(xp: jax.Array, bmax: jax.Array, banned: jax.Array) -> jax.Array:
    """bmax f32[B, Vp / _FINE] as if the ids banned i32[B, S] were -inf in xp f32[B, Vp]: only
    the (at most S) blocks holding a banned id are read again, so no pass over the logits.
    Ids >= V (none) land in a real block, whose maximum is then rewritten unchanged."""
    B, NB = bmax.shape
    blk = jnp.minimum(banned // _FINE, NB - 1)  # i32[B, S]
    blocks = _blocks(xp, blk)  # f32[B, S, _FINE]
    idx = blk[:, :, None] * _FINE + jnp.arange(_FINE)  # i32[B, S, _FINE]
    hit = jnp.any(idx[:, :, :, None] == banned[:, None, None, :], axis=3)  # bool[B, S, _FINE]
    m = jnp.max(jnp.where(hit, -jnp.inf, blocks), axis=2)  # f32[B, S]
    return bmax.at[jnp.arange(B)[:, None], blk].set(m)  # a block named twice gets one value twice


def _largest(xp: jax.Array, bmax: jax.Array, K: int) -> jax.Array:
    """f32[B, K]: the K largest values of each row of xp (f32[B, Vp]), descending.

    The K largest values lie in the K blocks with the largest maxima, so lax.top_k runs over
    K * _FINE candidates instead of the whole row (3x faster at V=49152, more for larger V).
    """
    B = xp.shape[0]
    NB = bmax.shape[1]
    nb = min(K, NB)
    _, blocks = jax.lax.top_k(bmax, nb)  # i32[B, nb]
    cand = _blocks(xp, blocks)
    return jax.lax.top_k(cand.reshape(B, nb * _FINE), K)[0]


def _topk_topp_threshold(
    xp: jax.Array,
    bmax: jax.Array,
    t: jax.Array,
    m: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    vocab_size: int,
    *,
    fast_k: int = FAST_TOPK,
    kernels: SamplerKernels = XLA_SAMPLER,
) -> jax.Array:
    """f32[B]: tokens with z = x / t >= threshold survive top-k and then top-p (HF semantics).

    xp f32[B, Vp] penalised logits padded with -inf, bmax f32[B, Vp / _FINE] their block maxima,
    t f32[B] temperatures (> 0), m f32[B] the row max of z. Top-k keeps values >= the k-th
    largest; top-p then keeps the smallest set of the largest survivors whose renormalised mass
    reaches p. Ties at a threshold are all kept. Rows with top_k <= 0 and top_p >= 1 get -inf.
    Each row's result depends on that row only, whichever path computed it. Rows whose k or
    nucleus is wider than fast_k take an exact bisection (``pallas_kernels.sample_threshold``:
    XLA's 32 passes, or the kernel, by ``kernels``).
    """
    V = vocab_size
    K = min(fast_k, V)
    tb, mb = t[:, None], m[:, None]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)  # i32[B]
    topv = _largest(xp, bmax, K) / tb  # f32[B, K] descending, in z space

    with jax.named_scope("top_k"):
        t_k = jnp.take_along_axis(topv, jnp.clip(k - 1, 0, K - 1)[:, None], axis=1)[:, 0]
        t_k = jnp.where(k >= V, -jnp.inf, t_k)  # f32[B]
        slow_k = (k > K) & (k < V)  # bool[B]

        def bisect_k():
            return jnp.where(slow_k, _bisected(_COUNT, kernels, xp, t, k), t_k)

        t_k = jax.lax.cond(jnp.any(slow_k), bisect_k, lambda: t_k)

    with jax.named_scope("top_p"):
        z = xp / tb  # recomputed wherever used: captured by a branch, it would be written out
        target = top_p * jnp.sum(jnp.where(z >= t_k[:, None], jnp.exp(z - mb), 0.0), axis=1)
        cum = jnp.cumsum(jnp.where(topv >= t_k[:, None], jnp.exp(topv - mb), 0.0), axis=1)
        j = jnp.sum(cum < target[:, None], axis=1)  # first index reaching the target
        t_p = jnp.take_along_axis(topv, jnp.minimum(j, K - 1)[:, None], axis=1)[:, 0]
        use_p = top_p < 1.0
        slow_p = use_p & (j >= K)  # nucleus wider than the K largest

        def bisect_p():
            return jnp.where(slow_p, _bisected(_MASS, kernels, xp, t, m, target), t_p)

        t_p = jax.lax.cond(jnp.any(slow_p), bisect_p, lambda: t_p)
        return jnp.where(use_p, jnp.maximum(t_p, t_k), t_k)


_COUNT = (st.count_threshold_kernel, st.count_threshold_reference)
_MASS = (st.mass_threshold_kernel, st.mass_threshold_reference)


def _bisected(op, kernels: SamplerKernels, xp, t, *per_row) -> jax.Array:
    """f32[B]: the threshold op (``_COUNT`` or ``_MASS``: its kernel and its reference) of xp
    f32[B, Vp], t f32[B] and its per-row operands: the kernel where ``kernels`` says so and the
    rows fit it (``sample_threshold.fits``), on a mesh inside shard_map (rows split over
    "model" where that divides them), else the reference (XLA's 32 passes)."""
    kernel, reference = op
    B, Vp = xp.shape
    model = 1 if kernels.mesh is None else kernels.mesh.shape["model"]
    split = model > 1 and B % model == 0 and st.fits(B // model, Vp)
    if not kernels.pallas or not (split or st.fits(B, Vp)):
        return reference(xp, t, *per_row)
    run = lambda *a: kernel(*a, interpret=kernels.interpret)  # noqa: E731
    if kernels.mesh is not None:
        rows = PartitionSpec("model") if split else PartitionSpec()
        run = per_model_shard(run, kernels.mesh, (rows,) * (2 + len(per_row)), rows)
    return run(xp, t, *per_row)


def _pick(mass: jax.Array, r: jax.Array) -> jax.Array:
    """i32[B]: inverse CDF over mass f32[B, N] >= 0 at r f32[B] in [0, 1); never a zero entry."""
    cum = jnp.cumsum(mass, axis=1)
    i = jnp.sum(cum <= (r * cum[:, -1])[:, None], axis=1)
    # r * total can round up to the total; fall back to the last entry with mass.
    last = jnp.max(jnp.where(mass > 0, jnp.arange(mass.shape[1]), 0), axis=1)
    return jnp.minimum(i, last)


def _categorical(xp: jax.Array, weight, u: jax.Array) -> jax.Array:
    """i32[B]: index drawn with probability proportional to weight(xp), uniforms u f32[B, 2].

    xp f32[B, Vp] with Vp a multiple of _BLOCK; weight maps any [B, ..., C] slice of xp to its
    unnormalised probabilities. Inverse CDF in two levels: a block of _BLOCK entries by its mass
    with u[:, 0], then an entry in it with u[:, 1]. The weights are summed per block in one
    fused pass and recomputed for the chosen block, so no f32[B, V] array of probabilities is
    written; and short cumulative sums keep small probabilities from being rounded away, which
    one float32 cumsum over 262144 entries would do.
    """
    block = _pick(_block_sums(weight(xp), jnp.sum, _BLOCK), u[:, 0])  # i32[B]
    inside = _blocks(xp, block[:, None], _BLOCK)[:, 0]  # f32[B, _BLOCK]
    return block * _BLOCK + _pick(weight(inside), u[:, 1])


def _row_uniforms(key: jax.Array, step: jax.Array) -> jax.Array:
    """f32[B, 2] from key u32[B, 2] and step i32[B]: a function of (seed, step) only."""

    def one(k, s):
        k = jax.random.fold_in(jax.random.wrap_key_data(k, impl="threefry2x32"), s)
        return jax.random.uniform(k, (2,), jnp.float32)

    return jax.vmap(one)(key, step)


def filter_threshold(xp: jax.Array, bmax: jax.Array, state: SamplingState, vocab_size: int, *,
                     kernels: SamplerKernels = XLA_SAMPLER):
    """(t f32[B], m f32[B], thr f32[B]): each row's temperature (1 for greedy rows), the row
    max of z = xp / t, and the threshold that top-k, top-p and min-p leave: the sampler draws
    from softmax(z) over the entries with z >= thr. xp f32[B, Vp] penalised logits padded with
    -inf, bmax f32[B, Vp / _FINE] their block maxima; kernels: where wide top-k / top-p
    bisect."""
    B = xp.shape[0]
    greedy = state.temperature <= 0.0
    with jax.named_scope("filter"):
        t = jnp.where(greedy, 1.0, state.temperature)  # f32[B]
        m = jnp.max(bmax, axis=1) / t  # row max of z = x / t (division by t > 0 is monotone)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        thr = jax.lax.cond(
            jnp.any(state.top_k > 0) | jnp.any(state.top_p < 1.0),
            lambda: _topk_topp_threshold(xp, bmax, t, m, state.top_k, state.top_p, vocab_size,
                                         kernels=kernels),
            lambda: jnp.full((B,), -jnp.inf, jnp.float32),
        )
        # min-p keeps p >= min_p * p_max, i.e. z >= max + log(min_p): no sort needed, and
        # as a ratio to the max it is unchanged by the renormalisation after top-k/top-p.
        thr = jnp.maximum(thr, jnp.where(state.min_p > 0, m + jnp.log(state.min_p), -jnp.inf))
    return t, m, thr


def penalised(logits: jax.Array, state: SamplingState) -> jax.Array:
    """f32[B, V] logits with the penalties applied, skipped (same result) when no row has any."""
    logits = logits.astype(jnp.float32)
    if not state.has_vocab_state:
        return logits
    return jax.lax.cond(_has_penalties(state), lambda: apply_penalties(logits, state), lambda: logits)


def sample(logits: jax.Array, state: SamplingState, step: jax.Array, banned: jax.Array | None = None, *,
           kernels: SamplerKernels = XLA_SAMPLER) -> jax.Array:
    """i32[B] next tokens from logits f32[B, V].

    step: i32[B], the index of the token being generated within each request (0 for the first),
    folded into the row's key. Penalties, then temperature, top-k, top-p, min-p, then a
    categorical draw; greedy rows (temperature 0) take the argmax of the penalised logits.
    Each stage that no row of the batch needs is skipped with lax.cond, with identical results,
    so a row's tokens do not depend on the rest of the batch.

    banned: None, or i32[B, S] ids sampled as if their logits were -inf (ids >= V: none), as
    ``banned_ids`` gives for ``min_tokens``: the same tokens as ``mask_tokens_before_min``
    before sampling, but only the block maxima and the block the argmax reads see the ban; the
    logits are written out with it only when some row samples.

    kernels (static): where wide top-k / top-p thresholds bisect (``SamplerKernels``).
    """
    B, V = logits.shape
    logits = logits.astype(jnp.float32)
    # The cond skips reading prompt_mask and output_counts (5 bytes per logit) when no row has
    # penalties, and writes the penalised logits once instead of letting XLA fuse (and so
    # recompute) them into each of their consumers.
    x = penalised(logits, state)  # f32[B, V]
    pad = -V % _BLOCK
    xp = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf) if pad else x  # f32[B, Vp]
    bmax = block_maxima(xp)  # f32[B, Vp / _FINE]
    if banned is not None:
        bmax = _ban_block_maxima(xp, bmax, banned)
    greedy = state.temperature <= 0.0  # bool[B]

    def random_rows():
        xb = xp if banned is None else xp.at[jnp.arange(B)[:, None], banned].set(-jnp.inf, mode="drop")
        t, m, thr = filter_threshold(xb, bmax, state, V, kernels=kernels)

        def weight(xs):  # f32[B, ..., C] slice of xb -> unnormalised probabilities
            z = xs / _rows(t, xs.ndim)
            return jnp.where(z >= _rows(thr, xs.ndim), jnp.exp(z - _rows(m, xs.ndim)), 0.0)

        with jax.named_scope("categorical"):
            tokens = _categorical(xb, weight, _row_uniforms(state.key, step))
        return jax.lax.cond(
            jnp.any(greedy),
            lambda: jnp.where(greedy, _argmax(xb, bmax, V), tokens),
            lambda: tokens,
        )

    return jax.lax.cond(jnp.all(greedy), lambda: _argmax(xp, bmax, V, banned), random_rows)


def update_counts(state: SamplingState, tokens: jax.Array) -> SamplingState:
    """Adds the sampled tokens (i32[B]) to output_counts (nothing to do without them)."""
    if not state.has_vocab_state:
        return state
    B = tokens.shape[0]
    counts = state.output_counts.at[jnp.arange(B), tokens].add(1)
    return dataclasses.replace(state, output_counts=counts)


def logprobs_of(
    logits: jax.Array, tokens: jax.Array, num_top: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities under the raw model logits (vLLM's default), before any sampling step.

    logits f32[B, V], tokens i32[B], num_top static -> (chosen f32[B], top_ids i32[B, num_top],
    top_logprobs f32[B, num_top]).
    """
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # f32[B, V]
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=1)[:, 0]
    if num_top == 0:
        B = logits.shape[0]
        return chosen, jnp.zeros((B, 0), jnp.int32), jnp.zeros((B, 0), jnp.float32)
    top_lp, top_ids = jax.lax.top_k(lp, num_top)
    return chosen, top_ids.astype(jnp.int32), top_lp


# --------------------------------------------------------------------------------------------
# min_tokens
# --------------------------------------------------------------------------------------------


def min_tokens_inputs(
    params: Sequence[SamplingParams],
    eos_token_ids: Iterable[int],
    *,
    batch_size: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Host arrays for ``mask_tokens_before_min``: (stop_ids i32[B, S] padded with -1,
    min_tokens i32[B]).

    A row's stop ids are its stop_token_ids plus the EOS ids unless ignore_eos. S is a power of
    two so the number of compiled shapes stays small.
    """
    B = len(params) if batch_size is None else batch_size
    eos = tuple(eos_token_ids)
    rows = [tuple(p.stop_token_ids) + (() if p.ignore_eos else eos) for p in params]
    S = 1 << max(0, (max((len(r) for r in rows), default=1) - 1).bit_length())
    stop_ids = np.full((B, S), -1, np.int32)
    min_tokens = np.zeros(B, np.int32)
    for row, (p, ids) in enumerate(zip(params, rows)):
        stop_ids[row, : len(ids)] = ids
        min_tokens[row] = p.min_tokens
    return stop_ids, min_tokens


def mask_tokens_before_min(
    logits: jax.Array, stop_ids: jax.Array, generated_count: jax.Array, min_tokens: jax.Array
) -> jax.Array:
    """Sets stop-token logits to -inf in rows that have generated fewer than min_tokens.

    logits f32[B, V]; stop_ids either bool[B, V] or i32[B, S] padded with -1; generated_count
    i32[B] tokens generated before this step; min_tokens i32[B]. Apply before ``sample`` (not to
    the logits given to ``logprobs_of``, which reports the raw model).
    """
    B, V = logits.shape
    active = generated_count < min_tokens  # bool[B]
    if stop_ids.dtype == jnp.bool_:
        return jnp.where(stop_ids & active[:, None], -jnp.inf, logits)
    ids = banned_ids(stop_ids, generated_count, min_tokens, V)  # V is dropped below
    return logits.at[jnp.arange(B)[:, None], ids].set(-jnp.inf, mode="drop")


def banned_ids(stop_ids: jax.Array, generated_count: jax.Array, min_tokens: jax.Array, vocab_size: int) -> jax.Array:
    """i32[B, S]: the stop ids (i32[B, S], -1 padded) of rows that have generated fewer than
    min_tokens (generated_count, min_tokens i32[B]), vocab_size (none) elsewhere: ``sample``'s
    ``banned``, the ban ``mask_tokens_before_min`` writes into the logits."""
    active = generated_count < min_tokens  # bool[B]
    return jnp.where(active[:, None] & (stop_ids >= 0), stop_ids, vocab_size)


def bitmask_words(vocab_size: int) -> int:
    """Words of a token bitmask row: int32[ceil(V/32)]."""
    return -(-vocab_size // 32)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array, has_mask: jax.Array) -> jax.Array:
    """Disallowed tokens to -inf, in the rows that have a mask (structured output).

    logits f32[B, V]; bitmask i32[B, ceil(V/32)] (bit t % 32 of word t // 32 set: token t is
    allowed); has_mask bool[B]. Rows with has_mask False come back unchanged.
    """
    B, V = logits.shape
    if bitmask.shape != (B, bitmask_words(V)) or has_mask.shape != (B,):
        raise ValueError(f"{bitmask.shape=} must be ({B}, {bitmask_words(V)}) and {has_mask.shape=} ({B},) "
                         f"for {logits.shape=}")
    with jax.named_scope("apply_token_bitmask"):
        shifts = jnp.arange(32, dtype=jnp.int32)
        bits = (bitmask[:, :, None] >> shifts) & 1  # i32[B, V/32, 32]: bit j of word w is token 32w + j
        allowed = bits.reshape(B, -1)[:, :V].astype(bool) | ~has_mask[:, None]
        return jnp.where(allowed, logits, -jnp.inf)
