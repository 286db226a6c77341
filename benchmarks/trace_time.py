"""Tracing and lowering an engine's first steps, side by side for source trees run alternately:
the seconds JAX reports (``jax.monitoring``) for tracing jaxprs, lowering them to MLIR and
loading executables from the persistent compilation cache, while SmolLM2 with n-gram
speculation answers two prompts of 6 tokens (warm caches: round 0 fills them, not counted).

    git worktree add /tmp/before <commit>
    python benchmarks/trace_time.py --trees before=/tmp/before after=. [--rounds 5]

Results: benchmarks/RESULTS.md, "Start-up".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVENTS = {"trace": "/jax/core/compile/jaxpr_trace_duration", "lower": "/jax/core/compile/jaxpr_to_mlir_module_duration",
          "cache load": "/jax/compilation_cache/cache_retrieval_time_sec"}

_CHILD = r"""
import json, time
from jax import monitoring
tot = {}
monitoring.register_event_duration_secs_listener(lambda ev, s, **kw: tot.__setitem__(ev, tot.get(ev, 0) + s))
from jaxinfer import LLM, SamplingParams, registry
from jaxinfer.llm import enable_compilation_cache
enable_compilation_cache()
llm = LLM(str(registry.fetch("smollm2-135m-instruct", progress=False)), max_model_len=1024, progress=False,
          kv_cache_memory_bytes=256 << 20,
          speculative_config={"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 16})
t = time.perf_counter()
llm.generate(["Copy: a b c a b c a b c", "Hi there"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
tot["first generate"] = time.perf_counter() - t
print("RESULT " + json.dumps(tot))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", nargs="+", default=[f"this={ROOT}"], help="NAME=PATH of each source tree")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    trees = dict(t.split("=", 1) for t in a.trees)
    what = {**EVENTS, "first generate": "first generate"}
    res = {(name, k): [] for name in trees for k in what}
    for r in range(a.rounds + 1):
        for name, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()), JAX_PLATFORMS="cpu")
            p = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True,
                               cwd=tree)
            got = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
            line = ", ".join(f"{k} {got.get(ev, 0.0):.2f} s" for k, ev in what.items())
            print(f"round {r}{' (warm-up)' if not r else ''} {name}: {line}", flush=True)
            if r:
                for k, ev in what.items():
                    res[(name, k)].append(got.get(ev, 0.0))
    for (name, k), v in res.items():
        print(f"{name:10s} {k:15s} {' '.join(f'{x:.2f}' for x in v)}  median {statistics.median(v):.2f} s")


if __name__ == "__main__":
    main()
