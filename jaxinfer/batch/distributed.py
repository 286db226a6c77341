"""Multi-host batch jobs over ``jax.distributed``: joining the job, and the key-value store and
barrier the processes use to sum their summaries."""

from __future__ import annotations

import dataclasses
import json

from jaxinfer.batch.statistics import BatchSummary, Latency
from jaxinfer.errors import InvalidRequest


def init_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> tuple[int, int]:
    """Join a ``jax.distributed`` job; (process index, process count).

    With no arguments JAX detects the cluster (Cloud TPU pod slices, SLURM, Open MPI, ...).
    Must run before anything touches a JAX device.
    """
    import jax

    try:
        jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                   process_id=process_id)
    except (ValueError, RuntimeError) as e:
        raise InvalidRequest(f"cannot join the jax.distributed job: {e}") from None
    return jax.process_index(), jax.process_count()


def coordination_client():
    """jax.distributed's key-value store and barrier client (the one orbax uses). A device
    collective would not do: gloo gives up after 30 s, and processes finish their shares
    minutes apart. The client is reachable only through JAX's private ``jax._src.distributed``;
    this is the one place that reaches for it, so a JAX release that moves it fails here,
    saying so, rather than somewhere inside a finished job."""
    try:
        from jax._src import distributed

        state = distributed.global_state
    except (ImportError, AttributeError) as e:
        import jax

        raise RuntimeError(
            f"jax {jax.__version__} no longer has jax._src.distributed.global_state ({e}); multi-host "
            "batch jobs need its key-value store: pin an earlier jax or update "
            "jaxinfer.batch.distributed.coordination_client") from None
    client = getattr(state, "client", None)
    if client is None:
        raise InvalidRequest("process_count > 1 needs jax.distributed (see init_distributed)")
    return client


BARRIER_TIMEOUT_S = 24 * 3600


def _gather(summary: BatchSummary, me: int, P: int) -> BatchSummary:
    """Every process posts its summary; all wait for each other; process 0 sums them."""
    client = coordination_client()
    client.key_value_set(f"jaxinfer_batch/summary/{me}", json.dumps(summary.to_json()))
    client.wait_at_barrier("jaxinfer_batch/done", BARRIER_TIMEOUT_S * 1000)
    if me != 0:
        return summary
    total = dataclasses.replace(summary, result=dataclasses.replace(summary.result),
                                run=dataclasses.replace(summary.run),
                                latency={k: Latency.from_json(h.to_json()) for k, h in summary.latency.items()})
    for p in range(1, P):
        total.merge_json(json.loads(client.blocking_key_value_get(f"jaxinfer_batch/summary/{p}", 60_000)))
    return total
