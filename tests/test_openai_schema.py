"""The pydantic request schema against the batch format's hand-written checks.

``openai_schema.parse_request`` is what the batch job runs; ``openai_schema.parse_body``
with ``Features.BATCH`` must accept and refuse the same bodies and, where it accepts, produce
the same request (messages, prompts, SamplingParams, logprobs). Two deliberate differences are
left out of the corpus and tested on their own: ``0`` for the booleans ``stream`` and ``echo``
(which ``v in (None, False)`` let through) and a malformed ``stream_options`` (ignored today).
"""

import dataclasses
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxinfer import openai_format as oai
from jaxinfer.openai_schema import (REQUEST_MODELS, ChatCompletion, Completion, Features, ParsedRequest, error_body,
                                    parse_request,
                                    parse_body)

URL = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
BASE = {"chat": {"messages": [{"role": "user", "content": "hi"}]}, "completion": {"prompt": "hi"}}
VALUES = [None, True, False, 0, 1, -1, 2, 3, 4, 5, 6, 16, 20, 21, 100, 128, 129, 2**31, 0.0, 0.5, 1.0, 1.5, 2.5,
          -2.0, -2.5, 100.5, float("inf"), float("nan"), 10**400, "", "a", "1", "none", "auto", "\ud800", [], ["a"],
          ["a", ""], ["a", "b", "c", "d"], ["a", "b", "c", "d", "e"], [1, 2], [[1], [2, 3]], [True], [["a"]], {},
          {"a": 1}, {"type": "text"}, {"type": "json_object"}, {"include_usage": True}]
MESSAGES = [
    [], [{"role": "user"}], [{"role": "user", "content": None}], [{"role": "robot", "content": "x"}],
    [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
    [{"role": "tool", "content": "x", "tool_call_id": None}], [{"role": "tool", "content": "x", "tool_call_id": "1"}],
    [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "x": 1}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], [{"role": "user", "content": []}],
    [{"role": "user", "content": "x", "name": 3}], [{"role": "user", "content": "x", "name": "bob"}],
    [{"role": "assistant", "content": "\ud800"}], ["hi"], [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}],
]


def _different(name, value):
    """The two deliberate differences (see the module docstring)."""
    zero = type(value) in (int, float) and value == 0
    return (name in ("stream", "echo") and zero) or (name == "stream_options" and value is not None and not (
        isinstance(value, dict) and set(value) <= {"include_usage"} and type(value.get("include_usage")) is bool))


def _fields(kind):
    return sorted(set(REQUEST_MODELS[kind].model_fields) | {"custom_id", "frobnicate"})


def _corpus():
    for kind in ("chat", "completion"):
        yield kind, BASE[kind]
        for name, value in itertools.product(_fields(kind), VALUES):
            if _different(name, value):
                continue
            yield kind, {**BASE[kind], name: value}
        for a, b in [("top_logprobs", "logprobs"), ("min_tokens", "max_tokens"), ("best_of", "n"),
                     ("max_completion_tokens", "max_tokens"), ("n", "prompt")]:
            for va, vb in itertools.product(VALUES[:18], VALUES[:18] + [["a"] * 3, [[1]] * 64]):
                yield kind, {**BASE[kind], a: va, b: vb}
    for m in MESSAGES:
        yield "chat", {"messages": m}
    yield "chat", {}
    yield "completion", {}
    for p in [[], [1, True], [[1], "a"], [[]], ["a"] * 129, ["a"] * 128, [-5], "\ud800"]:
        yield "completion", {"prompt": p}


def _old(kind, body):
    try:
        return parse_request("x", {"method": "POST", "url": URL[kind], "body": body}, 1)
    except oai.RequestError as e:
        return e


def _new(kind, body):
    try:
        return parse_body(kind, body, features=Features.BATCH, where="line 1: ")
    except oai.RequestError as e:
        return e


def _agree(kind, body):
    old, new = _old(kind, body), _new(kind, body)
    if isinstance(old, oai.RequestError) or isinstance(new, oai.RequestError):
        assert isinstance(old, oai.RequestError) and isinstance(new, oai.RequestError), (body, old, new)
        assert new.message.startswith("line 1: ")
        return False
    assert isinstance(new, ParsedRequest)
    for f in ("kind", "messages", "prompts", "max_tokens_set", "top_logprobs"):
        assert getattr(old, f) == getattr(new, f), (f, body)
    assert old.params == dataclasses.replace(new.params, guided_decoding=new.guided), body
    return True


def test_schema_accepts_and_refuses_what_the_batch_format_does():
    results = [_agree(kind, body) for kind, body in _corpus()]
    # the corpus holds plenty of both
    assert sum(results) > 300 and len(results) - sum(results) > 1000


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["chat", "completion"]), data=st.data())
def test_schema_agrees_on_generated_bodies(kind, data):
    names = st.sampled_from([f for f in _fields(kind) if f not in ("stream", "echo", "stream_options")])
    extra = data.draw(st.dictionaries(names, json_values | st.sampled_from(VALUES), max_size=4))
    _agree(kind, {**BASE[kind], **extra})


def test_the_batch_format_is_the_schema():
    # 0 is not a boolean; stream_options must be an object: one schema, so both paths refuse
    for kind, name, value in [("chat", "stream", 0), ("completion", "echo", 0), ("chat", "stream_options", 5)]:
        body = {**BASE[kind], name: value}
        assert isinstance(_old(kind, body), oai.RequestError) and isinstance(_new(kind, body), oai.RequestError)
    # structured output rides in the batch request's params
    req = _old("chat", {**BASE["chat"], "response_format": {"type": "json_object"}})
    assert req.params.guided_decoding.json == {"type": "object"}
    assert _old("completion", {**BASE["completion"], "guided_choice": ["a", "b"]}).params.guided_decoding.choice == ("a", "b")


@pytest.mark.parametrize("body,param,code", [
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, "frobnicate", "unknown_parameter"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools", "unsupported_parameter"),
    ({}, "messages", "missing_required_parameter"),
])
def test_errors_name_the_param_and_code(body, param, code):
    err = _new("chat", body)
    assert (err.param, err.code) == (param, code), err.message


def test_server_features_parse_streaming_and_structured_output():
    body = {**BASE["chat"], "stream": True, "stream_options": {"include_usage": True},
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                        "strict": True}}}
    req = parse_body("chat", body)
    assert req.stream and req.include_usage and req.guided.json == {"type": "object"}
    assert parse_body("completion", {"prompt": "x", "guided_regex": "[ab]+"}).guided.regex == "[ab]+"
    for bad in [{"use_beam_search": True}, {"guided_choice": []}, {"guided_regex": "a", "guided_json": {}},
                {"response_format": {"type": "json_schema"}}, {"stream_options": {"include_usage": 1}}]:
        with pytest.raises(oai.RequestError):
            parse_body("chat", {**BASE["chat"], **bad})
    with pytest.raises(oai.RequestError, match="stream"):
        parse_body("chat", {**BASE["chat"], "stream": True}, features=Features.BATCH)


def test_builders_produce_schema_valid_bodies(tiny_llm):
    from jaxinfer import SamplingParams

    outs = tiny_llm.generate(["a", "b"], SamplingParams(max_tokens=3, temperature=0, logprobs=2), use_tqdm=False)
    chat = parse_body("chat", {**BASE["chat"], "logprobs": True, "top_logprobs": 2})
    comp = parse_body("completion", {"prompt": ["a", "b"], "logprobs": 2})
    ChatCompletion.model_validate(oai.chat_completion(chat, outs[:1], "m"))
    Completion.model_validate(oai.text_completion(comp, outs, "m"))
    assert error_body("bad", param="n", code="invalid_value") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": "invalid_value"}}
