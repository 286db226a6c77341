"""The one jitted engine step (``packed_step``) and the one sampling step (``sample_rows``).

``packed_step`` runs the model once over a ``models.packed.PackedBatch`` (decode rows plus a
packed prefill row) and takes the engine's device state (``state.EngineState``: page pools,
per-slot state, the drafter's pools) donated, returning it advanced. A plain step samples one
token for every decode row. A verification step is the same step with a draft block
(``verify.DraftBlock``): each decode row carries drafts, which are made on device first where
the method does so (``verify.draft``), verified instead of sampled (``verify.verify``), and
then it may emit several tokens per row. Everything else is the one path: the forward pass
(or its pipeline stages), the slot update, logprobs and their ranks, prompt logprobs, and the
EAGLE head's entries of every token computed. Chains of decode steps (``chaining``) and
data-parallel replicas (``replicas``) wrap it. The kernel choice (``dispatch.Kernels``) is a
static argument, so it is part of the executable's cache key.

A plain step may leave its sampling to an executable of its own (``sample=False``, then
``sample_rows``): the sampler's compile depends only on the row count and the sampling options,
so on an accelerator, where each step executable took its own copy of it to compile, one
sampler per row bucket serves every step shape (``Engine`` decides, ``EngineConfig.separate_sampler``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer import lora as lora_mod
from jaxinfer import sampling as smp
from jaxinfer.dispatch import XLA, Kernels, sampler_kernels
from jaxinfer.engine import branches, verify
from jaxinfer.engine.pipeline import pipeline_forward
from jaxinfer.engine.slots import SlotState
from jaxinfer.engine.state import EngineState
from jaxinfer.models.packed import PackedBatch, PackedKV
from jaxinfer.models.registry import model_family


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    """What one step reads besides the target's weights and the device state (nothing here is
    donated). guide: None (no row is constrained: no mask work at all), or the structured-output
    masks of the decode rows: (bitmask i32[R, V/32], has_mask bool[R]) for a plain step, the
    masks of every block position (bitmask i32[R, q, V/32], has_mask bool[R]) with a draft block.
    None and arrays are different pytrees, so a step with no constrained row runs an executable
    without the mask."""

    batch: PackedBatch
    guide: tuple | None = None
    lora: dict | None = None  # the LoRA adapters' device stacks (``lora.LoRAManager.stacks``)
    drafts: verify.DraftBlock | None = None  # a verification step's block; None: a plain step
    drafter: verify.DraftModels | None = None  # the drafter's weights (speculative decoding)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOutput:
    tokens: jax.Array | None  # i32[R] each decode row's token; with drafts i32[R, q]: accepted drafts, new token, -1 after
    logprobs: tuple | None  # (chosen, rank, top ids [.., n], top logprobs [.., n]) of each token of ``tokens``
    prompt_logprobs: tuple | None  # (chosen f32[Tp], rank i32[Tp], top ids, top logprobs) of the prefill row
    accepted: jax.Array | None = None  # i32[R] drafts accepted per row (verification)
    next_drafts: jax.Array | None = None  # i32[R, K] (EAGLE branches: [R, W, K]) each row's next block's drafts
    drafted: jax.Array | None = None  # i32[R] drafts each row carried, where they were made on device (n-gram chained)
    logits: jax.Array | None = None  # f32[R, V] a plain step's sampling logits, where it leaves sampling to ``sample_rows``


def sampled_logprobs(logits, tokens, num_logprobs: int):
    """logits f32[B, V], tokens i32[B] -> (chosen f32[B], rank i32[B], top ids i32[B, n], top
    logprobs f32[B, n]); ranks under the raw model, as vLLM reports."""
    chosen, top_ids, top_lp = smp.logprobs_of(logits, tokens, num_logprobs)
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=1)
    rank = 1 + jnp.sum(logits > picked, axis=-1)
    return chosen, rank, top_ids, top_lp


def sample_step(logits, state, step, stop_ids, min_tokens, num_logprobs, guide=None, *, kernels: Kernels = XLA):
    """The one sampling step: logits f32[B, V] -> tokens i32[B], logprobs (or None when
    num_logprobs < 0), and the state with the new tokens counted.

    guide: None (no row is constrained: no mask work at all), or (bitmask i32[B, V/32],
    has_mask bool[B]), the structured-output rows' allowed tokens. kernels (static): the
    engine's choice, which decides where wide top-k / top-p thresholds bisect
    (``dispatch.sampler_kernels``: the Pallas kernel on TPU)."""
    # min_tokens bans stop ids inside the sampler (block maxima, the argmax's block), not by a
    # write of every logit
    banned = smp.banned_ids(stop_ids, step, min_tokens, logits.shape[-1])
    masked = logits if guide is None else smp.apply_token_bitmask(logits, *guide)
    tokens = smp.sample(masked, state, step, banned, kernels=sampler_kernels(kernels))
    state = smp.update_counts(state, tokens)
    if num_logprobs < 0:  # logprobs not requested by any row: skip the log-softmax
        return tokens, None, state
    return tokens, sampled_logprobs(logits, tokens, num_logprobs), state


def advance_slots(slots: SlotState, new: SlotState, active) -> SlotState:
    """slots (every slot [S, ...]) with the first R replaced by new ([R, ...]) where active
    (bool[R]): idle slots (and ones still prefilling) keep their state, since seeds and
    penalties must not see steps they took no part in."""
    R = active.shape[0]
    sub = jax.tree.map(lambda a: a[:R], slots)
    keep = lambda n, o: jnp.where(active.reshape((R,) + (1,) * (n.ndim - 1)), n, o)
    sub = jax.tree.map(keep, new, sub)
    return jax.tree.map(lambda a, s: a.at[:R].set(s), slots, sub)


def sample_rows(logits, slots: SlotState, active, guide=None, *, num_logprobs: int, kernels: Kernels = XLA):
    """The sampling of a plain step: logits f32[R, V] of its R decode rows (slots 0..R-1) ->
    (tokens i32[R], logprobs or None, slots advanced: each active row's new token counted).

    ``packed_step`` runs it inside the step, or, with ``sample=False``, returns the logits for
    it to run as an executable of its own (jitted with the slots donated): its compile depends
    only on R, V and the sampling options, not on the step's table widths and prefill shapes,
    so one per row bucket serves every step of that many rows. guide, kernels: ``sample_step``'s."""
    R = logits.shape[0]
    with jax.named_scope("sample"):
        sub = jax.tree.map(lambda a: a[:R], slots)
        tokens, lp, sampling = sample_step(logits, sub.sampling, sub.generated, sub.stop_ids, sub.min_tokens,
                                           num_logprobs, guide, kernels=kernels)
        new = SlotState(sampling, tokens, sub.stop_ids, sub.min_tokens, sub.generated + 1)
        return tokens, lp, advance_slots(slots, new, active)


def token_logprobs(logits, targets, num_top: int):
    """Teacher-forced logprobs: logits f32[T, V], targets i32[T] (-1: none) -> (chosen f32[T],
    rank i32[T], top ids i32[T, n], top logprobs f32[T, n])."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(lp, jnp.maximum(targets, 0)[:, None], axis=1)[:, 0]
    ranks = 1 + jnp.sum(lp > chosen[:, None], axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, max(num_top, 1))
    return chosen, ranks, top_ids[:, :num_top], top_lp[:, :num_top]


def packed_step(weights, inputs: StepInputs, state: EngineState, *, cfg, windowed, num_logprobs: int,
                prompt_logprobs: int, kernels: Kernels, pipeline=None, keys_transposed: bool = True,
                drafting: verify.Drafting = verify.NO_DRAFTING, sample: bool = True):
    """One scheduler iteration on device -> (StepOutput, EngineState).

    Decode row r is slot r. Its first query token is the host's, or, where use_prev, the
    token the previous step sampled for that slot (still on device: the host reads it while
    this step runs).

    inputs.drafts: None for a plain step (one token per decode row, from the logits of its
    query ``last_q``). A draft block makes it a verification step: row r carries q = k + 1
    queries, its last token then its drafts (``batch.last_q[r]`` of them real; the rest write to
    the scratch page), and emits its accepted drafts and one token; the slot state advances by
    what was emitted. With EAGLE branches (``engine.branches``) each row carries W chains,
    verified as virtual rows, and keeps one.

    inputs.drafter: the drafter's weights. A draft model (``drafting.cfg``) writes its keys and
    values of every token of a plain step (``verify.draft_kv_pass``) and drafts in a
    verification step; an EAGLE head, where given, has its entry of every token computed here
    written to its pools (state.draft_kv), and drafts the next block in a verification step.

    inputs.lora: each token's projections add its adapter's term (slot
    ``batch.lora_active[batch.lora_index]``; ``lora.attach``), over the batch's active slots
    only; a batch without lora_active (no token on an adapter) does no adapter work.

    pipeline: None, or an ``engine.pipeline.PipelineLayout`` (static): the layers then run as
    pipeline stages over micro-batches, with weights and pools stacked by stage.
    keys_transposed: the layout of every keys pool here, the target's and the drafter's
    (``cache.PagedKVCache.keys_transposed``, static).
    sample: False (static; a plain step with no EAGLE head only): the step samples nothing and
    returns its decode rows' logits (``StepOutput.logits``) with the slot state untouched, for
    ``sample_rows`` to run apart; ``num_logprobs`` and ``inputs.guide`` are then the sampler's
    and must be -1 and None here."""
    with jax.named_scope("packed_step"):
        mod = model_family(cfg.family)
        batch, block, models = inputs.batch, inputs.drafts, inputs.drafter or verify.DraftModels()
        if not sample and (block is not None or models.eagle is not None or num_logprobs >= 0
                           or inputs.guide is not None):
            raise ValueError("sample=False is for plain steps without an EAGLE head; their logprobs and "
                             "structured-output masks belong to the sampler (sample_rows)")
        k_pages, v_pages, slots, draft_kv = state.k_pages, state.v_pages, state.slots, state.draft_kv
        if inputs.lora is not None and batch.lora_active is not None:
            weights = lora_mod.attach(weights, inputs.lora, batch.lora_active, batch.lora_index, kernels)
        R, Q = batch.rows, batch.q
        if R:
            first = jnp.where(batch.use_prev, slots.last_tokens[:R], batch.tokens[0 : R * Q : Q])
            batch = dataclasses.replace(batch, tokens=batch.tokens.at[0 : R * Q : Q].set(first))
        dk = dict(kernels=kernels, keys_transposed=keys_transposed)
        q_draft = drafted = None
        if block is not None:
            batch, k_pages, v_pages, draft_kv, q_draft, drafted = verify.draft(
                mod, weights, models, block, batch, k_pages, v_pages, draft_kv, slots, cfg=cfg, drafting=drafting,
                windowed=windowed, **dk)
        elif models.draft_weights is not None:
            draft_kv = verify.draft_kv_pass(models.draft_weights, batch, draft_kv, draft_cfg=drafting.cfg, **dk)
        W = 1 if block is None or block.branch_drafts is None else block.branch_drafts.shape[1] + 1
        vb = batch if W == 1 else branches.expand(batch, block.branch_drafts)  # W virtual rows per row
        cache = None
        if pipeline is None:
            cache = PackedKV(k_pages, v_pages, vb, windowed, kernels, defer_writes=W > 1,
                             keys_transposed=keys_transposed)
            images = {} if vb.image_index is None else {"embeds": (vb.image_index[None], vb.image_embeds)}
            h, cache = mod.forward(weights, vb.tokens[None], None, cache, cfg=cfg, positions=vb.positions[None],
                                   **images)
        else:
            h, k_pages, v_pages = pipeline_forward(pipeline, weights, vb.tokens, vb, k_pages, v_pages, cfg=cfg, **dk)
        tokens = lp = plp = accepted = next_drafts = emitted = to_sample = None
        if R:
            sub = jax.tree.map(lambda a: a[:R], slots)
            if block is None:
                with jax.named_scope("logits"):
                    if Q > 1:
                        row_logits = mod.unembed(weights, h[0, : R * Q].reshape(R, Q, -1), cfg)  # f32[R, Q, V]
                        logits = jnp.take_along_axis(row_logits, batch.last_q[:, None, None], axis=1)[:, 0]
                    else:
                        # the rows as one sequence (h [1, R, D]): unembedded as R sequences of one
                        # token, XLA CPU lays the logits out so that the greedy argmax first copies
                        # all of them (12.6 MB a step at R = 64 over a 49,152-token vocabulary)
                        logits = mod.unembed(weights, h[:, :R], cfg)[0]  # f32[R, V]
                if sample:
                    tokens, lp, slots = sample_rows(logits, slots, batch.active, inputs.guide,
                                                    num_logprobs=num_logprobs, kernels=kernels)
                else:
                    to_sample = logits
                if models.eagle is not None:  # query j's next token is query j + 1's, the sampled one after the last
                    t = batch.tokens[: R * Q].reshape(R, Q)
                    shifted = jnp.concatenate([t[:, 1:], t[:, :1]], axis=1)
                    at_last = jnp.arange(Q)[None] == batch.last_q[:, None]
                    emitted = jnp.where(at_last, tokens[:, None], shifted)
            else:
                with jax.named_scope("verify"):
                    ver, row_logits, h, cache, next_drafts = verify.verify(
                        mod, weights, h, batch, vb, sub, cache, heads=models.heads, guide=inputs.guide,
                        q_draft=q_draft, W=W, cfg=cfg, kernels=kernels)
                tokens, accepted, emitted = ver.tokens, ver.accepted, ver.tokens
                new_last = jnp.take_along_axis(tokens, accepted[:, None], axis=1)[:, 0]
                upd = SlotState(ver.state, new_last, sub.stop_ids, sub.min_tokens, sub.generated + accepted + 1)
                if num_logprobs >= 0:
                    flat = row_logits.reshape(R * Q, -1)
                    lp = sampled_logprobs(flat, jnp.maximum(tokens.reshape(-1), 0), num_logprobs)
                    lp = tuple(a.reshape((R, Q) + a.shape[1:]) for a in lp)
                slots = advance_slots(slots, upd, batch.active)
        if cache is not None:
            k_pages, v_pages = cache.k, cache.v
        if prompt_logprobs >= 0 and batch.prefill_len:
            with jax.named_scope("prompt_logprobs"):
                logits = mod.unembed(weights, h[:, R * Q :], cfg)[0]
                plp = token_logprobs(logits, batch.targets, prompt_logprobs)
        if models.eagle is not None:
            with jax.named_scope("eagle"):
                nxt = batch.targets if emitted is None else jnp.concatenate([emitted.reshape(-1), batch.targets])
                g, draft_kv = verify.eagle_entry_pass(models.eagle, weights, h, batch, nxt, draft_kv, cfg=cfg, **dk)
                if block is not None and R:
                    next_drafts, draft_kv = verify.eagle_next_drafts(models.eagle, weights, g, batch, accepted,
                                                                     draft_kv, W, cfg=cfg, **dk)
    out = StepOutput(tokens, lp, plp, accepted, next_drafts, drafted, to_sample)
    return out, EngineState(k_pages, v_pages, slots, draft_kv)
