"""benchmarks/engine_overhead.py and vocab_ceiling.py, run end to end at toy sizes in their own
processes, so a change to the engine's internals that they call cannot leave them broken.
Nothing here measures speed: only that each finishes and prints its table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT / "benchmarks",
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_engine_overhead_runs_and_counts_no_second_build():
    out = _run("engine_overhead.py", "--tiny", "--batch", "2", "--new", "12", "--repeats", "1", "--prompt", "16",
               "--num-scheduler-steps", "1", "4")
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] == ["2"]]
    assert [r[1] for r in rows] == ["1", "4"], out
    assert all(r[-2] == "0" for r in rows), out  # a warm second generate builds nothing


def test_vocab_ceiling_runs_every_row():
    out = _run("vocab_ceiling.py", "--batch", "2", "--iters", "2", "--repeats", "1")
    for row in ("LM head", "head + sampler", "step", "step, dispatched", "matmul GFLOP/s"):
        assert row in out, out
