"""Start-up on a TPU: compile the engine's warm-up set for a TPU slice on this host (libtpu, no
TPU needed) and report each executable's compile time, the total and the count.

    python benchmarks/tpu_startup.py --target v6e-1 --model llama-3-8b --sample 4 --threads 2 \\
        --compilation-cache DIR --out OUT

The set is ``engine.warmup.step_shapes`` at the engine's options (``--max-num-seqs``,
``--max-num-batched-tokens``, ``--max-model-len``, ``--block-size``; vLLM's defaults as the
engine's) plus, with ``--num-scheduler-steps`` N > 1, a chained decode per decode shape, plus,
as the engine runs on a TPU (``EngineConfig.separate_sampler``), one sampler per row bucket
beside steps that return their logits (``--no-separate-sampler``: each step samples itself):
what ``Engine.warmup`` compiles. Every step is built as ``jaxinfer.aot`` builds it: abstract weights
and pools with the engine's shardings (the pools as many pages as the engine gives them on the
target: 90% of HBM beside the weights), the Pallas kernels, nothing of the model's size
allocated. ``--layers`` cuts the model (default: all of them); ``--sample N`` compiles N shapes
spread over the set (its extremes included) and projects the whole set from their mean.

``--threads T`` compiles T executables at once, as ``Engine.warmup`` does on its host's cores
(XLA compiles release the GIL). ``--compilation-cache DIR`` writes each executable to JAX's
persistent compilation cache; a second run over the same DIR finds every key there
(``found_in_cache``) and adds no entry (``new_cache_entries``). A TPU host loads them instead of
compiling (``loaded``); a CPU host cannot (deserializing a TPU executable needs a TPU client),
so there each is compiled again and written over its own entry.

Writes ``OUT/report.json``: one record per executable (name, R, width, Tp, chain, lower_s,
compile_s, cpu_s, cache outcome) and a summary (count of the set, compiled, wall, CPU and
summed times, threads, the host's load average before and after). On a shared host the wall
times follow the load; the CPU seconds measure the work.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import threading
import time
import warnings
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
from jax import monitoring  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tpu_compile import HF_CONFIGS, PRESETS, cut, model_config, tree_bytes  # noqa: E402

from jaxinfer import aot, dispatch  # noqa: E402
from jaxinfer import cache as kv  # noqa: E402
from jaxinfer.engine.config import EngineConfig, pool_sizes  # noqa: E402
from jaxinfer.engine.warmup import step_shapes  # noqa: E402

# JAX's events: an executable loaded from the cache, and one written to it (also when the key
# was there but could not be loaded: it is compiled and written over the same entry)
_CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "loaded", "/jax/compilation_cache/cache_misses": "written"}
_NOT_LOADABLE = "Error reading persistent compilation cache entry"


class _CacheCounts:
    """Per thread: what the persistent compilation cache did for the compile running on it
    (JAX's monitoring events, and its warning for an entry found but not loadable here)."""

    def __init__(self):
        self.local = threading.local()
        monitoring.register_event_listener(self._on_event)
        warnings.filterwarnings("always", message=_NOT_LOADABLE)
        self._show = warnings.showwarning
        warnings.showwarning = self._on_warning

    def _on_event(self, event: str, **kwargs):
        if event in _CACHE_EVENTS and getattr(self.local, "counts", None) is not None:
            self.local.counts[_CACHE_EVENTS[event]] += 1

    def _on_warning(self, message, *args, **kwargs):
        if _NOT_LOADABLE in str(message) and getattr(self.local, "counts", None) is not None:
            self.local.counts["found"] += 1
        else:
            self._show(message, *args, **kwargs)

    def start(self):
        self.local.counts = {"loaded": 0, "written": 0, "found": 0}

    def stop(self) -> dict:
        counts, self.local.counts = self.local.counts, None
        return counts


def warmup_set(args) -> list[aot.StepKind]:
    """The executables ``Engine.warmup`` builds at these options (one LoRA-less engine, no drafts)."""
    pages_per_seq = -(-args.max_model_len // args.block_size)
    shapes = step_shapes(max_num_seqs=args.max_num_seqs, page_size=args.block_size,
                         chunk=args.max_num_batched_tokens, pages_per_seq=pages_per_seq, max_len=args.max_model_len,
                         max_prompt=args.max_model_len)
    kinds = []
    apart = args.separate_sampler
    for R in sorted({R for R, _, _ in shapes if R}) if apart else ():
        kinds.append(aot.StepKind(f"sampler-R{R}", rows=R))
    for R, w, Tp in shapes:
        kinds.append(aot.StepKind(f"R{R}-w{w}-Tp{Tp}", rows=R, prefill=Tp, max_segments=min(Tp, args.max_num_seqs),
                                  sample=not apart))
        if R and not Tp and args.num_scheduler_steps > 1:
            kinds.append(aot.StepKind(f"R{R}-w{w}-chain{args.num_scheduler_steps}", rows=R,
                                      chain=args.num_scheduler_steps))
    return kinds


def width_of(kind: aot.StepKind) -> int:
    return int(kind.name.split("-w")[1].split("-")[0]) if "-w" in kind.name else 0


def is_sampler(kind: aot.StepKind) -> bool:
    return kind.name.startswith("sampler-")


def sample(kinds: list, n: int | None) -> list:
    """n of kinds, evenly spread (the first and last included); all of them without n."""
    if not n or n >= len(kinds):
        return list(kinds)
    if n == 1:
        return [kinds[len(kinds) // 2]]
    return [kinds[round(i * (len(kinds) - 1) / (n - 1))] for i in range(n)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="v6e-1", choices=sorted(aot.TARGETS))
    ap.add_argument("--model", default="llama-3-8b", choices=[*HF_CONFIGS, *PRESETS])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=None, help="compile the model cut to this many layers (default: all)")
    ap.add_argument("--sample", type=int, default=None, help="compile this many of the set, spread over it")
    ap.add_argument("--only", nargs="+", default=None, help="compile these executables of the set, by name")
    ap.add_argument("--threads", type=int, default=1, help="executables compiled at once")
    ap.add_argument("--compilation-cache", type=Path, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    ap.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    ap.add_argument("--num-scheduler-steps", type=int, default=1)
    ap.add_argument("--separate-sampler", action=argparse.BooleanOptionalAction, default=True,
                    help="plain steps sample in one executable per row bucket, as the engine on a TPU (default)")
    ap.add_argument("--list", action="store_true", help="print the set's executables and stop")
    args = ap.parse_args(argv)

    kinds = warmup_set(args)
    chosen = [k for k in kinds if k.name in set(args.only)] if args.only else sample(kinds, args.sample)
    if args.list:
        print("\n".join(k.name for k in kinds))
        print(f"{len(kinds)} executables", file=sys.stderr)
        return kinds
    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", str(args.compilation_cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    counts = _CacheCounts()

    target = aot.TARGETS[args.target]
    full = model_config(args.model)
    cfg = cut(full, args.layers) if args.layers else full
    mesh = aot.target_mesh(args.target)
    kernels = aot.target_kernels(mesh)
    full_weights, _ = aot.abstract_weights(full, mesh, kernels)
    weights_chip = tree_bytes(full_weights)
    # the engine's full-length pools on the target: 90% of HBM beside the weights (per chip,
    # the pools split over the model axis as the weights are), at most every slot at full length twice
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          block_size=args.block_size)
    budget = int(0.9 * target.hbm_bytes - weights_chip) * mesh.shape["model"]
    _, num_pages, _ = pool_sizes(full, config, kv.kv_storage_dtype("auto", full),
                                 -(-args.max_model_len // args.block_size), budget,
                                 lanes=dispatch.pool_lanes(kernels))
    weights, _ = aot.abstract_weights(cfg, mesh, kernels)

    def build(kind: aot.StepKind) -> dict:
        work = aot.Workload(context=width_of(kind) * args.block_size, page_size=args.block_size, num_pages=num_pages)
        counts.start()
        t0, c0 = time.perf_counter(), time.process_time()
        with jax.set_mesh(mesh):
            if is_sampler(kind):
                lowered = aot.lower_sampler(cfg, mesh, kind.rows, kernels=kernels)
            else:
                lowered, _ = aot.lower_step(cfg, weights, mesh, kernels, kind, work)
            t1 = time.perf_counter()
            lowered.compile()
        t2, c2 = time.perf_counter(), time.process_time()
        c = counts.stop()
        rec = dict(name=kind.name, rows=kind.rows, width=width_of(kind), prefill=kind.prefill, chain=kind.chain,
                   lower_s=t1 - t0, compile_s=t2 - t1,
                   # the process's CPU seconds meanwhile: this executable's alone with --threads 1
                   cpu_s=c2 - c0, loaded=c["loaded"], written=c["written"],
                   found_in_cache=c["loaded"] + c["found"])
        print(json.dumps(rec), file=sys.stderr, flush=True)
        return rec

    def entries() -> int:
        d = args.compilation_cache
        return len(list(d.glob("*-cache"))) if d and d.is_dir() else 0  # one file per executable

    entries_before = entries()
    load_before = os.getloadavg()
    t0, c0 = time.perf_counter(), time.process_time()
    with concurrent.futures.ThreadPoolExecutor(max(1, args.threads)) as pool:
        records = list(pool.map(build, chosen))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n_set = len(kinds)
    summed = sum(r["lower_s"] + r["compile_s"] for r in records)
    summary = dict(
        target=args.target, model=args.model, layers=cfg.n_layers, n_layers=full.n_layers,
        options=dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                     max_model_len=args.max_model_len, block_size=args.block_size,
                     num_scheduler_steps=args.num_scheduler_steps, separate_sampler=args.separate_sampler),
        num_pages=num_pages, executables_in_set=n_set, compiled=len(records), threads=args.threads,
        # CPU seconds of the whole compile (every thread): on a loaded host, the work itself
        wall_s=wall, cpu_s=cpu, summed_s=summed, mean_s=summed / max(len(records), 1),
        # the whole set at this sample's mean, on this many threads
        projected_set_wall_s=summed / max(len(records), 1) * n_set / max(1, args.threads),
        loaded=sum(r["loaded"] for r in records), written=sum(r["written"] for r in records),
        found_in_cache=sum(r["found_in_cache"] for r in records), new_cache_entries=entries() - entries_before,
        load_avg_before=load_before, load_avg_after=os.getloadavg(), cpus=os.cpu_count(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(dict(summary=summary, executables=records), indent=1))
    print(json.dumps(summary), file=sys.stderr)
    return summary, records


if __name__ == "__main__":
    main()
