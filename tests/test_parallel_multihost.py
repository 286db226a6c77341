"""Parallelism over two processes on 127.0.0.1 joined by jax.distributed, 4 CPU devices each
(jax's CPU backend runs cross-process collectives over gloo).

* ``LLM`` on one global mesh: data 2 across the processes x model 4 within each, every process
  running the same requests (SPMD); greedy tokens equal one process on one device.
* ``jaxinfer batch --tensor-parallel-size 4``: each process keeps tensor parallelism on its own
  4 devices and answers its share of the input lines (data parallelism across hosts is the
  batch job's split of lines); the ids and greedy tokens equal one process's.
* ``jaxinfer batch --tensor-parallel-size 4 --data-parallel-size 2``: one global mesh, so the
  batch job runs SPMD: every process runs every request, process 0 alone writes OUTPUT
  (resuming what is there); the ids and greedy tokens equal one process on one device. Two
  processes reading different inputs both refuse, exit 2.
"""

import json
import re
import socket
import subprocess
import sys
import textwrap

import pytest

from jaxinfer.batch import part_path
from tests.batch_testing import batch_cmd, by_id, completion, read_jsonl, subprocess_env, write_jsonl

_PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time", "Hi there"]

_LLM = textwrap.dedent("""
    import sys, jax
    port, pid, model = sys.argv[1], sys.argv[2], sys.argv[3]
    if pid != "single":
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=int(pid))
    from jaxinfer import LLM, SamplingParams
    kw = dict(tensor_parallel_size=4, data_parallel_size=2) if pid != "single" else {}
    llm = LLM(model, progress=False, max_model_len=256, max_num_seqs=4, **kw)
    if pid != "single":  # one mesh over both processes' devices, a model group per process
        assert dict(llm.mesh.shape) == {"data": 2, "stage": 1, "model": 4}, llm.mesh
        rows = llm.mesh.devices.reshape(2, -1)
        assert {d.process_index for d in rows[0]} == {0} and {d.process_index for d in rows[1]} == {1}
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    print("OUT", [o.outputs[0].token_ids for o in llm.generate(%r, sp, use_tqdm=False)], flush=True)
""" % _PROMPTS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path_factory, devices: int | None):
    env = subprocess_env(tmp_path_factory.getbasetemp().parent / "jax-compilation-cache")
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def test_llm_on_one_global_mesh_over_two_processes_equals_one_device(tiny_gguf, tmp_path_factory):
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _LLM, str(port), str(pid), str(tiny_gguf)],
                              env=_env(tmp_path_factory, 4), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for pid in (0, 1)]
    one = subprocess.run([sys.executable, "-c", _LLM, "0", "single", str(tiny_gguf)], env=_env(tmp_path_factory, None),
                         capture_output=True, text=True, timeout=600)
    results = [p.communicate(timeout=600) for p in procs]
    assert one.returncode == 0, one.stderr[-3000:]
    want = [x for x in one.stdout.splitlines() if x.startswith("OUT")]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
        assert [x for x in out.splitlines() if x.startswith("OUT")] == want


@pytest.mark.slow
def test_batch_tensor_parallel_4_per_process_two_processes_equal_one(tiny_gguf, tmp_path, tmp_path_factory):
    lines = [completion(f"id-{i}", f"Say {i}", max_tokens=4, temperature=0) for i in range(8)]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    one = tmp_path / "one.jsonl"
    r = subprocess.run(batch_cmd(inp, one, tiny_gguf), env=_env(tmp_path_factory, None), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    two = tmp_path / "two.jsonl"
    port = _free_port()
    procs = [subprocess.Popen(batch_cmd(inp, two, tiny_gguf, "--tensor-parallel-size", 4, "--coordinator-address",
                                        f"127.0.0.1:{port}", "--num-processes", 2, "--process-id", pid),
                              env=_env(tmp_path_factory, 4), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for pid in (0, 1)]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
        assert "requests answered" in err
    a, b = by_id(read_jsonl(one)), by_id(read_jsonl(two))
    assert sorted(a) == sorted(b) == sorted(f"id-{i}" for i in range(8))
    text = lambda r: r["response"]["body"]["choices"][0]["text"]  # noqa: E731
    assert {k: text(v) for k, v in a.items()} == {k: text(v) for k, v in b.items()}
    # process 1 answered a share (process 0 reports the sum of both)
    share = int(results[1][1].split("this run: ")[1].split(" requests")[0])
    assert 0 < share < 8, share


def _two_processes(inputs, out, model, *extra, env):
    """``jaxinfer batch`` as processes 0 and 1 of one jax.distributed job; [(rc, stderr)]."""
    port = _free_port()
    procs = [subprocess.Popen(batch_cmd(inp, out, model, *extra, "--coordinator-address", f"127.0.0.1:{port}",
                                        "--num-processes", 2, "--process-id", pid),
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for pid, inp in enumerate(inputs)]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    return [(p.returncode, err) for p, err in zip(procs, errs)]


@pytest.mark.slow  # 30 s: three two-process runs; the global-mesh LLM test and tests/test_batch_resume.py cover its parts
def test_batch_on_one_global_mesh_resumes_and_equals_one_device(tiny_gguf, tmp_path, tmp_path_factory):
    lines = [completion(f"id-{i}", f"Say {i}", max_tokens=4, temperature=0) for i in range(8)]
    lines[3:3] = ["{broken"]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    one = tmp_path / "one.jsonl"
    r = subprocess.run(batch_cmd(inp, one, tiny_gguf), env=_env(tmp_path_factory, None), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows_one = read_jsonl(one)
    assert len(rows_one) == 9

    # an earlier run answered three ids and was killed in the middle of the fourth line
    two = tmp_path / "two.jsonl"
    answered = [x for x in rows_one if x["custom_id"] in ("id-0", "id-5", "id-7")]
    two.write_bytes(b"".join(json.dumps(x).encode() + b"\n" for x in answered) + b'{"id":"batch_req_')
    metrics = tmp_path / "metrics.json"
    results = _two_processes([inp, inp], two, tiny_gguf, "--tensor-parallel-size", 4, "--data-parallel-size", 2,
                             "--order", "input", "--metrics-out", metrics, env=_env(tmp_path_factory, 4))
    for pid, (rc, err) in enumerate(results):
        assert rc == 0, err[-3000:]
        # every process ran the six requests left (one program over both); process 0 wrote them
        assert f"process {pid} of 2: 9 of 9 requests answered (8 ok, 1 failed)" in err, err[-3000:]
        assert re.search(f"process {pid} of 2: this run: 6 requests \\(3 answered before\\)", err), err[-3000:]

    rows_two = read_jsonl(two)
    assert len(rows_two) == 9 and [x["error"]["line"] for x in rows_two if x["custom_id"] is None] == [4]
    a, b = by_id(rows_one), by_id(rows_two)
    assert sorted(b) == sorted(f"id-{i}" for i in range(8))
    text = lambda r: r["response"]["body"]["choices"][0]["text"]  # noqa: E731
    assert {k: text(v) for k, v in a.items()} == {k: text(v) for k, v in b.items()}
    for k in ("id-0", "id-5", "id-7"):  # kept as they were, not answered again
        assert b[k]["id"] == a[k]["id"]
    assert [x["custom_id"] for x in rows_two] == ["id-0", "id-1", "id-2", None, "id-3", "id-4", "id-5", "id-6",
                                                  "id-7"]  # --order input, by process 0
    assert not part_path(two, 0, 2).exists() and not part_path(two, 1, 2).exists()
    assert not list(tmp_path.glob("two.jsonl.*"))
    m = json.loads(metrics.read_text())
    assert m["processes"] == 2 and m["requests"]["total"] == 9 and m["requests"]["ok"] == 8


def test_batch_on_one_global_mesh_refuses_different_inputs(tiny_gguf, tmp_path, tmp_path_factory):
    a = write_jsonl(tmp_path / "a.jsonl", [completion("x", "Say 1", max_tokens=2)])
    b = write_jsonl(tmp_path / "b.jsonl", [completion("x", "Say 2", max_tokens=2)])
    out = tmp_path / "out.jsonl"
    results = _two_processes([a, b], out, tiny_gguf, "--tensor-parallel-size", 4, "--data-parallel-size", 2,
                             env=_env(tmp_path_factory, 4))
    for rc, err in results:
        assert rc == 2, err[-3000:]
        assert "jaxinfer: error: process" in err and "reads a different input" in err, err[-3000:]
    assert not out.exists()


_VOTES = textwrap.dedent("""
    import signal, sys, jax
    port, pid = sys.argv[1], int(sys.argv[2])
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    from jaxinfer.batch.distributed import _Spmd, coordination_client
    from jaxinfer.batch.signals import _StopSignals
    sync, stop = _Spmd(pid, 2), _StopSignals(5.0)
    votes = []
    for k in range(5):
        if pid == 1 and k == 3:
            stop.signum = signal.SIGTERM  # as the handler sets it, on process 1 only
        votes.append(sync.stop_vote(stop.signum))
        if votes[-1] is not None:
            stop.adopt(votes[-1])
    print("VOTES", votes, "STOP", int(stop.signum), stop.hard, flush=True)
    coordination_client().wait_at_barrier("votes-done", 60_000)
    print("LEFT", sorted(k.rsplit("/stop/", 1)[1] for k, _ in coordination_client().key_value_dir_get(
        sync.prefix + "/stop/")), flush=True)
""")


def test_stop_vote_stops_every_process_at_the_same_request(tmp_path_factory):
    """A SIGTERM on one process of an SPMD job: every process sees it at the same pull, and the
    votes of finished pulls are deleted from the key-value store (it stays small on long jobs)."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _VOTES, str(port), str(pid)], env=_env(tmp_path_factory, None),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for pid in (0, 1)]
    for pid, p in enumerate(procs):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        assert "VOTES [None, None, None, 15, 15] STOP 15 False" in out, out  # stopping, in its grace period
        assert ("SIGTERM on another process: admitting no more requests" in err) == (pid == 0), err[-3000:]
        assert "LEFT ['4/0', '4/1']" in out, out
