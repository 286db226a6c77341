"""The OpenAI request schema (``openai_schema.parse_body``, and ``parse_request`` for a batch line)
against two things that are not our code:

* results written out by hand from OpenAI's and vLLM's documentation: the Batch API guide's
  own example line, what each body field means (defaults, nulls, message flattening, token-id
  prompts, structured output, beam search), and which refusal names which parameter and code;
* the official ``openai`` package's request types (``CompletionCreateParamsNonStreaming`` of
  chat and completions), validated strictly with pydantic: every body we accept, less vLLM's
  extensions and the fields we accept and ignore, is a request OpenAI's own client can send.
  (The reverse does not hold by design: OpenAI's types carry no value ranges, and we refuse
  what we cannot serve.)

And the response bodies we build validate under the ``openai`` package's response models.
"""

import itertools
import json
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types import Completion as OpenAICompletion
from openai.types import completion_create_params
from openai.types.chat import ChatCompletion as OpenAIChatCompletion
from openai.types.chat import completion_create_params as chat_create_params
from pydantic import TypeAdapter, ValidationError

from jaxinfer import openai_format as oai
from jaxinfer.beam import BeamSearchParams
from jaxinfer.guided import GuidedDecoding
from jaxinfer.openai_schema import (REQUEST_MODELS, ChatCompletion, Completion, Features, error_body, parse_body,
                                    parse_request)
from jaxinfer.sampling import SamplingParams

BASE = {"chat": {"messages": [{"role": "user", "content": "hi"}]}, "completion": {"prompt": "hi"}}
USER = [{"role": "user", "content": "hi"}]


def _parse(kind, body, **kw):
    try:
        return parse_body(kind, body, features=Features.BATCH, **kw)
    except oai.RequestError as e:
        return e


# ------------------------------------------------------------------------- the Batch API's own line


def test_the_batch_guides_example_line():
    # the first line of the example input file in OpenAI's Batch API guide, byte for byte
    raw = (b'{"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": '
           b'"gpt-3.5-turbo-0125", "messages": [{"role": "system", "content": "You are a helpful assistant."},'
           b'{"role": "user", "content": "Hello world!"}],"max_tokens": 1000}}')
    custom_id, obj = oai.parse_envelope(raw, 1)
    req = parse_request(custom_id, obj, 1)
    assert req == oai.BatchRequest(
        "request-1", 1, "chat",
        [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello world!"}],
        None, SamplingParams(max_tokens=1000), True, None, None, model="gpt-3.5-turbo-0125")


@pytest.mark.parametrize("obj,code,param,text", [
    ({"method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}, "invalid_method", "method", '"POST"'),
    ({"url": "/v1/completions", "body": {"prompt": "x"}}, "invalid_method", "method", "got null"),
    ({"method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}, "invalid_url", "url", "/v1/embeddings"),
    ({"method": "POST", "url": "/v1/completions", "body": ["x"]}, "invalid_body", "body", "JSON object"),
    ({"method": "POST", "url": "/v1/completions"}, "invalid_body", "body", "JSON object"),
])
def test_batch_envelope_errors(obj, code, param, text):
    with pytest.raises(oai.RequestError) as e:
        parse_request("a", obj, 7)
    assert (e.value.code, e.value.param) == (code, param)
    assert e.value.message.startswith("line 7: ") and text in e.value.message


# ------------------------------------------------------------------------- what each field means

# (kind, body, expected): expected holds ParsedRequest fields; "params" is the whole SamplingParams.
# The defaults are OpenAI's (temperature 1, top_p 1, n 1, completions max_tokens 16) and ours for
# chat's max_tokens (256 instead of "the rest of the context").
MEANINGS = [
    ("chat", {"messages": USER},
     {"messages": USER, "prompts": None, "params": SamplingParams(max_tokens=256), "max_tokens_set": False,
      "top_logprobs": None, "guided": None, "beam": None}),
    # JSON null is "not given" everywhere, including inside a message
    ("chat", {"messages": [{"role": "user", "content": "hi", "name": None, "tool_calls": None}], "temperature": None,
              "n": None, "stop": None, "max_tokens": None, "logprobs": None, "model": None},
     {"messages": USER, "params": SamplingParams(max_tokens=256), "max_tokens_set": False, "top_logprobs": None}),
    # developer is read as system; content parts stay parts (encode_chat joins them for a
    # template that does not loop over them)
    ("chat", {"messages": [{"role": "developer", "content": "be brief"},
                           {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                           {"role": "assistant", "content": "c"}, {"role": "tool", "content": "4", "tool_call_id": "t1"}]},
     {"messages": [{"role": "system", "content": "be brief"},
                   {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                   {"role": "assistant", "content": "c"}, {"role": "tool", "content": "4", "tool_call_id": "t1"}]}),
    # max_completion_tokens replaces the deprecated max_tokens
    ("chat", {"messages": USER, "max_tokens": 5, "max_completion_tokens": 7},
     {"params": SamplingParams(max_tokens=7), "max_tokens_set": True}),
    ("chat", {"messages": USER, "max_tokens": 5}, {"params": SamplingParams(max_tokens=5), "max_tokens_set": True}),
    # chat logprobs: a boolean, and top_logprobs how many alternatives (0 when left out)
    ("chat", {"messages": USER, "logprobs": True}, {"top_logprobs": 0, "params": SamplingParams(max_tokens=256,
                                                                                                 logprobs=0)}),
    ("chat", {"messages": USER, "logprobs": True, "top_logprobs": 3},
     {"top_logprobs": 3, "params": SamplingParams(max_tokens=256, logprobs=3)}),
    ("chat", {"messages": USER, "logprobs": False}, {"top_logprobs": None}),
    # every sampling field, OpenAI's and vLLM's, lands in SamplingParams under vLLM's name
    ("chat", {"messages": USER, "n": 2, "temperature": 0, "top_p": 0.5, "stop": "x", "seed": 7, "presence_penalty": 0.5,
              "frequency_penalty": -1, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 2,
              "ignore_eos": True, "max_tokens": 9, "repetition_detection": {"max_period": 8}},
     {"params": SamplingParams(n=2, temperature=0.0, top_p=0.5, stop=["x"], seed=7, presence_penalty=0.5,
                               frequency_penalty=-1.0, top_k=5, min_p=0.1, repetition_penalty=1.2, min_tokens=2,
                               ignore_eos=True, max_tokens=9,
                               repetition_detection={"max_period": 8, "min_repeats": 4})}),
    ("chat", {"messages": USER, "stop": ["a", "b"]}, {"params": SamplingParams(max_tokens=256, stop=["a", "b"])}),
    # fields OpenAI documents that change nothing here are accepted at their neutral values
    ("chat", {"messages": USER, "model": "gpt-4o", "user": "u", "store": False, "metadata": {"k": "v"},
              "logit_bias": {}, "tools": [], "tool_choice": "none", "parallel_tool_calls": True},
     {"params": SamplingParams(max_tokens=256)}),
    # completions: a string, strings, token ids, lists of token ids; logprobs is a count
    ("completion", {"prompt": "hi"},
     {"messages": None, "prompts": ["hi"], "params": SamplingParams(max_tokens=16), "max_tokens_set": False,
      "top_logprobs": None}),
    ("completion", {"prompt": ["a", "b"], "n": 2, "best_of": 2, "echo": False, "suffix": ""},
     {"prompts": ["a", "b"], "params": SamplingParams(n=2, max_tokens=16)}),
    ("completion", {"prompt": [1, 2, 3]}, {"prompts": [[1, 2, 3]]}),
    ("completion", {"prompt": [[1], [2, 3]], "logprobs": 2, "max_tokens": 4},
     {"prompts": [[1], [2, 3]], "top_logprobs": 2, "params": SamplingParams(max_tokens=4, logprobs=2),
      "max_tokens_set": True}),
    ("completion", {"prompt": "hi", "logprobs": 0}, {"top_logprobs": 0}),
    # structured output: OpenAI's response_format and vLLM's guided_* fields
    ("chat", {"messages": USER, "response_format": {"type": "json_object"}},
     {"guided": GuidedDecoding(json={"type": "object"})}),
    ("chat", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}, "strict": True}}},
     {"guided": GuidedDecoding(json={"type": "object", "properties": {"a": {"type": "integer"}}})}),
    ("chat", {"messages": USER, "response_format": {"type": "text"}}, {"guided": None}),
    ("completion", {"prompt": "x", "guided_choice": ["yes", "no"]}, {"guided": GuidedDecoding(choice=("yes", "no"))}),
    ("completion", {"prompt": "x", "guided_regex": "[ab]+"}, {"guided": GuidedDecoding(regex="[ab]+")}),
    # vLLM's beam search: n beams of max_tokens
    ("completion", {"prompt": "x", "use_beam_search": True, "n": 3, "max_tokens": 5, "length_penalty": 0.5},
     {"beam": BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=False, length_penalty=0.5)}),
]


@pytest.mark.parametrize("kind,body,expected", MEANINGS, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(MEANINGS)])
def test_a_body_means_what_openai_documents(kind, body, expected):
    req = parse_body(kind, body, features=Features.BATCH)
    assert req.kind == kind
    assert {name: getattr(req, name) for name in expected} == expected


def test_batch_line_carries_structured_output_in_params():
    obj = {"method": "POST", "url": "/v1/chat/completions",
           "body": {"messages": USER, "response_format": {"type": "json_object"}, "max_tokens": 3}}
    req = parse_request("a", obj, 1)
    assert req.params == SamplingParams(max_tokens=3, guided_decoding=GuidedDecoding(json={"type": "object"}))


def test_defaults_apply_under_the_body():
    # the command line's defaults replace OpenAI's, and the body's own values replace both
    defaults = {"temperature": 0.0, "max_tokens": 50, "top_k": 4}
    req = parse_body("chat", {"messages": USER, "top_k": 9}, features=Features.BATCH, defaults=defaults)
    assert req.params == SamplingParams(temperature=0.0, max_tokens=50, top_k=9) and not req.max_tokens_set
    req = parse_body("completion", {"prompt": "x", "temperature": 0.7, "max_tokens": 3}, defaults=defaults)
    assert req.params == SamplingParams(temperature=0.7, max_tokens=3, top_k=4) and req.max_tokens_set


# (kind, body, param, code, words in the message)
REFUSALS = [
    ("chat", {}, "messages", "missing_required_parameter", "missing required parameter 'messages'"),
    ("completion", {}, "prompt", "missing_required_parameter", "'prompt'"),
    ("chat", {"messages": []}, "messages", "invalid_value", "at least 1"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value", "robot"),
    ("chat", {"messages": [{"role": "user"}]}, "messages[0].content", "invalid_value", "required"),
    ("chat", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content", "invalid_value",
     "surrogate"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].image_url.image_url.url", "invalid_value", "Field required"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}]},
     "messages[0].content[0]", "invalid_value", "'text', 'image_url'"),
    ("chat", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", "invalid_value", "tool_call_id"),
    ("chat", {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]}, "messages[0]",
     "unsupported_parameter", '"tool_calls" is not supported'),
    ("chat", {**BASE["chat"], "frobnicate": 1}, "frobnicate", "unknown_parameter", "unrecognized request argument"),
    ("chat", {**BASE["chat"], "temperature": 2.5}, "temperature", "invalid_value", "2.5"),
    ("chat", {**BASE["chat"], "temperature": "1"}, "temperature", "invalid_value", "number"),
    ("chat", {**BASE["chat"], "n": 0}, "n", "invalid_value", "greater than or equal to 1"),
    ("chat", {**BASE["chat"], "n": 129}, "n", "invalid_value", "128"),
    ("chat", {**BASE["chat"], "n": True}, "n", "invalid_value", "integer"),
    ("chat", {**BASE["chat"], "n": 2.0}, "n", "invalid_value", "integer"),
    ("chat", {**BASE["chat"], "top_p": 0}, "top_p", "invalid_value", "greater than 0"),
    ("chat", {**BASE["chat"], "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value", "at most 4"),
    ("chat", {**BASE["chat"], "stop": ""}, "stop", "invalid_value", "at least 1"),
    ("chat", {**BASE["chat"], "max_tokens": 0}, "max_tokens", "invalid_value", "greater than or equal to 1"),
    ("chat", {**BASE["chat"], "top_logprobs": 2}, "top_logprobs", "invalid_value", "requires logprobs"),
    ("chat", {**BASE["chat"], "logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value", "20"),
    ("chat", {**BASE["chat"], "min_tokens": 300}, "min_tokens", "invalid_value", "max_tokens (256, the default)"),
    ("chat", {**BASE["chat"], "tools": [{"type": "function"}]}, "tools", "unsupported_parameter", "not supported"),
    ("chat", {**BASE["chat"], "tool_choice": "required"}, "tool_choice", "unsupported_parameter", "not supported"),
    ("chat", {**BASE["chat"], "logit_bias": {"1": 5}}, "logit_bias", "unsupported_parameter", "not supported"),
    ("chat", {**BASE["chat"], "stream": True}, "stream", "unsupported_parameter", "stream=true"),
    ("chat", {**BASE["chat"], "stream": 0}, "stream", "invalid_value", "boolean"),
    ("chat", {**BASE["chat"], "stream_options": 5}, "stream_options", "invalid_value", "got 5"),
    ("chat", {**BASE["chat"], "response_format": {"type": "json_schema"}}, "response_format", "invalid_value",
     "json_schema is required"),
    ("chat", {**BASE["chat"], "guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format",
     "invalid_value", "at most one kind of structured output per request, got guided_regex, response_format"),
    ("chat", {**BASE["chat"], "length_penalty": 0.5}, "length_penalty", "invalid_value", "use_beam_search"),
    ("chat", {**BASE["chat"], "use_beam_search": True, "temperature": 0.5}, "use_beam_search",
     "unsupported_parameter", "temperature"),
    ("completion", {"prompt": []}, "prompt", "invalid_value", "at least 1"),
    ("completion", {"prompt": ["a"] * 129}, "prompt", "invalid_value", "128"),
    ("completion", {"prompt": ["a"] * 65, "n": 2}, "n", "invalid_value", "n x number of prompts must be <= 128"),
    ("completion", {"prompt": "x", "logprobs": 6}, "logprobs", "invalid_value", "5"),
    ("completion", {"prompt": "x", "logprobs": True}, "logprobs", "invalid_value", "integer"),
    ("completion", {"prompt": "x", "best_of": 3}, "best_of", "unsupported_parameter", "best_of other than n"),
    ("completion", {"prompt": "x", "echo": True}, "echo", "unsupported_parameter", "not supported"),
    ("completion", {"prompt": "x", "suffix": "y"}, "suffix", "unsupported_parameter", "not supported"),
    ("completion", {"prompt": "x", "messages": USER}, "messages", "unknown_parameter", "unrecognized"),
]


@pytest.mark.parametrize("kind,body,param,code,words", REFUSALS,
                         ids=[f"{k}-{p}-{i}" for i, (k, _, p, _, _) in enumerate(REFUSALS)])
def test_a_refusal_names_the_param_and_code(kind, body, param, code, words):
    err = _parse(kind, body, where="line 3: ")
    assert isinstance(err, oai.RequestError), err
    assert (err.param, err.code) == (param, code), err.message
    assert err.message.startswith("line 3: ") and words in err.message, err.message


def test_server_features_parse_streaming_and_structured_output():
    body = {**BASE["chat"], "stream": True, "stream_options": {"include_usage": True},
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                        "strict": True}}}
    req = parse_body("chat", body)
    assert req.stream and req.include_usage and req.guided.json == {"type": "object"}
    assert not parse_body("chat", {**BASE["chat"], "stream": True}).include_usage
    for bad, param in [({"use_beam_search": True}, "use_beam_search"), ({"guided_choice": []}, "guided_choice"),
                       ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage")]:
        with pytest.raises(oai.RequestError) as e:
            parse_body("chat", {**BASE["chat"], **bad})
        assert e.value.param == param, e.value.message


# ------------------------------------------------------------------------- the openai package's types

OPENAI_TYPES = {"chat": chat_create_params.CompletionCreateParamsNonStreaming,
                "completion": completion_create_params.CompletionCreateParamsNonStreaming}
OPENAI_FIELDS = {k: frozenset(typing.get_type_hints(t)) for k, t in OPENAI_TYPES.items()}
ADAPTERS = {k: TypeAdapter(t) for k, t in OPENAI_TYPES.items()}
# vLLM's additions to OpenAI's bodies (and ours, repetition_detection), left out before comparing
VLLM_EXTENSIONS = frozenset({"top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "repetition_detection",
                             "guided_json", "guided_regex", "guided_choice", "guided_grammar", "use_beam_search",
                             "length_penalty"})
# OpenAI fields we do not serve: a request that sets them is refused
OPENAI_ONLY = frozenset({"audio", "modalities", "moderation", "prediction", "prompt_cache_key", "prompt_cache_options",
                         "prompt_cache_retention", "reasoning_effort", "safety_identifier", "verbosity",
                         "web_search_options"})
# Accepted with any value and not used: one model per server; OpenAI's account and billing fields.
IGNORED = frozenset({"model", "user", "metadata", "store", "service_tier", "parallel_tool_calls"})
VALUES = [None, True, False, 0, 1, -1, 2, 3, 4, 5, 16, 20, 21, 128, 129, 2**31, 0.0, 0.5, 1.0, 1.5, 2.5, -2.0, -2.5,
          float("inf"), float("nan"), "", "a", "1", "none", "auto", "required", "\ud800", [], ["a"], ["a", ""],
          ["a", "b", "c", "d"], ["a", "b", "c", "d", "e"], [1, 2], [True], [["a"]], {}, {"a": 1}, {"1": 5},
          {"type": "text"}, {"type": "json_object"}, {"include_usage": True}, {"include_usage": 1}]
MESSAGES = [
    [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
    [{"role": "system", "content": [{"type": "text", "text": "a"}]}, {"role": "user", "content": "x", "name": "bob"}],
    [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    [{"role": "assistant", "content": "x", "refusal": None, "tool_calls": None}],
    [{"role": "tool", "content": "x", "tool_call_id": None}], [{"role": "tool", "content": "x", "tool_call_id": "1"}],
    [{"role": "tool", "content": "x"}], [{"role": "function", "content": "x", "name": "f"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "assistant", "content": None}], [{"role": "user", "content": []}], [{"role": "user", "content": 3}],
    [{"role": "user", "content": "x", "name": 3}], [{"role": "robot", "content": "x"}], ["hi"], [],
]
PROMPTS = ["", "x", ["a", "b"], [1, 2], [], [1, True], [1.0], [["a"]], {}, None]


def _without_nulls(x):
    if isinstance(x, dict):
        return {k: _without_nulls(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_without_nulls(v) for v in x]
    return x


def _openai_accepts(kind, body) -> bool:
    """Whether the openai package's request type (strict: no "1" for 1, no true for 1) holds
    ``body`` with the fields we ignore left out; null means not given, as in our schema."""
    body = {"model": "m", **{k: v for k, v in _without_nulls(body).items() if k not in IGNORED}}
    if set(body) - OPENAI_FIELDS[kind]:
        return False
    try:
        out = ADAPTERS[kind].validate_python(body, strict=True)
        for v in out.values():  # Iterable[...] fields validate lazily, as they are read
            if hasattr(v, "__next__"):
                list(v)
    except ValidationError:
        return False
    return True


def _accepted_are_openai_requests(bodies) -> int:
    accepted = 0
    for kind, body in bodies:
        if isinstance(_parse(kind, body), oai.RequestError):
            continue
        accepted += 1
        openai_body = {k: v for k, v in body.items() if k not in VLLM_EXTENSIONS}
        assert _openai_accepts(kind, openai_body), (kind, body)
    return accepted


def _corpus():
    for kind in ("chat", "completion"):
        yield kind, BASE[kind]
        for name, value in itertools.product(sorted(OPENAI_FIELDS[kind] - IGNORED), VALUES):
            if name not in ("messages", "prompt"):
                yield kind, {**BASE[kind], name: value}
        for (a, b), (va, vb) in itertools.product([("logprobs", "top_logprobs"), ("max_tokens", "max_completion_tokens"),
                                                    ("n", "best_of"), ("stop", "max_tokens")],
                                                   itertools.product(VALUES[:16], VALUES[:16] + [["a"]])):
            yield kind, {**BASE[kind], a: va, b: vb}
    for m in MESSAGES:
        yield "chat", {"messages": m}
    for p in PROMPTS:
        yield "completion", {"prompt": p}


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_our_fields_are_openai_fields_and_vllms(kind):
    ours = frozenset(REQUEST_MODELS[kind].model_fields)
    assert ours - OPENAI_FIELDS[kind] - IGNORED == VLLM_EXTENSIONS
    assert OPENAI_FIELDS[kind] - ours <= OPENAI_ONLY
    for name in OPENAI_FIELDS[kind] - ours:
        assert _parse(kind, {**BASE[kind], name: "x"}).code == "unknown_parameter", name


def test_what_we_accept_is_an_openai_request():
    assert _openai_accepts("chat", BASE["chat"]) and not _openai_accepts("chat", {**BASE["chat"], "n": "1"})
    assert _accepted_are_openai_requests(_corpus()) > 300  # and not by refusing everything


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["chat", "completion"]), data=st.data())
def test_generated_bodies_we_accept_are_openai_requests(kind, data):
    names = st.sampled_from(sorted(OPENAI_FIELDS[kind] - IGNORED - {"messages", "prompt"}))
    extra = data.draw(st.dictionaries(names, json_values | st.sampled_from(VALUES), max_size=4))
    _accepted_are_openai_requests([(kind, {**BASE[kind], **extra})])


# ------------------------------------------------------------------------- response bodies


def test_built_responses_are_openai_responses(tiny_llm):
    outs = tiny_llm.generate(["a", "b"], SamplingParams(max_tokens=3, temperature=0, logprobs=2), use_tqdm=False)
    chat = parse_body("chat", {**BASE["chat"], "logprobs": True, "top_logprobs": 2})
    comp = parse_body("completion", {"prompt": ["a", "b"], "logprobs": 2})
    chat_body = json.loads(json.dumps(oai.chat_completion(chat, outs[:1], "m")))
    comp_body = json.loads(json.dumps(oai.text_completion(comp, outs, "m")))
    ChatCompletion.model_validate(chat_body)
    Completion.model_validate(comp_body)
    theirs = OpenAIChatCompletion.model_validate(chat_body)
    assert theirs.choices[0].message.content == outs[0].outputs[0].text
    assert len(theirs.choices[0].logprobs.content) == len(outs[0].outputs[0].token_ids)
    assert all(len(t.top_logprobs) == 2 for t in theirs.choices[0].logprobs.content)
    theirs = OpenAICompletion.model_validate(comp_body)
    assert [c.text for c in theirs.choices] == [o.outputs[0].text for o in outs]
    assert all(len(c.logprobs.top_logprobs[0]) <= 2 for c in theirs.choices)
    assert theirs.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in outs)
    assert error_body("bad", param="n", code="invalid_value") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": "invalid_value"}}
