"""The jitted plain engine step: one packed step per scheduler iteration and the one sampling step
(the per-slot state they carry is ``slots.SlotState``; chains of decode steps: ``chaining``;
the speculative verification step: ``verify``).

``packed_step`` runs the model once over a ``models.packed.PackedBatch`` (decode rows plus a
packed prefill row), samples one token for every decode row, and returns the page pools and
the per-slot device state, both donated. With an EAGLE head it also writes the head's entries
of every token it computed (``_eagle_entry_pass``, which verification shares). The kernel
choice (``dispatch.Kernels``) is a static argument, so it is part of the executable's cache key.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer import lora as lora_mod
from jaxinfer import sampling as smp
from jaxinfer.dispatch import Kernels
from jaxinfer.engine.pipeline import pipeline_forward
from jaxinfer.engine.slots import SlotState
from jaxinfer.models import eagle as eagle_mod
from jaxinfer.models.packed import PackedBatch, PackedKV
from jaxinfer.models.registry import model_family

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOutput:
    tokens: jax.Array | None  # i32[R] the token sampled for each decode row
    logprobs: tuple | None  # (chosen f32[R], rank i32[R], top ids i32[R, n], top logprobs f32[R, n])
    row_logits: jax.Array | None  # f32[R, q, V] every query's logits, when q > 1 (verification)
    prompt_logprobs: tuple | None  # (chosen f32[Tp], rank i32[Tp], top ids, top logprobs) of the prefill row


def sample_step(logits, state, step, stop_ids, min_tokens, num_logprobs, guide=None):
    """The one sampling step of plain and verification steps: logits f32[B, V] -> tokens i32[B], logprobs
    (or None when num_logprobs < 0), and the state with the new tokens counted.

    guide: None (no row is constrained: no mask work at all), or (bitmask i32[B, V/32],
    has_mask bool[B]), the structured-output rows' allowed tokens."""
    # min_tokens bans stop ids inside the sampler (block maxima, the argmax's block), not by a
    # write of every logit
    banned = smp.banned_ids(stop_ids, step, min_tokens, logits.shape[-1])
    masked = logits if guide is None else smp.apply_token_bitmask(logits, *guide)
    tokens = smp.sample(masked, state, step, banned)
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


def packed_step(weights, batch: PackedBatch, k_pages, v_pages, slots: SlotState, guide=None, eagle=None,
                eagle_kv=None, lora=None, *, cfg, windowed, num_logprobs: int, prompt_logprobs: int,
                kernels: Kernels, pipeline=None, keys_transposed: bool = True):
    """One scheduler iteration on device -> (StepOutput, k_pages, v_pages, slots[, eagle_kv]).

    eagle: None, or an EAGLE draft head (speculative ``eagle``: {"head", "rows", "vocab"}) whose
    pools eagle_kv = (k, v) are donated and returned last: its entry for every token computed
    here is written (``_eagle_entry_pass``), so the pages hold what drafting will read.

    pipeline: None, or an ``engine.pipeline.PipelineLayout`` (static): the layers then run as
    pipeline stages over micro-batches, with weights and pools stacked by stage.

    lora: None, or the LoRA adapters' device stacks (``lora.LoRAManager.stacks``): each token's
    projections then add its adapter's term (slot ``batch.lora_active[batch.lora_index]``;
    ``lora.attach``), over the batch's active slots only; a batch without lora_active (no
    token on an adapter) does no adapter work.

    keys_transposed: the keys pools' layout, the engine's and its drafter's alike
    (``cache.PagedKVCache.keys_transposed``, static).

    guide: None, or (bitmask i32[R, V/32], has_mask bool[R]) for the decode rows when any is
    constrained (structured output). None and arrays are different pytrees, so a batch with
    no constrained row runs an executable without the mask.

    Decode row r is slot r. Its first query token is the host's, or, where use_prev, the
    token the previous step sampled for that slot (still on device: the host reads it while
    this step runs)."""
    with jax.named_scope("packed_step"):
        mod = model_family(cfg.family)
        if lora is not None and batch.lora_active is not None:
            weights = lora_mod.attach(weights, lora, batch.lora_active, batch.lora_index, kernels)
        R, Q = batch.rows, batch.q
        tokens = batch.tokens
        if R:
            first = jnp.where(batch.use_prev, slots.last_tokens[:R], tokens[0 : R * Q : Q])
            tokens = tokens.at[0 : R * Q : Q].set(first)
        if pipeline is None:
            cache = PackedKV(k_pages, v_pages, batch, windowed, kernels, keys_transposed=keys_transposed)
            images = {} if batch.image_index is None else {"embeds": (batch.image_index[None], batch.image_embeds)}
            h, cache = mod.forward(weights, tokens[None], None, cache, cfg=cfg, positions=batch.positions[None],
                                   **images)
            k_pages, v_pages = cache.k, cache.v
        else:
            h, k_pages, v_pages = pipeline_forward(pipeline, weights, tokens, batch, k_pages, v_pages, cfg=cfg,
                                                   kernels=kernels, keys_transposed=keys_transposed)
        new = lp = row_logits = plp = None
        if R:
            with jax.named_scope("sample"):
                if Q > 1:
                    row_logits = mod.unembed(weights, h[0, : R * Q].reshape(R, Q, -1), cfg)  # f32[R, Q, V]
                    logits = jnp.take_along_axis(row_logits, batch.last_q[:, None, None], axis=1)[:, 0]
                else:
                    # the rows as one sequence (h [1, R, D]): unembedded as R sequences of one
                    # token, XLA CPU lays the logits out so that the greedy argmax first copies
                    # all of them (12.6 MB a step at R = 64 over a 49,152-token vocabulary)
                    logits = mod.unembed(weights, h[:, :R], cfg)[0]  # f32[R, V]
                sub = jax.tree.map(lambda a: a[:R], slots)
                new, lp, sampling = sample_step(logits, sub.sampling, sub.generated, sub.stop_ids,
                                                sub.min_tokens, num_logprobs, guide)
                upd = SlotState(sampling, new, sub.stop_ids, sub.min_tokens, sub.generated + 1)
                # idle slots (and ones still prefilling) keep their state: seeds and penalties
                # must not see steps they took no part in
                keep = lambda n, o: jnp.where(batch.active.reshape((R,) + (1,) * (n.ndim - 1)), n, o)
                sub = jax.tree.map(keep, upd, sub)
                slots = jax.tree.map(lambda a, s: a.at[:R].set(s), slots, sub)
        if prompt_logprobs >= 0 and batch.prefill_len:
            with jax.named_scope("prompt_logprobs"):
                logits = mod.unembed(weights, h[:, R * Q :], cfg)[0]
                plp = token_logprobs(logits, batch.targets, prompt_logprobs)
        if eagle is not None:
            with jax.named_scope("eagle_entries"):
                nxt = batch.targets
                if R:  # query j's next token is the row's query j + 1, the sampled one after its last
                    t = tokens[: R * Q].reshape(R, Q)
                    shifted = jnp.concatenate([t[:, 1:], t[:, :1]], axis=1)
                    at_last = jnp.arange(Q)[None] == batch.last_q[:, None]
                    nxt = jnp.concatenate([jnp.where(at_last, new[:, None], shifted).reshape(-1), nxt])
                _, eagle_kv = _eagle_entry_pass(eagle, weights, h, batch, nxt, eagle_kv, cfg=cfg,
                                                kernels=kernels, keys_transposed=keys_transposed)
            return StepOutput(new, lp, row_logits, plp), k_pages, v_pages, slots, eagle_kv
    return StepOutput(new, lp, row_logits, plp), k_pages, v_pages, slots


def _eagle_entry_pass(eagle, weights, h, batch: PackedBatch, next_tokens, eagle_kv, *, cfg, kernels,
                      keys_transposed: bool = True):
    """EAGLE entry p = (f_p, t_{p+1}) of every token the target just computed (features h
    [1, N, D], next_tokens i32[N], -1 read as 0: their entries are rewritten before anything
    reads them), written to the draft's pools at p -> (g f32[N, D], eagle_kv)."""
    x = eagle_mod.entries(eagle["head"], weights, h[0], jnp.maximum(next_tokens, 0), cfg)
    cache = PackedKV(*eagle_kv, batch, (), kernels, keys_transposed=keys_transposed)
    g, cache = eagle_mod.run_layer(eagle["head"], x[None], batch.positions[None], cache, cfg)
    return g[0], (cache.k, cache.v)
