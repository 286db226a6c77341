"""Speculative verification on device: given the target's logits at a row's k + 1 block
positions and the k drafted tokens, how many drafts the row accepts and which token follows.

Position j of a block is shaped exactly as ``sample`` would shape the token at step
``step + j``: the ``min_tokens`` mask at that step, penalties over the output counts plus the
drafts before j (the ones that must be accepted for j to matter), temperature, top-k, top-p
and min-p. Greedy rows (temperature 0) accept the longest prefix of drafts equal to the argmax
and then take the argmax, so greedy output equals decoding without speculation token for
token. Sampled rows run rejection sampling (a point-mass draft distribution when the drafts
come without probabilities, e.g. prompt lookup), so their tokens are distributed exactly as
without speculation. A row's uniforms are a function of its seed and step only, and a row
with no drafts in a block draws with the plain sampler's own uniforms.

``draft_sample`` draws a draft model's token at one block position from the same shaping, and
returns the distribution q it drew from for ``verify_block``'s ``draft_probs``.

The accept/resample core is ``pallas_kernels.spec_verify`` (kernel or reference, chosen by
the caller's kernel mode).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxinfer.sampling.device import (
    XLA_SAMPLER,
    SamplerKernels,
    _BLOCK,
    _FINE,
    SamplingState,
    _argmax,
    _ban_block_maxima,
    _categorical,
    _has_penalties,
    apply_penalties,
    banned_ids,
    block_maxima,
    filter_threshold,
    sample,
)
from jaxinfer.sharding import per_model_shard
from pallas_kernels import spec_verify as sv
from pallas_kernels.spec_verify.common import leading

_LANES = 128  # the vocabulary is padded (with -inf) to a multiple of this
_SPEC_STREAM = 0x5BEC  # folded into a row's key: verification's uniforms, apart from sample's
_DRAFT_STREAM = 0xD2AF  # likewise for a draft model's own draws


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Verified:
    accepted: jax.Array  # i32[B] drafted tokens accepted (0..num_drafts[b])
    tokens: jax.Array  # i32[B, k+1] the accepted drafts, then the new token at index accepted; -1 after
    state: SamplingState  # output counts updated with tokens[b, :accepted + 1]


def _block_size(Vp: int) -> sv.BlockSizes:
    for c in (2048, 1024, 512, 256, 128):
        if Vp % c == 0:
            return sv.BlockSizes(c)
    raise AssertionError(Vp)


def _uniforms(key: jax.Array, step: jax.Array, J: int) -> jax.Array:
    """f32[B, J, 3] from key u32[B, 2] and step i32[B]: position j's from (seed, step + j)."""

    def one(k, s):
        k = jax.random.wrap_key_data(k, impl="threefry2x32")
        ks = jax.vmap(lambda j: jax.random.fold_in(jax.random.fold_in(k, s + j), _SPEC_STREAM))(jnp.arange(J))
        return jax.vmap(lambda kk: jax.random.uniform(kk, (3,), jnp.float32))(ks)

    return jax.vmap(one)(key, step)


def _positions(state: SamplingState, drafts: jax.Array, J: int, with_counts: bool = True) -> SamplingState:
    """The state of every block position as a batch of B * J rows: position j's output counts
    include drafts[:, :j] (with_counts=False: the row's own counts, repeated, for what reads
    every field but the counts)."""
    rep = lambda a: jnp.repeat(a, J, axis=0)
    if not state.has_vocab_state:
        return jax.tree.map(rep, state)
    B, V = state.output_counts.shape
    if with_counts:
        onehot = jax.nn.one_hot(drafts, V, dtype=jnp.int32)  # i32[B, k, V]
        before = jnp.concatenate([jnp.zeros((B, 1, V), jnp.int32), jnp.cumsum(onehot, axis=1)], axis=1)
        counts = (state.output_counts[:, None] + before).reshape(B * J, V)
    else:
        counts = rep(state.output_counts)
    return SamplingState(**{f.name: rep(getattr(state, f.name)) for f in dataclasses.fields(state)
                            if f.name != "output_counts"}, output_counts=counts)


def _penalised_block(logits, drafts, state, step, stop_ids, min_tokens):
    """(xp f32[B * J, Vp], bmax f32[B * J, Vp / _FINE], banned i32[B * J, S], flat_state): each
    block position's logits with the penalties applied, padded with -inf to a multiple of 128;
    their block maxima with the position's min_tokens ban applied (``banned_ids``: the ids that
    read as -inf, which only ``_banned`` writes into the logits); and the state of every
    position (its counts left out). The positions are rows of one [B * J, Vp] array from the
    start: on a TPU [B, J, V] pads J to a tile's 8 rows, and every reshape between the two
    forms is a copy of all the logits."""
    B, J, V = logits.shape
    flat_state = _positions(state, drafts, J, with_counts=False)
    rep = lambda a: jnp.repeat(a, J, axis=0)
    flat_step = (step[:, None] + jnp.arange(J)[None]).reshape(B * J)
    x = logits.reshape(B * J, V).astype(jnp.float32)
    banned = banned_ids(rep(stop_ids), flat_step, rep(min_tokens), V)
    # the per-position counts (a one-hot of the drafts over V) are built only when a row has
    # penalties: in the cond, not as its operand
    if state.has_vocab_state:
        x = jax.lax.cond(_has_penalties(state), lambda: apply_penalties(x, _positions(state, drafts, J)), lambda: x)
    pad = -V % max(_LANES, _FINE)
    xp = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf) if pad else x
    return xp, _ban_block_maxima(xp, block_maxima(xp), banned), banned, flat_state


def _banned(xp, banned):
    """xp f32[B, Vp] with the ids banned i32[B, S] (>= V: none) set to -inf, by comparison: a
    scatter into the logits flattens them on a TPU, a copy there and back."""
    ids = jnp.arange(xp.shape[1], dtype=jnp.int32)[None]
    hit = ids == banned[:, :1]
    for s in range(1, banned.shape[1]):
        hit = hit | (ids == banned[:, s : s + 1])
    return jnp.where(hit, -jnp.inf, xp)


def _filtered(xp, bmax, flat_state, B: int, J: int, V: int, sampler: SamplerKernels = XLA_SAMPLER):
    """(z f32[B, J, Vp], thr f32[B, J]): temperature applied, and the top-k / top-p / min-p
    threshold of each position (wide ones bisected where ``sampler`` says)."""
    t, _, thr = filter_threshold(xp, bmax, flat_state, V, kernels=sampler)
    return (xp / t[:, None]).reshape(B, J, -1), thr.reshape(B, J)


def shape_block(logits, drafts, state, step, stop_ids, min_tokens):
    """(z f32[B, J, Vp], thr f32[B, J], greedy bool[B], argmax i32[B, J]): the sampler's view of
    each block position, the vocabulary padded with -inf to a multiple of 128."""
    B, J, V = logits.shape
    xp, bmax, banned, flat_state = _penalised_block(logits, drafts, state, step, stop_ids, min_tokens)
    z, thr = _filtered(_banned(xp, banned), bmax, flat_state, B, J, V)
    return z, thr, state.temperature <= 0.0, _argmax(xp, bmax, V, banned).reshape(B, J)


def draft_sample(logits, drafts, state: SamplingState, step, stop_ids, min_tokens):
    """A draft model's token at one block position and the distribution it was drawn from:
    logits f32[B, V] (the draft's raw logits), drafts i32[B, j] the row's drafts before this
    position, step i32[B] the position's step (the row's step + j) -> (tokens i32[B],
    q f32[B, V]).

    The draft's logits are shaped exactly as the target's at this position will be (penalties
    over the output counts plus the earlier drafts, the min_tokens mask, temperature, top-k,
    top-p, min-p), so q is the draft's own sampling distribution, the q that rejection sampling
    needs. Greedy rows take the argmax (q is then their shaped softmax, which greedy
    verification never reads). The draw's uniforms come from (seed, step) on a stream of their
    own, so a row's drafts never depend on the rest of the batch."""
    B, V = logits.shape
    if state.has_vocab_state:
        V1 = jax.nn.one_hot(drafts, V, dtype=jnp.int32).sum(axis=1)  # i32[B, V]
        state = dataclasses.replace(state, output_counts=state.output_counts + V1)
    z, thr, greedy, amax = shape_block(logits[:, None], jnp.zeros((B, 0), jnp.int32), state, step, stop_ids,
                                       min_tokens)
    z, thr, amax = z[:, 0], thr[:, 0], amax[:, 0]
    pad = -z.shape[1] % _BLOCK
    z = jnp.pad(z, ((0, 0), (0, pad)), constant_values=-jnp.inf) if pad else z
    m = jnp.max(z, axis=1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)

    def weight(xs):  # f32[B, ..., C] slice of z -> unnormalised probabilities, as the verifier's p
        shape = (B,) + (1,) * (xs.ndim - 1)
        return jnp.where(xs >= thr.reshape(shape), jnp.exp(xs - m.reshape(shape)), 0.0)

    e = weight(z)[:, :V]
    q = e / jnp.sum(e, axis=1, keepdims=True)

    def one(k, s):
        k = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(k, impl="threefry2x32"), s), _DRAFT_STREAM)
        return jax.random.uniform(k, (2,), jnp.float32)

    u = jax.vmap(one)(state.key, step)
    tokens = jnp.where(greedy, amax, _categorical(z, weight, u))
    return tokens.astype(jnp.int32), q


def verify_block(logits, drafts, num_drafts, state: SamplingState, step, stop_ids, min_tokens, *,
                 draft_probs=None, use_kernel: bool = False, interpret: bool = False, platform: str | None = None,
                 mesh=None, sampler: SamplerKernels = XLA_SAMPLER) -> Verified:
    """Verify a block of drafts. logits f32[B, k+1, V] (the target's raw logits at the block's
    positions), drafts i32[B, k], num_drafts i32[B] (rows may carry fewer, even 0), step i32[B]
    tokens the row has generated before the block, stop_ids i32[B, W] / min_tokens i32[B] as in
    ``mask_tokens_before_min``, draft_probs f32[B, k, V] or None (point-mass drafts).
    use_kernel / interpret: let ``spec_verify`` dispatch (the Pallas kernel on TPU, or
    interpreted anywhere; the reference elsewhere) instead of always the reference; platform:
    where it runs ("cpu", "gpu", "tpu"; None: the default backend's); mesh: the engine's mesh,
    or None. On a mesh the kernel runs inside ``shard_map`` over "model" with the logits whole
    on every device (it streams the whole vocabulary of a row: XLA cannot partition it).
    sampler (static): where the positions' wide top-k / top-p thresholds bisect."""
    B, J, V = logits.shape
    drafts = jnp.clip(drafts, 0, V - 1).astype(jnp.int32)
    xp, bmax, banned, flat_state = _penalised_block(logits, drafts, state, step, stop_ids, min_tokens)
    amax = _argmax(xp, bmax, V, banned).reshape(B, J)
    greedy = state.temperature <= 0.0
    num_drafts = num_drafts.astype(jnp.int32)

    def greedy_rows():  # what the kernel decides for greedy rows, without its softmaxes
        ok = (drafts == amax[:, :-1]) & (jnp.arange(J - 1)[None] < num_drafts[:, None])
        a = leading(ok)
        return a, jnp.take_along_axis(amax, a[:, None], axis=1)[:, 0]

    def any_rows():
        z, thr = _filtered(_banned(xp, banned), bmax, flat_state, B, J, V, sampler)
        Vp = z.shape[-1]
        q = None
        if draft_probs is not None:
            q = jnp.pad(draft_probs.astype(jnp.float32), ((0, 0), (0, 0), (0, Vp - V))) if Vp > V else draft_probs
        u = _uniforms(state.key, step, J)
        opts = {"block_sizes": _block_size(Vp), "interpret": interpret, "platform": platform}
        if not use_kernel:
            a, nxt = sv.spec_verify_reference(z, thr, drafts, num_drafts, u, greedy, q, **opts)
        else:
            args = (z, thr, drafts, num_drafts, u, greedy, q)
            run = lambda *a: sv.spec_verify(*a, **opts)  # noqa: E731
            if mesh is not None:
                whole = jax.tree.map(lambda _: PartitionSpec(), args)
                run = per_model_shard(run, mesh, whole, (PartitionSpec(), PartitionSpec()))
            a, nxt = run(*args)
        # greedy rows take the sampler's own argmax (identical to the kernel's first maximum)
        nxt = jnp.where(greedy, jnp.take_along_axis(amax, a[:, None], axis=1)[:, 0], nxt)
        # a row without drafts draws exactly the token a plain step would (the sampler's own
        # uniforms), so whether its step ran with speculation, which depends on the other rows,
        # never changes its seeded output
        # position 0 of each row as a strided slice of the rows: logits[:, 0] of [B, J, V]
        # relays all of them out on a TPU first
        first = logits.reshape(B * J, V)[::J]
        plain = sample(first, state, step, banned_ids(stop_ids, step, min_tokens, V), kernels=sampler)
        return a, jnp.where(num_drafts == 0, plain, nxt)

    # an all-greedy block (the usual batch-1 chat) takes the argmaxes alone: no temperature,
    # filters, uniforms or softmaxes over [B, k + 1, V]
    accepted, nxt = jax.lax.cond(jnp.all(greedy), greedy_rows, any_rows)
    j = jnp.arange(J)[None]
    full = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
    tokens = jnp.where(j < accepted[:, None], full, jnp.where(j == accepted[:, None], nxt[:, None], -1))
    if state.has_vocab_state:
        at = jnp.where(tokens >= 0, tokens, V)  # -1 (not emitted) falls outside and is dropped
        counts = state.output_counts.at[jnp.arange(B)[:, None], at].add(1, mode="drop")
        state = dataclasses.replace(state, output_counts=counts)
    return Verified(accepted, tokens.astype(jnp.int32), state)
