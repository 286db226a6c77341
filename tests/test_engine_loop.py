"""The server over the incremental engine interface (add / abort / step) that ``Engine``
implements.

``ScriptedEngine`` implements that interface on the host: each step every running row takes
the argmax of seeded random logits, masked by the row's grammar (``row.guided``, attached by
the server) through ``BatchBitmask`` and ``apply_token_bitmask`` over the whole padded batch,
as the jitted step will. Rows are real
``Row``s from ``LLM.new_request`` with the real tokenizer, stop checker and detokenizer, so the
server's streaming, cancellation, back-pressure and structured output are exercised end to end
through the official client, with the engine's timing (held steps, full queues) in the test's
hands; tests/test_server.py runs the server over the real engine.
"""

import collections
import json
import re
import threading
import time

import httpx2 as httpx
import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import openai
import pytest

from jaxinfer.engine.rows import record_token
from jaxinfer.errors import InvalidRequest
from jaxinfer.guided import BatchBitmask, apply_token_bitmask
from jaxinfer.server import ServerConfig
from jaxinfer.server.engine_loop import Accepted, Done, EngineLoop, Failed, Job, QueueFull
from tests.server_testing import live_server, metric_samples

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
    "required": ["name", "n", "pets"], "additionalProperties": False,
}
PAGE = 16


class ScriptedEngine:
    """The incremental engine interface on the host (see the module docstring)."""

    def __init__(self, tokenizer, vocab_size: int, *, max_num_seqs: int = 4, num_pages: int = 64):
        self.tokenizer, self.vocab_size, self.max_num_seqs = tokenizer, vocab_size, max_num_seqs
        self.num_pages = num_pages
        self.waiting: collections.deque = collections.deque()
        self.running: list = []
        self.pages: dict[int, int] = {}  # id(row) -> pages held
        self.gate = threading.Event()  # step() waits on it: the tests hold requests in the queue
        self.gate.set()
        self.aborted = 0
        self._mask = jax.jit(apply_token_bitmask)
        self.masks = BatchBitmask(max_num_seqs, vocab_size, num_threads=1)
        self.images = None  # no image encoder: image parts are refused

    def add(self, row) -> None:
        if len(row.prompt_ids) + row.max_new > PAGE * self.num_pages:
            raise InvalidRequest("the sequence can never fit in the KV cache")
        self.waiting.append(row)

    def abort(self, row) -> None:
        if row in self.waiting:
            self.waiting.remove(row)
        elif any(r is row for r in self.running):
            self.running = [r for r in self.running if r is not row]
            self.pages.pop(id(row), None)
        self.aborted += 1

    def step(self) -> list:
        self.gate.wait()
        while self.waiting and len(self.running) < self.max_num_seqs:
            row = self.waiting.popleft()
            row.scheduled_time = time.perf_counter()
            self.running.append(row)
        # one masked "sampling step" for the whole batch, padded to max_num_seqs, as the jitted
        # engine step will take it: logits f32[B, V], bitmask i32[B, V/32], has_mask bool[B]
        B, rows = self.max_num_seqs, list(self.running)
        logits = np.zeros((B, self.vocab_size), np.float32)
        for b, row in enumerate(rows):
            self.pages[id(row)] = -(-(len(row.prompt_ids) + len(row.token_ids) + 1) // PAGE)
            rng = np.random.default_rng([row.params.seed or 0, len(row.token_ids), *row.prompt_ids[-3:]])
            logits[b] = rng.standard_normal(self.vocab_size)
        matchers = [getattr(row, "guided", None) for row in rows]
        self.masks.fill(matchers)
        masked = self._mask(jnp.asarray(logits), jnp.asarray(self.masks.bitmask), jnp.asarray(self.masks.has_mask))
        tokens = np.asarray(jnp.argmax(masked, axis=-1))
        finished = []
        for b, row in enumerate(rows):
            tok = int(tokens[b])  # record_token advances the row's matcher, as in the real engine
            if record_token(row, tok, None, b, time.perf_counter(), self.tokenizer):
                self.running.remove(row)
                self.pages.pop(id(row))
                finished.append(row)
        return finished

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_usage(self) -> float:
        return sum(self.pages.values()) / self.num_pages


@pytest.fixture(scope="module")
def llm(tiny_gguf):
    from jaxinfer import LLM

    llm = LLM(str(tiny_gguf), progress=False, max_num_seqs=4, num_gpu_blocks_override=8)
    llm.engine = ScriptedEngine(llm.tokenizer, llm.cfg.vocab_size, num_pages=12)
    return llm


@pytest.fixture(scope="module")
def server(llm):
    with live_server(llm, ServerConfig("scripted", max_waiting=4)) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=60)


def _idle(url, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        m = metric_samples(url)
        if (m[("jaxinfer:num_requests_running", frozenset())], m[("jaxinfer:num_requests_waiting", frozenset())],
                m[("jaxinfer:kv_cache_usage_perc", frozenset())]) == (0, 0, 0):
            return
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_outputs_validate(client, seed):
    r = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "a pet owner as JSON"}], max_tokens=120, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "owner", "schema": SCHEMA, "strict": True}})
    c = r.choices[0]
    assert c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.message.content), SCHEMA)


@pytest.mark.parametrize("seed", range(4))
def test_choice_and_regex_outputs_are_in_the_language(client, seed):
    choices = ["sunny", "rainy", "partly cloudy"]
    r = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "weather?"}],
                                       max_tokens=20, seed=seed, n=2, extra_body={"guided_choice": choices})
    assert len(r.choices) == 2 and all(c.message.content in choices for c in r.choices)
    regex = r"[A-Z][a-z]{1,5}-[0-9]{2,3}"
    r = client.completions.create(model="scripted", prompt="code:", max_tokens=20, seed=seed,
                                  extra_body={"guided_regex": regex})
    assert re.fullmatch(regex, r.choices[0].text), r.choices[0].text


def test_stream_comes_token_by_token_and_equals_the_whole(client):
    kw = dict(model="scripted", prompt="Once", max_tokens=8, seed=3, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert len(chunks) >= 4  # the incremental engine streams as it goes
    assert [c.choices[0].finish_reason for c in chunks].count("length") == 1 and chunks[-1].choices[0].finish_reason


def test_disconnect_aborts_and_frees(server, client, llm):
    url, _ = server
    before = llm.engine.aborted
    stream = client.completions.create(model="scripted", prompt="long", max_tokens=100, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 30
    while llm.engine.aborted == before:
        assert time.monotonic() < deadline, "the row was not aborted"
        time.sleep(0.05)
    _idle(url)


def test_full_queue_answers_429_and_recovers(server, llm):
    """Hold the engine: 4 slots + 4 waiting take 8 sequences; the 9th is refused with Retry-After."""
    url, _ = server
    _idle(url)
    llm.engine.gate.clear()
    results = {}

    def post(i):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": f"p{i}", "max_tokens": 2}, timeout=60)
        results[i] = r.status_code

    threads = [threading.Thread(target=post, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while server[1].state.server.loop.rows_in_flight < 8:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "one too many", "max_tokens": 2}, timeout=60)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
    finally:
        llm.engine.gate.set()
        for t in threads:
            t.join(60)
    assert results == {i: 200 for i in range(8)}
    _idle(url)


def test_engine_refusal_is_a_400(client):
    with pytest.raises(openai.BadRequestError):  # 12 pages of 16 tokens < prompt + 200
        client.completions.create(model="scripted", prompt="x", max_tokens=200)


def test_rate_limit_per_key(llm):
    with live_server(llm, ServerConfig("scripted", rate_limit=2)) as (url, _):
        def post(key):
            return httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                              headers={"Authorization": f"Bearer {key}"}, timeout=60)

        assert [post("a").status_code for _ in range(2)] == [200, 200]
        r = post("a")
        assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 60
        assert post("b").status_code == 200  # another key has its own budget


def test_loop_bound_without_a_thread(llm):
    """The bound on sequences in flight, counted by submit alone (no thread, nothing finishes)."""
    loop = EngineLoop(llm, max_waiting=2)  # 4 slots + 2
    events = []

    def job(n, prompts=1):
        from jaxinfer import SamplingParams

        return Job([(None, [1, 2, 3])] * prompts, SamplingParams(n=n, max_tokens=2), sink=events.append)

    loop.submit(job(4))
    loop.submit(job(1, prompts=2))
    with pytest.raises(QueueFull):
        loop.submit(job(1))
    assert loop.rows_in_flight == 6
    big = EngineLoop(llm, max_waiting=0)
    big.submit(job(8))  # an idle loop takes any job, however large
    assert big.rows_in_flight == 8


def test_stop_fails_jobs_in_flight(llm):
    llm2 = llm  # the scripted engine is shared: hold it so the job stays in flight
    llm2.engine.gate.clear()
    got = []
    done = threading.Event()

    def sink(ev):
        got.append(ev)
        if isinstance(ev, (Done, Failed)):
            done.set()

    from jaxinfer import SamplingParams

    loop = EngineLoop(llm2)
    loop.start()
    loop.submit(Job([(None, [5, 6])], SamplingParams(max_tokens=3), sink=sink))
    deadline = time.monotonic() + 10
    while not got:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    threading.Timer(0.2, llm2.engine.gate.set).start()
    loop.stop(timeout=30)
    assert isinstance(got[0], Accepted) and done.is_set()
    assert isinstance(got[-1], (Done, Failed))
    while llm2.engine.has_unfinished():  # leave the shared engine clean
        llm2.engine.step()
