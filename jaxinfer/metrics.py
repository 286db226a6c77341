"""Serving metrics: per-request latencies, aggregate throughput and goodput, MFU and MBU.

Definitions (as vLLM's benchmarks use them):
  TTFT   arrival -> first output token.
  TPOT   (last token - first token) / (output tokens - 1), per request.
  ITL    every gap between consecutive output tokens of a request.
  E2E    arrival -> last token.
  goodput  requests per second (and output tokens per second) of the requests that met
           every given SLO.
  MFU    achieved model FLOP/s over the machine's measured peak matmul FLOP/s.
  MBU    achieved bytes/s over the measured peak memory bandwidth, where each decode step
         reads the weights once and the KV cache of every running sequence.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class RequestTiming:
    arrival: float
    scheduled: float
    token_times: tuple[float, ...]  # when each output token reached the host
    prompt_tokens: int
    output_tokens: int

    @property
    def queue(self) -> float:
        return self.scheduled - self.arrival

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.token_times))


def percentile(values, q: float, counts=None) -> float:
    """The q-th percentile of the samples ``values`` (ascending), each seen ``counts`` times
    (default once): linear interpolation between the two nearest ranks, numpy's default
    method. The one implementation: raw samples (``percentiles``) and the mergeable
    histograms of batch jobs (``batch.Latency``, bin values with their counts) both use it."""
    v = np.asarray(values, np.float64)
    c = np.ones(len(v), np.int64) if counts is None else np.asarray(counts, np.int64)
    n = int(c.sum())
    if n == 0:
        raise ValueError("percentile of no samples")
    h = (n - 1) * q / 100.0
    lo = math.floor(h)
    cum = np.cumsum(c)  # rank r (0-based) is value i for the first i with cum[i] > r
    a, b = v[np.searchsorted(cum, lo, side="right")], v[np.searchsorted(cum, min(lo + 1, n - 1), side="right")]
    return float(a + (b - a) * (h - lo))


def percentiles(xs, ps=(50, 90, 99)) -> dict[str, float | None]:
    xs = sorted(x for x in xs if x is not None)
    return {f"p{p}": (percentile(xs, p) if xs else None) for p in ps} | {
        "mean": float(np.mean(xs)) if xs else None}


def summarize(timings: list[RequestTiming], wall: float, *, ttft_slo: float | None = None,
              tpot_slo: float | None = None, model_flops_per_token: float | None = None,
              decode_bytes: float | None = None, peaks: dict | None = None) -> dict:
    """Aggregate a run. decode_bytes: bytes a run's decode steps read in all (weights per step
    plus KV per running sequence); model_flops_per_token: ~2 x parameters (+ attention)."""
    n_in = sum(t.prompt_tokens for t in timings)
    n_out = sum(t.output_tokens for t in timings)
    good = [t for t in timings
            if (ttft_slo is None or t.ttft <= ttft_slo) and (tpot_slo is None or (t.tpot or 0.0) <= tpot_slo)]
    out = {
        "requests": len(timings),
        "wall_s": wall,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "input_tok_s": n_in / wall,
        "output_tok_s": n_out / wall,
        "requests_s": len(timings) / wall,
        "goodput_requests_s": len(good) / wall,
        "goodput_output_tok_s": sum(t.output_tokens for t in good) / wall,
        "slo": {"ttft_s": ttft_slo, "tpot_s": tpot_slo, "met": len(good)},
        "queue_s": percentiles([t.queue for t in timings]),
        "ttft_s": percentiles([t.ttft for t in timings]),
        "tpot_s": percentiles([t.tpot for t in timings]),
        "itl_s": percentiles([x for t in timings for x in t.itls]),
        "e2e_s": percentiles([t.e2e for t in timings]),
    }
    if peaks and model_flops_per_token:
        out["mfu"] = model_flops_per_token * (n_in + n_out) / wall / peaks["flops"]
    if peaks and decode_bytes:
        out["mbu"] = decode_bytes / wall / peaks["bytes_s"]
    return out


def measure_peaks(cache_file: Path | None = None, dtype: str = "float32") -> dict:
    """Peak matmul FLOP/s (a large jitted matmul) and memory bandwidth (a large jitted
    reduction) of this machine's default JAX device; medians of several runs, cached."""
    if cache_file is not None and cache_file.is_file():
        d = json.loads(cache_file.read_text())
        if d.get("dtype") == dtype:
            return d
    import jax
    import jax.numpy as jnp

    n = 2048
    a = jnp.ones((n, n), dtype)
    mm = jax.jit(lambda x: x @ x)
    big = jnp.ones((64 << 20) // 4, jnp.float32)  # 256 MiB, far beyond any cache
    rd = jax.jit(lambda x: jnp.sum(x))

    def best(f, x, reps=5):
        jax.block_until_ready(f(x))
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(f(x))
            ts.append(time.perf_counter() - t)
        return float(np.median(ts))

    d = {"dtype": dtype, "flops": 2 * n**3 / best(mm, a), "bytes_s": big.nbytes / best(rd, big),
         "device": str(jax.local_devices()[0]), "method": "median of 5: 2048^3 matmul; sum over 256 MiB"}
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps(d))
    return d


def model_flops_per_token(num_params: int, n_layers: int, d_attn: int, context: float) -> float:
    """Forward FLOPs per token: 2 per parameter plus attention's 4 x L x context x (N*H)."""
    return 2.0 * num_params + 4.0 * n_layers * context * d_attn
