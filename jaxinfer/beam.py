"""Beam search over the paged engine, in vLLM's shape: ``LLM.beam_search(prompts,
BeamSearchParams(beam_width, max_tokens, length_penalty))``.

Each step asks the engine for one token of every live beam of every prompt (one batch), with
the top ``2 * beam_width`` logprobs of the next position; every beam grows by each of those
candidates, and the best ``beam_width`` candidates per prompt survive. A candidate ending in EOS
(unless ``ignore_eos``) is complete; so is a beam that reaches max_tokens or the context end.
Among the complete beams the best ``beam_width`` by score are returned, best first.

``2 * beam_width`` candidates per beam are enough: at most ``beam_width`` of a prompt's best
candidates can end in EOS, so the best ``beam_width`` that do not are among each beam's top
``2 * beam_width``. A beam is its prompt plus its tokens, so the beams of a prompt share the
prompt's KV pages through the prefix cache (full pages are shared read-only; each beam computes
only its own tail): the engine's copy-on-write.

Score (vLLM's ``get_beam_search_score``): cumulative logprob / len ** length_penalty, where len
counts the prompt and the generated tokens, less a final EOS.
"""

from __future__ import annotations

import dataclasses
import math

from jaxinfer.errors import InvalidRequest
from jaxinfer.sampling import MAX_LOGPROBS, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # the engine returns at most MAX_LOGPROBS candidates per position


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self):
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidRequest(f"{name} must be an int >= 1, got {v!r}")
        if self.beam_width > MAX_BEAM_WIDTH:
            raise InvalidRequest(f"beam_width must be <= {MAX_BEAM_WIDTH}, got {self.beam_width}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise InvalidRequest(f"length_penalty must be a finite number, got {lp!r}")


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam: the prompt's ids plus the generated ``token_ids``."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    cum_logprob: float
    logprobs: list[float]  # per generated token
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) | "length"
    score: float | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(prompt_len: int, token_ids: list[int], cum_logprob: float, eos_ids, length_penalty: float) -> float:
    n = prompt_len + len(token_ids) - (1 if token_ids and token_ids[-1] in eos_ids else 0)
    return cum_logprob / max(n, 1) ** length_penalty


def beam_search(llm, encoded: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search for each prompt's token ids on ``llm`` (an LLM: its ``generate``, tokenizer
    and max_model_len); see the module docstring."""
    eos = frozenset(llm.tokenizer.eos_ids)
    score = lambda b: beam_score(len(b.prompt_token_ids), b.token_ids, b.cum_logprob, eos,  # noqa: E731
                                 params.length_penalty)
    live = [[BeamSearchSequence(toks, [], 0.0, [])] for toks in encoded]
    done: list[list[BeamSearchSequence]] = [[] for _ in encoded]
    step_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=2 * params.beam_width)
    for step in range(params.max_tokens):
        # beams with no room left in the context are complete
        for i, beams in enumerate(live):
            full = [b for b in beams if len(b.prompt_token_ids) + len(b.token_ids) >= llm.max_model_len]
            for b in full:
                b.finish_reason = "length"
            done[i] += full
            live[i] = [b for b in beams if b.finish_reason is None]
        flat = [(i, b) for i, beams in enumerate(live) for b in beams]
        if not flat:
            break
        outs = llm.generate([{"prompt_token_ids": b.prompt_token_ids + b.token_ids} for _, b in flat], step_params,
                            use_tqdm=False)
        cands: list[list[BeamSearchSequence]] = [[] for _ in encoded]
        for (i, b), out in zip(flat, outs):
            for tok, lp in out.outputs[0].logprobs[0].items():
                nb = BeamSearchSequence(b.prompt_token_ids, b.token_ids + [tok], b.cum_logprob + lp.logprob,
                                        b.logprobs + [lp.logprob])
                if tok in eos and not params.ignore_eos:
                    nb.finish_reason = "stop"
                    done[i].append(nb)
                else:
                    cands[i].append(nb)
        live = [sorted(c, key=score, reverse=True)[: params.beam_width] for c in cands]
    results = []
    for i in range(len(encoded)):
        for b in live[i]:
            b.finish_reason = b.finish_reason or "length"
        best = sorted(done[i] + live[i], key=score, reverse=True)[: params.beam_width]
        for b in best:
            b.score = score(b)
            b.text = llm.tokenizer.decode(b.token_ids, skip_special_tokens=True)
        results.append(BeamSearchOutput(best))
    return results
