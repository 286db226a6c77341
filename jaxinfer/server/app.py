"""The OpenAI-compatible HTTP server: FastAPI routes over one ``EngineLoop``.

Every request body is validated by ``openai_schema``; a bad one is a 400 with OpenAI's error
body, never a 500. Completions stream as server-sent events (``data: {...}`` chunks, then
``data: [DONE]``). A client that goes away cancels its request. Past the waiting bound, and past
a key's rate limit, the answer is 429 with ``Retry-After``. ``drain()`` (SIGTERM) stops
admitting: new requests get 503 while the ones in flight finish.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import math
import signal
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from jaxinfer import __version__
from jaxinfer import openai_format as oai
from jaxinfer import openai_schema as schema
from jaxinfer.errors import InvalidRequest
from jaxinfer.outputs import CompletionOutput
from jaxinfer.server.engine_loop import Accepted, Delta, Done, EngineLoop, Failed, Job, QueueFull
from jaxinfer.server.metrics import CONTENT_TYPE, ServerMetrics

KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on /v1/*
    max_waiting: int = 256  # sequences that may wait beyond the running batch
    rate_limit: int | None = None  # requests per minute per API key (or per client address)
    retry_after_s: int = 1  # Retry-After when the waiting queue is full
    # LoRA adapters by name (``lora.parse_lora_modules``): a request whose model names one runs it
    lora_modules: dict = dataclasses.field(default_factory=dict)
    # /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    allow_runtime_lora_updating: bool = False


class HTTPError(Exception):
    """An answer other than 200, with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers

    @classmethod
    def bad_request(cls, e: oai.RequestError) -> HTTPError:
        return cls(400, e.message, code=e.code, param=e.param)

    def response(self) -> JSONResponse:
        return JSONResponse(schema.error_body(self.message, type=self.type, param=self.param, code=self.code),
                            status_code=self.status, headers=self.headers)


class RateLimiter:
    """At most ``per_minute`` requests per key in any 60-second window."""

    def __init__(self, per_minute: int, clock=time.monotonic):
        self.per_minute, self.clock = per_minute, clock
        self._hits: dict[str, collections.deque] = collections.defaultdict(collections.deque)

    def retry_after(self, key: str) -> float | None:
        """None: admitted (and counted); else seconds until the key may try again."""
        now, hits = self.clock(), self._hits[key]
        while hits and hits[0] <= now - 60.0:
            hits.popleft()
        if len(hits) >= self.per_minute:
            return hits[0] + 60.0 - now
        hits.append(now)
        return None


class Server:
    """The routes' state: the engine loop, the metrics, limits, and whether we are draining."""

    def __init__(self, llm, config: ServerConfig):
        self.llm, self.config = llm, config
        self.metrics = ServerMetrics(config.model_name)
        self.loop = EngineLoop(llm, max_waiting=config.max_waiting, on_finished=self.metrics.finished,
                               on_step=self._gauges)
        self.limiter = RateLimiter(config.rate_limit) if config.rate_limit else None
        self.draining = False
        self.created = int(time.time())
        self._compiler = None
        self.loras = dict(config.lora_modules)  # name -> LoRARequest (runtime loads add to it)
        for req in self.loras.values():  # a bad adapter fails the start, not its first request
            llm.lora_adapter(req)

    def drain(self) -> None:
        self.draining = True

    def _gauges(self) -> None:
        self.metrics.gauges(*self.loop.counts())

    # ------------------------------------------------------------------ admission
    def admit(self, request: Request) -> None:
        """Auth, draining and rate limit, in that order (a bad key is not counted)."""
        key = None
        if self.config.api_key is not None:
            auth = request.headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or token.strip() != self.config.api_key:
                raise HTTPError(401, "missing or incorrect API key: send Authorization: Bearer KEY",
                                code="invalid_api_key")
            key = token.strip()
        if self.draining:
            raise HTTPError(503, "the server is shutting down", type="server_error", code="shutting_down")
        if self.limiter is not None:
            if key is None:
                auth = request.headers.get("authorization", "")
                key = auth.partition(" ")[2].strip() or (request.client.host if request.client else "?")
            wait = self.limiter.retry_after(key)
            if wait is not None:
                raise HTTPError(429, f"rate limit of {self.limiter.per_minute} requests per minute reached",
                                type="rate_limit_error", code="rate_limit_exceeded",
                                headers={"Retry-After": str(max(1, math.ceil(wait)))})

    # ------------------------------------------------------------------ completions
    async def complete(self, request: Request, kind: str) -> Response:
        self.admit(request)
        body = await _json_body(request)
        try:
            req = schema.parse_body(kind, body, defaults=self.llm.sampling_defaults)
            lora = await asyncio.to_thread(oai.lora_for, self.llm, req.model, self.loras, {self.config.model_name})
            prompts, params = await asyncio.to_thread(self._encode, req)
            on_row = await asyncio.to_thread(self._grammar, req, len(prompts) * params.n)
        except oai.RequestError as e:
            if e.code == "model_not_found":  # vLLM's answer to a model it does not serve
                raise HTTPError(404, e.message, type="NotFoundError", code=e.code, param=e.param) from None
            raise HTTPError.bad_request(e) from None
        model = self.config.model_name if lora is None else req.model
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job = Job(prompts, params, sink=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev), on_row=on_row,
                  stream=bool(req.stream), lora=lora)
        try:
            self.loop.submit(job)
        except QueueFull as e:
            raise HTTPError(429, f"the waiting queue is full ({e}); retry later", type="server_overloaded",
                            code="queue_full", headers={"Retry-After": str(self.config.retry_after_s)}) from None
        try:
            first = await events.get()
        except asyncio.CancelledError:
            self.loop.abort(job)
            raise
        if isinstance(first, Failed):
            raise _failure(first)
        assert isinstance(first, Accepted), first
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        if req.stream:
            # the background abort covers a client gone before the stream's first chunk, when the
            # generator (and its finally) never runs; after a finished job it does nothing
            return StreamingResponse(self._stream(req, job, events, rid, model), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(self.loop.abort, job))
        return await self._whole(request, req, job, events, model)

    async def _whole(self, request: Request, req: schema.ParsedRequest, job: Job, events: asyncio.Queue,
                     model: str) -> Response:
        async def result():
            while True:
                ev = await events.get()
                if isinstance(ev, (Done, Failed)):
                    return ev

        waiter = asyncio.ensure_future(result())
        try:
            while not waiter.done():
                await asyncio.wait({waiter}, timeout=0.25)
                if not waiter.done() and await request.is_disconnected():
                    self.loop.abort(job)
                    waiter.cancel()
                    return Response(status_code=499)
        except asyncio.CancelledError:
            self.loop.abort(job)
            waiter.cancel()
            raise
        ev = waiter.result()
        if isinstance(ev, Failed):
            raise _failure(ev)
        build = oai.chat_completion if req.kind == "chat" else oai.text_completion
        return JSONResponse(build(req, ev.outputs, model))

    async def _stream(self, req: schema.ParsedRequest, job: Job, events: asyncio.Queue, rid: str, model: str):
        created, chat = int(time.time()), req.kind == "chat"
        chunk_type = schema.ChatCompletionChunk if chat else schema.CompletionChunk
        finished = False
        try:
            if chat:  # the role first, for every choice
                for i in range(job.num_rows):
                    yield schema.sse(chunk_type(id=rid, created=created, model=model, choices=[
                        schema.ChatChunkChoice(index=i, delta=schema.ChatDelta(role="assistant", content=""))]))
            while True:
                ev = await events.get()
                if isinstance(ev, Delta):
                    if ev.text or ev.finish_reason is not None or (ev.token_ids and req.top_logprobs is not None):
                        yield schema.sse(chunk_type(id=rid, created=created, model=model,
                                                    choices=[_chunk_choice(req, ev)]))
                elif isinstance(ev, Done):
                    finished = True
                    if req.include_usage:
                        yield schema.sse(chunk_type(id=rid, created=created, model=model, choices=[],
                                                    usage=schema.Usage(**oai.usage(ev.outputs))))
                    yield schema.sse("[DONE]")
                    return
                elif isinstance(ev, Failed):
                    finished = True
                    err = _failure(ev)
                    yield schema.sse(json.dumps(schema.error_body(err.message, type=err.type, code=err.code)))
                    yield schema.sse("[DONE]")
                    return
        finally:
            if not finished:  # the client went away (or the server is stopping): free its rows
                self.loop.abort(job)

    def _encode(self, req: schema.ParsedRequest):
        """Token ids of the prompts, and the params fitted to the context (the batch job's rules)."""
        return oai.encode_for(self.llm, req.kind, req.messages, req.prompts, req.params, req.max_tokens_set)

    def _grammar(self, req: schema.ParsedRequest, num_rows: int):
        """Check a request's structured output; the callback that gives each of its rows a matcher.
        The matchers are compiled here, off the engine thread (a big grammar takes a while)."""
        if req.guided is None:
            return None
        from jaxinfer.guided import GrammarCompiler

        param = req.guided_field
        if self._compiler is None:
            self._compiler = GrammarCompiler(self.llm.tokenizer, self.llm.cfg.vocab_size)
        try:
            grammar = self._compiler.check(req.guided)
        except InvalidRequest as e:
            raise oai.RequestError(str(e), param=param) from None

        first = self._compiler.matcher(grammar)
        matchers = [first] + [first.copy() for _ in range(num_rows - 1)]

        def attach(row):
            row.guided = matchers.pop()

        return attach

    # ------------------------------------------------------------------ LoRA adapters
    def load_lora(self, body) -> dict:
        """vLLM's /v1/load_lora_adapter: read and check the adapter now, then serve it by name."""
        from jaxinfer.lora import LoRARequest

        self._runtime_lora()
        try:
            r = schema.parse_model(schema.LoadLoRAAdapterRequest, body)
        except oai.RequestError as e:
            raise HTTPError.bad_request(e) from None
        if r.lora_name in self.loras:
            raise HTTPError(400, f"the LoRA adapter {r.lora_name!r} is already loaded", param="lora_name")
        req = LoRARequest(r.lora_name, max((q.lora_int_id for q in self.loras.values()), default=0) + 1, r.lora_path)
        try:
            self.llm.lora_adapter(req)
        except InvalidRequest as e:
            raise HTTPError(400, str(e), param="lora_path") from None
        self.loras[r.lora_name] = req
        return {"message": f"Success: LoRA adapter '{r.lora_name}' added successfully."}

    def unload_lora(self, body) -> dict:
        """vLLM's /v1/unload_lora_adapter: stop serving an adapter (rows running it finish)."""
        self._runtime_lora()
        try:
            r = schema.parse_model(schema.UnloadLoRAAdapterRequest, body)
        except oai.RequestError as e:
            raise HTTPError.bad_request(e) from None
        if r.lora_name not in self.loras:
            raise HTTPError(404, f"the LoRA adapter {r.lora_name!r} is not loaded", type="NotFoundError",
                            code="model_not_found", param="lora_name")
        del self.loras[r.lora_name]
        self.llm.engine.lora.unload(r.lora_name)
        return {"message": f"Success: LoRA adapter '{r.lora_name}' removed successfully."}

    def _runtime_lora(self) -> None:
        if not self.config.allow_runtime_lora_updating:
            raise HTTPError(404, "loading and unloading LoRA adapters at run time is off: start the server with "
                                 "--enable-lora --allow-runtime-lora-updating", code="not_found")
        if self.llm.engine.lora is None:
            raise HTTPError(400, "the model was loaded without enable_lora")

    # ------------------------------------------------------------------ other routes
    def tokenize(self, body) -> dict:
        try:
            r = schema.parse_model(schema.TokenizeRequest, body)
            if r.messages is not None:
                conv = [m.for_template() for m in r.messages]
                _, toks = self.llm.encode_chat(conv, 0, add_generation_prompt=r.add_generation_prompt)
            else:
                toks = self.llm.tokenizer.encode(r.prompt, add_special_tokens=r.add_special_tokens)
        except oai.RequestError as e:
            raise HTTPError.bad_request(e) from None
        except InvalidRequest as e:
            raise HTTPError(400, str(e), code="invalid_value") from None
        return schema.TokenizeResponse(tokens=toks, count=len(toks), max_model_len=self.llm.max_model_len).model_dump()

    def detokenize(self, body) -> dict:
        try:
            r = schema.parse_model(schema.DetokenizeRequest, body)
            text = self.llm.tokenizer.decode(r.tokens)
        except oai.RequestError as e:
            raise HTTPError.bad_request(e) from None
        except InvalidRequest as e:
            raise HTTPError(400, str(e), code="invalid_value", param="tokens") from None
        return schema.DetokenizeResponse(prompt=text).model_dump()


def _chunk_choice(req: schema.ParsedRequest, ev: Delta):
    logprobs = None
    if req.top_logprobs is not None:
        part = CompletionOutput(ev.index, ev.text, ev.token_ids, None, ev.logprobs, ev.finish_reason)
        fmt = oai.chat_logprobs if req.kind == "chat" else oai.completion_logprobs
        logprobs = fmt(part, req.top_logprobs)
    if req.kind == "chat":
        return schema.ChatChunkChoice(index=ev.index, delta=schema.ChatDelta(content=ev.text), logprobs=logprobs,
                                      finish_reason=ev.finish_reason)
    return schema.CompletionChoice(text=ev.text, index=ev.index, logprobs=logprobs, finish_reason=ev.finish_reason)


def _failure(ev: Failed) -> HTTPError:
    if isinstance(ev.error, InvalidRequest):
        return HTTPError(400, str(ev.error), code="invalid_value")
    return HTTPError(503, f"the request could not finish: {ev.error}", type="server_error", code="unavailable")


async def _json_body(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:
        raise HTTPError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None


def build_app(llm, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving ``llm``; the engine loop runs for the app's lifespan."""
    srv = Server(llm, config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        srv.loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(srv.loop.stop, 30.0)

    app = FastAPI(title="jaxinfer", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = srv

    @app.exception_handler(HTTPError)
    async def _http_error(request, e: HTTPError):
        return e.response()

    @app.exception_handler(404)
    async def _not_found(request, e):
        return HTTPError(404, f"no route {request.url.path}", code="not_found").response()

    @app.exception_handler(405)
    async def _bad_method(request, e):
        message = f"{request.method} is not allowed on {request.url.path}"
        return HTTPError(405, message, code="method_not_allowed").response()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await srv.complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await srv.complete(request, "completion")

    @app.get("/v1/models")
    async def models(request: Request):
        srv.admit(request)
        cards = [schema.ModelCard(id=config.model_name, created=srv.created, root=str(llm.model_path),
                                  max_model_len=llm.max_model_len)]
        cards += [schema.ModelCard(id=name, created=srv.created, root=req.lora_path, parent=config.model_name,
                                   max_model_len=llm.max_model_len) for name, req in srv.loras.items()]
        return schema.ModelList(data=cards).model_dump()

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        srv.admit(request)
        return await asyncio.to_thread(srv.load_lora, await _json_body(request))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        srv.admit(request)
        return await asyncio.to_thread(srv.unload_lora, await _json_body(request))

    @app.get("/health")
    async def health():
        if srv.draining or srv.loop.error is not None:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return srv.tokenize(await _json_body(request))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return srv.detokenize(await _json_body(request))

    @app.get("/metrics")
    async def metrics():
        return Response(srv.metrics.exposition(), media_type=CONTENT_TYPE)

    return app


def serve(llm, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000, grace_period: float = 30.0,
          log_level: str = "info") -> None:
    """Serve until SIGTERM/SIGINT: then stop admitting, give in-flight requests ``grace_period``
    seconds to finish, and return."""
    import uvicorn

    app = build_app(llm, config)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.server.drain()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn's own re-raises the signal after shutting down; a drained stop is a clean exit
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

    uvicorn_config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                    timeout_graceful_shutdown=grace_period)
    _Server(uvicorn_config).run()
