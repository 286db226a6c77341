"""``SamplingParams``: the public, validated per-request sampling parameters (vLLM's names,
ranges and defaults). Every bad value is an ``InvalidRequest`` naming the field."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Sequence

import numpy as np

from jaxinfer.errors import InvalidRequest

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by them overflows.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20


def _describe(value) -> str:
    return f"{type(value).__name__} {value!r}"


def _check_int(name: str, value, *, allow_none: bool = False):
    if value is None and allow_none:
        return None
    # bool is an int subclass; True as a token count is a bug in the caller, not a 1.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        kind = "an int or None" if allow_none else "an int"
        raise InvalidRequest(f"{name} must be {kind}, got {_describe(value)}")
    return int(value)


def _check_float(name: str, value) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidRequest(f"{name} must be a number, got {_describe(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidRequest(f"{name} must be finite, got {value}")
    return value


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidRequest(f"{name} must be a bool, got {_describe(value)}")
    return bool(value)


# JSON output without free-form whitespace between tokens: the model cannot stall on spaces,
# and the output is the compact form every JSON parser reads.
_JSON_OPTIONS = {"whitespace_flexible": False}


@dataclasses.dataclass(frozen=True)
class GuidedDecoding:
    """One output constraint; exactly one field is set.

    json: a JSON schema (a dict, or its JSON text); ``{"type": "object"}`` is OpenAI's
    json_object. regex: the whole output matches it. choice: the output is one of these
    strings. grammar: a Lark grammar (llguidance's dialect) whose ``start`` rule is the output.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]
        if len(given) != 1:
            raise InvalidRequest(f"guided decoding takes exactly one of json, regex, choice, grammar; got {given}")
        if self.choice is not None:
            choice = tuple(self.choice)
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise InvalidRequest("guided choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", choice)

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's own (JSON) form."""
        import llguidance

        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise InvalidRequest(f"guided json is not valid JSON: {e.msg}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequest("guided json must be a JSON schema (an object)")
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
            except ValueError as e:
                raise InvalidRequest(f"invalid JSON schema: {e}") from None
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            # every choice is a Lark string literal: JSON string escapes are Lark's too
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return llguidance.LLMatcher.grammar_from_lark(self.grammar)


@dataclasses.dataclass(frozen=True)
class RepetitionDetection:
    """End a row stuck in a loop: when its last ``period * min_repeats`` tokens are one block of
    ``period`` tokens (1 <= period <= max_period) repeated ``min_repeats`` times, it finishes
    with ``finish_reason == "repetition"``. ``min_tokens`` generated tokens are never checked."""

    max_period: int = 32
    min_repeats: int = 4

    def __post_init__(self):
        for name, lo in (("max_period", 1), ("min_repeats", 2)):
            value = _check_int(f"repetition_detection.{name}", getattr(self, name))
            if value < lo:
                raise InvalidRequest(f"repetition_detection.{name} must be >= {lo}, got {value}")
            object.__setattr__(self, name, value)

    def repeating(self, ids) -> bool:
        """Whether the sequence ids (a list of ints) ends in a repeated block."""
        last = ids[-1] if ids else None
        for p in range(1, self.max_period + 1):
            n = p * self.min_repeats
            if n > len(ids):
                return False
            # a block repeated k times: every token equals the one p before it, over n - p tokens
            if ids[-1 - p] == last and ids[-n + p:] == ids[-n:-p]:
                return True
        return False


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters (vLLM's names, defaults and ranges).

    Validated on construction (and on ``dataclasses.replace``); invalid values raise
    ``InvalidRequest`` naming the field and the value. ``stop`` is normalised to a tuple of
    strings and ``stop_token_ids`` to a tuple of ints. ``temperature`` 0 (or below 1e-5) is
    greedy. ``top_k`` 0 or -1 disables top-k.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs returned per generated token
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # structured output: a GuidedDecoding, or a dict of its fields (vLLM's GuidedDecodingParams)
    guided_decoding: GuidedDecoding | dict | None = None
    # opt-in loop detection: a RepetitionDetection, or a dict of its fields
    repetition_detection: RepetitionDetection | dict | None = None

    def __post_init__(self):
        def put(name, value):  # frozen: normalised values go in through object.__setattr__
            object.__setattr__(self, name, value)

        put("n", _check_int("n", self.n))
        if self.n < 1:
            raise InvalidRequest(f"n must be >= 1, got {self.n}")

        put("temperature", _check_float("temperature", self.temperature))
        if self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")

        put("top_p", _check_float("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")

        put("top_k", _check_int("top_k", self.top_k))
        if self.top_k < -1:
            raise InvalidRequest(
                f"top_k must be -1 (disable), 0 (disable) or >= 1, got {self.top_k}"
            )

        put("min_p", _check_float("min_p", self.min_p))
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}")

        put("seed", _check_int("seed", self.seed, allow_none=True))

        put("max_tokens", _check_int("max_tokens", self.max_tokens))
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {self.max_tokens}")
        put("min_tokens", _check_int("min_tokens", self.min_tokens))
        if self.min_tokens < 0:
            raise InvalidRequest(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequest(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}"
            )

        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (list, tuple)):
            stop = tuple(stop)
        else:
            raise InvalidRequest(f"stop must be a str or a list of str, got {_describe(stop)}")
        for s in stop:
            if not isinstance(s, str):
                raise InvalidRequest(f"stop must contain only strings, got {_describe(s)}")
            if not s:
                raise InvalidRequest("stop strings must be non-empty, got ''")
        put("stop", stop)

        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        elif not isinstance(ids, (list, tuple)):
            raise InvalidRequest(f"stop_token_ids must be a list of int, got {_describe(ids)}")
        ids = tuple(_check_int(f"stop_token_ids[{n}]", i) for n, i in enumerate(ids))
        for i in ids:
            if i < 0:
                raise InvalidRequest(f"stop_token_ids must be >= 0, got {i}")
        put("stop_token_ids", ids)

        for name in ("logprobs", "prompt_logprobs"):
            value = _check_int(name, getattr(self, name), allow_none=True)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequest(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
            put(name, value)

        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {value}")
            put(name, value)
        put("repetition_penalty", _check_float("repetition_penalty", self.repetition_penalty))
        if self.repetition_penalty <= 0:
            raise InvalidRequest(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            put(name, _check_bool(name, getattr(self, name)))

        g = self.guided_decoding
        if isinstance(g, dict):
            unknown = sorted(set(g) - {f.name for f in dataclasses.fields(GuidedDecoding)})
            if unknown:
                raise InvalidRequest(f"guided_decoding takes json, regex, choice or grammar, got {unknown}")
            g = GuidedDecoding(**{k: v for k, v in g.items() if v is not None})
        elif g is not None and not isinstance(g, GuidedDecoding):
            raise InvalidRequest(f"guided_decoding must be a GuidedDecoding or a dict, got {_describe(g)}")
        put("guided_decoding", g)

        r = self.repetition_detection
        if isinstance(r, dict):
            unknown = sorted(set(r) - {"max_period", "min_repeats"})
            if unknown:
                raise InvalidRequest(f"repetition_detection takes max_period and min_repeats, got {unknown}")
            r = RepetitionDetection(**r)
        elif r is not None and not isinstance(r, RepetitionDetection):
            raise InvalidRequest(f"repetition_detection must be a RepetitionDetection or a dict, got {_describe(r)}")
        put("repetition_detection", r)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
