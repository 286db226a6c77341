"""Request outputs in vLLM's shape: RequestOutput -> CompletionOutput -> Logprob."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen/actual token plus the top-n).
PositionLogprobs = dict[int, Logprob]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None  # "stop" | "length" | "repetition"
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0
    token_times: tuple[float, ...] = ()  # when each token of the first sample reached the host
    spec_drafted_tokens: int = 0  # speculative decoding: tokens drafted for this request's samples
    spec_accepted_tokens: int = 0  # and accepted by verification

    @property
    def spec_acceptance_rate(self) -> float | None:
        return self.spec_accepted_tokens / self.spec_drafted_tokens if self.spec_drafted_tokens else None

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (a.k.a. mean inter-token latency)."""
        if self.num_generated_tokens < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generated_tokens - 1)


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    lora_request: object = None  # the LoRARequest the request ran (vLLM's field), None: the base model
