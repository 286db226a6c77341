"""The OpenAI Batch API wire formats: request lines in, result lines out.

Pure functions over JSON values; nothing here loads a model.

* ``parse_envelope`` reads one input line (``{"custom_id", "method", "url", "body"}``) and
  returns its custom_id and object, or a ``LineError`` when the line cannot be answered under a
  custom_id (malformed JSON, no usable custom_id).
* ``parse_request`` validates the envelope and body of a line that has a custom_id and returns a
  ``BatchRequest`` (prompts or messages, ``SamplingParams``), or raises ``RequestError``, which is
  answered with a 400 response carrying OpenAI's error body.
* ``chat_completion`` / ``text_completion`` build the response bodies (``chat.completion`` and
  ``text_completion`` objects, with OpenAI's two logprobs formats, also built alone by
  ``chat_logprobs`` / ``completion_logprobs`` / ``usage`` for stream chunks) from
  ``RequestOutput``s, and ``result_line`` / ``error_response_line`` / ``line_error_line`` the
  output lines.

Which failure goes where: a line with a usable custom_id always gets a line under that id (a 200
or a 400 response), so a consumer can join results to requests by custom_id. A line without one
(or repeating an earlier line's custom_id) gets ``"custom_id": null`` and a top-level
``"error": {"code", "message", "line"}``, the shape OpenAI uses for input-file errors.
Every message starts with ``line N:``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import time
import uuid
from collections.abc import Mapping
from typing import Any

from jaxinfer.errors import InvalidRequest
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.sampling import SamplingParams

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 128  # OpenAI's limit on n; also the cap on n x number of prompts of one line
MAX_PROMPTS = 128
MAX_STOP = 4  # OpenAI: "up to 4 sequences"
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_CUSTOM_ID_CHARS = 1024
MAX_REPETITION_PENALTY = 100.0
MAX_TOP_K = 2**31 - 1
# Defaults for requests that set no max_tokens: OpenAI's 16 for completions; chat's "up to the
# context" would size every cache row for the whole context, so chat gets a fixed default.
DEFAULT_MAX_TOKENS = {"chat": 256, "completion": 16}
# vLLM's floor for logprobs: -inf is not valid JSON.
LOGPROB_FLOOR = -9999.0

_COMMON = frozenset({
    "model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
    "frequency_penalty", "logprobs", "user", "metadata", "store", "service_tier", "stream",
    "stream_options", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
    "logit_bias",
})
_FIELDS = {
    "chat": _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                       "parallel_tool_calls", "functions", "function_call", "response_format"},
    "completion": _COMMON | {"prompt", "best_of", "echo", "suffix"},
}
_IGNORED = frozenset({"model", "user", "metadata", "store", "service_tier", "stream_options",
                      "parallel_tool_calls"})


@dataclasses.dataclass(frozen=True)
class LineError:
    """An input line with no usable custom_id: answered by line number."""

    line: int  # 1-based line of the input file
    code: str  # "invalid_json" | "invalid_request" | "missing_custom_id" | "duplicate_custom_id"
    message: str


class RequestError(InvalidRequest):
    """A request with a custom_id that cannot run: answered with a 400 response."""

    def __init__(self, message: str, *, code: str = "invalid_value", param: str | None = None):
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


@dataclasses.dataclass(frozen=True)
class BatchRequest:
    """One validated input line."""

    custom_id: str
    line: int
    kind: str  # "chat" | "completion"
    messages: list[dict] | None  # chat: [{"role", "content": str}]
    prompts: list[str | list[int]] | None  # completion: one entry per prompt
    params: SamplingParams
    max_tokens_set: bool  # False: params.max_tokens is a default, to be capped to the context
    top_logprobs: int | None  # None: no logprobs; chat: top_logprobs; completion: logprobs


# ------------------------------------------------------------------------------------ parsing


def parse_envelope(raw: bytes, line: int) -> tuple[str, dict] | LineError:
    """(custom_id, object) of one input line, or the LineError that answers it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return LineError(line, "invalid_json", f"line {line}: not valid UTF-8 ({e.reason} at byte {e.start})")
    if line == 1:
        text = text.lstrip("\ufeff")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return LineError(line, "invalid_json", f"line {line}: malformed JSON ({e.msg} at column {e.colno})")
    except (RecursionError, ValueError) as e:  # nesting too deep; numbers too long to convert
        return LineError(line, "invalid_json", f"line {line}: malformed JSON ({type(e).__name__}: {e})")
    if not isinstance(obj, dict):
        return LineError(line, "invalid_request", f"line {line}: expected a JSON object, got {_kind(obj)}")
    cid = obj.get("custom_id")
    if "custom_id" not in obj:
        return LineError(line, "missing_custom_id", f"line {line}: missing custom_id")
    if not isinstance(cid, str) or not cid:
        return LineError(line, "missing_custom_id",
                         f"line {line}: custom_id must be a non-empty string, got {_kind(cid)}")
    if len(cid) > MAX_CUSTOM_ID_CHARS:
        return LineError(line, "missing_custom_id",
                         f"line {line}: custom_id has {len(cid)} characters; at most {MAX_CUSTOM_ID_CHARS}")
    return cid, obj


def duplicate_error(line: int, custom_id: str, first_line: int) -> LineError:
    return LineError(line, "duplicate_custom_id",
                     f"line {line}: custom_id {_short(custom_id)} was already used on line {first_line}")


def parse_request(custom_id: str, obj: dict, line: int, defaults: Mapping[str, Any] | None = None) -> BatchRequest:
    """Validate the envelope and body of one line. ``defaults``: SamplingParams fields applied
    when the body does not set them (e.g. from the command line), over OpenAI's defaults."""
    defaults = dict(defaults or {})
    default_max_tokens = defaults.pop("max_tokens", None)
    where = f"line {line}: "
    method = obj.get("method")
    if method != "POST":
        raise RequestError(f'{where}method must be "POST", got {_short(method)}', code="invalid_method", param="method")
    url = obj.get("url")
    kind = URLS.get(url) if isinstance(url, str) else None
    if kind is None:
        raise RequestError(f"{where}unknown url {_short(url)}; expected one of {', '.join(URLS)}",
                           code="invalid_url", param="url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise RequestError(f"{where}body must be a JSON object, got {_kind(body)}", code="invalid_body", param="body")
    for name in body:
        if name not in _FIELDS[kind]:
            raise RequestError(f"{where}unrecognized request argument {_short(name)} for {url}",
                               code="unknown_parameter", param=str(name))
    _check_unsupported(body, kind, where)
    f = _Fields(body, where)

    n = f.int("n", 1, lo=1, hi=MAX_N)
    if kind == "chat":
        messages, prompts = _messages(body.get("messages"), where), None
        legacy = f.int("max_tokens", None, lo=1)  # deprecated for chat, still accepted
        max_tokens = f.int("max_completion_tokens", None, lo=1)
        if max_tokens is None:
            max_tokens = legacy
        want_lp = f.bool("logprobs", False)
        top = f.int("top_logprobs", None, lo=0, hi=MAX_CHAT_TOP_LOGPROBS)
        if top is not None and not want_lp:
            raise RequestError(f"{where}top_logprobs requires logprobs to be true", param="top_logprobs")
        top_logprobs = (top or 0) if want_lp else None
    else:
        messages, prompts = None, _prompts(body.get("prompt"), where)
        max_tokens = f.int("max_tokens", None, lo=1)
        top_logprobs = f.int("logprobs", None, lo=0, hi=MAX_COMPLETION_LOGPROBS)
        best_of = f.int("best_of", None, lo=1)
        if best_of is not None and best_of != n:
            raise RequestError(f"{where}best_of other than n is not supported", code="unsupported_parameter", param="best_of")
    if n * len(prompts or [None]) > MAX_N:
        raise RequestError(f"{where}n x number of prompts must be <= {MAX_N}, got {n} x {len(prompts)}", param="n")

    max_tokens_set = max_tokens is not None
    if max_tokens is None:
        max_tokens = default_max_tokens or DEFAULT_MAX_TOKENS[kind]
    stop = f.stop()
    kw = {
        "n": n, "max_tokens": max_tokens, "stop": stop,
        "temperature": f.float("temperature", defaults.get("temperature", 1.0), lo=0.0, hi=2.0),
        "top_p": f.float("top_p", defaults.get("top_p", 1.0), lo=0.0, hi=1.0, lo_open=True),
        "seed": f.int("seed", defaults.get("seed")),
        "presence_penalty": f.float("presence_penalty", defaults.get("presence_penalty", 0.0), lo=-2.0, hi=2.0),
        "frequency_penalty": f.float("frequency_penalty", defaults.get("frequency_penalty", 0.0), lo=-2.0, hi=2.0),
        "top_k": f.int("top_k", defaults.get("top_k", 0), lo=-1, hi=MAX_TOP_K),
        "min_p": f.float("min_p", defaults.get("min_p", 0.0), lo=0.0, hi=1.0),
        "repetition_penalty": f.float("repetition_penalty", defaults.get("repetition_penalty", 1.0),
                                   lo=0.0, hi=MAX_REPETITION_PENALTY, lo_open=True),
        "min_tokens": f.int("min_tokens", defaults.get("min_tokens", 0), lo=0),
        "ignore_eos": f.bool("ignore_eos", defaults.get("ignore_eos", False)),
        "logprobs": top_logprobs,
    }
    if kw["min_tokens"] > max_tokens:
        which = "" if max_tokens_set else ", the default"
        raise RequestError(f"{where}min_tokens ({kw['min_tokens']}) must be <= max_tokens ({max_tokens}{which})",
                           param="min_tokens")
    try:
        params = SamplingParams(**kw)
    except InvalidRequest as e:  # every field is checked above; this is a second net
        raise RequestError(f"{where}{e}") from None
    return BatchRequest(custom_id, line, kind, messages, prompts, params, max_tokens_set, top_logprobs)


def context_error(line: int, kind: str, prompt_tokens: int, max_tokens: int, max_model_len: int) -> RequestError:
    what = "messages" if kind == "chat" else "prompt"
    return RequestError(
        f"line {line}: this model's maximum context length is {max_model_len} tokens, but "
        f"{prompt_tokens + max_tokens} were requested ({prompt_tokens} in the {what}, {max_tokens} "
        f"in the completion); reduce the length of the {what} or max_tokens",
        code="context_length_exceeded", param="max_tokens" if prompt_tokens < max_model_len else what,
    )


def encode_for(llm, kind: str, messages, prompts, params: SamplingParams, max_tokens_set: bool, *,
               where: str = "") -> tuple[list[tuple[str | None, list[int]]], SamplingParams]:
    """Token ids of a request's prompts (``llm.encode_chat`` / ``encode_prompt``) and its
    params fitted to the context: the rules the batch job and the server share. A prompt or
    max_tokens that cannot fit raises RequestError, its message prefixed by ``where``."""
    try:
        if kind == "chat":
            encoded = [llm.encode_chat(messages, 0)]
        else:
            encoded = [llm.encode_prompt(p, k) for k, p in enumerate(prompts)]
    except InvalidRequest as e:
        code = "context_length_exceeded" if "max_model_len" in str(e) else "invalid_value"
        raise RequestError(f"{where}{e}", code=code, param="messages" if kind == "chat" else "prompt") from None
    longest = max(len(ids) for _, ids in encoded)
    room = llm.max_model_len - longest
    if max_tokens_set and params.max_tokens > room:
        e = context_error(0, kind, longest, params.max_tokens, llm.max_model_len)
        raise RequestError(where + e.message.removeprefix("line 0: "), code=e.code, param=e.param)
    changes = {}
    if params.max_tokens > room:  # a default, not asked for: generation runs to the context end
        changes.update(max_tokens=room, min_tokens=min(params.min_tokens, room))
    if params.top_k > llm.cfg.vocab_size:  # the same distribution; keeps per-row ints small
        changes["top_k"] = 0
    return encoded, dataclasses.replace(params, **changes) if changes else params


class _Fields:
    """Typed reads of body fields; None (JSON null) means "not given"."""

    def __init__(self, body: dict, where: str):
        self.body, self.where = body, where

    def _bad(self, name, must: str):
        value = self.body[name]
        return RequestError(f"{self.where}{name} must be {must}, got {_short(value)}", param=name)

    def int(self, name, default, *, lo=None, hi=None):
        value = self.body.get(name)
        if value is None:
            return default
        rng = _range(lo, hi)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(name, "an integer" + rng)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise self._bad(name, "an integer" + rng)
        return value

    def float(self, name, default, *, lo, hi, lo_open=False):
        value = self.body.get(name)
        if value is None:
            return default
        rng = f" in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise self._bad(name, "a number" + rng)
        try:
            x = float(value)
        except OverflowError:
            raise self._bad(name, "a number" + rng) from None
        if not math.isfinite(x) or x > hi or x < lo or (lo_open and x == lo):
            raise self._bad(name, "a number" + rng)
        return x

    def bool(self, name, default):
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._bad(name, "true or false")
        return value

    def stop(self):
        value = self.body.get("stop")
        if value is None:
            return None
        seq = [value] if isinstance(value, str) else value
        if not isinstance(seq, list) or not 1 <= len(seq) <= MAX_STOP or not all(isinstance(s, str) and s for s in seq):
            raise self._bad("stop", f"a non-empty string or a list of 1 to {MAX_STOP} non-empty strings")
        return [_text(s, self.where, "stop") for s in seq]


def _check_unsupported(body: dict, kind: str, where: str) -> None:
    """Fields we accept only at their neutral value."""
    neutral = {
        "stream": lambda v: v in (None, False),
        "logit_bias": lambda v: v is None or v == {},
        "echo": lambda v: v in (None, False),
        "suffix": lambda v: v is None or v == "",
        "tools": lambda v: v is None or v == [],
        "functions": lambda v: v is None or v == [],
        "tool_choice": lambda v: v in (None, "none", "auto"),
        "function_call": lambda v: v in (None, "none", "auto"),
        "response_format": lambda v: v is None or v == {"type": "text"},
    }
    for name, ok in neutral.items():
        if name in body and not ok(body[name]):
            raise RequestError(f"{where}{name}={_short(body[name])} is not supported", code="unsupported_parameter",
                               param=name)


def _messages(value, where: str) -> list[dict]:
    if value is None:
        raise RequestError(f"{where}missing required parameter 'messages'", code="missing_required_parameter",
                           param="messages")
    if not isinstance(value, list) or not value:
        raise RequestError(f"{where}messages must be a non-empty list, got {_short(value)}", param="messages")
    out = []
    for i, m in enumerate(value):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where}{at} must be an object, got {_short(m)}", param=at)
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}{at}.role must be one of {', '.join(ROLES)}, got {_short(role)}",
                               param=f"{at}.role")
        for key, v in m.items():
            if key not in ("role", "content", "name") and v is not None:
                raise RequestError(f"{where}{at}.{_short(key, 40)} is not supported", code="unsupported_parameter",
                                   param=f"{at}.{key}")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise RequestError(f"{where}{at}.name must be a string, got {_short(m['name'])}", param=f"{at}.name")
        content = _text(_content(m.get("content"), where, at), where, f"{at}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _content(value, where: str, at: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:  # content parts: text only (vLLM joins them with newlines)
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}{at}.content[{j}] must be a text part "
                                   f'{{"type": "text", "text": ...}}, got {_short(part)}', param=f"{at}.content")
            texts.append(part["text"])
        return "\n".join(texts)
    raise RequestError(f"{where}{at}.content must be a string or a list of text parts, got {_short(value)}",
                       param=f"{at}.content")


def _prompts(value, where: str) -> list[str | list[int]]:
    """A completion prompt: a string, a list of strings, a list of token ids, or a list of those."""

    def ids(x):
        return isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if value is None:
        raise RequestError(f"{where}missing required parameter 'prompt'", code="missing_required_parameter",
                           param="prompt")
    if isinstance(value, str) or ids(value):
        prompts = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) or ids(p) for p in value):
        prompts = list(value)
    else:
        raise RequestError(f"{where}prompt must be a string, a list of strings, a list of token ids or a list of "
                           f"lists of token ids, got {_short(value)}", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(f"{where}at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
    return [_text(p, where, "prompt") if isinstance(p, str) else p for p in prompts]


def _text(s: str, where: str, param: str) -> str:
    """Text from JSON can hold lone surrogates ("\\ud800"), which no tokenizer can encode."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{where}{param} holds an unpaired UTF-16 surrogate", param=param) from None
    return s


# ------------------------------------------------------------------------------------ results


def chat_completion(req: BatchRequest, outs: list[RequestOutput], model: str, *, created: int | None = None) -> dict:
    """A ``chat.completion`` object: one choice per sample."""
    choices = []
    for c in _choices(outs):
        choices.append({
            "index": len(choices),
            "message": {"role": "assistant", "content": c.text, "refusal": None},
            "logprobs": chat_logprobs(c, req.top_logprobs) if req.top_logprobs is not None else None,
            "finish_reason": c.finish_reason,
        })
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": _now(created),
            "model": model, "choices": choices, "usage": usage(outs), "system_fingerprint": None}


def text_completion(req: BatchRequest, outs: list[RequestOutput], model: str, *, created: int | None = None) -> dict:
    """A ``text_completion`` object: choices ordered by prompt, then sample."""
    choices = []
    for c in _choices(outs):
        choices.append({
            "text": c.text, "index": len(choices),
            "logprobs": completion_logprobs(c, req.top_logprobs) if req.top_logprobs is not None else None,
            "finish_reason": c.finish_reason,
        })
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": _now(created),
            "model": model, "choices": choices, "usage": usage(outs), "system_fingerprint": None}


def result_line(custom_id: str, body: dict) -> dict:
    return {"id": _batch_req_id(), "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": _request_id(), "body": body}, "error": None}


def error_response_line(custom_id: str, err: RequestError) -> dict:
    body = {"error": {"message": err.message, "type": "invalid_request_error", "param": err.param, "code": err.code}}
    return {"id": _batch_req_id(), "custom_id": custom_id,
            "response": {"status_code": 400, "request_id": _request_id(), "body": body}, "error": None}


def line_error_line(err: LineError) -> dict:
    return {"id": _batch_req_id(), "custom_id": None, "response": None,
            "error": {"code": err.code, "message": err.message, "line": err.line}}


def result_key(rec: dict) -> tuple:
    """What a result line answers: ("id", custom_id) or, for a line error, ("line", n)."""
    cid = rec["custom_id"]
    if isinstance(cid, str):
        return ("id", cid)
    if cid is None and isinstance(rec["error"]["line"], int):
        return ("line", rec["error"]["line"])
    raise ValueError("neither a custom_id nor an error line")


def result_ok(rec: dict) -> bool:
    return rec.get("error") is None and (rec.get("response") or {}).get("status_code") == 200


def result_tokens(rec: dict) -> tuple[int, int]:
    """(prompt_tokens, completion_tokens) of a result line (0, 0 for errors)."""
    if not result_ok(rec):
        return 0, 0
    u = rec["response"]["body"]["usage"]
    return u["prompt_tokens"], u["completion_tokens"]


def _choices(outs: list[RequestOutput]) -> list[CompletionOutput]:
    return [c for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]


def usage(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_logprobs(c: CompletionOutput, top: int) -> dict:
    content = []
    for tok, pos in zip(c.token_ids, c.logprobs or []):
        chosen = pos[tok]
        content.append({
            "token": chosen.decoded_token or "", "logprob": _lp(chosen.logprob),
            "bytes": _bytes(chosen.decoded_token),
            "top_logprobs": [{"token": lp.decoded_token or "", "logprob": _lp(lp.logprob), "bytes": _bytes(lp.decoded_token)}
                             for lp in _top(pos, top)],
        })
    return {"content": content, "refusal": None}


def completion_logprobs(c: CompletionOutput, top: int) -> dict:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = 0
    for tok, pos in zip(c.token_ids, c.logprobs or []):
        chosen = pos[tok]
        s = chosen.decoded_token or ""
        tokens.append(s)
        token_logprobs.append(_lp(chosen.logprob))
        # OpenAI: the `logprobs` most likely tokens, and always the sampled one
        entry = {lp.decoded_token or "": _lp(lp.logprob) for lp in _top(pos, top)}
        entry.setdefault(s, _lp(chosen.logprob))
        top_logprobs.append(entry)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def _top(pos, k: int):
    return sorted((lp for lp in pos.values() if lp.rank is not None and lp.rank <= k), key=lambda lp: lp.rank)[:k]


def _lp(x: float) -> float:
    x = float(x)
    return x if math.isfinite(x) and x > LOGPROB_FLOOR else LOGPROB_FLOOR


def _bytes(s: str | None) -> list[int]:
    return list((s or "").encode("utf-8"))


def _now(created):
    return int(time.time()) if created is None else created


def _batch_req_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def _request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def _range(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    if lo is not None:
        return f" >= {lo}"
    return ""


def _kind(x) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(x), type(x).__name__) + ("" if x is None or isinstance(x, (dict, list)) else f" {_short(x)}")


def _short(x, limit: int = 80) -> str:
    """A value for an error message: JSON, cut to ``limit`` characters."""
    try:
        s = json.dumps(x, ensure_ascii=True)
    except (TypeError, ValueError):
        s = repr(x)
    return s if len(s) <= limit else s[: limit - 3] + "..."
