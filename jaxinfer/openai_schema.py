"""The OpenAI wire schema as pydantic models: request bodies, response and stream-chunk bodies,
and OpenAI's error body. Declared once; validation comes from the declarations.

``parse_body(kind, body, features=...)`` validates a chat or completions request body and returns
a ``ParsedRequest`` (messages or prompts, ``SamplingParams``, logprobs, structured output), or
raises ``openai_format.RequestError`` (answered with a 400 and OpenAI's error body). Unknown
fields and bad values are refused; JSON null means "not given". ``Features`` says what the
caller can serve: the batch job (``Features.BATCH``) refuses streaming, structured output and the
fields vLLM adds to OpenAI's (``guided_*``, ``use_beam_search``), exactly as
``parse_request`` does (it is the batch job's parser); the server (``Features.SERVER``) streams, and serves
structured output where its engine can.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr,
                      ValidationError, model_validator)
from pydantic_core import PydanticCustomError

from jaxinfer.beam import BeamSearchParams
from jaxinfer.errors import InvalidRequest
from jaxinfer.guided import GuidedDecoding
from jaxinfer.openai_format import (DEFAULT_MAX_TOKENS, MAX_CHAT_TOP_LOGPROBS, MAX_COMPLETION_LOGPROBS, MAX_N, URLS,
                                    BatchRequest,
                                    MAX_PROMPTS, MAX_REPETITION_PENALTY, MAX_STOP, MAX_TOP_K, ROLES, RequestError,
                                    _short)
from jaxinfer.sampling import SamplingParams

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
VLLM_FIELDS = frozenset(GUIDED_FIELDS) | {"use_beam_search"}  # vLLM's additions to OpenAI's bodies


@dataclasses.dataclass(frozen=True)
class Features:
    """What a caller of ``parse_body`` can serve; a request for anything else is refused."""

    stream: bool
    structured_output: bool
    vllm_fields: bool  # accept vLLM's extra fields at all
    beam_search: bool = False  # use_beam_search=true (the batch job runs those lines after the rest)


Features.BATCH = Features(stream=False, structured_output=True, vllm_fields=True, beam_search=True)
Features.SERVER = Features(stream=True, structured_output=True, vllm_fields=True)


# ------------------------------------------------------------------------------------ field types


def _utf8(s: str) -> str:
    """Text from JSON can hold lone surrogates ("\\ud800"), which no tokenizer can encode."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError("invalid_value", "holds an unpaired UTF-16 surrogate") from None
    return s


def _neutral(*allowed):
    """A field accepted only at a value that changes nothing (and null)."""

    def check(v):
        if v is not None and not any(v == a and type(v) is type(a) for a in allowed):
            raise PydanticCustomError("unsupported_parameter", "{value} is not supported", {"value": _short(v)})
        return v

    return AfterValidator(check)


Text = Annotated[StrictStr, AfterValidator(_utf8)]
NonEmptyText = Annotated[StrictStr, Field(min_length=1), AfterValidator(_utf8)]
TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
Stop = Union[NonEmptyText, Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_STOP)]]
Prompt = Union[Text, TokenIds, Annotated[list[Union[Text, TokenIds]], Field(min_length=1, max_length=MAX_PROMPTS)]]


class _Model(BaseModel):
    # strict: no "1" for 1, no true for 1, no 1.0 for an integer (the batch format's rules)
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Model):
    include_usage: StrictBool | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: Text


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    url: StrictStr
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(BaseModel):
    """An image in a chat message, as OpenAI and vLLM write it: a data: URL, a file:// URL
    under the server's allowed_local_media_path, or an http(s) URL."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["image_url"]
    image_url: ImageUrl


class Message(BaseModel):
    """One chat message. Fields we do not use (tool_calls, refusal, ...) are accepted only null."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal[ROLES]
    content: Union[Text, Annotated[list[Annotated[Union[TextPart, ImageUrlPart], Field(discriminator="type")]],
                                   Field(min_length=1)]]
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None  # which call a tool message answers: OpenAI requires it there

    @model_validator(mode="after")
    def _only_null_extras(self):
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError("invalid_value", "a tool message needs tool_call_id")
        for key, v in (self.model_extra or {}).items():
            if v is not None:
                raise PydanticCustomError("unsupported_parameter", "{key} is not supported", {"key": _short(key, 40)})
        return self

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)  # vLLM joins text parts with newlines

    def for_template(self) -> dict:
        """The message as the chat template takes it (developer is read as system); content
        parts stay parts: ``LLM.encode_chat`` gives them to a template that loops over them, and
        joins them into one string for one that does not."""
        content = [p.model_dump(exclude_none=True) for p in self.content] if self.content and not isinstance(
            self.content, str) else self.text()
        out = {"role": "system" if self.role == "developer" else self.role, "content": content}
        return out if self.tool_call_id is None else {**out, "tool_call_id": self.tool_call_id}


class JsonSchemaFormat(_Model):
    name: StrictStr
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class RepetitionBody(_Model):
    """Opt-in loop detection (``SamplingParams.repetition_detection``)."""

    max_period: Annotated[StrictInt, Field(ge=1, le=1024)] = 32
    min_repeats: Annotated[StrictInt, Field(ge=2, le=1024)] = 4


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("invalid_value",
                                      'json_schema is required with, and only with, "type": "json_schema"')
        return self


class _Request(_Model):
    """Fields common to both endpoints (OpenAI's, then vLLM's)."""

    model: Any = None  # the served model (not checked), or a LoRA adapter the server or job names
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    stop: Stop | None = None
    seed: StrictInt | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: Annotated[dict[str, Any] | None, _neutral({})] = None
    # vLLM's sampling extensions
    top_k: Annotated[StrictInt, Field(ge=-1, le=MAX_TOP_K)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=MAX_REPETITION_PENALTY, allow_inf_nan=False)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    ignore_eos: StrictBool | None = None
    repetition_detection: RepetitionBody | None = None  # ours: ends a looping row, finish_reason "repetition"
    # vLLM's structured output and beam search
    guided_json: Union[dict[str, Any], StrictStr] | None = None
    guided_regex: StrictStr | None = None
    guided_choice: Annotated[list[NonEmptyText], Field(min_length=1)] | None = None
    guided_grammar: StrictStr | None = None
    use_beam_search: StrictBool | None = None  # n beams; the batch job only (Features.beam_search)
    length_penalty: Annotated[float, Field(allow_inf_nan=False)] | None = None  # beam search's


class ChatCompletionRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None  # deprecated for chat, still accepted
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_CHAT_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[Any, _neutral([])] = None
    functions: Annotated[Any, _neutral([])] = None
    tool_choice: Annotated[Any, _neutral("none", "auto")] = None
    function_call: Annotated[Any, _neutral("none", "auto")] = None
    parallel_tool_calls: Any = None


class CompletionRequest(_Request):
    prompt: Prompt
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1)] | None = None
    echo: Annotated[StrictBool | None, _neutral(False)] = None
    suffix: Annotated[StrictStr | None, _neutral("")] = None


REQUEST_MODELS = {"chat": ChatCompletionRequest, "completion": CompletionRequest}


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    """One validated request body."""

    kind: str  # "chat" | "completion"
    messages: list[dict] | None  # chat: [{"role", "content": str}], developer read as system
    prompts: list[str | list[int]] | None  # completion: one entry per prompt
    params: SamplingParams
    max_tokens_set: bool  # False: params.max_tokens is a default, to be capped to the context
    top_logprobs: int | None  # None: no logprobs; chat: top_logprobs; completion: logprobs
    guided: GuidedDecoding | None = None
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    beam: BeamSearchParams | None = None  # use_beam_search: n beams of params.max_tokens
    guided_field: str | None = None  # the request field that asked for guided (its errors name it)
    model: Any = None  # the body's "model": the served model, or a LoRA adapter's name (``lora``)


def parse_body(kind: str, body: Any, *, features: Features = Features.SERVER, where: str = "",
               defaults: Mapping[str, Any] | None = None) -> ParsedRequest:
    """Validate one request body. ``defaults``: SamplingParams fields applied when the body does
    not set them (e.g. from the command line), over OpenAI's defaults. ``where`` prefixes every
    error message (the batch job's "line N: ")."""
    if not isinstance(body, dict):
        raise RequestError(f"{where}body must be a JSON object, got {_short(body)}", code="invalid_body", param="body")
    if not features.vllm_fields:
        for name in body:
            if name in VLLM_FIELDS:
                raise RequestError(f"{where}unrecognized request argument {_short(name)}",
                                   code="unknown_parameter", param=name)
    try:
        req = REQUEST_MODELS[kind].model_validate(body)
    except ValidationError as e:
        raise _request_error(e, where) from None
    return _resolve(kind, req, features, where, dict(defaults or {}))


def parse_request(custom_id: str, obj: dict, line: int, defaults: Mapping[str, Any] | None = None) -> BatchRequest:
    """Validate the envelope and body of one line. ``defaults``: SamplingParams fields applied
    when the body does not set them (e.g. from the command line), over OpenAI's defaults."""
    where = f"line {line}: "
    method = obj.get("method")
    if method != "POST":
        raise RequestError(f'{where}method must be "POST", got {_short(method)}', code="invalid_method", param="method")
    url = obj.get("url")
    kind = URLS.get(url) if isinstance(url, str) else None
    if kind is None:
        raise RequestError(f"{where}unknown url {_short(url)}; expected one of {', '.join(URLS)}",
                           code="invalid_url", param="url")
    req = parse_body(kind, obj.get("body"), features=Features.BATCH, where=where, defaults=defaults)
    params = req.params
    if req.guided is not None:
        params = dataclasses.replace(params, guided_decoding=req.guided)
    return BatchRequest(custom_id, line, kind, req.messages, req.prompts, params, req.max_tokens_set,
                        req.top_logprobs, req.beam, req.guided_field, req.model)


def _resolve(kind: str, req: _Request, features: Features, where: str, defaults: dict) -> ParsedRequest:
    """The rules that span fields, and the SamplingParams."""

    def bad(message, param, code="invalid_value"):
        return RequestError(f"{where}{message}", code=code, param=param)

    if req.stream and not features.stream:
        raise bad("stream=true is not supported", "stream", "unsupported_parameter")
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type != "text" and not features.structured_output:
        raise bad(f"response_format={_short(fmt.model_dump(by_alias=True, exclude_none=True))} is not supported",
                  "response_format", "unsupported_parameter")
    n = req.n or 1
    default_max_tokens = defaults.pop("max_tokens", None)
    if kind == "chat":
        messages = [m.for_template() for m in req.messages]
        prompts = None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise bad("top_logprobs requires logprobs to be true", "top_logprobs")
        top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        messages = None
        prompts = [req.prompt] if isinstance(req.prompt, str) or _ids(req.prompt) else list(req.prompt)
        max_tokens = req.max_tokens
        top_logprobs = req.logprobs
        if req.best_of is not None and req.best_of != n:
            raise bad("best_of other than n is not supported", "best_of", "unsupported_parameter")
    if n * len(prompts or [None]) > MAX_N:
        raise bad(f"n x number of prompts must be <= {MAX_N}, got {n} x {len(prompts)}", "n")
    max_tokens_set = max_tokens is not None
    if max_tokens is None:
        max_tokens = default_max_tokens or DEFAULT_MAX_TOKENS[kind]

    def pick(name, openai_default):
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, openai_default)

    stop = req.stop
    kw = {
        "n": n, "max_tokens": max_tokens,
        "stop": None if stop is None else [stop] if isinstance(stop, str) else list(stop),
        "temperature": float(pick("temperature", 1.0)), "top_p": float(pick("top_p", 1.0)), "seed": pick("seed", None),
        "presence_penalty": float(pick("presence_penalty", 0.0)),
        "frequency_penalty": float(pick("frequency_penalty", 0.0)),
        "top_k": pick("top_k", 0), "min_p": float(pick("min_p", 0.0)),
        "repetition_penalty": float(pick("repetition_penalty", 1.0)),
        "min_tokens": pick("min_tokens", 0), "ignore_eos": pick("ignore_eos", False), "logprobs": top_logprobs,
        "repetition_detection": req.repetition_detection.model_dump() if req.repetition_detection else None,
    }
    if kw["min_tokens"] > max_tokens:
        which = "" if max_tokens_set else ", the default"
        raise bad(f"min_tokens ({kw['min_tokens']}) must be <= max_tokens ({max_tokens}{which})", "min_tokens")
    try:
        params = SamplingParams(**kw)
    except InvalidRequest as e:  # the fields are checked above; this is a second net
        raise bad(str(e), None) from None
    guided = None
    if features.structured_output:
        try:
            guided = _guided(req)
        except InvalidRequest as e:
            raise bad(str(e), _guided_param(req)) from None
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    beam = None
    if req.use_beam_search:
        if not features.beam_search:
            raise bad("use_beam_search=true is not supported here", "use_beam_search", "unsupported_parameter")
        for name, given in (("logprobs", top_logprobs is not None), ("guided decoding", guided is not None),
                            ("temperature", req.temperature not in (None, 0)), ("stop", req.stop is not None)):
            if given:
                raise bad(f"use_beam_search does not combine with {name}", "use_beam_search", "unsupported_parameter")
        try:
            beam = BeamSearchParams(beam_width=n, max_tokens=max_tokens, ignore_eos=params.ignore_eos,
                                    length_penalty=float(req.length_penalty if req.length_penalty is not None else 1.0))
        except InvalidRequest as e:
            raise bad(str(e), "n") from None
    elif req.length_penalty is not None:
        raise bad("length_penalty needs use_beam_search=true", "length_penalty")
    return ParsedRequest(kind, messages, prompts, params, max_tokens_set, top_logprobs, guided, bool(req.stream),
                         include_usage, beam, _guided_param(req) if guided is not None else None, req.model)


def _guided_param(req: _Request) -> str:
    """The field a structured-output error is about: the one given (response_format first)."""
    fmt = getattr(req, "response_format", None)
    names = [name for name in GUIDED_FIELDS if getattr(req, name) is not None]
    if fmt is not None and fmt.type != "text":
        names.insert(0, "response_format")
    return names[0] if names else "response_format"


def _guided(req: _Request) -> GuidedDecoding | None:
    given = {name: getattr(req, name) for name in GUIDED_FIELDS if getattr(req, name) is not None}
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        given["response_format"] = {"type": "object"}
    elif fmt is not None and fmt.type == "json_schema":
        given["response_format"] = fmt.json_schema.schema_ or {"type": "object"}
    if len(given) > 1:
        raise InvalidRequest(f"at most one kind of structured output per request, got {', '.join(given)}")
    if not given:
        return None
    ((name, value),) = given.items()
    if name in ("guided_json", "response_format"):
        return GuidedDecoding(json=value)
    if name == "guided_regex":
        return GuidedDecoding(regex=value)
    if name == "guided_choice":
        return GuidedDecoding(choice=tuple(value))
    return GuidedDecoding(grammar=value)


def _ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) for t in x)


def _request_error(e: ValidationError, where: str) -> RequestError:
    """One of pydantic's errors in OpenAI's terms (code, param, message): the deepest, which for
    a value no member of a union took is the one from the member that got furthest. A wrong
    type ranks below any other error: five stop strings are "at most 4", not "not a string"."""
    errors = e.errors(include_url=False)
    err = max(errors, key=lambda x: (not x["type"].endswith("_type"), len(x["loc"])))
    # union members add their type names to the location: keep only real field names and indices
    loc = [p for p in err["loc"] if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS)]
    param = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(loc)) or None
    kind = err["type"]
    if kind == "extra_forbidden":
        return RequestError(f"{where}unrecognized request argument {_short(err['loc'][-1])}",
                            code="unknown_parameter", param=str(err["loc"][-1]))
    if kind == "missing" and len(err["loc"]) == 1:
        return RequestError(f"{where}missing required parameter {err['loc'][0]!r}", code="missing_required_parameter",
                            param=str(err["loc"][0]))
    code = kind if kind in ("unsupported_parameter",) else "invalid_value"
    value = err.get("input")
    got = "" if kind == "unsupported_parameter" else f", got {_short(value)}"
    return RequestError(f"{where}{param or 'body'}: {err['msg']}{got}", code=code, param=param)


# what pydantic adds to an error's location for the member of a union that failed
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "any"})


# ------------------------------------------------------------------------------------ responses


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return ErrorBody(error=ErrorDetail(message=message, type=type, param=param, code=code)).model_dump()


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One ``data:`` event of a streamed chat completion; the usage chunk has no choices."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChunk(BaseModel):
    """One ``data:`` event of a streamed completion (the object is ``text_completion``, as OpenAI's)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxinfer"
    root: str | None = None  # vLLM's: the model's (or a LoRA adapter's) path
    parent: str | None = None  # vLLM's: a LoRA adapter's base model
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(_Model):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]


class UnloadLoRAAdapterRequest(_Model):
    """vLLM's /v1/unload_lora_adapter body."""

    lora_name: Annotated[str, Field(min_length=1)]
    lora_int_id: Any = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def sse(chunk: BaseModel | str) -> bytes:
    """One server-sent event: ``data: {...}`` (or ``data: [DONE]``) and a blank line."""
    data = chunk if isinstance(chunk, str) else json.dumps(chunk.model_dump(mode="json"), ensure_ascii=False,
                                                           allow_nan=False)
    return f"data: {data}\n\n".encode()



# ------------------------------------------------------------------------------------ vLLM's extras


class TokenizeRequest(_Model):
    """``/tokenize``: a prompt, or a conversation rendered through the chat template."""

    model: Any = None
    prompt: Text | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("invalid_value", "give exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(_Model):
    model: Any = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


def parse_model(model: type[BaseModel], body: Any) -> BaseModel:
    """Validate a body against one of the models above, or raise RequestError."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _request_error(e, "") from None
