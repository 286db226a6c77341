"""The benchmark scripts' one timer for a jitted call."""

from __future__ import annotations

import statistics
import time

import jax


def median_seconds(fn, *args, reps: int) -> float:
    """Median seconds of ``reps`` calls of fn(*args), each waited for, after one warm call
    (which compiles)."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def step_seconds(eng, batch, n: int) -> list[float]:
    """Seconds of each of n runs of the engine's jitted step on ``batch``, each waited for
    (its tokens and the donated pools); no warm call: the caller decides what compiles."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        res = eng.run_step(batch)
        jax.block_until_ready((res.tokens, eng.k_pages))
        out.append(time.perf_counter() - t)
    return out
