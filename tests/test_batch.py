"""Batch jobs in-process on the tiny model: a mixed OpenAI batch file checked field by field
(chat, completions, n=2, stop, both logprobs formats, several prompts, every kind of bad line),
input order, resuming from a partial file, duplicate ids across a resume, quick mode, the output
file's repair rules and lock, and the latency histogram."""

import fcntl
import json

import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer import batch as jb
from jaxinfer.batch import Latency, OutputFileError, run_batch, scan_results
from tests.batch_testing import (
    by_id,
    chat,
    check_400,
    check_chat_logprobs,
    check_completion_logprobs,
    check_line_error,
    check_ok,
    completion,
    read_jsonl,
    write_jsonl,
)


def _run(llm, inp, out, **kw):
    return run_batch(llm, inp, out, progress=False, **kw)


@pytest.fixture(scope="module")
def stop_case(tiny_llm):
    """A greedy completion of "The cat sat" and a stop string first found past its start, as
    near its middle as can be: the shortest string from there that the text holds nowhere
    earlier. One always exists (the text from character 1 on, unless every character is the
    same), so the case never goes missing."""
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    text = tiny_llm.generate("The cat sat", sp, use_tqdm=False)[0].outputs[0].text
    third = max(1, len(text) // 3)
    for i in [*range(third, len(text)), *range(third - 1, 0, -1)]:
        for end in range(i + 1, len(text) + 1):
            s = text[i:end]
            if s.strip() and text.find(s) == i:
                return s, text[:i]
    pytest.fail(f"the tiny model's greedy text {text!r} repeats one character: no stop string cuts it")


def _mixed_lines(stop):
    long_prompt = "word " * 600  # > max_model_len (512) tokens
    return [
        chat("c-plain", "Hello there", max_tokens=6),                                                  # 1
        completion("p-n2", "Once upon a time", n=2, max_tokens=5, temperature=0.9, seed=7),            # 2
        completion("p-stop", "The cat sat", temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),  # 3
        chat("c-lp", "Hi", logprobs=True, top_logprobs=3, max_completion_tokens=4, temperature=0),     # 4
        completion("p-lp", "Hi", logprobs=2, max_tokens=4, temperature=0, top_k=5, min_p=0.01,
                   repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),               # 5
        completion("p-multi", ["a b", "c d"], max_tokens=3),                                           # 6
        {"custom_id": "c-parts", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "developer", "content": "Be brief."},
                               {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                  "max_tokens": 3, "min_tokens": 2, "top_p": 0.9}},                                    # 7
        '{"custom_id": "broken", "method": ',                                                          # 8
        "[1, 2]",                                                                                      # 9
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},                         # 10
        {"custom_id": 5, "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},        # 11
        chat("c-plain", "the same id again"),                                                          # 12
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},  # 13
        {"custom_id": "bad-method", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}},  # 14
        completion("bad-temp", "x", temperature="hot"),                                                # 15
        completion("bad-n", "x", n=0),                                                                 # 16
        completion("bad-field", "x", frobnicate=1),                                                    # 17
        completion("too-long", long_prompt),                                                           # 18
        completion("too-many-tokens", "x", max_tokens=10**6),                                          # 19
        {"custom_id": "bad-body", "method": "POST", "url": "/v1/completions", "body": "x"},           # 20
        b"\xff\xfe{",                                                                                  # 21
        "   ",                                                                                         # 22: blank, skipped
        {"custom_id": "no-messages", "method": "POST", "url": "/v1/chat/completions", "body": {}},    # 23
        chat("bad-top", "x", top_logprobs=2),                                                          # 24
        chat("bad-stream", "x", stream=True),                                                          # 25
        completion("bad-min", "x", max_tokens=2, min_tokens=3),                                        # 26
        completion("bad-lp", "x", logprobs=6),                                                         # 27
        chat("bad-role", "x") | {"body": {"messages": [{"role": "wizard", "content": "x"}]}},          # 28
    ]


@pytest.fixture(scope="module")
def mixed(tiny_llm, stop_case, tmp_path_factory):
    d = tmp_path_factory.mktemp("mixed")
    inp = write_jsonl(d / "in.jsonl", _mixed_lines(stop_case[0]))
    out = d / "out.jsonl"
    summary = _run(tiny_llm, inp, out, model_name="tiny")
    return inp, out, summary


def test_mixed_file_good_lines(mixed, stop_case, tiny_llm):
    _, out, _ = mixed
    rows = read_jsonl(out)
    got = by_id(rows)

    b = check_ok(got["c-plain"], "chat", 1)
    assert b["model"] == "tiny" and b["choices"][0]["logprobs"] is None
    assert b["usage"]["completion_tokens"] <= 6

    b = check_ok(got["p-n2"], "completion", 2)
    assert 2 <= b["usage"]["completion_tokens"] <= 10

    b = check_ok(got["p-stop"], "completion", 1)
    assert b["choices"][0]["text"] == stop_case[1] and b["choices"][0]["finish_reason"] == "stop"

    b = check_ok(got["c-lp"], "chat", 1)
    check_chat_logprobs(b["choices"][0]["logprobs"], 3, b["usage"]["completion_tokens"])
    assert "".join(t["token"] for t in b["choices"][0]["logprobs"]["content"]).startswith(
        b["choices"][0]["message"]["content"])

    b = check_ok(got["p-lp"], "completion", 1)
    check_completion_logprobs(b["choices"][0]["logprobs"], 2)
    assert len(b["choices"][0]["logprobs"]["tokens"]) == b["usage"]["completion_tokens"]

    b = check_ok(got["p-multi"], "completion", 2)  # one choice per prompt
    enc = tiny_llm.tokenizer.encode
    assert b["usage"]["prompt_tokens"] == len(enc("a b")) + len(enc("c d")) and b["usage"]["completion_tokens"] <= 6

    b = check_ok(got["c-parts"], "chat", 1)
    assert 2 <= b["usage"]["completion_tokens"] <= 3


def test_mixed_file_bad_lines(mixed):
    _, out, summary = mixed
    rows = read_jsonl(out)
    assert len(rows) == 27  # every non-blank line answered once
    errors = {r["error"]["line"]: r for r in rows if r["error"] is not None}
    assert sorted(errors) == [8, 9, 10, 11, 12, 21]
    assert "malformed JSON" in check_line_error(errors[8], "invalid_json", 8)
    assert "expected a JSON object" in check_line_error(errors[9], "invalid_request", 9)
    assert "missing custom_id" in check_line_error(errors[10], "missing_custom_id", 10)
    assert "non-empty string" in check_line_error(errors[11], "missing_custom_id", 11)
    assert "already used on line 1" in check_line_error(errors[12], "duplicate_custom_id", 12)
    assert "UTF-8" in check_line_error(errors[21], "invalid_json", 21)

    got = by_id(rows)
    assert "/v1/embeddings" in check_400(got["bad-url"], "bad-url", "invalid_url", "url", 13)["message"]
    check_400(got["bad-method"], "bad-method", "invalid_method", "method", 14)
    assert '"hot"' in check_400(got["bad-temp"], "bad-temp", "invalid_value", "temperature", 15)["message"]
    check_400(got["bad-n"], "bad-n", "invalid_value", "n", 16)
    assert "frobnicate" in check_400(got["bad-field"], "bad-field", "unknown_parameter", "frobnicate", 17)["message"]
    assert "max_model_len is 512" in check_400(got["too-long"], "too-long", "context_length_exceeded", "prompt", 18)["message"]
    msg = check_400(got["too-many-tokens"], "too-many-tokens", "context_length_exceeded", "max_tokens", 19)["message"]
    assert "maximum context length is 512" in msg and "1000000 in the completion" in msg
    check_400(got["bad-body"], "bad-body", "invalid_body", "body", 20)
    check_400(got["no-messages"], "no-messages", "missing_required_parameter", "messages", 23)
    check_400(got["bad-top"], "bad-top", "invalid_value", "top_logprobs", 24)
    check_400(got["bad-stream"], "bad-stream", "unsupported_parameter", "stream", 25)
    check_400(got["bad-min"], "bad-min", "invalid_value", "min_tokens", 26)
    check_400(got["bad-lp"], "bad-lp", "invalid_value", "logprobs", 27)
    check_400(got["bad-role"], "bad-role", "invalid_value", "messages[0].role", 28)

    assert summary.complete and summary.total == 27 and summary.result.ok == 7 and summary.result.failed == 20
    ok_rows = [r for r in rows if r["error"] is None and r["response"]["status_code"] == 200]
    assert summary.result.output_tokens == sum(r["response"]["body"]["usage"]["completion_tokens"] for r in ok_rows)
    assert summary.latency["ttft_s"].n == 8  # one per prompt run (p-multi has two)


def test_rerun_answers_nothing_and_input_order(mixed, tmp_path):
    inp, out, _ = mixed
    copy = tmp_path / "out.jsonl"
    copy.write_bytes(out.read_bytes())
    s = _run(lambda: pytest.fail("a finished job must not load the model"), inp, copy, order="input")
    assert s.run.answered == 0 and s.before == 27 and s.complete
    rows = read_jsonl(copy)
    line_of = {}
    for n, line in enumerate(inp.read_bytes().splitlines(), 1):
        try:
            line_of.setdefault(json.loads(line)["custom_id"], n)
        except (ValueError, KeyError, TypeError):
            pass
    lines = [r["error"]["line"] if r["custom_id"] is None else line_of[r["custom_id"]] for r in rows]
    assert lines == sorted(lines) and len(lines) == 27
    assert sorted(out.read_bytes().splitlines()) == sorted(copy.read_bytes().splitlines())  # same lines, moved


def test_resume_from_partial_output_keeps_earlier_results(tiny_llm, tmp_path):
    lines = [completion(f"r{i}", f"Number {i}", max_tokens=3, temperature=0) for i in range(12)]
    lines.insert(3, "{oops")
    lines.append(completion("r0", "a duplicate of the first"))
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    _run(tiny_llm, inp, out)
    full = out.read_bytes()
    kept = b"".join(full.splitlines(keepends=True)[:5])
    out.write_bytes(kept + full.splitlines(keepends=True)[5][:40])  # and a torn line
    s = _run(tiny_llm, inp, out)
    assert s.before == 5 and s.run.answered == 9 and s.complete
    data = out.read_bytes()
    assert data.startswith(kept)
    rows = read_jsonl(out)
    assert len(rows) == 14 and set(by_id(rows)) == {f"r{i}" for i in range(12)}
    assert sorted(r["error"]["line"] for r in rows if r["error"]) == [4, 14]


def test_quick_mode_streams_and_resumes(tiny_llm, tmp_path):
    inp = tmp_path / "prompts.txt"
    inp.write_bytes(b"first prompt\n\nsecond prompt\r\n" + b"word " * 600 + b"\n\xff bad bytes\nlast\n")
    out = tmp_path / "out.jsonl"
    sp = SamplingParams(max_tokens=3, temperature=0.0)
    s = _run(tiny_llm, inp, out, sampling_params=sp)
    rows = read_jsonl(out)
    assert [r["index"] for r in rows] == [0, 1, 2, 3, 4]  # input order by default
    assert [r["prompt"] for r in rows[:2]] == ["first prompt", "second prompt"] and rows[4]["prompt"] == "last"
    for r in (rows[0], rows[1], rows[4]):
        assert set(r) == {"index", "prompt", "text", "finish_reason", "prompt_tokens", "completion_tokens"}
        assert 1 <= r["completion_tokens"] <= 3
    assert "max_model_len" in rows[2]["error"] and rows[2]["error"].startswith("line 4: ")
    assert "UTF-8" in rows[3]["error"]
    assert s.result.ok == 3 and s.result.failed == 2
    out.write_bytes(b"".join(out.read_bytes().splitlines(keepends=True)[:2]) + b'{"index":2,"pro')
    s = _run(tiny_llm, inp, out, sampling_params=sp)
    assert s.before == 2 and s.run.answered == 3
    assert read_jsonl(out) == rows


# ------------------------------------------------------------------------------ the output file


def _fmt():
    return jb._OpenAIFormat(None, None)


def _rec(cid):
    return json.dumps({"id": "batch_req_x", "custom_id": cid, "response": None, "error": None},
                      separators=(",", ":")).encode()


@pytest.mark.parametrize("tail,kept", [
    (b'{"id":"batch_', 2),  # a write cut off: cut
    (b'{"id":"batch_req_x","custom_id":"c","response":null,"error":null}', 3),  # only the newline lost
    (b"\0\0\0\0", 2),  # zeros a crash left
])
def test_scan_repairs_only_the_torn_last_line(tmp_path, tail, kept):
    p = tmp_path / "out.jsonl"
    p.write_bytes(_rec("a") + b"\n" + _rec("b") + b"\n" + tail)
    keys = [k for *_, k in scan_results(p, _fmt(), repair=True)]
    assert len(keys) == kept
    assert p.read_bytes().endswith(b"\n") and len(read_jsonl(p)) == kept


@pytest.mark.parametrize("content", [b"hello world\n", _rec("a") + b"\nnot json\n" + _rec("b") + b"\n",
                                     b'{"index": 3, "text": "quick mode"}\n', b"some notes without newline"])
def test_refuses_a_file_that_is_not_a_batch_output(tmp_path, content, capsys):
    p = tmp_path / "out.jsonl"
    p.write_bytes(content)
    with pytest.raises(OutputFileError, match="not a result line"):
        list(scan_results(p, _fmt(), repair=True))
    assert p.read_bytes() == content


def test_refuses_an_output_locked_by_another_run(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [completion("a", "x")])
    out = tmp_path / "out.jsonl"
    with open(out, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        with pytest.raises(OutputFileError, match="locked"):
            _run(lambda: pytest.fail("no model needed"), inp, out)


def test_cli_exit_2_on_a_foreign_output(tmp_path, capsys, tiny_gguf):
    from jaxinfer.cli import main

    inp = write_jsonl(tmp_path / "in.jsonl", [completion("a", "x")])
    out = tmp_path / "out.jsonl"
    out.write_text("my precious notes\n")
    assert main(["batch", str(inp), "-o", str(out), "--model", str(tiny_gguf)]) == 2
    err = capsys.readouterr().err
    assert "line 1 is not a result line" in err and "Traceback" not in err
    assert out.read_text() == "my precious notes\n"


# ------------------------------------------------------------------------------ latency histogram


def test_latency_percentiles_within_one_percent():
    rng = np.random.default_rng(0)
    xs = rng.lognormal(-3, 1.5, 5000)
    a, b = Latency(), Latency()
    for x in xs[:2000]:
        a.add(x)
    for x in xs[2000:]:
        b.add(x)
    a.merge(Latency.from_json(json.loads(json.dumps(b.to_json()))))
    s = a.summary()
    assert s["count"] == 5000 and s["min"] == xs.min() and s["max"] == xs.max()
    assert s["mean"] == pytest.approx(xs.mean())
    for q in (50, 90, 95, 99):
        exact = np.percentile(xs, q, method="inverted_cdf")
        assert s[f"p{q}"] == pytest.approx(exact, rel=0.011)
    assert Latency().summary() == {"count": 0}


def test_structured_output_in_a_batch_file(tiny_llm, tmp_path):
    import jsonschema

    schema = {"type": "object", "required": ["k"], "additionalProperties": False,
              "properties": {"k": {"enum": ["x", "yy"]}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "k", "schema": schema, "strict": True}}
    inp = write_jsonl(tmp_path / "in.jsonl", [
        chat("c-json", "a k", max_tokens=30, seed=1, response_format=fmt),
        completion("p-choice", "pick", max_tokens=8, n=2, seed=2, guided_choice=["left", "right"]),
        chat("c-bad", "x", max_tokens=8, guided_regex="(["),
        chat("c-free", "x", max_tokens=4, temperature=0, ignore_eos=True),
        chat("c-badjson", "x", max_tokens=8, guided_json={"type": "bogus"}),
    ])
    _run(tiny_llm, inp, tmp_path / "out.jsonl")
    rows = by_id(read_jsonl(tmp_path / "out.jsonl"))
    body = check_ok(rows["c-json"], "chat", 1)
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)
    body = check_ok(rows["p-choice"], "completion", 2)
    assert {c["text"] for c in body["choices"]} <= {"left", "right"}
    check_400(rows["c-bad"], "c-bad", "invalid_value", "guided_regex", 3)
    check_400(rows["c-badjson"], "c-badjson", "invalid_value", "guided_json", 5)  # the field it came in
    assert check_ok(rows["c-free"], "chat", 1)["usage"]["completion_tokens"] == 4


def test_beam_search_lines(tiny_llm, tmp_path):
    from jaxinfer.beam import BeamSearchParams

    inp = write_jsonl(tmp_path / "in.jsonl", [
        completion("p-beam", "Hello world", n=3, max_tokens=4, use_beam_search=True, ignore_eos=True),
        completion("p-free", "Hello world", max_tokens=4, temperature=0, ignore_eos=True),
        completion("p-bad", "x", n=2, use_beam_search=True, logprobs=2),
    ])
    _run(tiny_llm, inp, tmp_path / "out.jsonl")
    rows = by_id(read_jsonl(tmp_path / "out.jsonl"))
    body = check_ok(rows["p-beam"], "completion", 3)
    want = tiny_llm.beam_search("Hello world", BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True))[0]
    assert [c["text"] for c in body["choices"]] == [s.text for s in want.sequences]
    assert body["usage"]["completion_tokens"] == 12
    check_ok(rows["p-free"], "completion", 1)
    check_400(rows["p-bad"], "p-bad", "unsupported_parameter", "use_beam_search", 3)
