"""The OpenAI Batch API wire formats: request lines in, result lines out.

Pure functions over JSON values; nothing here loads a model.

* ``parse_envelope`` reads one input line (``{"custom_id", "method", "url", "body"}``) and
  returns its custom_id and object, or a ``LineError`` when the line cannot be answered under a
  custom_id (malformed JSON, no usable custom_id).
* ``openai_schema.parse_request`` validates the envelope of a line that has a custom_id, and its body with the
  server's pydantic models (``openai_schema.parse_body``, one request schema for both), and
  returns a ``BatchRequest`` (prompts or messages, ``SamplingParams``, structured output in
  ``params.guided_decoding``), or raises ``RequestError``, which is answered with a 400
  response carrying OpenAI's error body.
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
import time
import uuid

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
    beam: object = None  # beam.BeamSearchParams when use_beam_search: its n beams are the choices
    guided_field: str | None = None  # the field that asked for structured output (its errors name it)
    model: object = None  # the body's "model": a LoRA adapter's name runs that adapter


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


def context_error(line: int, kind: str, prompt_tokens: int, max_tokens: int, max_model_len: int) -> RequestError:
    what = "messages" if kind == "chat" else "prompt"
    return RequestError(
        f"line {line}: this model's maximum context length is {max_model_len} tokens, but "
        f"{prompt_tokens + max_tokens} were requested ({prompt_tokens} in the {what}, {max_tokens} "
        f"in the completion); reduce the length of the {what} or max_tokens",
        code="context_length_exceeded", param="max_tokens" if prompt_tokens < max_model_len else what,
    )


def encode_for(llm, kind: str, messages, prompts, params: SamplingParams, max_tokens_set: bool, *,
               where: str = "", guided_field: str | None = None) -> tuple[list[tuple[str | None, list[int]]], SamplingParams]:
    """Token ids of a request's prompts (``llm.encode_chat`` / ``encode_prompt``) and its
    params fitted to the context: the rules the batch job and the server share. A prompt or
    max_tokens that cannot fit raises RequestError, its message prefixed by ``where``; a grammar
    that cannot compile names ``guided_field``, the request field it came in."""
    try:
        if kind == "chat":
            encoded = [llm.encode_chat(messages, 0)]
        else:
            encoded = [llm.encode_prompt(p, k) for k, p in enumerate(prompts)]
    except InvalidRequest as e:
        code = "context_length_exceeded" if "max_model_len" in str(e) else "invalid_value"
        raise RequestError(f"{where}{e}", code=code, param="messages" if kind == "chat" else "prompt") from None
    if params.guided_decoding is not None:  # a grammar that cannot compile fails its own request
        try:
            llm.compile_grammar(params.guided_decoding)
        except InvalidRequest as e:
            raise RequestError(f"{where}{e}", param=guided_field or "response_format") from None
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


def lora_for(llm, model, loras, served, *, where: str = ""):
    """The LoRA adapter a body's ``model`` names (``llm.lora_adapter``), or None for the served
    model. loras: adapter name -> ``lora.LoRARequest`` (``--lora-modules``); served: the names the
    served model answers to. With adapters configured, any other name is an unknown model
    (RequestError, code model_not_found); without, the name is not checked."""
    if isinstance(model, str) and model in loras:
        try:
            return llm.lora_adapter(loras[model])
        except InvalidRequest as e:
            raise RequestError(f"{where}{e}", param="model") from None
    if loras and model is not None and model not in served:
        raise RequestError(f"{where}model {_short_name(model)} is neither the served model nor a LoRA adapter "
                           f"(adapters: {', '.join(sorted(loras))})", code="model_not_found", param="model")
    return None


def _short_name(v) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."
