"""The per-slot state the device keeps between steps (``SlotState``), and placing new
sequences into it: each decode slot's sampling state, last token, stop ids and step count.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxinfer import sampling as smp
from jaxinfer.engine.rows import Row

STOP_ID_WIDTH = 16  # per-row stop ids masked before min_tokens (EOS ids + stop_token_ids)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """What the device keeps per decode slot between steps (S = max_num_seqs)."""

    sampling: smp.SamplingState  # parameters, keys, and prompt mask and output counts when a row has penalties
    last_tokens: jax.Array  # i32[S] the token each slot's previous step sampled
    stop_ids: jax.Array  # i32[S, STOP_ID_WIDTH] ids masked before min_tokens, -1 padded
    min_tokens: jax.Array  # i32[S]
    generated: jax.Array  # i32[S] tokens sampled so far (the step index of the next sample)


def make_slots(vocab_size: int, max_num_seqs: int, seed: int, *, vocab_state: bool = True) -> SlotState:
    """Every slot idle; vocab_state False: without the [S, V] penalty statistics."""
    S = max_num_seqs
    return SlotState(smp.make_sampling_state([], [], vocab_size, default_seed=seed, batch_size=S,
                                             vocab_state=vocab_state),
                     *jax.device_put((np.zeros(S, np.int32), np.full((S, STOP_ID_WIDTH), -1, np.int32),
                                      np.zeros(S, np.int32), np.zeros(S, np.int32))))


def slots_with_vocab_state(slots: SlotState, vocab_size: int, need: bool) -> SlotState:
    """``slots`` carrying the [S, V] penalty statistics exactly when ``need`` (some running row
    has penalties). Added zeroed: the rows already running have no penalties, so nothing they
    generated needs counting; dropped when the last such row leaves. The two forms are
    different pytrees, so every step compiles (once) a variant without any [S, V] state."""
    if need == slots.sampling.has_vocab_state:
        return slots
    sampling = (smp.with_vocab_state(slots.sampling, vocab_size) if need
                else smp.without_vocab_state(slots.sampling))
    return dataclasses.replace(slots, sampling=sampling)


def insert_step(slots: SlotState, slot, rows: SlotState) -> SlotState:
    """Place n sequences' slot state (batch n) into slots ``slot`` i32[n]; a slot number past
    the last (padding up to a batch bucket) is dropped."""
    return jax.tree.map(lambda a, r: a.at[slot].set(r, mode="drop"), slots, rows)


def slot_states_for(rows: list[Row], vocab_size: int, eos_ids, seed: int, *, vocab_state: bool = True,
                    batch_size: int | None = None) -> SlotState:
    """The sequences' slot state (batch ``batch_size``, default len(rows); rows past len(rows)
    are greedy padding): their sampling state (penalties counting what each generated before a
    preemption; without [V] statistics unless vocab_state), stop ids, min_tokens and step count."""
    n = len(rows)
    B = n if batch_size is None else batch_size
    params = [r.params for r in rows]
    sampling = smp.make_sampling_state(params, [r.prompt_ids for r in rows], vocab_size, default_seed=seed,
                                       batch_size=B, request_indices=[r.request_index for r in rows],
                                       vocab_state=vocab_state)
    if vocab_state and any(r.token_ids for r in rows):  # recomputed after preemption: penalties see what was generated
        counts = np.zeros((B, vocab_size), np.int32)
        for i, r in enumerate(rows):
            counts[i] = np.bincount(r.token_ids, minlength=vocab_size)
        sampling = dataclasses.replace(sampling, output_counts=jax.device_put(counts))
    stop, mins = smp.min_tokens_inputs(params, eos_ids, batch_size=B)
    stop_ids = np.full((B, STOP_ID_WIDTH), -1, np.int32)
    stop_ids[:, : min(stop.shape[1], STOP_ID_WIDTH)] = stop[:, :STOP_ID_WIDTH]
    generated = np.zeros(B, np.int32)
    generated[:n] = [len(r.token_ids) for r in rows]
    # host arrays in one transfer (jnp.asarray would compile a small executable per shape)
    return SlotState(sampling, *jax.device_put((np.zeros(B, np.int32), stop_ids, mins.astype(np.int32), generated)))
