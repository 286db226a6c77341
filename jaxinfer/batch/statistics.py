"""What a batch run did: counts of answers (``Tally``), mergeable latency histograms
(``Latency``), and the ``BatchSummary`` that the CLI prints and ``--metrics-out`` writes."""

from __future__ import annotations

import dataclasses
import math

from jaxinfer import metrics


@dataclasses.dataclass
class Tally:
    """Counts over result lines."""

    ok: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    repetitions: int = 0  # sequences ended by repetition detection (finish_reason "repetition")

    def add(self, ok: bool, tokens: tuple[int, int], repetitions: int = 0) -> None:
        self.ok += ok
        self.failed += not ok
        self.input_tokens += tokens[0]
        self.output_tokens += tokens[1]
        self.repetitions += repetitions

    def merge(self, other: Tally) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def answered(self) -> int:
        return self.ok + self.failed


class Latency:
    """Latency samples in log-spaced bins 1% wide (10 us to ~3 h, clamped outside).

    Fixed size and mergeable: percentiles over any number of requests and across processes in
    bounded memory, each within 1% of the exact value (min, max and mean are exact).
    """

    LO, GROWTH = 1e-5, 1.01
    BINS = math.ceil(math.log(1e4 / 1e-5) / math.log(1.01))

    def __init__(self):
        self.counts: dict[int, int] = {}
        self.n, self.total, self.min, self.max = 0, 0.0, math.inf, -math.inf

    def add(self, x: float | None) -> None:
        if x is None or not math.isfinite(x):
            return
        x = max(float(x), 0.0)
        b = 0 if x <= self.LO else min(self.BINS - 1, int(math.log(x / self.LO) / math.log(self.GROWTH)))
        self.counts[b] = self.counts.get(b, 0) + 1
        self.n += 1
        self.total += x
        self.min, self.max = min(self.min, x), max(self.max, x)

    def merge(self, other: Latency) -> None:
        for b, c in other.counts.items():
            self.counts[b] = self.counts.get(b, 0) + c
        self.n += other.n
        self.total += other.total
        self.min, self.max = min(self.min, other.min), max(self.max, other.max)

    def percentile(self, q: float) -> float | None:
        """The q-th percentile of the binned samples (each bin at its middle, within
        [min, max]), by ``metrics.percentile``."""
        if not self.n:
            return None
        bins = sorted(self.counts)
        mids = [min(max(self.LO * self.GROWTH ** (b + 0.5), self.min), self.max) for b in bins]
        return metrics.percentile(mids, q, [self.counts[b] for b in bins])

    def summary(self) -> dict:
        if not self.n:
            return {"count": 0}
        out = {"count": self.n, "mean": self.total / self.n, "min": self.min}
        out.update({f"p{q}": self.percentile(q) for q in (50, 90, 95, 99)})
        out["max"] = self.max
        return out

    def to_json(self) -> dict:
        return {"counts": {str(b): c for b, c in self.counts.items()}, "n": self.n, "total": self.total,
                "min": self.min if self.n else None, "max": self.max if self.n else None}

    @classmethod
    def from_json(cls, d: dict) -> Latency:
        h = cls()
        h.counts = {int(b): c for b, c in d["counts"].items()}
        h.n, h.total = d["n"], d["total"]
        h.min = d["min"] if d["min"] is not None else math.inf
        h.max = d["max"] if d["max"] is not None else -math.inf
        return h


# TTFT, TPOT (per request: mean gap after the first token), ITL (every gap between two tokens of
# the first sample), end-to-end, and time in the engine's queue
LATENCIES = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s")


@dataclasses.dataclass
class BatchSummary:
    """What a batch run did. ``total``/``before``/``result`` cover the whole job (all processes
    when this is process 0 of a multi-host run); ``run`` and the latencies cover this run."""

    output: str
    total: int  # requests (input lines) in the job
    before: int  # answered before this run started
    result: Tally  # every answer in the output now
    run: Tally  # answered by this run
    wall_s: float
    latency: dict[str, Latency]
    interrupted: int | None = None  # the signal that stopped the run, if one did
    process_index: int = 0
    process_count: int = 1
    speculative: dict | None = None  # this process's acceptance counters (engine.speculative.SpecStats)

    @property
    def complete(self) -> bool:
        return self.interrupted is None

    def metrics(self) -> dict:
        """The ``--metrics-out`` JSON."""
        wall = max(self.wall_s, 1e-9)
        return {
            "output": self.output, "processes": self.process_count, "complete": self.complete,
            "requests": {"total": self.total, "ok": self.result.ok, "failed": self.result.failed,
                         "answered_before_this_run": self.before},
            "input_tokens": self.result.input_tokens, "output_tokens": self.result.output_tokens,
            "repetitions": self.result.repetitions,
            "this_run": {"requests": self.run.answered, "ok": self.run.ok, "failed": self.run.failed,
                         "input_tokens": self.run.input_tokens, "output_tokens": self.run.output_tokens,
                         "wall_s": self.wall_s, "output_tokens_per_s": self.run.output_tokens / wall,
                         "requests_per_s": self.run.answered / wall},
            "latency": {name: h.summary() for name, h in self.latency.items()},
            **({"speculative": self.speculative} if self.speculative is not None else {}),
        }

    def to_json(self) -> dict:
        return {"total": self.total, "before": self.before, "result": dataclasses.asdict(self.result),
                "run": dataclasses.asdict(self.run), "wall_s": self.wall_s,
                "latency": {k: h.to_json() for k, h in self.latency.items()}}

    def merge_json(self, d: dict) -> None:
        """Fold in the summary of another process of the same job."""
        self.total += d["total"]
        self.before += d["before"]
        self.result.merge(Tally(**d["result"]))
        self.run.merge(Tally(**d["run"]))
        self.wall_s = max(self.wall_s, d["wall_s"])
        for k, h in d["latency"].items():
            self.latency[k].merge(Latency.from_json(h))
