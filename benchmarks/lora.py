"""What LoRA adapters cost a decode step on this CPU, and what swapping one into a device slot
costs: the bare jitted 64-row decode step of SmolLM2 (the registry's checkpoint; its shape
with random weights under ``--random``), rank-16 adapters on all seven projections of every
layer, in three cases against the same rows on an engine without adapters:

* rows over 8 adapters (row r on adapter r % 8; ``max_loras=8``);
* every row on one adapter;
* no row on an adapter (the adapters' engine; such a step carries no active set and does
  no adapter work).

Interleaved rounds in one process, min and median. Then the time to write an adapter into a
device slot (host dispatch, and until the stacks are ready), and whether the step compiled
anew after the swaps (it must not).

    python benchmarks/lora.py --context 200 --rounds 5 [--random]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from jaxinfer import LLM
from jaxinfer.engine import buckets, replicas
from jaxinfer.engine.batch import lora_arrays
from jaxinfer.lora import Adapter, LoRARequest, target_shapes
from jaxinfer.models.registry import model_family
from timing import step_seconds


def _llm(model, lora: bool, **kw):
    return LLM(model, max_model_len=1024, max_num_seqs=64, progress=False, enable_prefix_caching=False,
               kv_cache_memory_bytes=1 << 30, enable_lora=lora, max_loras=8, max_lora_rank=16, **kw)


def _decode_batch(eng, ctx: int, rng, slots=None, rows: int = 64):
    ps = eng.allocator.page_size
    n = -(-(ctx + 1) // ps)
    b = replicas.only(eng.idle_batch(rows, buckets.width_bucket(n, eng.pages_per_seq), 0))  # one replica's
    pages = 1 + rng.permutation(eng.allocator.num_pages - 1)[: rows * n].reshape(rows, n)
    b.table[:rows, :n] = pages
    b.positions[:] = ctx
    b.write_page[:] = pages[:, ctx // ps]
    b.active[:] = True
    b.tokens[:] = rng.integers(100, 40000, rows)
    if slots is not None:  # the step's adapters as the engine passes them: its active slots, bucketed
        b.lora_active, b.lora_index = lora_arrays(np.asarray(slots, np.int32), eng.lora.config.max_loras)
    return replicas.stack([b])


def _adapter(cfg, i: int, rank: int, rng) -> Adapter:
    """A random rank-``rank`` adapter on every projection, padded to the engine's rank 16."""
    dt = np.dtype(cfg.jnp_dtype)
    pairs = {}
    for layer in range(cfg.n_layers):
        for w, (I, O) in target_shapes(cfg, model_family(cfg.family)).items():
            a = np.zeros((I, 16), dt)
            b = np.zeros((16, O), dt)
            a[:, :rank] = rng.standard_normal((I, rank)) * I**-0.5
            b[:rank] = rng.standard_normal((rank, O)) * 0.01
            pairs[(layer, w)] = (a, b)
    return Adapter(LoRARequest(f"bench{i}", i + 1, f"random:{i}"), rank, 1.0, pairs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--random", action="store_true", help="random weights of SmolLM2-135M's shape")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    model = "smollm2-135m-instruct"
    if a.random:
        from jaxinfer.loaders.checkpoint import load
        from jaxinfer.loaders.random_weights import random_loaded
        from jaxinfer.registry import resolve

        cfg = load(resolve(model), dtype="float32").cfg
        model = random_loaded(cfg)
    base = _llm(model, False).engine
    eng = _llm(model if a.random else "smollm2-135m-instruct", True).engine
    cfg = eng.cfg
    adapters = [_adapter(cfg, i, 16, rng) for i in range(8)]
    for ad in adapters:
        assert eng.lora.acquire(ad) is not None
    cases = {
        "no adapters (base engine)": (base, _decode_batch(base, a.context, rng)),
        "8 adapters, row r on r % 8": (eng, _decode_batch(eng, a.context, rng, np.arange(64) % 8)),
        "1 adapter, every row": (eng, _decode_batch(eng, a.context, rng, np.zeros(64, np.int32))),
        "adapters' engine, no row on one": (eng, _decode_batch(eng, a.context, rng, -np.ones(64, np.int32))),
    }
    for e, b in cases.values():
        step_seconds(e, b, 2)
    compiled = eng.num_compilations()
    times: dict[str, list[float]] = {}
    for _ in range(a.rounds):
        for name, (e, b) in cases.items():
            times.setdefault(name, []).extend(step_seconds(e, b, 2))
    # swapping: an adapter into a slot another adapter held (its rows released first)
    swaps, ready = [], []
    for i in range(8):
        eng.lora.release(i)
    for i in range(5):
        ad = _adapter(cfg, 100 + i, 16, rng)
        t = time.perf_counter()
        eng.lora.acquire(ad)
        swaps.append(time.perf_counter() - t)
        jax.block_until_ready(eng.lora.stacks)
        ready.append(time.perf_counter() - t)
        eng.lora.release(eng.lora.slot_of[ad.key])
    after = step_seconds(eng, cases["8 adapters, row r on r % 8"][1], 2)
    base_min = min(times["no adapters (base engine)"])
    print(f"SmolLM2-135M{' (random weights)' if a.random else ''} {cfg.dtype}, 64 decode rows at context {a.context}, "
          f"rank-16 adapters on q/k/v/o/gate/up/down; ms per step")
    for name, ts in times.items():
        print(f"  {name:34s} min {min(ts) * 1e3:7.1f}  median {statistics.median(ts) * 1e3:7.1f}  "
              f"ratio (min) {min(ts) / base_min:5.2f}")
    print(f"  swap into a slot: dispatch median {statistics.median(swaps) * 1e3:.1f} ms, until ready median "
          f"{statistics.median(ready) * 1e3:.1f} ms; step executables compiled after the swaps: "
          f"{eng.num_compilations() - compiled} (step after them {min(after) * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
