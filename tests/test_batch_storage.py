"""Batch jobs to and from object storage, against real local servers (the GCS emulator through
gcsfs, moto's S3 server through s3fs): a job from a bucket to a bucket answers what a local job
answers; a rerun skips what any part holds, a part written twice counts once; a second run on
one output is refused while the first holds the lease; a job killed with SIGKILL and rerun
answers every custom_id exactly once (one kill per store here, ten under -m slow); two processes
of a jax.distributed job write one prefix (slow); bad URLs, missing buckets and objects, denied
access and a missing gcsfs each give one line and exit 2."""

import json
import random
import re
import signal
import socket
import subprocess
import time

import pytest

from jaxinfer import storage
from jaxinfer.batch import OutputFileError, run_batch
from jaxinfer.batch.parts import list_parts, parts_prefix
from tests.batch_testing import batch_cmd, by_id, chat, completion, read_jsonl, subprocess_env, write_jsonl


# Each of these runs the job in a subprocess that loads the model, half a minute a store: the
# default suite runs them on S3, and on GCS with the slow tests (the stores' own code is
# covered on both by the tests above them).
ONE_STORE_BY_DEFAULT = pytest.mark.parametrize("store", ["s3", pytest.param("gs", marks=pytest.mark.slow)],
                                               indirect=True)


def _requests(n: int, seed: int = 0):
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        make = chat if i % 3 == 0 else completion
        lines.append(make(f"q{i}", f"Question {i}: what is {i} plus {i}?", max_tokens=rng.randint(2, 8),
                          temperature=0))
    lines.insert(n // 2, "{not json")
    lines.append(completion("q1", "a duplicate id"))
    return lines


def _upload(store, tmp_path, lines, name="in.jsonl") -> str:
    bucket = store.bucket()
    local = write_jsonl(tmp_path / name, lines)
    url = f"{store.scheme}://{bucket}/jobs/{name}"
    storage.put(storage.parse(url), local.read_bytes())
    return url


def _rows(url: str) -> list[dict]:
    data = storage.read(storage.parse(url))
    assert not data or data.endswith(b"\n")
    return [json.loads(x) for x in data.splitlines()]


def _answers(rows) -> dict:
    """custom_id (or error line) -> what the model said: equal between runs of a greedy job."""
    out = {}
    for r in rows:
        key = r["custom_id"] if r["custom_id"] is not None else ("line", r["error"]["line"])
        assert key not in out, f"{key} answered twice"
        body = (r["response"] or {}).get("body") or {}
        out[key] = (r["response"] or {}).get("status_code"), [
            c.get("text", (c.get("message") or {}).get("content")) for c in body.get("choices", ())], r["error"]


@pytest.fixture(scope="module")
def local_answers(tiny_llm, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local")
    inp = write_jsonl(tmp / "in.jsonl", _requests(12))
    run_batch(tiny_llm, inp, tmp / "out.jsonl", progress=False)
    return read_jsonl(tmp / "out.jsonl")


def test_bucket_to_bucket_answers_what_a_local_job_does(tiny_llm, store, tmp_path, local_answers):
    inp = _upload(store, tmp_path, _requests(12))
    out = inp.rsplit("/", 1)[0] + "/out.jsonl"
    s = run_batch(tiny_llm, inp, out, progress=False, part_lines=3)
    assert s.total == 14 and s.result.answered == 14 and s.interrupted is None
    assert _answers(_rows(out)) == _answers(local_answers)
    # finished: the parts and the lease are gone
    assert storage.listing(parts_prefix(storage.parse(out))) == {}

    # --order input: the parts rewritten into one object in input order
    ordered = inp.rsplit("/", 1)[0] + "/ordered.jsonl"
    run_batch(tiny_llm, inp, ordered, order="input", progress=False, part_lines=3)
    rows = _rows(ordered)
    assert _answers(rows) == _answers(local_answers)
    first_line = {}
    for n, x in enumerate(storage.read(storage.parse(inp)).decode().splitlines(), 1):
        if x.startswith('{"'):
            first_line.setdefault(json.loads(x)["custom_id"], n)
    positions = [r["error"]["line"] if r["custom_id"] is None else first_line[r["custom_id"]] for r in rows]
    assert positions == sorted(positions)


PART = "{}-000000.jsonl"


def test_a_part_written_twice_counts_once(tiny_llm, store, tmp_path, local_answers):
    """Parts left by earlier runs: one uploaded twice (under a second run's name) and one that
    repeats some of its keys. The rerun skips every key any part holds, counts each once, and the
    joined OUTPUT holds each once."""
    inp = _upload(store, tmp_path, _requests(12))
    out = storage.parse(inp.rsplit("/", 1)[0] + "/out.jsonl")
    lines = [json.dumps(r).encode() + b"\n" for r in local_answers]
    prefix = parts_prefix(out)
    storage.put(prefix.child(PART.format("20260101T000000Z-aaaaaaaa")), b"".join(lines[0:5]))
    storage.put(prefix.child(PART.format("20260101T000000Z-bbbbbbbb")), b"".join(lines[0:5]))  # twice
    storage.put(prefix.child(PART.format("20260101T000001Z-cccccccc")), b"".join(lines[3:8]))  # overlaps
    s = run_batch(tiny_llm, inp, str(out), progress=False)
    assert s.before == 8 and s.run.answered == 6 and s.result.answered == 14
    assert s.result.ok + s.result.failed == 14
    rows = _rows(str(out))
    assert len(rows) == 14 and _answers(rows) == _answers(local_answers)
    assert storage.listing(prefix) == {}


def test_a_run_that_needs_no_model_leaves_the_lease_as_it_found_it(store, tmp_path, local_answers):
    """A lease held by a live run on another host refuses a second run; an expired one, or one
    whose process on this host is gone, is taken over."""
    inp = _upload(store, tmp_path, _requests(12))
    out = storage.parse(inp.rsplit("/", 1)[0] + "/out.jsonl")
    storage.put(out, b"".join(json.dumps(r).encode() + b"\n" for r in local_answers))  # all answered
    lease = parts_prefix(out).child("lease")
    held = {"run": "20260101T000000Z-dddddddd", "host": "another-host", "pid": 1, "boot": "",
            "expires": time.time() + 600}
    storage.put(lease, json.dumps(held).encode())

    def no_model():
        raise AssertionError("every request is answered: the model is not needed")

    with pytest.raises(OutputFileError, match="being written by another jaxinfer batch.*another-host"):
        run_batch(no_model, inp, str(out), progress=False)
    assert json.loads(storage.read(lease)) == held  # left alone

    for stale in ({**held, "expires": time.time() - 1},  # expired
                  {**held, "host": socket.gethostname(), "pid": _dead_pid()}):  # its process is gone
        storage.put(lease, json.dumps(stale).encode())
        s = run_batch(no_model, inp, str(out), progress=False)
        assert s.before == 14 and s.run.answered == 0
        assert storage.info(lease) is None  # taken over, then released
    assert _answers(_rows(str(out))) == _answers(local_answers)


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.fixture(scope="module")
def env(tmp_path_factory, object_stores):
    e = subprocess_env(tmp_path_factory.getbasetemp().parent / "jax-compilation-cache")
    for s in object_stores.values():
        e.update(s.env)
    return e


# two decode slots and parts of two lines: results and parts arrive a few at a time, so kills
# land between them
MODEL_ARGS = ("--max-num-seqs", "2", "--max-model-len", "64", "--part-lines", "2")


def _start(cmd, env, log_path):
    """The job in the background, its output in a file (a pipe nobody reads could fill and stop it)."""
    log = open(log_path, "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log


def _wait_for(cond, proc, log_path, timeout=300):
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, open(log_path).read()[-3000:]
        assert time.monotonic() < deadline, open(log_path).read()[-3000:]
        time.sleep(0.1)


def _check_exactly_once(rows, n):
    assert len(rows) == n + 2  # one line per input line: n ids, a bad line, a duplicate
    got = by_id(rows)
    assert set(got) == {f"q{i}" for i in range(n)}
    assert all(got[f"q{i}"]["response"]["status_code"] == 200 for i in range(n))
    assert sorted(r["error"]["code"] for r in rows if r["error"]) == ["duplicate_custom_id", "invalid_json"]


@ONE_STORE_BY_DEFAULT
def test_a_second_run_is_refused_and_sigterm_writes_the_last_part(store, tmp_path, tiny_gguf, env):
    n = 20
    inp = _upload(store, tmp_path, _requests(n))
    out = storage.parse(inp.rsplit("/", 1)[0] + "/out.jsonl")
    log_path = tmp_path / "first.log"
    first, log = _start(batch_cmd(inp, out, tiny_gguf, *MODEL_ARGS, "--part-lines", "3", "--grace-period", "4"),
                        env, log_path)
    try:
        _wait_for(lambda: storage.info(parts_prefix(out).child("lease")) is not None, first, log_path)
        second = subprocess.run(batch_cmd(inp, out, tiny_gguf, *MODEL_ARGS), env=env, capture_output=True,
                                text=True, timeout=300)
        assert second.returncode == 2
        err = second.stderr.strip().splitlines()
        assert err[-1].startswith("jaxinfer: error: ") and "being written by another jaxinfer batch" in err[-1]
        _wait_for(lambda: list_parts(out), first, log_path)  # answering (its signal handlers are in place)
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
    finally:
        first.kill()
        log.close()
    text = log_path.read_text()
    assert first.returncode in (0, 128 + signal.SIGTERM), text[-3000:]
    if first.returncode:  # stopped: all it answered is in its parts, the last written at the signal; no lease
        answered = int(re.search(r"this run: (\d+) requests", text).group(1))
        names = storage.listing(parts_prefix(out))
        assert "lease" not in names and storage.info(out) is None
        assert sum(storage.read(u).count(b"\n") for u, _ in list_parts(out)) == answered
        rerun = subprocess.run(batch_cmd(inp, out, tiny_gguf, *MODEL_ARGS), env=env, capture_output=True,
                               text=True, timeout=600)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
    _check_exactly_once(_rows(str(out)), n)


def _kill_and_resume(store, tmp_path, tiny_gguf, env, seed: int):
    rng = random.Random(seed)
    n = 24
    for attempt in range(3):  # each in a new bucket; a job that finished before its kill is tried again
        inp = _upload(store, tmp_path, _requests(n, seed))
        out = storage.parse(inp.rsplit("/", 1)[0] + "/out.jsonl")
        log_path = tmp_path / "killed.log"
        proc, log = _start(batch_cmd(inp, out, tiny_gguf, *MODEL_ARGS), env, log_path)
        try:
            want = rng.randint(1, 6) if attempt == 0 else 1
            _wait_for(lambda: len(list_parts(out)) >= want, proc, log_path)
            time.sleep(rng.uniform(0, 0.5) if attempt == 0 else 0)
        finally:
            proc.kill()
            proc.wait()
            log.close()
        kept = [storage.read(u) for u, _ in list_parts(out)]  # what the kill left: it must survive as it is
        if kept:
            break
        # no part left: the job answered everything and merged its output before the kill came
        assert storage.info(out) is not None, open(log_path).read()[-3000:]
    else:
        pytest.fail("the job finished before its kill three times: nothing was left to resume")
    rerun = subprocess.run(batch_cmd(inp, out, tiny_gguf, *MODEL_ARGS), env=env, capture_output=True, text=True,
                           timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert storage.listing(parts_prefix(out)) == {}
    final = storage.read(out)
    _check_exactly_once([json.loads(x) for x in final.splitlines()], n)
    for part in kept:
        for line in part.splitlines(keepends=True):
            assert line in final


@ONE_STORE_BY_DEFAULT
def test_killed_then_resumed_answers_every_id_once(store, tmp_path, tiny_gguf, env):
    _kill_and_resume(store, tmp_path, tiny_gguf, env, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(10))
def test_killed_at_random_points_then_resumed(store, tmp_path, tiny_gguf, env, trial):
    _kill_and_resume(store, tmp_path, tiny_gguf, env, seed=100 + trial)


@pytest.fixture
def urls(object_stores, tmp_path):
    """An input object in each store, and a bucket for outputs."""
    out = {}
    for scheme, s in object_stores.items():
        out[scheme] = _upload(s, tmp_path, [completion("a", "hello", max_tokens=2)], name=f"in-{scheme}.jsonl")
    return out


BAD = {
    "scheme": (lambda u: ("ftp://bucket/in.jsonl", "out"), "unsupported URL scheme ftp:// in ftp://bucket/in.jsonl"),
    "bucket name": (lambda u: ("gs://Not_A_Bucket/in.jsonl", "out"), "'Not_A_Bucket' is not a valid bucket name"),
    "missing bucket": (lambda u: ("gs://no-such-bucket-anywhere/in.jsonl", "out"),
                       "bucket gs://no-such-bucket-anywhere does not exist"),
    "missing object": (lambda u: (u["s3"].rsplit("/", 1)[0] + "/nothing.jsonl", "out"),
                       "input s3://.*/nothing.jsonl does not exist"),
    "missing output bucket": (lambda u: (u["gs"], "s3://no-such-bucket-anywhere/out.jsonl"),
                              "bucket s3://no-such-bucket-anywhere does not exist"),
    "output names no object": (lambda u: (u["gs"], u["gs"].split("/jobs/")[0] + "/"), "names no object"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_urls_get_one_line_and_exit_2(urls, case, capsys, tmp_path):
    from jaxinfer.cli import main

    make, message = BAD[case]
    inp, out = make(urls)
    out = str(tmp_path / "out.jsonl") if out == "out" else out
    model_never_loaded = str(tmp_path / "no-model.gguf")
    assert main(["batch", inp, "-o", out, "--model", model_never_loaded, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxinfer: error: "), err
    assert re.search(message, err[0]), err[0]


def test_a_missing_library_names_the_extra(urls, capsys, tmp_path, monkeypatch):
    from jaxinfer.cli import main

    monkeypatch.setattr(storage, "_FILESYSTEMS", {})
    monkeypatch.setitem(__import__("sys").modules, "gcsfs", None)  # the import now fails
    assert main(["batch", urls["gs"], "-o", str(tmp_path / "o.jsonl"), "--model", "m", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"jaxinfer: error: {urls['gs']} needs gcsfs, which is not installed: pip install 'jaxinfer[gcs]'"]


def test_denied_access_gets_one_line_and_exit_2(object_stores, capsys, tmp_path, monkeypatch):
    """A server that checks credentials refuses this process's keys, for input and output alike."""
    from jaxinfer.cli import main
    from tests.storage_servers import reset_clients, start_s3, stop

    strict = start_s3(check_credentials=True)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", strict.env["AWS_ENDPOINT_URL"])
        reset_clients()
        local = write_jsonl(tmp_path / "in.jsonl", [completion("a", "hello")])
        for inp, out in (("s3://private-bucket/in.jsonl", str(tmp_path / "out.jsonl")),
                         (str(local), "s3://private-bucket/out.jsonl")):
            assert main(["batch", inp, "-o", out, "--model", "m", "--no-progress"]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and "s3://private-bucket" in err[0] and "access denied" in err[0], err
    finally:
        monkeypatch.undo()
        reset_clients()
        stop(strict)


@pytest.mark.slow  # 50 s: two processes, each loading the model
def test_two_processes_write_one_prefix(object_stores, tmp_path, tiny_gguf, env):
    """Two processes joined by jax.distributed on 127.0.0.1, each answering its share into its own
    parts under one bucket prefix (no shared filesystem); process 0 joins them."""
    from tests.storage_servers import free_port

    n = 16
    inp = _upload(object_stores["gs"], tmp_path, _requests(n))
    out = inp.rsplit("/", 1)[0] + "/out.jsonl"
    port = free_port()
    logs = [tmp_path / f"p{i}.log" for i in (0, 1)]
    procs = [_start(batch_cmd(inp, out, tiny_gguf, "--max-model-len", "64", "--coordinator-address",
                              f"127.0.0.1:{port}", "--num-processes", 2, "--process-id", i), env, logs[i])
             for i in (0, 1)]
    for (p, log), path in zip(procs, logs):
        p.wait(timeout=600)
        log.close()
        assert p.returncode == 0, path.read_text()[-3000:]
    _check_exactly_once(_rows(out), n)
    assert storage.listing(parts_prefix(storage.parse(out))) == {}
    share = int(re.search(r"process 1 of 2: this run: (\d+) requests", logs[1].read_text()).group(1))
    assert 0 < share < n + 2
