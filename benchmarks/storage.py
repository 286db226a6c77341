"""Object storage against local disk, on a GCS emulator started here on 127.0.0.1 (through gcsfs):

* ``job``: a batch job of N request lines (default 10,000) on the tiny random Llama the tests use
  (SmolLM2's tokenizer, 2 layers of width 64), its output to a local file and to ``gs://``
  (parts of ``--part-lines``, joined at the end), interleaved, the same model and warm
  compilations; requests per second of each.
* ``read``: one object of ``--gib`` GiB read from the emulator as one stream (8 MiB read-ahead)
  and by parallel range requests (``bucket.RemoteFile``: 32 MiB chunks, 8 requests of 4 MiB in
  flight), as the safetensors loader reads. The emulator is local and single-process: this shows
  whether the reads overlap, not what a network gives.
* ``load``: a random Llama-shaped safetensors checkpoint of about ``--gib`` GiB loaded in a fresh
  process from local disk and from the emulator: seconds and peak host memory.

    python benchmarks/storage.py job --lines 10000 --repeats 2
    python benchmarks/storage.py read --gib 1
    python benchmarks/storage.py load --gib 1

Needs the test extra (gcsfs, gcp-storage-emulator) and, for ``job``, the SmolLM2 registry model
(its tokenizer); prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _emulator():
    from tests.storage_servers import reset_clients, start_gcs

    store = start_gcs()
    os.environ.update(store.env)
    reset_clients()
    return store


def _requests(n: int) -> list[str]:
    return [json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"model": "m", "prompt": f"Question {i}: what is {i} plus {i}?", "max_tokens": 4,
                                 "temperature": 0}}) for i in range(n)]


def job(a) -> None:
    from jaxinfer import LLM, registry, storage
    from jaxinfer.batch import run_batch
    from tests.tiny_gguf import write_tiny_llama

    store = _emulator()
    try:
        tmp = Path(tempfile.mkdtemp())
        model = tmp / "tiny.gguf"
        write_tiny_llama(model, registry.fetch("smollm2-135m-instruct", progress=False), layers=2, d=64, heads=4,
                         kv_heads=2, ff=128, context=512)
        llm = LLM(str(model), progress=False, max_num_seqs=a.max_num_seqs, kv_cache_memory_bytes=256 << 20)
        inp = tmp / "in.jsonl"
        inp.write_text("\n".join(_requests(a.lines)) + "\n")
        warm = tmp / "warm.jsonl"
        warm.write_text("\n".join(_requests(min(a.lines, 4 * a.max_num_seqs))) + "\n")
        run_batch(llm, warm, tmp / "warm-out.jsonl", progress=False)
        fs = storage.filesystem(storage.parse("gs://bench/x"))
        fs.mkdir("bench")
        rates = {"local": [], "gs": []}
        for r in range(a.repeats):
            for where in ("local", "gs"):
                out = str(tmp / f"out-{r}.jsonl") if where == "local" else f"gs://bench/out-{r}.jsonl"
                t0 = time.perf_counter()
                s = run_batch(llm, inp, out, progress=False, part_lines=a.part_lines)
                wall = time.perf_counter() - t0
                assert s.result.answered == a.lines and s.interrupted is None
                rates[where].append(a.lines / wall)
                print(json.dumps({"what": "job", "output": where, "lines": a.lines, "repeat": r,
                                  "wall_s": round(wall, 2), "req_per_s": round(a.lines / wall, 1)}), flush=True)
        loc, gs = statistics.median(rates["local"]), statistics.median(rates["gs"])
        print(json.dumps({"what": "job summary", "lines": a.lines, "part_lines": a.part_lines,
                          "local_req_per_s": round(loc, 1), "gs_req_per_s": round(gs, 1),
                          "gs_over_local": round(gs / loc, 3), **_machine()}))
    finally:
        from tests.storage_servers import stop

        stop(store)


def read(a) -> None:
    import numpy as np

    from jaxinfer import bucket, storage

    store = _emulator()
    try:
        size = int(a.gib * (1 << 30))
        u = storage.parse("gs://bench/weights.bin")
        fs = storage.filesystem(u)
        fs.mkdir("bench")
        data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
        t0 = time.perf_counter()
        storage.put(u, data)
        print(json.dumps({"what": "upload", "bytes": size, "s": round(time.perf_counter() - t0, 2)}), flush=True)
        for r in range(a.repeats):
            t0 = time.perf_counter()
            got = 0
            with storage.open_read(u, block_size=8 << 20) as f:
                while block := f.read(32 << 20):
                    got += len(block)
            one = time.perf_counter() - t0
            assert got == size
            print(json.dumps({"what": "read", "how": "one stream, 8 MiB read-ahead", "bytes": size, "repeat": r,
                              "MiB_s": round(size / one / (1 << 20), 1), **_machine()}), flush=True)
            for range_mib, in_flight in a.ranges:
                bucket.RANGE_BYTES, bucket.RANGE_REQUESTS = range_mib << 20, in_flight
                chunk = (range_mib << 20) * in_flight
                rf = bucket.RemoteFile(u, size)
                t0 = time.perf_counter()
                for start in range(0, size, chunk):
                    got = rf.read(start, min(start + chunk, size))
                par = time.perf_counter() - t0
                assert got == data[-len(got):]
                print(json.dumps({"what": "read", "how": f"ranges of {range_mib} MiB, {in_flight} in flight",
                                  "bytes": size, "repeat": r, "MiB_s": round(size / par / (1 << 20), 1),
                                  **_machine()}), flush=True)
    finally:
        from tests.storage_servers import stop

        stop(store)


def load(a) -> None:
    """A random Llama-shaped Hugging Face checkpoint of about ``--gib`` GiB (bfloat16, 4 shards),
    loaded in a fresh process from local disk and from the emulator (safetensors read in place):
    seconds and peak resident memory above the process's baseline (``tests.random_hf``)."""
    from jaxinfer import registry
    from tests.random_hf import SHAPE_2GB, measure_load, write_llama

    store = _emulator()
    try:
        tmp = Path(tempfile.mkdtemp())
        layers = max(1, round((a.gib * (1 << 30) / 2 - 2 * 32000 * 2048) / 62_914_560))
        sizes = write_llama(tmp / "hf", dtype="bfloat16", shards=4, **(SHAPE_2GB | {"n_layers": layers}))
        from jaxinfer import storage

        storage.filesystem(storage.parse("gs://bench/x")).mkdir("bench")
        t0 = time.perf_counter()
        for p in sorted((tmp / "hf").iterdir()):
            storage.put(storage.parse(f"gs://bench/hf/{p.name}"), p.read_bytes())
        print(json.dumps({"what": "upload", "bytes": sizes["weights_bytes"], "s": round(time.perf_counter() - t0, 1)}),
              flush=True)
        staged = registry.resolve("gs://bench/hf", download_dir=tmp / "staged")
        for r in range(a.repeats):
            for where, path in (("local", tmp / "hf"), ("gs", staged)):
                m = measure_load(path, dtype="bfloat16", timeout=1800)
                print(json.dumps({"what": "load", "from": where, "repeat": r, "weights_bytes": m["weights_bytes"],
                                  "largest_tensor_bytes": sizes["largest_tensor_bytes"],
                                  "seconds": round(m["seconds"], 2),
                                  "peak_rss_above_baseline_MiB": round(m["peak_rss_above_baseline"] / (1 << 20), 1),
                                  **_machine()}), flush=True)
    finally:
        from tests.storage_servers import stop

        stop(store)


def _machine() -> dict:
    return {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "python": platform.python_version()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    j = sub.add_parser("job")
    j.add_argument("--lines", type=int, default=10_000)
    j.add_argument("--part-lines", type=int, default=1000)
    j.add_argument("--max-num-seqs", type=int, default=64)
    j.add_argument("--repeats", type=int, default=2)
    r = sub.add_parser("read")
    r.add_argument("--gib", type=float, default=1.0)
    r.add_argument("--repeats", type=int, default=2)
    r.add_argument("--ranges", type=lambda t: tuple(map(int, t.split("x"))), nargs="+",
                   default=[(4, 8), (32, 1), (32, 8)], help="RANGE_MiBxIN_FLIGHT settings to measure")
    ld = sub.add_parser("load")
    ld.add_argument("--gib", type=float, default=1.0)
    ld.add_argument("--repeats", type=int, default=1)
    a = p.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    {"job": job, "read": read, "load": load}[a.cmd](a)


if __name__ == "__main__":
    main()
