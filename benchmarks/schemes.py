"""Batch throughput of each quantization scheme on the batch workload, side by side.

Runs ``jaxinfer bench`` once per scheme and round in its own process (so each scheme
compiles and warms up alone, and a crash in one does not stop the others), rounds
interleaved: round 1 runs every scheme, then round 2, ... Reports medians over rounds of
output tok/s, TTFT and TPOT p50, MFU, compilations, weight bytes and KV bytes per token
(the last three as the bench reports them).

    python benchmarks/schemes.py [--schemes float32 int8 int4 w8a8 w8a8+kv8] [--rounds 1] \\
        [--json benchmarks/schemes.json]

A scheme is ``float32``, a ``--quantization`` value, or either with ``+kv8`` (int8 KV cache).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _split(scheme: str) -> tuple[str | None, str]:
    base, _, kv = scheme.partition("+")
    if kv not in ("", "kv8"):
        raise SystemExit(f"unknown scheme {scheme!r}: a quantization value or float32, optionally +kv8")
    return (None if base == "float32" else base), ("int8" if kv else "auto")


def run_one(model: str, scheme: str, bench_args: list[str]) -> dict:
    q, kv = _split(scheme)
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "bench.json"
        cmd = [sys.executable, "-m", "jaxinfer", "bench", "--model", model, "--json", str(out),
               "--kv-cache-dtype", kv, *bench_args] + (["--quantization", q] if q else [])
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--schemes", nargs="+", default=["float32", "int8", "int4", "w8a8", "w8a8+kv8"])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default=None)
    a, bench_args = ap.parse_known_args()
    bench_args = bench_args or ["--max-model-len", "1024", "--max-num-seqs", "64"]
    started = datetime.datetime.now().astimezone()
    runs: dict[str, list[dict]] = {s: [] for s in a.schemes}
    loads = []
    for r in range(a.rounds):
        for s in a.schemes:
            loads.append(os.getloadavg()[0])
            runs[s].append(run_one(a.model, s, bench_args))
            print(f"round {r + 1} {s}: {runs[s][-1]['output_tok_s']:.1f} output tok/s", flush=True)
    rows = []
    med = statistics.median
    for s in a.schemes:
        b = runs[s]
        rows.append({
            "scheme": s,
            "output_tok_s": med([x["output_tok_s"] for x in b]),
            "ttft_p50_s": med([x["ttft_s"]["p50"] for x in b]),
            "tpot_p50_s": med([x["tpot_s"]["p50"] for x in b]),
            "mfu": med([x.get("mfu", 0.0) for x in b]),
            "compilations": b[-1]["compilations"],
            "weights_bytes": b[-1]["weights_bytes"],
            "kv_bytes_per_token": b[-1]["kv_bytes_per_token"],
            "runs_output_tok_s": [round(x["output_tok_s"], 1) for x in b],
        })
    base = next((r["output_tok_s"] for r in rows if r["scheme"] == "float32"), None)
    lines = ["| scheme | output tok/s | / float32 | TTFT p50 s | TPOT p50 ms | MFU | weights MB | KV B/token | compilations (warm-up + run) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['output_tok_s'] / base:.2f}" if base else "-"
        c = r["compilations"]
        lines.append(f"| {r['scheme']} | {r['output_tok_s']:.1f} | {ratio} | {r['ttft_p50_s']:.1f} | "
                     f"{1e3 * r['tpot_p50_s']:.0f} | {100 * r['mfu']:.1f}% | {r['weights_bytes'] / 1e6:.1f} | "
                     f"{r['kv_bytes_per_token']} | {c['warmup']} + {c['during_run']} |")
    table = "\n".join(lines)
    print(table)
    if a.json:
        Path(a.json).write_text(json.dumps({
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "date": started.isoformat(timespec="seconds"), "platform": platform.platform(),
            "cpu": platform.processor() or _cpu_model(), "loadavg_before_runs": loads,
            "rows": rows, "table": table}, indent=1))


def _cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return ""


if __name__ == "__main__":
    main()
