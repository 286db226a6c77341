"""Speculative decoding's configuration (vLLM's ``speculative_config``), the prompt-lookup
proposer (on the host, and on device for chained verification steps), and the acceptance
statistics.

Every method but ``draft_model`` proposes a deterministic block of drafts, so verification
treats them as a point mass (accept draft x with probability p(x), resample from p without x
on rejection); a draft model's tokens come with their distribution q (accept with probability
min(1, p(x)/q(x)), resample from norm(max(0, p - q))). Lossless in every sampling mode (see
``sampling.verify``). Where drafts come from:

* ``ngram``: the longest suffix of the sequence (prompt + output), between
  ``prompt_lookup_min`` and ``prompt_lookup_max`` tokens, that occurred earlier; the tokens that
  followed its latest earlier occurrence are the drafts. No model: ``ngram_propose`` on the
  host, and ``ngram_drafts``, its twin over padded histories, inside a verification step
  chained to the unread one (``engine.drafting``).
* ``early_exit``: the model's own first ``num_layers`` layers, final norm and head, run
  greedily k times inside the same jitted step before the block is verified; their keys and
  values go to the target's own pages (the verification pass rewrites them).
* ``draft_model``: a second, smaller model with the same vocabulary (``model``: a registry
  name or a path, optionally quantized while loading with ``quantization``) drafts k tokens
  autoregressively inside the jitted step, sampling each with the row's own temperature /
  top-k / top-p shaping, and hands its distributions q to verification (true rejection
  sampling, not a point mass). It keeps its own page pools, indexed by the target's page
  tables, and runs over every token the target computes (prefill chunks and plain decode
  steps too), so its pages hold the same positions as the target's under prefix caching,
  preemption and rejection.
* ``medusa``: K trained heads (``models.medusa``, from ``model``) on the hidden state of each
  verified position, read out by the model's own LM head in the same matmul as the
  verification logits; the heads at the accepted position give the next block's drafts.
* ``eagle``: a trained EAGLE head (``models.eagle``, from ``model``): one decoder layer over the
  target's features, with its own one-layer page pools. Each step writes its entries for the
  tokens the target computed; after verification it runs k times from the accepted position,
  and those are the next block's drafts (host-visible, as Medusa's). With ``branches`` W > 1,
  the head's W most likely first drafts each begin a chain of k, all verified in the same
  step (``engine.branches``); a greedy row keeps the chain that accepted most.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from jaxinfer.errors import InvalidRequest


class SpecMethod(str, enum.Enum):
    NGRAM = "ngram"
    EARLY_EXIT = "early_exit"
    DRAFT_MODEL = "draft_model"
    MEDUSA = "medusa"
    EAGLE = "eagle"


_FIELDS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "num_layers",
           "disable_by_batch_size", "model", "revision", "quantization", "branches"}
MAX_BRANCHES = 8
_QUANTIZATIONS = ("int8", "int4")  # draft_model: weight-only schemes applied while loading the draft


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: SpecMethod
    num_speculative_tokens: int  # k: drafted tokens per row and step
    prompt_lookup_max: int = 4  # ngram: longest suffix looked up
    prompt_lookup_min: int = 1  # ngram: shortest suffix looked up
    num_layers: int | None = None  # early_exit: layers that draft
    disable_by_batch_size: int | None = None  # steps with more decoding rows than this run without
    # speculation (None: speculate at every batch size, as vLLM)
    model: str | None = None  # medusa: the heads directory (``jaxinfer train-medusa``); draft_model: the draft
    revision: str | None = None  # draft_model given as a Hugging Face Hub id: its branch, tag or commit
    quantization: str | None = None  # draft_model: quantize the draft while loading (int8, int4); eagle: int8
    branches: int = 1  # eagle: chains per row, one from each of the head's top-`branches` first drafts

    def speculates(self, rows: int) -> bool:
        """Whether a step with this many decoding rows speculates (``disable_by_batch_size``)."""
        return self.disable_by_batch_size is None or rows <= self.disable_by_batch_size

    def max_rows(self, max_num_seqs: int) -> int:
        """The most decoding rows a speculating step can have."""
        return min(max_num_seqs, self.disable_by_batch_size or max_num_seqs)

    @classmethod
    def parse(cls, spec, n_layers: int | None = None) -> SpeculativeConfig | None:
        """From a dict or a JSON string (or None / an existing config), validated."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            out = spec
        else:
            if isinstance(spec, str):
                try:
                    spec = json.loads(spec)
                except json.JSONDecodeError as e:
                    raise InvalidRequest(f"speculative_config is not valid JSON: {e}") from None
            if not isinstance(spec, Mapping):
                raise InvalidRequest(f"speculative_config must be an object, got {type(spec).__name__}")
            unknown = sorted(set(spec) - _FIELDS)
            if unknown:
                raise InvalidRequest(f"speculative_config has unknown field(s) {unknown}; known: {sorted(_FIELDS)}")
            if "method" not in spec:
                raise InvalidRequest("speculative_config needs a 'method': one of "
                                     + ", ".join(m.value for m in SpecMethod))
            try:
                method = SpecMethod(spec["method"])
            except ValueError:
                raise InvalidRequest(f"speculative_config method must be one of "
                                     f"{', '.join(m.value for m in SpecMethod)}, got {spec['method']!r}") from None
            kw = {k: v for k, v in spec.items() if k != "method"}
            for name in ("model", "revision"):
                if name in kw and not isinstance(kw[name], str):
                    raise InvalidRequest(f"speculative_config {name} must be a string, got {kw[name]!r}")
            if kw.get("quantization") is not None and kw["quantization"] not in _QUANTIZATIONS:
                raise InvalidRequest(f"speculative_config quantization must be one of {', '.join(_QUANTIZATIONS)}, "
                                     f"got {kw['quantization']!r}")
            for name, v in kw.items():
                if name == "disable_by_batch_size" and v is None:
                    continue
                if name not in ("model", "revision", "quantization") and (not isinstance(v, int) or isinstance(v, bool)):
                    raise InvalidRequest(f"speculative_config {name} must be an integer, got {v!r}")
            if "num_speculative_tokens" not in kw:
                raise InvalidRequest("speculative_config needs num_speculative_tokens (k >= 1)")
            out = cls(method=method, **kw)
        if out is not None:
            out.check(n_layers)
        return out

    def check(self, n_layers: int | None = None) -> None:
        k = self.num_speculative_tokens
        if not 1 <= k <= 16:
            raise InvalidRequest(f"speculative_config num_speculative_tokens must be in [1, 16], got {k}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise InvalidRequest(f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                                 f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise InvalidRequest(f"speculative_config disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if self.method == SpecMethod.EARLY_EXIT:
            if self.num_layers is None:
                raise InvalidRequest("speculative_config method early_exit needs num_layers")
            if n_layers is not None and not 1 <= self.num_layers < n_layers:
                raise InvalidRequest(f"speculative_config num_layers must be in [1, {n_layers - 1}] "
                                     f"(the model has {n_layers} layers), got {self.num_layers}")
        elif self.num_layers is not None:
            raise InvalidRequest(f"speculative_config num_layers applies to early_exit, not {self.method.value}")
        if self.method == SpecMethod.MEDUSA and not self.model:
            raise InvalidRequest("speculative_config method medusa needs model: a heads directory "
                                 "(made by jaxinfer train-medusa)")
        if self.method == SpecMethod.EAGLE and not self.model:
            raise InvalidRequest("speculative_config method eagle needs model: an EAGLE head directory "
                                 "(made by jaxinfer train-eagle)")
        if self.method == SpecMethod.DRAFT_MODEL and not self.model:
            raise InvalidRequest("speculative_config method draft_model needs model: a registry name, a Hugging "
                                 "Face Hub id or a path of a model with the target's vocabulary")
        if self.revision is not None and self.method != SpecMethod.DRAFT_MODEL:
            raise InvalidRequest(f"speculative_config revision applies to draft_model, not {self.method.value}")
        if self.method not in (SpecMethod.MEDUSA, SpecMethod.EAGLE, SpecMethod.DRAFT_MODEL) and self.model is not None:
            raise InvalidRequest(f"speculative_config model applies to medusa, eagle and draft_model, "
                                 f"not {self.method.value}")
        if not 1 <= self.branches <= MAX_BRANCHES:
            raise InvalidRequest(f"speculative_config branches must be in [1, {MAX_BRANCHES}], got {self.branches}")
        if self.branches > 1 and self.method != SpecMethod.EAGLE:
            raise InvalidRequest(f"speculative_config branches applies to eagle, not {self.method.value}")
        if self.method == SpecMethod.EAGLE and self.quantization not in (None, "int8"):
            raise InvalidRequest(f"speculative_config quantization of an eagle head must be int8, "
                                 f"got {self.quantization!r}")
        if self.method not in (SpecMethod.DRAFT_MODEL, SpecMethod.EAGLE) and self.quantization is not None:
            raise InvalidRequest(f"speculative_config quantization applies to draft_model and eagle, "
                                 f"not {self.method.value}")


def ngram_propose(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: for n from max_n down to min_n, find the latest earlier occurrence of the
    last n tokens and return (up to) k tokens that followed it; [] if no suffix recurs."""
    L = len(tokens)
    toks = list(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = toks[L - n:]
        for start in range(L - n - 1, -1, -1):  # latest occurrence first
            if toks[start:start + n] == suffix:
                follow = toks[start + n:start + n + k]
                if follow:
                    return follow
    return []


def ngram_drafts(history: jax.Array, lengths: jax.Array, k: int, min_n: int, max_n: int) -> tuple[jax.Array, jax.Array]:
    """``ngram_propose`` on device, row by row: history i32[R, L] (row r's tokens at [0,
    lengths[r]), anything after), lengths i32[R] -> (drafts i32[R, k], -1 past each row's
    count; count i32[R]), the drafts ``ngram_propose(history[r, :lengths[r]], k, min_n, max_n)``
    returns. An earlier occurrence of the last n tokens is named by its end e (the position of
    the first token that followed it): the n tokens before e equal the last n, e < length."""
    if not 1 <= min_n <= max_n or k < 1:
        raise ValueError(f"ngram_drafts needs 1 <= min_n <= max_n and k >= 1, got {min_n=}, {max_n=}, {k=}")
    R, L = history.shape
    e = jnp.arange(L)[None]  # [1, L]
    last = lengths[:, None] - 1
    match = jnp.ones((R, L), bool)
    best = jnp.full(R, -1, jnp.int32)
    for j in range(max_n):  # match: the j + 1 tokens before e equal the last j + 1
        src = e - 1 - j
        mine = jnp.take_along_axis(history, jnp.clip(last - j, 0, L - 1), axis=1)  # [R, 1]
        match = match & (src >= 0) & (jnp.take_along_axis(history, jnp.clip(src, 0, L - 1), axis=1) == mine)
        if j + 1 >= min_n:  # the longest n with an occurrence wins; within it, the latest
            latest = jnp.max(jnp.where(match & (e <= last), e, -1), axis=1)
            best = jnp.where(latest >= 0, latest, best)
    count = jnp.where(best >= 0, jnp.minimum(k, lengths - best), 0).astype(jnp.int32)
    i = jnp.arange(k)[None]
    drafts = jnp.take_along_axis(history, jnp.clip(best[:, None] + i, 0, L - 1), axis=1)
    return jnp.where(i < count[:, None], drafts, -1).astype(jnp.int32), count


@dataclasses.dataclass
class SpecStats:
    """Acceptance counters: per step, per row, by draft position."""

    k: int
    steps: int = 0  # verification steps run (each verifies every decoding row's block)
    rows: int = 0  # row-blocks verified
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens produced by verification steps (accepted + one per row)
    disabled_steps: int = 0  # decode steps run without speculation (batch too large, no drafts)
    chained_steps: int = 0  # verification steps dispatched before the host read the previous one
    by_position: list[int] = dataclasses.field(default_factory=list)  # blocks whose draft j was accepted
    drafted_by_position: list[int] = dataclasses.field(default_factory=list)  # blocks with a draft j

    def __post_init__(self):
        self.by_position = self.by_position or [0] * self.k
        self.drafted_by_position = self.drafted_by_position or [0] * self.k

    def record(self, drafted: int, accepted: int) -> None:
        self.rows += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += accepted + 1
        for j in range(accepted):
            self.by_position[j] += 1
        for j in range(drafted):
            self.drafted_by_position[j] += 1

    def summary(self) -> dict:
        rate = self.accepted / self.drafted if self.drafted else 0.0
        return {"spec_steps": self.steps, "spec_disabled_steps": self.disabled_steps,
                "spec_chained_steps": self.chained_steps,
                "spec_drafted_tokens": self.drafted, "spec_accepted_tokens": self.accepted,
                "spec_acceptance_rate": round(rate, 4),
                "spec_mean_accepted_length": round(self.emitted / self.rows, 4) if self.rows else 0.0,
                "spec_acceptance_by_position": [round(a / d, 4) if d else 0.0
                                                for a, d in zip(self.by_position, self.drafted_by_position)]}
