"""Batch jobs run in bounded memory: the input is streamed and requests reach the engine a
window at a time, so what grows with the input is one small key per request, never the lines.

The default test drives ``run_batch`` with an instant stand-in for the engine (the LLM API the job
uses, with ``generate_stream``'s windowed pull) and compares the Python heap peak of a 500- and
a 3,000-line file of fat lines. The slow test runs the real command on the tiny model over
100,000 lines with ``max_tokens=1`` and samples the process's resident memory.
"""

import json
import subprocess
import time
import tracemalloc
from itertools import islice

import pytest

from jaxinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tests.batch_testing import batch_cmd, read_jsonl, subprocess_env


def _write_input(path, n: int, pad: int = 1000):
    """n completions with max_tokens=1, each line carrying ``pad`` bytes the job must not keep."""
    with open(path, "w") as f:
        for i in range(n):
            body = {"prompt": f"Request {i}", "max_tokens": 1, "metadata": {"pad": "x" * pad}}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    return path


class _Cfg:
    vocab_size = 100


class InstantLLM:
    """The parts of LLM a batch job uses; answers each request with one token at once."""

    max_model_len = 64
    cfg = _Cfg()
    model_path = "instant"
    tokenizer = None
    sampling_defaults: dict = {}
    window = 32

    def __init__(self):
        self.in_flight = self.max_in_flight = 0

    def encode_prompt(self, p, i=0):
        return p, [1, 2, 3]

    def encode_chat(self, conv, i=0):
        return "chat", [1, 2, 3]

    def generate_stream(self, requests, *, window=None, on_sequence_done=None):
        it = iter(requests)
        while chunk := list(islice(it, self.window)):
            self.in_flight += len(chunk)
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            for rid, text, ids, p, *_lora in chunk:
                now = time.perf_counter()
                self.in_flight -= 1
                c = CompletionOutput(0, "y", [7], None, None, "length")
                yield RequestOutput(rid, text, ids, None, [c], True,
                                    RequestMetrics(now, now, now, now, now, 1))


def _heap_peak(tmp_path, n: int) -> tuple[int, InstantLLM]:
    from jaxinfer.batch import run_batch

    inp = _write_input(tmp_path / f"in{n}.jsonl", n)
    llm = InstantLLM()
    tracemalloc.start()
    try:
        s = run_batch(llm, inp, tmp_path / f"out{n}.jsonl", progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert s.complete and s.result.ok == n
    return peak, llm


def test_memory_does_not_grow_with_the_input(tmp_path):
    _heap_peak(tmp_path, 100)  # first-use caches
    small, llm = _heap_peak(tmp_path, 500)
    large, llm = _heap_peak(tmp_path, 3_000)
    # 2,500 more lines are 2.7 MB more input (far more once parsed); the job keeps ~100 bytes a
    # line (the first line of each custom_id)
    assert large - small < 1_000_000, (small, large)
    assert llm.max_in_flight <= llm.window  # the engine saw one window at a time
    rows = read_jsonl(tmp_path / "out3000.jsonl")
    assert len(rows) == 3_000 and len({r["custom_id"] for r in rows}) == 3_000


@pytest.mark.slow
def test_100k_lines_tiny_model_bounded_rss(tiny_gguf, tmp_path, tmp_path_factory):
    import psutil

    n = 100_000
    inp = _write_input(tmp_path / "in.jsonl", n, pad=2000)  # ~210 MB
    out = tmp_path / "out.jsonl"
    env = subprocess_env(tmp_path_factory.getbasetemp().parent / "jax-compilation-cache")
    p = subprocess.Popen(batch_cmd(inp, out, tiny_gguf, "--max-num-seqs", 256, "--max-model-len", 32),
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    proc = psutil.Process(p.pid)
    baseline = peak = None
    while p.poll() is None:
        try:
            rss = proc.memory_info().rss
        except psutil.NoSuchProcess:
            break
        done = out.stat().st_size if out.exists() else 0
        if baseline is None and done > 0 and out.read_bytes().count(b"\n") >= n // 10:
            baseline = peak = rss  # the engine is warm and a tenth is done
        elif baseline is not None:
            peak = max(peak, rss)
        time.sleep(0.5)
    assert p.wait() == 0, p.stderr.read()[-3000:]
    assert baseline is not None
    print(f"RSS after 10,000 lines {baseline / 2**20:.0f} MiB, peak after {peak / 2**20:.0f} MiB")
    # holding the remaining 90,000 lines would take ~190 MB of text alone; what does grow (~50 MB
    # seen) is native: executables for new shapes, allocator arenas
    assert peak - baseline < 96 * 2**20, (baseline, peak)
    with open(out, "rb") as f:
        assert sum(1 for _ in f) == n
