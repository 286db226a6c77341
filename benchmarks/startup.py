"""Start-up, side by side: the README's main job (warm caches, wall time of the process) and
`jaxinfer generate` to its first stdout byte, for two source trees run alternately.

    git worktree add /tmp/before <commit>
    python benchmarks/startup.py --trees before=/tmp/before after=. [--rounds 5]

Each tree runs as `python -m jaxinfer` with PYTHONPATH pointing at it, sharing this venv and
$JAXINFER_HOME (the model and the persistent compilation cache). Round 0 warms the caches and
is not counted. Prints each round and the medians. Results: benchmarks/RESULTS.md, "Start-up".
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", nargs="+", default=[f"this={ROOT}"], help="NAME=PATH of each source tree")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    trees = dict(t.split("=", 1) for t in a.trees)
    res = {(name, what): [] for name in trees for what in ("job", "generate")}
    for r in range(a.rounds + 1):
        for name, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
            with tempfile.TemporaryDirectory() as tmp:
                t = time.perf_counter()
                subprocess.run([sys.executable, "-m", "jaxinfer", "batch", str(ROOT / "examples/requests.jsonl"),
                                "-o", f"{tmp}/out.jsonl", "--no-progress"], env=env, check=True, capture_output=True)
                job = time.perf_counter() - t
            t = time.perf_counter()
            p = subprocess.Popen([sys.executable, "-m", "jaxinfer", "generate", "--prompt", "The capital of France is",
                                  "--max-tokens", "32"], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            p.stdout.read(1)
            gen = time.perf_counter() - t
            p.stdout.read()
            p.wait()
            if r:
                res[(name, "job")].append(job)
                res[(name, "generate")].append(gen)
            print(f"round {r}{' (warm-up)' if not r else ''} {name}: main job {job:.2f} s, "
                  f"generate first byte {gen:.2f} s", flush=True)
    for (name, what), v in res.items():
        print(f"{name:10s} {what:9s} {' '.join(f'{x:.2f}' for x in v)}  median {statistics.median(v):.2f} s")


if __name__ == "__main__":
    main()
