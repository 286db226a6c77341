"""The host's record of one sequence: its request, its tokens so far, and how a sampled
token is taken in (stop checks, detokenizing, logprobs, timing)."""

from __future__ import annotations

import dataclasses

from jaxinfer import sampling as smp
from jaxinfer.outputs import Logprob


@dataclasses.dataclass
class Row:
    """One sequence: a sample of a request, and everything the host tracks about it."""

    prompt_ids: list[int]
    params: smp.SamplingParams  # per sample (its seed already derived)
    request_index: int  # distinct per row: seeds a row that has no seed
    checker: smp.StopChecker
    detok: object  # IncrementalDetokenizer
    max_new: int  # max_tokens capped by max_model_len
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    scheduled_time: float | None = None
    owner: object = None  # the caller's handle for the request this row samples
    token_times: list[float] = dataclasses.field(default_factory=list)  # when each token arrived
    # params.prompt_logprobs set: one entry per prompt token (None for the first), filled by prefill
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    guided: object = None  # structured output: the row's guided.GrammarMatcher (None: unconstrained)
    stream: bool = False  # its text streams to a client as it grows: the host reads every token
    spec_drafted: int = 0  # speculative decoding: tokens drafted for this row
    spec_accepted: int = 0  # and accepted
    lora: object = None  # the row's LoRA adapter (``lora.Adapter``), None: the base model
    images: object = None  # the prompt's images (``engine.multimodal.PromptImages``), None: text only


def record_token(r: Row, tok: int, host_lp, b: int, now: float, tokenizer) -> bool:
    """Feed one sampled token (row b of a step's outputs) to a row; True when it finished."""
    if r.first_token_time is None:
        r.first_token_time = now
    r.last_token_time = now
    r.token_times.append(now)
    r.token_ids.append(tok)
    if host_lp is not None and r.params.logprobs is not None:
        chosen, rank, top_ids, top_lps = (a[b] for a in host_lp)
        r.cumulative_logprob += float(chosen)
        r.logprobs.append(position_logprobs(tokenizer, tok, float(chosen), int(rank), top_ids[: r.params.logprobs], top_lps))
    r.checker.update(tok, r.detok.add(tok))
    if r.guided is not None and not r.checker.finished and not r.guided.accept(tok):
        r.checker.end("stop")  # the grammar allowed nothing the sampler could take (e.g. EOS masked)
    rep = r.params.repetition_detection
    if (rep is not None and not r.checker.finished and len(r.token_ids) > r.params.min_tokens
            and rep.repeating(r.token_ids)):
        r.checker.end("repetition")
    if r.checker.finished:
        r.finished_time = now
        return True
    return False


def position_logprobs(tokenizer, tok, chosen, rank, top_ids, top_lps) -> dict[int, Logprob]:
    """vLLM's per-position logprobs: the chosen token plus the top-n, each with its rank."""
    piece = lambda t: tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    entry = {tok: Logprob(chosen, rank, piece(tok))}
    for i, (t, l) in enumerate(zip(top_ids, top_lps), 1):
        entry.setdefault(int(t), Logprob(float(l), i, piece(int(t))))
    return entry
