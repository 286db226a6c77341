"""`jaxinfer serve` driven live on 127.0.0.1 by the official `openai` client.

The server runs the tiny random Llama (SmolLM2's real tokenizer and chat template, 2 layers)
so it starts and compiles in seconds on a CPU; its text is noise, so every check is about the
API's behaviour, not the words. Everything is bounded: few requests, few tokens, timeouts.
"""

import asyncio
import concurrent.futures
import json
import re
import time

import httpx2 as httpx  # the openai client's own HTTP library
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxinfer.server import ServerConfig
from tests.server_testing import live_server, metric_samples

KEY = "test-key"
CHAT = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def llm(tiny_gguf):
    from jaxinfer import LLM

    return LLM(str(tiny_gguf), progress=False, max_num_seqs=8)


@pytest.fixture(scope="module")
def server(llm):
    with live_server(llm, ServerConfig("tiny", api_key=KEY, max_waiting=8)) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _chat(client, **kw):
    return client.chat.completions.create(model="tiny", messages=kw.pop("messages", CHAT), **kw)


def _prompt_tokens(url, **body):
    r = httpx.post(f"{url}/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["count"]


# ------------------------------------------------------------------------------------ basics


def test_chat_with_exact_usage(server, client):
    r = _chat(client, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    (c,) = r.choices
    assert r.object == "chat.completion" and c.message.role == "assistant" and c.finish_reason == "length"
    assert r.usage.prompt_tokens == _prompt_tokens(server[0], messages=CHAT)
    assert r.usage.completion_tokens == 6 and r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_completions_with_exact_usage(server, client):
    r = client.completions.create(model="tiny", prompt=["Once upon", "a time there"], max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True}, logprobs=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(len(c.logprobs.tokens) == 5 for c in r.choices)
    want = sum(_prompt_tokens(server[0], prompt=p) for p in ["Once upon", "a time there"])
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want, 10)


def test_n_2(client):
    r = _chat(client, max_tokens=4, temperature=1.0, seed=7, n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 8
    r = client.completions.create(model="tiny", prompt=["a", "b"], n=2, max_tokens=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.usage.completion_tokens == 12


def test_stop_string_ends_the_text_before_it(client):
    full = client.completions.create(model="tiny", prompt="The", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    want = full[: full.index(stop)]
    r = client.completions.create(model="tiny", prompt="The", max_tokens=12, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")


def test_logprobs_0_5_and_21(client):
    r = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert [list(d) for d in lp.top_logprobs] == [[t] for t in lp.tokens]  # just the sampled token
    r = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0, logprobs=5)
    lp = r.choices[0].logprobs
    assert all(5 <= len(d) <= 6 and t in d for d, t in zip(lp.top_logprobs, lp.tokens))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="Hi", max_tokens=3, logprobs=21)
    r = _chat(client, max_tokens=3, temperature=0, logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 5 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[-1].logprob
    r = _chat(client, max_tokens=2, temperature=0, logprobs=True, top_logprobs=0)
    assert all(t.top_logprobs == [] for t in r.choices[0].logprobs.content)
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, max_tokens=3, logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs"


def test_streams_equal_whole_answers(client):
    for n in (1, 2):
        kw = dict(max_tokens=10, temperature=0, n=n, extra_body={"min_tokens": 2})
        whole = _chat(client, **kw)
        chunks = list(_chat(client, stream=True, stream_options={"include_usage": True}, **kw))
        texts, reasons = [""] * n, [[] for _ in range(n)]
        for ch in chunks[:-1]:
            assert ch.usage is None
            for c in ch.choices:
                texts[c.index] += c.delta.content or ""
                if c.finish_reason is not None:
                    reasons[c.index].append(c.finish_reason)
        assert texts == [c.message.content for c in whole.choices]
        assert reasons == [[c.finish_reason] for c in whole.choices]
        for i in range(n):  # the finish reason comes in the choice's last chunk
            last = [ch for ch in chunks if any(c.index == i for c in ch.choices)][-1]
            assert last.choices[0].finish_reason is not None
        assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage

    whole = client.completions.create(model="tiny", prompt="Hello", max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [whole.choices[0].finish_reason]
    assert chunks[-1].choices[0].finish_reason is not None


def test_sse_wire_format(server):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server[0]}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


def test_models_version_health_tokenize(server, client, llm):
    url = server[0]
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/version").json()["version"]
    ids = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()["tokens"]
    assert ids == llm.tokenizer.encode("Hello world", add_special_tokens=False)
    assert httpx.post(f"{url}/detokenize", json={"tokens": ids}).json() == {"prompt": "Hello world"}
    assert httpx.post(f"{url}/detokenize", json={"tokens": [10**9]}).status_code == 400
    assert httpx.post(f"{url}/tokenize", json={"prompt": "a", "messages": CHAT}).status_code == 400


def test_api_key(server):
    url = server[0]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": CHAT, "temperature": 2.5}, "temperature"),
    ({"messages": CHAT, "frobnicate": 1}, "frobnicate"),
    ({"messages": CHAT, "max_tokens": 10**6}, "max_tokens"),
    ({"messages": CHAT, "guided_regex": "(["}, "guided_regex"),
    ({"messages": CHAT, "guided_json": {"type": "bogus"}}, "guided_json"),
    ({"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"messages": CHAT, "guided_choice": []}, "guided_choice"),
])
def test_bad_requests_get_400_with_openai_error_body(server, body, param):
    r = httpx.post(f"{server[0]}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "n"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999}}}


def test_json_schema_outputs_validate_over_many_seeds(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        rs = list(pool.map(lambda s: _chat(client, max_tokens=80, temperature=1.0, seed=s, response_format=fmt),
                           range(16)))
    for r in rs:
        (c,) = r.choices
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_json_object_and_unconstrained_rows_share_the_batch(client):
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        free = [pool.submit(_chat, client, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
                for _ in range(3)]
        obj = [pool.submit(_chat, client, max_tokens=120, temperature=0.8, seed=s,
                           response_format={"type": "json_object"}) for s in range(3)]
        for f in free:
            assert f.result().choices[0].finish_reason == "length" and f.result().usage.completion_tokens == 12
        for f in obj:
            c = f.result().choices[0]
            if c.finish_reason == "stop":  # an object may outgrow max_tokens; one that ends must parse
                assert isinstance(json.loads(c.message.content), dict)


def test_guided_choice_and_regex_stay_inside_the_language(client):
    for s in range(6):
        r = client.completions.create(model="tiny", prompt="Pick:", max_tokens=10, temperature=1.0, seed=s,
                                      extra_body={"guided_choice": ["red", "green", "blue sky"]})
        assert r.choices[0].text in {"red", "green", "blue sky"} and r.choices[0].finish_reason == "stop"
        r = _chat(client, max_tokens=20, temperature=1.0, seed=s, extra_body={"guided_regex": r"[0-9]{2}-[a-z]{1,3}"})
        assert re.fullmatch(r"[0-9]{2}-[a-z]{1,3}", r.choices[0].message.content)
    # streamed, the pieces concatenate to a sentence of the grammar
    chunks = list(_chat(client, max_tokens=20, temperature=1.0, seed=3, stream=True,
                        extra_body={"guided_grammar": 'start: "a" ("b" | "cd")+ "!"'}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert re.fullmatch(r"a(b|cd)+!", text) or chunks[-1].choices[0].finish_reason == "length"


def test_malformed_json_is_a_400(server):
    r = httpx.post(f"{server[0]}/v1/completions", content=b"{nope", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


# ------------------------------------------------------------------------------------ metrics


def _wait_idle(url, timeout=60.0):
    deadline = time.monotonic() + timeout
    while True:
        m = metric_samples(url)
        if m[("jaxinfer:num_requests_running", frozenset())] == 0 and m[("jaxinfer:num_requests_waiting", frozenset())] == 0:
            return m
        assert time.monotonic() < deadline, "running/waiting did not return to 0"
        time.sleep(0.2)


def test_metrics_count_exactly(server, client):
    url = server[0]
    before = _wait_idle(url)
    a = _chat(client, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    b = client.completions.create(model="tiny", prompt=["x", "y z"], max_tokens=3, extra_body={"ignore_eos": True})
    full = client.completions.create(model="tiny", prompt="The", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full.split()[1]
    c = client.completions.create(model="tiny", prompt="The", max_tokens=8, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert c.choices[0].finish_reason == "stop"
    after = _wait_idle(url)

    def delta(name, **labels):
        key = (name, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("jaxinfer:request_success_total", finished_reason="length") == 1 + 2 + 1
    assert delta("jaxinfer:request_success_total", finished_reason="stop") == 1
    usages = [a.usage, b.usage, c.usage]  # and `full`: prompt "The", 8 tokens
    assert delta("jaxinfer:prompt_tokens_total") == sum(u.prompt_tokens for u in usages) + _prompt_tokens(url, prompt="The")
    assert delta("jaxinfer:generation_tokens_total") == sum(u.completion_tokens for u in usages) + 8
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"jaxinfer:{h}_count") == 5  # one per prompt
    assert after[("jaxinfer:kv_cache_usage_perc", frozenset())] == 0.0


# ------------------------------------------------------------------------------------ load


def test_load_with_disconnects(server, llm):
    """40 concurrent streaming clients; every 4th hangs up after its first chunk. Each request
    is answered once or refused with 429, and the server ends idle with every page free."""
    url, app = server
    N, DROP = 40, 4
    outcome: dict[int, str] = {}

    async def one(i, aclient):
        try:
            stream = await aclient.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"Story number {i}"}], max_tokens=12,
                stream=True, temperature=0, extra_body={"ignore_eos": True})
        except openai.RateLimitError as e:
            assert e.response.headers.get("retry-after")
            outcome[i] = "429"
            return
        reasons, ids = [], set()
        async for ch in stream:
            ids.add(ch.id)
            if i % DROP == 0:
                await stream.close()
                outcome[i] = "dropped"
                return
            reasons += [c.finish_reason for c in ch.choices if c.finish_reason]
        assert reasons == ["length"] and len(ids) == 1, (reasons, ids)
        assert i not in outcome
        outcome[i] = "answered"

    async def main():
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        await asyncio.wait_for(asyncio.gather(*(one(i, aclient) for i in range(N))), timeout=240)
        await aclient.close()

    asyncio.run(main())
    assert sorted(outcome) == list(range(N)) and set(outcome.values()) <= {"answered", "dropped", "429"}
    assert outcome.get(1) in ("answered", "429") and "answered" in outcome.values()
    m = _wait_idle(url, timeout=120)
    assert m[("jaxinfer:kv_cache_usage_perc", frozenset())] == 0.0
    deadline = time.monotonic() + 60
    while app.state.server.loop.rows_in_flight:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    # and it still answers
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200


# ------------------------------------------------------------------------------------ fuzz

SMALL = st.sampled_from([None, -1, 0, 1, 2, 3, 129, 10**30, 1.5, True, "2", [], {}])
VALUE = st.one_of(
    SMALL, st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
    st.lists(st.one_of(st.integers(-3, 60000), st.text(max_size=4)), max_size=3),
    st.dictionaries(st.text(max_size=4), st.one_of(st.none(), st.integers(), st.text(max_size=4)), max_size=2))
FIELDS = ["temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty", "logprobs",
          "top_logprobs", "stream", "stream_options", "top_k", "min_p", "repetition_penalty", "min_tokens",
          "ignore_eos", "logit_bias", "response_format", "guided_regex", "guided_choice", "guided_json",
          "use_beam_search", "best_of", "echo", "suffix", "tools", "tool_choice", "user", "bogus"]
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "robot", 3]),
                                 "content": st.one_of(st.text(max_size=8), st.none(), st.just([{"type": "text", "text": "a"}]))})


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[0], headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(chat=st.booleans(), fields=st.dictionaries(st.sampled_from(FIELDS), VALUE, max_size=4),
       max_tokens=SMALL, messages=st.lists(MESSAGE, max_size=3),
       prompt=st.one_of(st.text(max_size=8), st.lists(st.integers(-2, 50000), max_size=3), SMALL))
def test_fuzzed_bodies_get_200_or_4xx(http, chat, fields, max_tokens, messages, prompt):
    body = {**fields, "max_tokens": max_tokens}
    if isinstance(body.get("n"), int) and body["n"] > 4:
        body["n"] = 4  # keep the work bounded; n's limits are in test_openai_schema
    body.update({"messages": messages} if chat else {"prompt": prompt})
    r = http.post("/v1/chat/completions" if chat else "/v1/completions", content=json.dumps(body))
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code != 200:
        assert r.json()["error"]["message"]


def test_server_answers_after_the_fuzz(http):
    assert http.get("/health").status_code == 200
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None


def test_repetition_detection_ends_a_loop_and_is_counted(server, client):
    key = ("jaxinfer:request_success_total", frozenset({("finished_reason", "repetition")}))
    before = metric_samples(server[0]).get(key, 0)
    # the grammar forces a loop; min_tokens keeps EOS away (and the detector off) for 10 tokens
    r = client.completions.create(model="tiny", prompt="ab", max_tokens=60, temperature=0, extra_body={
        "guided_regex": "(ab)+", "min_tokens": 10, "repetition_detection": {"max_period": 4, "min_repeats": 3}})
    c = r.choices[0]
    assert c.finish_reason == "repetition" and 10 < r.usage.completion_tokens < 60 and re.fullmatch("(ab)*a?", c.text)  # a prefix of the language
    assert metric_samples(server[0])[key] == before + 1
    bad = httpx.post(f"{server[0]}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={"prompt": "x", "repetition_detection": {"min_repeats": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("repetition_detection")
