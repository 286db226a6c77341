"""Fuzzed request lines (wrong types, huge values, odd unicode, lone surrogates, special-token text)
never crash a batch job: each line is parsed into a runnable request or a RequestError/LineError,
and a job over a file of them answers every line exactly once with valid JSON."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxinfer import batch as jb
from jaxinfer import openai_format as oai
from jaxinfer.batch import run_batch
from jaxinfer.openai_schema import parse_request
from tests.batch_testing import read_jsonl

odd_text = st.one_of(
    st.text(max_size=12),
    st.text(st.characters(codec="utf-8"), max_size=12),
    st.sampled_from(["", " ", "\u0000", "\ud800", "a\udfffb", "e\u0301\u0301", "\U0001f980" * 5, "\u202eabc",
                     "<|im_start|>", "<|im_end|>", "<|endoftext|>", "\n\n", "\ufeff", "日本語のテキスト"]),
)
huge = st.one_of(st.integers(-(2**80), 2**80), st.sampled_from([2**31, 2**63, -(2**63) - 1, 10**30]))
junk = st.recursive(
    st.one_of(st.none(), st.booleans(), huge, st.floats(allow_nan=True, allow_infinity=True), odd_text),
    lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(odd_text, c, max_size=3)),
    max_leaves=6,
)


def field(plausible):
    return st.one_of(plausible, junk)


message = st.fixed_dictionaries(
    {"role": field(st.sampled_from(oai.ROLES)), "content": field(odd_text)},
    optional={"name": field(odd_text), "tool_calls": junk},
)
body_fields = {
    "messages": field(st.lists(message, min_size=1, max_size=3)),
    "prompt": field(st.one_of(odd_text, st.lists(odd_text, min_size=1, max_size=3),
                              st.lists(st.one_of(st.integers(0, 49151), huge), min_size=1, max_size=4))),
    "max_tokens": field(st.one_of(st.integers(1, 3), st.integers(-3, 0), st.integers(10**4, 10**30))),
    "max_completion_tokens": field(st.integers(-2, 3)),
    "n": field(st.one_of(st.integers(1, 2), st.integers(-2, 0), st.integers(129, 2**70))),
    "temperature": field(st.floats(-1, 3)),
    "top_p": field(st.floats(-0.5, 1.5)),
    "stop": field(st.one_of(odd_text, st.lists(odd_text, max_size=6))),
    "seed": field(huge),
    "presence_penalty": field(st.floats(-3, 3)),
    "frequency_penalty": field(st.floats(-3, 3)),
    "logprobs": field(st.one_of(st.booleans(), st.integers(-1, 7))),
    "top_logprobs": field(st.integers(-1, 25)),
    "top_k": field(st.one_of(st.integers(-2, 100), huge)),
    "min_p": field(st.floats(-0.5, 1.5)),
    "repetition_penalty": field(st.floats(-1, 1e300)),
    "min_tokens": field(st.one_of(st.integers(0, 3), huge)),
    "ignore_eos": field(st.booleans()),
    "stream": field(st.booleans()),
    "user": field(odd_text),
    "logit_bias": junk,
}
body = st.one_of(st.fixed_dictionaries({}, optional=body_fields), junk)
line_obj = st.fixed_dictionaries(
    {},
    optional={
        "custom_id": field(odd_text),
        "method": field(st.just("POST")),
        "url": field(st.sampled_from([*oai.URLS, "/v1/embeddings", "/v1/chat/completions/", ""])),
        "body": body,
    },
)


def _good_envelope(url, main, exclude):
    fields = {k: v for k, v in body_fields.items() if k not in exclude and k != main}
    return st.fixed_dictionaries({
        "custom_id": st.text(min_size=1, max_size=6), "method": st.just("POST"), "url": st.just(url),
        "body": st.fixed_dictionaries({main: body_fields[main]}, optional=fields),
    })


good_envelope = st.one_of(
    _good_envelope("/v1/chat/completions", "messages", {"prompt"}),
    _good_envelope("/v1/completions", "prompt", {"messages", "max_completion_tokens", "top_logprobs"}),
)
raw_line = st.one_of(
    line_obj.map(lambda o: json.dumps(o).encode()),
    good_envelope.map(lambda o: json.dumps(o).encode()),
    good_envelope.map(lambda o: json.dumps(o, ensure_ascii=False).encode("utf-8", "surrogatepass")),
    line_obj.map(lambda o: json.dumps(o, ensure_ascii=False).encode("utf-8", "surrogatepass")),
    junk.map(lambda o: json.dumps(o).encode()),
    st.binary(min_size=1, max_size=30),
)

# lines that mostly run, so the job-level test drives the engine with odd text too
plausible_line = st.builds(
    lambda cid, kind, text, mt, n, temp: json.dumps(
        {"custom_id": cid, "method": "POST", "url": kind,
         "body": {("messages" if "chat" in kind else "prompt"):
                  [{"role": "user", "content": text}] if "chat" in kind else text,
                  "max_tokens": mt, "n": n, "temperature": temp}}).encode(),
    st.text(min_size=1, max_size=4), st.sampled_from(list(oai.URLS)), odd_text, st.integers(1, 2),
    st.integers(1, 2), st.floats(0, 2),
)

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(FUZZ, max_examples=300)
@given(raw=raw_line)
def test_fuzzed_lines_parse_or_fail_cleanly(tiny_llm, raw):
    env = oai.parse_envelope(raw, 7)
    if isinstance(env, oai.LineError):
        assert env.line == 7 and env.message.startswith("line 7: ")
        json.dumps(oai.line_error_line(env), allow_nan=False)
        return
    cid, obj = env
    try:
        req = parse_request(cid, obj, 7, {"max_tokens": 2})
        prompts, params = jb._encode(tiny_llm, req)
    except oai.RequestError as e:
        assert e.message.startswith("line 7: ") and e.code
        jb._dumps(oai.error_response_line(cid, e))
        return
    assert prompts and all(ids for _, ids in prompts)
    assert all(len(ids) + params.max_tokens <= tiny_llm.max_model_len for _, ids in prompts)
    assert 0 <= params.top_k <= tiny_llm.cfg.vocab_size and params.n * len(prompts) <= oai.MAX_N


@settings(FUZZ, max_examples=4)
@given(lines=st.lists(st.one_of(raw_line, plausible_line), min_size=1, max_size=8))
def test_a_job_over_fuzzed_lines_answers_each_once(tiny_llm, tmp_path_factory, lines):
    d = tmp_path_factory.mktemp("fuzz")
    lines = [x.replace(b"\n", b" ") for x in lines]  # one request per line
    (d / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    out = d / "out.jsonl"
    s = run_batch(tiny_llm, d / "in.jsonl", out, progress=False, defaults={"max_tokens": 2})
    rows = read_jsonl(out)
    answerable = [x for x in lines if x.strip()]
    assert s.complete and len(rows) == len(answerable) == s.result.answered
    keys = [jb._OpenAIFormat.key_of(r) for r in rows]
    assert len(set(keys)) == len(keys)
