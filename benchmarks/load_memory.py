"""Peak host memory and time of loading a 2 GB multi-shard Hugging Face checkpoint.

    python benchmarks/load_memory.py [--dir DIR] [--keep] [--dtype bfloat16] [--layers 14]
                                     [--shards 4] [--trees NAME=PATH ...]
    python benchmarks/load_memory.py --checkpoint FILE_OR_DIR [--trees NAME=PATH ...]

Writes a random Llama-shaped bfloat16 checkpoint (``tests.random_hf.SHAPE_2GB``: width 2048,
14 layers, MLP 8192, 32000-token vocabulary, 1.01 billion parameters, 2.02 GB; ``--dtype
float32 --layers 6`` is 2.03 GB of float32) as safetensors shards, then loads it in a fresh
process per case: bfloat16 on one CPU device, bfloat16 split over two virtual CPU devices
(tensor parallel, as ``LLM(tensor_parallel_size=2)`` splits it), and float32 (the CPU
default) on one. Each process reports its peak resident memory above its resident memory
before the load. On CPU the loaded weights are host memory themselves, so the figure that
matters is the transient: peak minus the weights' bytes, to compare with one shard file and
with the largest tensor (in the loaded dtype).

--trees measures other source trees' jaxinfer on the same checkpoint, case by case in turn
(``git archive <commit> jaxinfer | tar -x -C /tmp/before`` makes one). The checkpoint is
deleted afterwards unless --keep (with --dir, an existing checkpoint there is reused).
--checkpoint measures an existing checkpoint of any format (a GGUF file, say) the same way.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's jaxinfer and tests, not an installed one

from tests.random_hf import SHAPE_2GB, checkpoint_sizes, measure_load, write_llama  # noqa: E402

CASES = (("bfloat16", 1), ("bfloat16", 2), ("float32", 1))
MiB = 2**20


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", help="where to write the checkpoint (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="stored dtype")
    ap.add_argument("--layers", type=int, default=SHAPE_2GB["n_layers"])
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--checkpoint", help="measure this existing checkpoint (any format) instead; kept")
    ap.add_argument("--trees", nargs="+", default=[f"this={ROOT}"], help="NAME=PATH of each source tree")
    a = ap.parse_args()
    trees = dict(t.split("=", 1) for t in a.trees)
    print(f"cpu: {cpu_model()}, Python {platform.python_version()}")
    if a.checkpoint:
        path = Path(a.checkpoint).expanduser()
        info = checkpoint_sizes(path) if (path / "model.safetensors.index.json").is_file() else None
        print(f"checkpoint: {path}")
        report(path, info, trees)
        return
    path = Path(a.dir or tempfile.mkdtemp(prefix="load_memory_")) / "model"
    try:
        t = time.perf_counter()
        if (path / "model.safetensors.index.json").is_file():
            info = checkpoint_sizes(path)
            print(f"reusing {path}")
        else:
            info = write_llama(path, dtype=a.dtype, shards=a.shards, n_layers=a.layers)
            print(f"wrote {path} in {time.perf_counter() - t:.1f} s")
        stored = json.loads((path / "config.json").read_text())["torch_dtype"]
        print(f"checkpoint: {stored}, {info['weights_bytes'] / MiB:.0f} MiB in {info['shards']} shards, "
              f"largest shard {info['largest_shard_bytes'] / MiB:.0f} MiB, largest tensor "
              f"{info['largest_tensor_bytes'] / MiB:.0f} MiB")
        report(path, info, trees)
    finally:
        if not a.keep:
            shutil.rmtree(path, ignore_errors=True)
            if not a.dir:
                shutil.rmtree(path.parent, ignore_errors=True)


def report(path: Path, info: dict | None, trees: dict) -> None:
    """One line per case and tree. info: the sizes of a safetensors checkpoint, for the ratios
    to its largest shard and tensor (None for other formats: no ratios)."""
    print(f"{'tree':>8} {'load as':>9} {'TP':>2} {'weights MiB':>11} {'per device MiB':>14} "
          f"{'peak RSS MiB':>12} {'transient MiB':>13} {'/ shard':>7} {'/ tensor':>8} {'seconds':>7}")
    for dtype, tp in CASES:
        for name, tree in trees.items():
            try:
                r = measure_load(path, dtype=dtype, tp=tp, tree=tree)
            except RuntimeError as e:  # a model TP does not divide
                print(f"{name:>8} {dtype:>9} {tp:>2} failed: {str(e).strip().splitlines()[-1]}")
                continue
            transient = r["peak_rss_above_baseline"] - r["weights_bytes"]
            per_device = max(r["device_bytes"].values())
            ratios = f"{'-':>7} {'-':>8}"
            if info is not None:
                tensor = info["largest_tensor_bytes"] * r["weights_bytes"] / info["weights_bytes"]
                ratios = f"{transient / info['largest_shard_bytes']:>7.2f} {transient / tensor:>8.2f}"
            print(f"{name:>8} {dtype:>9} {tp:>2} {r['weights_bytes'] / MiB:>11.0f} {per_device / MiB:>14.0f} "
                  f"{r['peak_rss_above_baseline'] / MiB:>12.0f} {transient / MiB:>13.0f} {ratios} "
                  f"{r['seconds']:>7.1f}")


if __name__ == "__main__":
    main()
