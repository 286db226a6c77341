"""Where a packed step's time goes on this CPU: the bare jitted step of the real model (no
scheduler, no host work) for a 64-row decode step and a 512-token prefill row (4 prompts of
128), with its attention as built and with attention taken out (replaced by its queries, so
what is left is every matmul, norm, rotary and the sampler), and with XLA's readers in place
of the native kernels (``kernels=`` with XLA attention), interleaved in one process, min and median
of the rounds. The difference is the attention's share. Under w8a8 on an AMX CPU, "XLA int8
dots" is the engine with its weights left unpacked, so its dots run through XLA's s8 dot
(which repacks each weight per call) instead of ``cpu_kernels.int8_amx``.

    python benchmarks/step_profile.py --context 200 --block-size 16 64 --rounds 5
    python benchmarks/step_profile.py --quantization w8a8 --kv-cache-dtype int8

Decode rows attend to ``--context`` positions on pages scattered through the pool, as a
running engine's are.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

import jaxinfer.models.packed as packed
from jaxinfer import LLM, cpu_kernels, dispatch
from jaxinfer.engine import buckets, replicas
from timing import step_seconds

REAL = (packed.paged_rows_attention, packed.prefill_row_attention)


def _engine(page_size: int, attention: bool, native: bool, opts: dict, amx: bool = True):
    auto = dispatch.choose("auto")
    kernels = dispatch.Kernels(auto.attention if native else dispatch.Attention.XLA,
                               auto.matmul if amx else dispatch.Matmul.XLA)
    if attention:
        packed.paged_rows_attention, packed.prefill_row_attention = REAL
    else:
        packed.paged_rows_attention = lambda q, *a, **k: q
        packed.prefill_row_attention = lambda q, *a, **k: q
    llm = LLM("smollm2-135m-instruct", max_model_len=1024, max_num_seqs=64, progress=False,
              enable_prefix_caching=False, block_size=page_size, kv_cache_memory_bytes=1 << 30, kernels=kernels, **opts)
    return llm.engine


def _decode_batch(eng, ctx: int, rng, rows: int = 64):
    ps = eng.allocator.page_size
    n = -(-(ctx + 1) // ps)
    b = replicas.only(eng.idle_batch(rows, buckets.width_bucket(n, eng.pages_per_seq), 0))  # one replica's
    pages = 1 + rng.permutation(eng.allocator.num_pages - 1)[: rows * n].reshape(rows, n)
    b.table[:rows, :n] = pages
    b.positions[:] = ctx
    b.write_page[:] = pages[:, ctx // ps]
    b.active[:] = True
    return replicas.stack([b])


def _prefill_batch(eng, rng, tokens: int = 512, prompts: int = 4):
    ps = eng.allocator.page_size
    b = replicas.only(eng.idle_batch(0, buckets.width_bucket(1, eng.pages_per_seq), tokens))
    n = tokens // prompts
    for k in range(prompts):
        sl = slice(k * n, (k + 1) * n)
        b.seg[sl] = k
        b.positions[sl] = np.arange(n)
        b.write_page[sl] = 1 + k * (-(-n // ps)) + np.arange(n) // ps
    b.tokens[:] = rng.integers(100, 40000, tokens)
    return replicas.stack([b])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--block-size", type=int, nargs="+", default=[16])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quantization", help="int8, int4 or w8a8 (default: the checkpoint's float32)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    a = ap.parse_args()
    opts = {"quantization": a.quantization, "kv_cache_dtype": a.kv_cache_dtype}
    rng = np.random.default_rng(0)
    cases = {}
    ps0 = a.block_size[0]
    variants = [(f"page {p}", p, True, True, True) for p in a.block_size] + [
        (f"page {ps0}, XLA readers", ps0, True, False, True),
        (f"page {ps0}, no attention", ps0, False, True, True)]
    if a.quantization == "w8a8" and cpu_kernels.amx_available():
        variants.append((f"page {ps0}, XLA int8 dots", ps0, True, True, False))
    for name, ps, attention, native, amx in variants:
        eng = _engine(ps, attention, native, opts, amx)
        batches = {"decode, 64 rows": _decode_batch(eng, a.context, rng), "prefill row, 512": _prefill_batch(eng, rng)}
        for b in batches.values():
            step_seconds(eng, b, 2)  # traced and compiled now, with this variant's attention
        cases[name] = (eng, batches)
    packed.paged_rows_attention, packed.prefill_row_attention = REAL
    times = {}
    for _ in range(a.rounds):
        for name, (eng, batches) in cases.items():
            for kind, b in batches.items():
                times.setdefault((kind, name), []).extend(step_seconds(eng, b, 2))
    print(f"context {a.context}, quantization {a.quantization}, KV {a.kv_cache_dtype}; ms per step")
    for (kind, name), ts in sorted(times.items()):
        print(f"  {kind:18s} {name:28s} min {min(ts) * 1e3:7.1f}  median {statistics.median(ts) * 1e3:7.1f}")


if __name__ == "__main__":
    main()
