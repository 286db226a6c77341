"""Batch jobs survive what kills them: ``jaxinfer batch`` runs as a subprocess and is killed with
SIGKILL at random moments (some kills followed by a torn write), stopped with SIGTERM (drain) and
with SIGINT twice (at once), and resumed each time. After every stop the file holds only valid
lines and starts with everything it held before; at the end every valid custom_id is answered
exactly once and every bad line (duplicates included) has exactly one error line."""

import json
import random
import signal
import subprocess
import time

import pytest

from tests.batch_testing import (
    batch_cmd,
    by_id,
    chat,
    completion,
    read_jsonl,
    subprocess_env,
    write_jsonl,
)

# two decode slots: results arrive a few at a time, so kills land between them
MODEL_ARGS = ("--max-num-seqs", "2", "--max-model-len", "64")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return subprocess_env(tmp_path_factory.getbasetemp().parent / "jax-compilation-cache")


def _requests(n: int, rng: random.Random, max_tokens=(4, 16)):
    """n valid requests (chat and completions, greedy and seeded), two duplicates, bad lines."""
    lines = []
    for i in range(n):
        body = {"max_tokens": rng.randint(*max_tokens), "temperature": rng.choice([0, 0.7]), "seed": i}
        make = chat if i % 3 == 0 else completion
        lines.append(make(f"q{i}", f"Question {i}: what is {i} plus {i}?", **body))
    lines.insert(n // 3, "{not json")
    lines.insert(n // 2, completion("q1", "a duplicate id"))
    lines.append(chat("q2", "another duplicate"))
    lines.append(completion("bad", "x", temperature=9))
    return lines


def _valid_prefix(path) -> bytes:
    """The file up to its last newline; every line in it must be a valid result line."""
    data = path.read_bytes() if path.exists() else b""
    data = data[: data.rfind(b"\n") + 1]
    for line in data.splitlines():
        rec = json.loads(line)
        assert set(rec) == {"id", "custom_id", "response", "error"}
    return data


def _lines_in(path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _check_final(out, inp_lines, n):
    rows = read_jsonl(out)
    assert len(rows) == len(inp_lines)  # one line per input line, nothing twice
    got = by_id(rows)
    assert set(got) == {f"q{i}" for i in range(n)} | {"bad"}
    assert all(got[f"q{i}"]["response"]["status_code"] == 200 for i in range(n))
    assert got["bad"]["response"]["status_code"] == 400
    errors = sorted((r["error"]["code"], r["error"]["line"]) for r in rows if r["error"])
    assert [c for c, _ in errors] == sorted(["invalid_json", "duplicate_custom_id", "duplicate_custom_id"])
    return rows


def _kill_cycles(tiny_gguf, tmp_path, env, kills: int, seed: int):
    rng = random.Random(seed)
    n = 12 + 6 * kills
    lines = _requests(n, rng)
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    before = b""
    with open(tmp_path / "stderr.txt", "ab") as log:
        for cycle in range(kills):
            p = subprocess.Popen(batch_cmd(inp, out, tiny_gguf, *MODEL_ARGS), env=env, stdout=subprocess.DEVNULL,
                                 stderr=log)
            start_lines = _lines_in(out)
            want = rng.randint(0, 6)  # new lines to wait for; 0: a kill during startup
            deadline = time.monotonic() + (rng.uniform(0.0, 2.0) if want == 0 else 120)
            while p.poll() is None and time.monotonic() < deadline and (want == 0 or _lines_in(out) < start_lines + want):
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.05))
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=60)
            now = _valid_prefix(out)
            assert now.startswith(before), f"cycle {cycle}: earlier results changed"
            by_id(json.loads(x) for x in now.splitlines())  # nothing answered twice so far
            before = now
            if rng.random() < 0.4:  # a write cut short by the kill
                with open(out, "ab") as f:
                    f.write(b'{"id":"batch_req_0123","custom_id":"q'[: rng.randint(1, 38)])
    r = subprocess.run(batch_cmd(inp, out, tiny_gguf, *MODEL_ARGS), env=env, capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert out.read_bytes().startswith(before)
    _check_final(out, [x for x in lines if x], n)


def test_kill9_at_random_moments_then_resume(tiny_gguf, tmp_path, env):
    _kill_cycles(tiny_gguf, tmp_path, env, kills=2, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_kill9_many_times(tiny_gguf, tmp_path, env, seed):
    _kill_cycles(tiny_gguf, tmp_path, env, kills=15, seed=seed)


def _start(inp, out, tiny_gguf, env, err, *extra):
    return subprocess.Popen(batch_cmd(inp, out, tiny_gguf, *extra), env=env, stdout=subprocess.DEVNULL,
                            stderr=err)


def _wait_lines(p, out, n, timeout=180):
    deadline = time.monotonic() + timeout
    while _lines_in(out) < n:
        assert p.poll() is None, "the job ended before it was signalled"
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_sigterm_drains_sigint_twice_stops_then_resume(tiny_gguf, tmp_path, env):
    rng = random.Random(3)
    n = 30
    lines = _requests(n, rng, max_tokens=(6, 6))
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    seqs = 2
    args = ("--max-num-seqs", seqs, "--max-model-len", 64, "--grace-period", 60)

    # SIGTERM: nothing new is admitted, what is in flight finishes and is written, exit 128 + 15
    err = tmp_path / "term.txt"
    with open(err, "wb") as e:
        p = _start(inp, out, tiny_gguf, env, e, *args)
        _wait_lines(p, out, 3)
        at_signal = _lines_in(out)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 128 + signal.SIGTERM
    msg = err.read_text()
    assert "SIGTERM: admitting no more requests" in msg and "run the same command again to resume" in msg
    first = _valid_prefix(out)
    assert first == out.read_bytes()  # a clean stop leaves no torn line
    after = len(first.splitlines())
    assert after < len(lines)  # it stopped early ...
    assert after - at_signal <= 4 * seqs + 4  # ... admitting at most one window more (plus error lines)

    # SIGINT twice: stop now, still between writes, exit 128 + 2
    with open(tmp_path / "int.txt", "wb") as e:
        p = _start(inp, out, tiny_gguf, env, e, *args)
        _wait_lines(p, out, after + 1)
        p.send_signal(signal.SIGINT)
        time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=60) == 128 + signal.SIGINT
    second = _valid_prefix(out)
    assert second == out.read_bytes() and second.startswith(first)

    r = subprocess.run(batch_cmd(inp, out, tiny_gguf, *args), env=env, capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert out.read_bytes().startswith(second)
    _check_final(out, lines, n)
    assert "answered before" in r.stderr
