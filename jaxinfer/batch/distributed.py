"""Multi-host batch jobs over ``jax.distributed``: joining the job, the key-value store and
barrier the processes use to sum their summaries, and the agreements of an SPMD job (one mesh
over all processes): the same input everywhere, each setup step done everywhere, and the same
request at which all stop admitting."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
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


_SPMD_JOBS = itertools.count()  # SPMD processes call run_batch alike, so the n-th call agrees everywhere


class _Spmd:
    """What the processes of an SPMD batch job agree on through the key-value store. Not device
    collectives: gloo gives up after 30 s, and a process may wait longer than that (its peers
    compiling, or process 0 fsyncing)."""

    def __init__(self, me: int, P: int):
        self.me, self.P = me, P
        self.client = coordination_client()
        self.prefix = f"jaxinfer_batch/spmd/{next(_SPMD_JOBS)}"
        self.pulls = 0

    def _all(self, step: str, value: str) -> list[str]:
        """Post ``value`` for ``step``; every process's value, in process order."""
        self.client.key_value_set(f"{self.prefix}/{step}/{self.me}", value)
        return [value if p == self.me else
                self.client.blocking_key_value_get(f"{self.prefix}/{step}/{p}", BARRIER_TIMEOUT_S * 1000)
                for p in range(self.P)]

    def same_input(self, fingerprint: str) -> None:
        """InvalidRequest, on every process, unless all read the same input with the same options."""
        for p, theirs in enumerate(self._all("input", fingerprint)):
            if theirs != fingerprint:
                raise InvalidRequest(
                    f"process {p} of {self.P} reads a different input than process {self.me} ({theirs} vs "
                    f"{fingerprint}): on one mesh over all processes every process runs every request, so "
                    "each needs the same input file and options")

    def step(self, name: str, error: Exception | None) -> None:
        """Every process reports how ``name`` went; if any failed, all raise (the failed one its own
        error), rather than the others waiting for it forever."""
        for p, msg in enumerate(self._all(name, "ok" if error is None else f"error: {error}")):
            if error is not None:
                raise error
            if msg != "ok":
                raise InvalidRequest(f"process {p} of {self.P}: {msg.removeprefix('error: ')}")

    def stop_vote(self, signum: int | None) -> int | None:
        """Before each request is admitted: the signal that stops admitting, if any process has
        one (the first in process order), so every process stops at the same request."""
        k = self.pulls
        self.pulls += 1
        votes = self._all(f"stop/{k}", str(int(signum or 0)))
        if k:  # every process has posted pull k, so it has read pull k - 1: that key is no longer needed
            self.client.key_value_delete(f"{self.prefix}/stop/{k - 1}/{self.me}")
        return next((int(v) for v in votes if v != "0"), None)


def fingerprint(path, *options) -> str:
    """Size and sha256 of the first and last MiB of ``path`` (a local path or a
    ``jaxinfer.storage.Url``), and a hash of ``options``: equal on every process of a job that
    reads the same file the same way (cheap on a file of any size)."""
    from jaxinfer import storage

    h = hashlib.sha256()
    if isinstance(path, storage.Url):
        size = storage.info(path)["size"]
        ranges = [(0, min(size, 1 << 20))] + ([(max(1 << 20, size - (1 << 20)), size)] if size > 1 << 20 else [])
        for data in storage.read_ranges(path, ranges):
            h.update(data)
    else:
        size = path.stat().st_size
        with open(path, "rb") as f:
            h.update(f.read(1 << 20))
            if size > 1 << 20:
                f.seek(max(1 << 20, size - (1 << 20)))
                h.update(f.read())
    opts = hashlib.sha256(repr(options).encode()).hexdigest()[:12]
    return f"{size} bytes, sha256 of the ends {h.hexdigest()[:16]}, options {opts}"
