"""Multi-host batch jobs: two processes on 127.0.0.1 joined by jax.distributed (CPU), each running
its own copy of the tiny model over its share of the input lines, answer the same set of ids
(and error lines) as one process; process 0 merges the parts in input order and sums the
metrics of both."""

import json
import re
import socket
import subprocess

from jaxinfer.batch import part_path, run_batch
from tests.batch_testing import (
    batch_cmd,
    by_id,
    chat,
    completion,
    read_jsonl,
    subprocess_env,
    write_jsonl,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keys(rows):
    return sorted((r["custom_id"] is None, r["custom_id"] or r["error"]["line"]) for r in rows)


def test_two_processes_answer_what_one_does(tiny_llm, tiny_gguf, tmp_path, tmp_path_factory):
    lines = []
    for i in range(16):
        make = chat if i % 2 else completion
        lines.append(make(f"id-{i}", f"Say {i}", max_tokens=1 + i % 3, temperature=0))
    lines[5:5] = ["{broken", completion("id-3", "a duplicate"), completion("bad", "x", n=-1)]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)

    one = tmp_path / "one.jsonl"
    run_batch(tiny_llm, inp, one, progress=False)

    two = tmp_path / "two.jsonl"
    metrics = tmp_path / "metrics.json"
    env = subprocess_env(tmp_path_factory.getbasetemp().parent / "jax-compilation-cache")
    port = _free_port()
    procs = [subprocess.Popen(batch_cmd(inp, two, tiny_gguf, "--order", "input", "--metrics-out", metrics,
                                        "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", 2,
                                        "--process-id", pid),
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for pid in (0, 1)]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]

    rows_one, rows_two = read_jsonl(one), read_jsonl(two)
    assert _keys(rows_two) == _keys(rows_one) and len(rows_two) == len(lines)
    got = by_id(rows_two)
    assert got["bad"]["response"]["status_code"] == 400
    assert all(got[f"id-{i}"]["response"]["status_code"] == 200 for i in range(16))
    # --order input: the merged file follows the input
    order = {}
    for n, x in enumerate(inp.read_text().splitlines(), 1):
        if x.startswith('{"'):
            order.setdefault(json.loads(x)["custom_id"], n)
    positions = [r["error"]["line"] if r["custom_id"] is None else order[r["custom_id"]] for r in rows_two]
    assert positions == sorted(positions)
    assert not part_path(two, 0, 2).exists() and not part_path(two, 1, 2).exists()

    # each process answered a share; process 0 reports the sum
    for pid, (_, err) in enumerate(results):
        assert f"process {pid} of 2: " in err
    share = int(re.search(r"process 1 of 2: this run: (\d+) requests", results[1][1]).group(1))
    assert 0 < share < len(lines)
    m = json.loads(metrics.read_text())
    assert m["processes"] == 2 and m["requests"]["total"] == len(lines)
    assert m["requests"]["ok"] == 16 and m["requests"]["failed"] == 3
    assert m["latency"]["ttft_s"]["count"] == 16
    assert m["latency"]["itl_s"]["count"] == sum(  # one gap per token after the first
        r["response"]["body"]["usage"]["completion_tokens"] - 1 for r in got.values()
        if r["response"]["status_code"] == 200)
    assert m["output_tokens"] == sum(r["response"]["body"]["usage"]["completion_tokens"] for r in rows_two
                                     if r["error"] is None and r["response"]["status_code"] == 200)
