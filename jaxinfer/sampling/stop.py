"""``StopChecker``: per-request finish detection on the host (stop strings, stop tokens, EOS,
``min_tokens``, ``max_tokens``) that streams text without ever retracting it."""

from __future__ import annotations

from collections.abc import Iterable

from jaxinfer.sampling.params import SamplingParams


class StopChecker:
    """Finish detection for one request, fed one generated token and its text delta at a time.

    ``update`` returns the text that is now safe to stream: a tail that could still grow into a
    stop string is held back, so streamed text never has to be retracted. On finish the held
    tail is released (or dropped, if it was the start of the stop string).

    Semantics (vLLM's): the first ``min_tokens`` tokens never finish the request. A token in
    ``stop_token_ids``, or an EOS id unless ``ignore_eos``, finishes with "stop"; its text is
    dropped unless ``include_stop_str_in_output``. A stop string finishes with "stop" and the text
    ends just before it (or just after it with ``include_stop_str_in_output``); among stop strings
    completed by the same delta the one ending first wins (then the longest), so the result does
    not depend on how the text was split into deltas. Otherwise reaching ``max_tokens`` finishes
    with "length". A stop token on the last allowed token is "stop", not "length".
    ``stop_reason`` is the stop string or stop token id (None for EOS and length).
    """

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int] = ()):
        self._stop = tuple(params.stop)
        self._stop_ids = frozenset(params.stop_token_ids)
        self._eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self._include = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._max_tokens = params.max_tokens
        self._text = ""  # all text so far, truncated at a stop string once found
        self._emitted = 0  # length of the prefix of _text already returned
        self.num_tokens = 0
        self.finish_reason: str | None = None  # "stop" | "length"
        self.stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def output_text(self) -> str:
        """The text streamed so far (the final text once finished)."""
        return self._text[: self._emitted]

    def update(self, token_id: int, text_delta: str) -> str:
        """Consumes one generated token and its detokenized text; returns the text to stream."""
        if self.finished:
            raise RuntimeError("update() after the request finished")
        self.num_tokens += 1
        may_stop = self.num_tokens > self._min_tokens
        stop_token = may_stop and (token_id in self._stop_ids or token_id in self._eos)
        prev_len = len(self._text)
        if self._include or not stop_token:
            self._text += text_delta

        if may_stop and self._stop:
            found = self._find_stop(prev_len)
            if found is not None:
                start, s = found
                self._text = self._text[: start + len(s) if self._include else start]
                return self._finish("stop", s)
        if stop_token:
            return self._finish("stop", token_id if token_id in self._stop_ids else None)
        if self.num_tokens >= self._max_tokens:
            return self._finish("length", None)
        return self._release(len(self._text) - self._held_back())

    def _find_stop(self, prev_len: int) -> tuple[int, str] | None:
        """(start, stop string) of the earliest-ending stop string that ends after prev_len."""
        best = None
        for s in self._stop:
            start = self._text.find(s, max(0, prev_len - len(s) + 1))
            if start < 0:
                continue
            rank = (start + len(s), start)
            if best is None or rank < best[0]:
                best = (rank, start, s)
        return None if best is None else (best[1], best[2])

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string.

        Text that ends up inside the output even when a stop string completes (always, with
        include_stop_str_in_output) need not be held.
        """
        if self._include:
            return 0
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._text)), longest, -1):
                if self._text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _release(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        delta = self._text[self._emitted : upto]
        self._emitted = upto
        return delta

    def end(self, reason: str) -> str:
        """Finish now for a reason found outside the checker (a grammar, repetition); returns
        the text held back for stop strings."""
        return self._finish(reason, None)

    def _finish(self, reason: str, stop_reason) -> str:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        return self._release(len(self._text))
