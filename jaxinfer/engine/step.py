"""The jitted engine steps: one packed step per scheduler iteration, the one sampling step,
and placing a sequence into a decode slot.

``packed_step`` runs the model once over a ``models.packed.PackedBatch`` (decode rows plus a
packed prefill row), samples one token for every decode row, and returns the page pools and
the per-slot device state, both donated. The kernel mode is a static argument, so it is part
of the executable's cache key.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer import kernels
from jaxinfer import sampling as smp
from jaxinfer.engine.pipeline import pipeline_forward
from jaxinfer.models.packed import PackedBatch, PackedKV
from jaxinfer.models import medusa
from jaxinfer.models.registry import family_module

STOP_ID_WIDTH = 16  # per-row stop ids masked before min_tokens (EOS ids + stop_token_ids)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """What the device keeps per decode slot between steps (S = max_num_seqs)."""

    sampling: smp.SamplingState  # parameters, keys, prompt mask and output counts
    last_tokens: jax.Array  # i32[S] the token each slot's previous step sampled
    stop_ids: jax.Array  # i32[S, STOP_ID_WIDTH] ids masked before min_tokens, -1 padded
    min_tokens: jax.Array  # i32[S]
    generated: jax.Array  # i32[S] tokens sampled so far (the step index of the next sample)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOutput:
    tokens: jax.Array | None  # i32[R] the token sampled for each decode row
    logprobs: tuple | None  # (chosen f32[R], rank i32[R], top ids i32[R, n], top logprobs f32[R, n])
    row_logits: jax.Array | None  # f32[R, q, V] every query's logits, when q > 1 (verification)
    prompt_logprobs: tuple | None  # (chosen f32[Tp], rank i32[Tp], top ids, top logprobs) of the prefill row


def make_slots(vocab_size: int, max_num_seqs: int, seed: int) -> SlotState:
    S = max_num_seqs
    return SlotState(smp.make_sampling_state([], [], vocab_size, default_seed=seed, batch_size=S),
                     jnp.zeros(S, jnp.int32), jnp.full((S, STOP_ID_WIDTH), -1, jnp.int32),
                     jnp.zeros(S, jnp.int32), jnp.zeros(S, jnp.int32))


def insert_step(slots: SlotState, slot, row: SlotState) -> SlotState:
    """Place one sequence's slot state (batch 1) into slot ``slot``."""
    return jax.tree.map(lambda a, r: a.at[slot].set(r[0]), slots, row)


def sample_step(logits, state, step, stop_ids, min_tokens, num_logprobs, guide=None):
    """The one sampling step of both engines: logits f32[B, V] -> tokens i32[B], logprobs
    (or None when num_logprobs < 0), and the state with the new tokens counted.

    guide: None (no row is constrained: no mask work at all), or (bitmask i32[B, V/32],
    has_mask bool[B]), the structured-output rows' allowed tokens."""
    masked = smp.mask_tokens_before_min(logits, stop_ids, step, min_tokens)
    if guide is not None:
        masked = smp.apply_token_bitmask(masked, *guide)
    tokens = smp.sample(masked, state, step)
    state = smp.update_counts(state, tokens)
    if num_logprobs < 0:  # logprobs not requested by any row: skip the log-softmax
        return tokens, None, state
    chosen, top_ids, top_lp = smp.logprobs_of(logits, tokens, num_logprobs)
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=1)
    rank = 1 + jnp.sum(logits > picked, axis=-1)  # rank under the raw model, as vLLM reports
    return tokens, (chosen, rank, top_ids, top_lp), state


def token_logprobs(logits, targets, num_top: int):
    """Teacher-forced logprobs: logits f32[T, V], targets i32[T] (-1: none) -> (chosen f32[T],
    rank i32[T], top ids i32[T, n], top logprobs f32[T, n])."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(lp, jnp.maximum(targets, 0)[:, None], axis=1)[:, 0]
    ranks = 1 + jnp.sum(lp > chosen[:, None], axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, max(num_top, 1))
    return chosen, ranks, top_ids[:, :num_top], top_lp[:, :num_top]


def packed_step(weights, batch: PackedBatch, k_pages, v_pages, slots: SlotState, guide=None, *, cfg, windowed,
                num_logprobs: int, prompt_logprobs: int, kernel_mode: kernels.KernelMode, pipeline=None):
    """One scheduler iteration on device -> (StepOutput, k_pages, v_pages, slots).

    pipeline: None, or an ``engine.pipeline.PipelineLayout`` (static): the layers then run as
    pipeline stages over micro-batches, with weights and pools stacked by stage.

    guide: None, or (bitmask i32[R, V/32], has_mask bool[R]) for the decode rows when any is
    constrained (structured output). None and arrays are different pytrees, so a batch with
    no constrained row runs an executable without the mask.

    Decode row r is slot r. Its first query token is the host's, or, where use_prev, the
    token the previous step sampled for that slot (still on device: the host reads it while
    this step runs)."""
    with kernels.traced_with(kernel_mode):
        mod = family_module(cfg.family)
        R, Q = batch.rows, batch.q
        tokens = batch.tokens
        if R:
            first = jnp.where(batch.use_prev, slots.last_tokens[:R], tokens[0 : R * Q : Q])
            tokens = tokens.at[0 : R * Q : Q].set(first)
        use_kernels = kernel_mode != kernels.KernelMode.OFF
        if pipeline is None:
            cache = PackedKV(k_pages, v_pages, batch, windowed, use_kernels)
            h, cache = mod.forward(weights, tokens[None], None, cache, cfg=cfg, positions=batch.positions[None])
            k_pages, v_pages = cache.k, cache.v
        else:
            h, k_pages, v_pages = pipeline_forward(pipeline, weights, tokens, batch, k_pages, v_pages, cfg=cfg,
                                                   use_kernels=use_kernels)
        new = lp = row_logits = plp = None
        if R:
            with jax.named_scope("sample"):
                hd = h[0, : R * Q].reshape(R, Q, -1)
                if Q > 1:
                    row_logits = mod.unembed(weights, hd, cfg)  # f32[R, Q, V]
                    logits = jnp.take_along_axis(row_logits, batch.last_q[:, None, None], axis=1)[:, 0]
                else:
                    logits = mod.unembed(weights, hd, cfg)[:, 0]
                sub = jax.tree.map(lambda a: a[:R], slots)
                new, lp, sampling = sample_step(logits, sub.sampling, sub.generated, sub.stop_ids,
                                                sub.min_tokens, num_logprobs, guide)
                upd = SlotState(sampling, new, sub.stop_ids, sub.min_tokens, sub.generated + 1)
                # idle slots (and ones still prefilling) keep their state: seeds and penalties
                # must not see steps they took no part in
                keep = lambda n, o: jnp.where(batch.active.reshape((R,) + (1,) * (n.ndim - 1)), n, o)  # noqa: E731
                sub = jax.tree.map(keep, upd, sub)
                slots = jax.tree.map(lambda a, s: a.at[:R].set(s), slots, sub)
        if prompt_logprobs >= 0 and batch.prefill_len:
            with jax.named_scope("prompt_logprobs"):
                logits = mod.unembed(weights, h[:, R * Q :], cfg)[0]
                plp = token_logprobs(logits, batch.targets, prompt_logprobs)
    return StepOutput(new, lp, row_logits, plp), k_pages, v_pages, slots


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecOutput:
    tokens: jax.Array  # i32[R, q] each row's accepted drafts, then its new token; -1 after
    accepted: jax.Array  # i32[R] drafts accepted per row
    logprobs: tuple | None  # (chosen f32[R, q], rank i32[R, q], top ids i32[R, q, n], top logprobs f32[R, q, n])
    prompt_logprobs: tuple | None
    next_drafts: jax.Array | None = None  # i32[R, K] medusa: the heads' drafts for each row's next block


def _early_exit_drafts(mod, weights, batch: PackedBatch, k_pages, v_pages, *, cfg, windowed, use_kernels,
                       num_layers: int):
    """Fill each decode row's draft columns with the greedy tokens of the model's first
    num_layers layers (plus final norm and head), one position at a time; their keys and
    values go to the same pages the verification pass then rewrites -> (tokens i32[N], pools)."""
    R, Q = batch.rows, batch.q
    toks = batch.tokens[: R * Q].reshape(R, Q)
    pos = batch.positions[: R * Q].reshape(R, Q)
    wp = batch.write_page[: R * Q].reshape(R, Q)
    wwp = batch.write_wpage[: R * Q].reshape(R, Q)
    head = dict(weights, layers=weights["layers"][:num_layers])
    none = jnp.zeros(0, jnp.int32)
    cur, drafts = toks[:, 0], []
    for j in range(Q - 1):
        sub = PackedBatch(tokens=cur, positions=pos[:, j], write_page=wp[:, j], write_wpage=wwp[:, j],
                          active=batch.active, use_prev=jnp.zeros(R, bool), last_q=jnp.zeros(R, jnp.int32),
                          table=batch.table, wtable=batch.wtable, wbase=batch.wbase, seg=none,
                          hist_end=jnp.int32(0), targets=none, rows=R, q=1)
        cache = PackedKV(k_pages, v_pages, sub, windowed, use_kernels)
        h, cache = mod.forward(head, cur[None], None, cache, cfg=cfg, positions=pos[None, :, j])
        k_pages, v_pages = cache.k, cache.v
        cur = jnp.argmax(mod.unembed(weights, h[0][:, None], cfg)[:, 0], axis=-1).astype(jnp.int32)
        drafts.append(cur)
    toks = toks.at[:, 1:].set(jnp.stack(drafts, axis=1))
    return batch.tokens.at[: R * Q].set(toks.reshape(-1)), k_pages, v_pages


def spec_step(weights, batch: PackedBatch, k_pages, v_pages, slots: SlotState, heads=None, guide=None, *,
              cfg, windowed,
              num_logprobs: int, prompt_logprobs: int, kernel_mode: kernels.KernelMode, draft_layers: int = 0):
    """One speculative scheduler iteration -> (SpecOutput, k_pages, v_pages, slots).

    Decode row r (slot r) carries q = k + 1 queries: its last token, then its drafts
    (``batch.last_q[r]`` of them are real; the rest write to the scratch page). With
    draft_layers > 0 the drafts are made here first (early exit). One forward pass over every
    row and the prefill row, then ``sampling.verify_block`` accepts a prefix of each row's
    drafts and adds one token; the slot state advances by what was emitted. With Medusa
    ``heads``, their logits come out of the same LM-head matmul as the verification logits,
    and those at each row's accepted position are its next block's drafts. guide: None, or the
    structured-output masks of every block position (bitmask i32[R, q, V/32], has_mask bool[R]),
    applied to the logits verification reads (logprobs stay the raw model's)."""
    with kernels.traced_with(kernel_mode):
        mod = family_module(cfg.family)
        R, Q = batch.rows, batch.q
        use_kernels = kernel_mode != kernels.KernelMode.OFF
        tokens = batch.tokens
        if draft_layers:
            with jax.named_scope("early_exit_draft"):
                tokens, k_pages, v_pages = _early_exit_drafts(mod, weights, batch, k_pages, v_pages, cfg=cfg,
                                                              windowed=windowed, use_kernels=use_kernels,
                                                              num_layers=draft_layers)
            batch = dataclasses.replace(batch, tokens=tokens)
        cache = PackedKV(k_pages, v_pages, batch, windowed, use_kernels)
        h, cache = mod.forward(weights, tokens[None], None, cache, cfg=cfg, positions=batch.positions[None])
        with jax.named_scope("verify"):
            hd = h[0, : R * Q].reshape(R, Q, -1)
            if heads is None:
                row_logits = mod.unembed(weights, hd, cfg)  # f32[R, Q, V]
            else:  # one matmul for the verification logits and every head at every position
                hk = medusa.head_hidden(heads, hd).astype(hd.dtype)  # [R, Q, K, D]
                x = jnp.concatenate([hd[:, :, None], hk], axis=2)  # [R, Q, 1 + K, D]
                both = mod.unembed(weights, x.reshape(R, -1, x.shape[-1]), cfg).reshape(x.shape[:3] + (-1,))
                row_logits, head_logits = both[:, :, 0], both[:, :, 1:]  # f32[R, Q, V], f32[R, Q, K, V]
            sub = jax.tree.map(lambda a: a[:R], slots)
            drafts = tokens[: R * Q].reshape(R, Q)[:, 1:]
            shaped = row_logits
            if guide is not None:
                bm, has = guide
                V = row_logits.shape[-1]
                shaped = smp.apply_token_bitmask(row_logits.reshape(R * Q, V), bm.reshape(R * Q, -1),
                                                 jnp.repeat(has, Q)).reshape(R, Q, V)
            ver = smp.verify_block(shaped, drafts, batch.last_q, sub.sampling, sub.generated, sub.stop_ids,
                                   sub.min_tokens, use_kernel=use_kernels,
                                   interpret=kernel_mode == kernels.KernelMode.INTERPRET)
            new_last = jnp.take_along_axis(ver.tokens, ver.accepted[:, None], axis=1)[:, 0]
            next_drafts = None
            if heads is not None:
                at = jnp.take_along_axis(head_logits, ver.accepted[:, None, None, None], axis=1)[:, 0]
                next_drafts = jnp.argmax(at, axis=-1).astype(jnp.int32)  # i32[R, K]
            upd = SlotState(ver.state, new_last, sub.stop_ids, sub.min_tokens, sub.generated + ver.accepted + 1)
            keep = lambda n, o: jnp.where(batch.active.reshape((R,) + (1,) * (n.ndim - 1)), n, o)  # noqa: E731
            sub = jax.tree.map(keep, upd, sub)
            slots = jax.tree.map(lambda a, s: a.at[:R].set(s), slots, sub)
        lp = plp = None
        if num_logprobs >= 0:
            flat = row_logits.reshape(R * Q, -1)
            toks = jnp.maximum(ver.tokens.reshape(-1), 0)
            chosen, top_ids, top_lp = smp.logprobs_of(flat, toks, num_logprobs)
            picked = jnp.take_along_axis(flat, toks[:, None], axis=1)
            rank = 1 + jnp.sum(flat > picked, axis=-1)
            lp = tuple(a.reshape((R, Q) + a.shape[1:]) for a in (chosen, rank, top_ids, top_lp))
        if prompt_logprobs >= 0 and batch.prefill_len:
            with jax.named_scope("prompt_logprobs"):
                logits = mod.unembed(weights, h[:, R * Q :], cfg)[0]
                plp = token_logprobs(logits, batch.targets, prompt_logprobs)
    return SpecOutput(ver.tokens, ver.accepted, lp, plp, next_drafts), cache.k, cache.v, slots
