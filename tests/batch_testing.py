"""Helpers for the batch tests: OpenAI batch output checked field by field, request lines, and
running ``jaxinfer batch`` as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

LINE_KEYS = {"id", "custom_id", "response", "error"}
CHAT_KEYS = {"id", "object", "created", "model", "choices", "usage", "system_fingerprint"}
USAGE_KEYS = {"prompt_tokens", "completion_tokens", "total_tokens"}


def chat(cid, content, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": content}], **body}}


def completion(cid, prompt, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": prompt, **body}}


def write_jsonl(path: Path, lines) -> Path:
    """lines: dicts (dumped as JSON) or str/bytes (written as they are)."""
    with open(path, "wb") as f:
        for x in lines:
            if isinstance(x, dict):
                x = json.dumps(x)
            f.write((x.encode() if isinstance(x, str) else x) + b"\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    data = Path(path).read_bytes()
    assert not data or data.endswith(b"\n"), "the file ends in a torn line"
    return [json.loads(line) for line in data.splitlines()]


def by_id(rows) -> dict:
    out = {}
    for r in rows:
        if r["custom_id"] is not None:
            assert r["custom_id"] not in out, f"custom_id {r['custom_id']} answered twice"
            out[r["custom_id"]] = r
    return out


def check_line(rec) -> None:
    assert set(rec) == LINE_KEYS
    assert isinstance(rec["id"], str) and rec["id"].startswith("batch_req_")


def check_ok(rec, kind: str, n_choices: int) -> dict:
    """A 200 line holding a chat.completion or text_completion; returns the body."""
    check_line(rec)
    assert rec["error"] is None
    resp = rec["response"]
    assert set(resp) == {"status_code", "request_id", "body"} and resp["status_code"] == 200
    assert resp["request_id"].startswith("req_")
    body = resp["body"]
    assert set(body) == CHAT_KEYS
    assert body["object"] == ("chat.completion" if kind == "chat" else "text_completion")
    assert body["id"].startswith("chatcmpl-" if kind == "chat" else "cmpl-")
    assert isinstance(body["created"], int) and isinstance(body["model"], str)
    assert [c["index"] for c in body["choices"]] == list(range(n_choices))
    for c in body["choices"]:
        assert c["finish_reason"] in ("stop", "length")
        if kind == "chat":
            assert set(c) == {"index", "message", "logprobs", "finish_reason"}
            assert c["message"] == {"role": "assistant", "content": c["message"]["content"], "refusal": None}
            assert isinstance(c["message"]["content"], str)
        else:
            assert set(c) == {"text", "index", "logprobs", "finish_reason"} and isinstance(c["text"], str)
    u = body["usage"]
    assert set(u) == USAGE_KEYS and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert u["prompt_tokens"] > 0 and u["completion_tokens"] >= n_choices
    return body


def check_400(rec, cid, code, param, line) -> dict:
    check_line(rec)
    assert rec["custom_id"] == cid and rec["error"] is None
    resp = rec["response"]
    assert resp["status_code"] == 400 and resp["request_id"].startswith("req_")
    err = resp["body"]["error"]
    assert set(resp["body"]) == {"error"} and set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == code and err["param"] == param, err
    assert err["message"].startswith(f"line {line}: "), err["message"]
    return err


def check_line_error(rec, code, line) -> str:
    check_line(rec)
    assert rec["custom_id"] is None and rec["response"] is None
    assert set(rec["error"]) == {"code", "message", "line"}
    assert rec["error"]["code"] == code and rec["error"]["line"] == line, rec["error"]
    assert rec["error"]["message"].startswith(f"line {line}: ")
    return rec["error"]["message"]


def check_chat_logprobs(lp, top: int, n_tokens: int) -> None:
    assert set(lp) == {"content", "refusal"} and lp["refusal"] is None
    assert len(lp["content"]) == n_tokens
    for t in lp["content"]:
        assert set(t) == {"token", "logprob", "bytes", "top_logprobs"}
        assert t["bytes"] == list(t["token"].encode()) and t["logprob"] <= 0
        assert len(t["top_logprobs"]) == top
        lps = [x["logprob"] for x in t["top_logprobs"]]
        assert lps == sorted(lps, reverse=True)
        for x in t["top_logprobs"]:
            assert set(x) == {"token", "logprob", "bytes"} and x["bytes"] == list(x["token"].encode())
        if top:  # the top token is at least as likely as the chosen one
            assert lps[0] >= t["logprob"] - 1e-5


def check_completion_logprobs(lp, top: int) -> None:
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    n = len(lp["tokens"])
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    offset = 0
    for tok, tlp, tops, off in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"]):
        assert off == offset
        offset += len(tok)
        assert tlp <= 0 and tops[tok] == tlp  # the sampled token is always listed
        assert top <= len(tops) <= top + 1


def subprocess_env(cache_dir: Path) -> dict:
    """CPU JAX with a persistent compilation cache, so each restart skips most compiles."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache_dir),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
               PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    return env


def batch_cmd(inp, out, model, *extra) -> list[str]:
    return [sys.executable, "-m", "jaxinfer", "batch", str(inp), "-o", str(out), "--model", str(model),
            "--no-progress", *map(str, extra)]


def run_batch_cli(inp, out, model, *extra, env, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(batch_cmd(inp, out, model, *extra), env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
