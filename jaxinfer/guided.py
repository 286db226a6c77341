"""Structured output: grammars compiled by llguidance against our own tokenizer's vocabulary.

A request asks for one kind of constraint (``GuidedDecoding``): a JSON schema (OpenAI's
``response_format`` json_object / json_schema, vLLM's ``guided_json``), a regex, a choice
among strings, or a Lark grammar. ``GrammarCompiler`` (one per tokenizer: building the
llguidance vocabulary costs a fraction of a second) checks a request's grammar and makes a
``GrammarMatcher`` per row. Each decode step the host asks every constrained row's matcher
for its token bitmask (int32[ceil(V/32)], bit t of word t // 32 set = token t allowed;
``BatchBitmask`` fills a whole batch's at once), the device applies the masks with
``apply_token_bitmask`` inside the sampling step, and the host feeds each sampled token back
with ``GrammarMatcher.accept``. Rows without a constraint carry
``has_mask = False`` and keep their logits untouched, so constrained and unconstrained rows
share a batch.

When a grammar is complete the matcher allows only EOS, so the row ends through its ordinary
stop check.
"""

from __future__ import annotations

import dataclasses
import numpy as np

from jaxinfer.errors import InvalidRequest
from jaxinfer.sampling.device import apply_token_bitmask, bitmask_words  # noqa: F401 (re-exported)
from jaxinfer.sampling.params import GuidedDecoding  # noqa: F401 (re-exported)



class GrammarCompiler:
    """llguidance's view of one tokenizer, and the matchers made from it.

    vocab_size: the model's logit width V when it is larger than the tokenizer's vocabulary
    (padded embedding rows); ids past the tokenizer are never allowed.
    """

    def __init__(self, tokenizer, vocab_size: int | None = None):
        import llguidance

        self.vocab_size = vocab_size or tokenizer.vocab_size
        if self.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"{vocab_size=} must be >= the tokenizer's {tokenizer.vocab_size}")
        self.eos_ids = sorted(tokenizer.eos_ids)
        if not self.eos_ids:
            raise InvalidRequest("structured output needs a tokenizer with an EOS token")
        self._tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer, self.eos_ids[0])),
                                           eos_token=self.eos_ids)

    def check(self, spec: GuidedDecoding) -> str:
        """The compiled grammar, or InvalidRequest saying what is wrong with it."""
        import llguidance

        grammar = spec.llguidance_grammar()
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tok)
        if error:
            raise InvalidRequest(f"invalid {_kind(spec)}: {error.strip()}")
        return grammar

    def matcher(self, spec: GuidedDecoding | str) -> GrammarMatcher:
        """A fresh matcher for one row (``spec``: a request, or a grammar from ``check``)."""
        import llguidance

        grammar = self.check(spec) if isinstance(spec, GuidedDecoding) else spec
        m = llguidance.LLMatcher(self._tok, grammar, log_level=0)
        if m.is_error():
            raise InvalidRequest(f"invalid grammar: {m.get_error().strip()}")
        return GrammarMatcher(m, self.vocab_size, bitmask_words(self._tok.vocab_size))


class GrammarMatcher:
    """The grammar state of one row: which tokens may come next, and the tokens taken so far."""

    def __init__(self, matcher, vocab_size: int, filled_words: int):
        self._m = matcher
        self.vocab_size = vocab_size
        self._filled = filled_words  # llguidance writes the tokenizer's words; the rest stay 0

    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state (no recompiling: one per sample of a request)."""
        return GrammarMatcher(self._m.deep_copy(), self.vocab_size, self._filled)

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the allowed next tokens into ``out`` (int32[ceil(V/32)], C-contiguous)."""
        if out.dtype != np.int32 or out.shape != (bitmask_words(self.vocab_size),) or not out.flags.c_contiguous:
            raise ValueError(f"bitmask row must be contiguous int32[{bitmask_words(self.vocab_size)}], "
                             f"got {out.dtype}{list(out.shape)}")
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, 4 * self._filled)
        out[self._filled:] = 0

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar did not allow it (the matcher then
        stays in its error state: the row should end)."""
        return self._m.consume_token(int(token))

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete sentence of the grammar."""
        return self._m.is_accepting()

    @property
    def is_stopped(self) -> bool:
        """Nothing but EOS may follow (a complete sentence that cannot grow, or an error)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return self._m.get_error() or None if self._m.is_error() else None


class BatchBitmask:
    """The host side of one decode step's masks: ``bitmask`` int32[B, ceil(V/32)] and
    ``has_mask`` bool[B] for a batch of up to B slots, refilled each step from the slots'
    matchers (several rows at once on llguidance's thread pool). Pass both to
    ``apply_token_bitmask`` inside the jitted step; their shapes never change, so neither does
    the compiled step.
    """

    def __init__(self, max_batch: int, vocab_size: int, *, num_threads: int | None = None):
        import llguidance

        self.vocab_size = vocab_size
        self.bitmask = allocate_bitmask(max_batch, vocab_size)
        self.has_mask = np.zeros(max_batch, bool)
        self._executor = llguidance.LLExecutor(num_threads)

    def fill(self, matchers) -> bool:
        """matchers: per slot, a GrammarMatcher or None (unconstrained). Returns whether any slot
        is constrained (when none is, the step may skip the mask altogether)."""
        if len(matchers) > len(self.has_mask):
            raise ValueError(f"{len(matchers)} slots, but the bitmask holds {len(self.has_mask)}")
        self.has_mask[:] = False
        self.has_mask[: len(matchers)] = [m is not None for m in matchers]
        rows = [(b, m) for b, m in enumerate(matchers) if m is not None]
        words = self.bitmask.shape[1]
        if rows and all(m._filled == words for _, m in rows):
            self._executor.unsafe_compute_mask_ptr([(m._m, b) for b, m in rows], self.bitmask.ctypes.data,
                                                   4 * words, self.bitmask.shape[0])
        else:  # a model wider than its tokenizer: llguidance fills each row's first words
            for b, m in rows:
                m.fill_bitmask(self.bitmask[b])
        return bool(rows)


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads from a tokenizer."""

    def __init__(self, tokenizer, eos_id: int):
        self.eos_token_id = eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = tokenizer.token_bytes()
        self.special_token_ids = sorted(tokenizer.special_ids)
        self._tokenizer = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


def _kind(spec: GuidedDecoding) -> str:
    return {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}[
        next(f.name for f in dataclasses.fields(spec) if getattr(spec, f.name) is not None)]


def allocate_bitmask(batch: int, vocab_size: int) -> np.ndarray:
    """int32[B, ceil(V/32)], every token allowed."""
    return np.full((batch, bitmask_words(vocab_size)), -1, np.int32)
