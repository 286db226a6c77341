"""The replica axis of every engine: D replicas over the mesh's "data" axis (D = 1 without a
mesh, or with a mesh whose "data" axis is 1), each with its own decode slots, page pools and
scheduler, run by the engine's one loop in one jitted step.

A replica's inputs and outputs carry a leading replica axis [D, ...]: each step's
``PackedBatch``, its structured-output masks and its draft block (every replica's batch padded
to the largest replica's bucketed shape, so one executable runs them all), and the step's
``StepOutput``. The device state is folded instead: replica d's page pools are pages
[d * P, (d + 1) * P) of one [D * P, ...] pool and its slots are slots [d * S, (d + 1) * S) of
one [D * S, ...] slot state, split over "data" (``state.fold``), so one replica's state is the
state itself, and a replica's page and slot numbers are its own (each replica sees only its
part). The weights, LoRA stacks and the drafter's weights are shared (replicated over "data",
split over "model").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxinfer.dispatch import XLA, Kernels
from jaxinfer.engine.state import EngineState
from jaxinfer.engine import step
from jaxinfer.engine.step import StepInputs, packed_step


def count(mesh) -> int:
    """D: the replicas of an engine on ``mesh`` (None: one device, one replica)."""
    return mesh.shape["data"] if mesh is not None else 1


def replicas_step(weights, inputs: StepInputs, state: EngineState, *, mesh, **statics):
    """``step.packed_step`` of every replica at once: the step's batch, masks and draft block
    carry a leading replica axis [D, ...], the device state is folded (module doc); the weights,
    LoRA stacks and drafter weights are shared -> (StepOutput [D, ...], state).

    Several replicas run in a ``shard_map`` manual over "data" only (the "model" axis stays
    with the partitioner, as in one replica): each data group runs its own replica and nothing
    crosses replicas (``jax.vmap`` over the replica axis let the partitioner all-gather the
    sampling step's logits across replicas). One replica needs no partition of "data": its
    step is the same function called directly, where taking the axis off the inputs and putting
    it on the outputs are reshapes XLA folds away. statics: ``packed_step``'s."""
    own = (inputs.batch, inputs.guide, inputs.drafts)
    shared = (inputs.lora, inputs.drafter)

    def one(w, shared, own, state):
        batch, guide, drafts = jax.tree.map(lambda a: a[0], own)
        out, state = packed_step(w, StepInputs(batch, guide, shared[0], drafts, shared[1]), state, **statics)
        return jax.tree.map(lambda a: a[None], out), state

    if count(mesh) == 1:
        return one(weights, shared, own, state)
    rep, split = PartitionSpec(), PartitionSpec("data")
    return jax.shard_map(one, mesh=mesh, in_specs=(rep, rep, split, split), out_specs=split,
                         axis_names={"data"}, check_vma=False)(weights, shared, own, state)


def sample_rows(logits, slots, active, guide=None, *, num_logprobs: int, kernels: Kernels = XLA):
    """``step.sample_rows`` of the one replica of an engine that samples apart
    (``Engine.separate_sampler``): logits, active and guide carry the replica axis [1, ...] as
    the step's outputs and inputs do, and the tokens and logprobs come back with it; the slot
    state is the replica's own (folded over one replica, module doc)."""
    logits, active, guide = only((logits, active, guide))
    tokens, lp, slots = step.sample_rows(logits, slots, active, guide, num_logprobs=num_logprobs, kernels=kernels)
    return jax.tree.map(lambda a: a[None], tokens), jax.tree.map(lambda a: a[None], lp), slots


def folded_slots(replica: int, slots: np.ndarray, max_num_seqs: int, D: int) -> np.ndarray:
    """Replica ``replica``'s slot numbers i32[n] in the folded slot state; a number past a
    replica's last slot (padding up to a batch bucket) goes past every replica's, so the
    insert drops it."""
    return np.where(slots < max_num_seqs, replica * max_num_seqs + slots, D * max_num_seqs).astype(np.int32)


def stack(per_replica: list):
    """Replicas' inputs of one shape (host batches, masks, draft blocks) -> one with a leading
    replica axis; device arrays (a batch's image embeddings) stay on their device. One
    replica's are views with the axis added, not copies."""
    if len(per_replica) == 1:
        return jax.tree.map(lambda a: a[None], per_replica[0])

    def one(*a):
        if all(isinstance(x, np.ndarray | np.generic) for x in a):
            return np.stack(a)
        return jnp.stack(a)

    return jax.tree.map(one, *per_replica)


def only(tree):
    """The one replica's part of inputs stacked on the replica axis [1, ...], for what runs one
    replica only (chains of decode steps, the drafter's host state)."""
    def one(a):
        assert a.shape[0] == 1, a.shape
        return a[0]

    return jax.tree.map(one, tree)


def host_readable(out):
    """A step's output, readable on this host: on a mesh spanning several processes each holds
    only its own replicas' rows, so they are gathered (every process plans every replica)."""
    leaves = [x for x in jax.tree.leaves(out) if isinstance(x, jax.Array)]
    if all(x.is_fully_addressable for x in leaves):
        return out
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(out, tiled=True)
