"""Data parallelism within one engine: D replicas over the mesh's "data" axis, each with its own
decode slots, page pools and scheduler, run by the engine's one loop in one jitted step.

Every device array of a replica gains a leading replica axis of size D, split over "data": the
page pools [D, P, K, ps, H] (split over "model" like one replica's, see
``sharding.kv_pool_shardings``), the slot state [D, S, ...] and each step's ``PackedBatch``
[D, ...], every replica's batch padded to the largest replica's bucketed shape so one
executable runs them all. The weights are shared (replicated over "data", split over "model").
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec

from jaxinfer.engine.state import EngineState
from jaxinfer.engine.step import StepInputs, packed_step
from jaxinfer.models.packed import PackedBatch


def replicas_step(weights, inputs: StepInputs, state: EngineState, *, mesh, **statics):
    """``step.packed_step`` of every replica at once: the step's inputs and the device state
    carry a leading replica axis [D, ...] split over "data"; the weights are shared ->
    (StepOutput [D, ...], state). A ``shard_map`` manual over "data" only (the "model" axis
    stays with the partitioner, as in one replica): each data group runs its own replica and
    nothing crosses replicas. (``jax.vmap`` over the replica axis let the partitioner all-gather
    the sampling step's logits across replicas.) statics: ``packed_step``'s."""

    def one(w, inputs, state):
        inputs, state = jax.tree.map(lambda a: a[0], (inputs, state))
        return jax.tree.map(lambda a: a[None], packed_step(w, inputs, state, **statics))

    rep, split = PartitionSpec(), PartitionSpec("data")
    return jax.shard_map(one, mesh=mesh, in_specs=(rep, split, split), out_specs=split,
                         axis_names={"data"}, check_vma=False)(weights, inputs, state)


def insert_replica(slots, replica, slot, row):
    """Place one sequence's slot state (batch 1) into slot ``slot`` of replica ``replica``."""
    return jax.tree.map(lambda a, r: a.at[replica, slot].set(r[0]), slots, row)


def stack(batches: list[PackedBatch]) -> PackedBatch:
    """Replicas' host batches of one shape -> one batch with a leading replica axis."""
    return jax.tree.map(lambda *a: np.stack(a), *batches)


def host_readable(out):
    """A step's output, readable on this host: on a mesh spanning several processes each holds
    only its own replicas' rows, so they are gathered (every process plans every replica)."""
    leaves = [x for x in jax.tree.leaves(out) if isinstance(x, jax.Array)]
    if all(x.is_fully_addressable for x in leaves):
        return out
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(out, tiled=True)
