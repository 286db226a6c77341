"""Static-batch generation: bucketed prefill, then one jitted decode step per token.

Rows are sorted by prompt length and cut into batches of at most ``max_num_seqs``. Batch
size, prompt length and cache length each go through a small set of buckets, so the number
of compiled executables is bounded. The cache and the sampling state are donated to every
step. The host dispatches step i+1 before it reads step i's tokens, so detokenizing and stop
checks overlap device work; each row stops on its own EOS or stop condition.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import cache as kv
from jaxinfer import sampling as smp
from jaxinfer.config import ModelConfig
from jaxinfer.errors import InvalidRequest
from jaxinfer.models.registry import family_module
from jaxinfer.outputs import Logprob

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MIN_LEN_BUCKET = 16


def bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n=} exceeds the largest bucket {buckets[-1]}")


def len_bucket(n: int) -> int:
    """Powers of two from 16: at most log2(max_model_len) prompt/cache shapes."""
    return max(MIN_LEN_BUCKET, 1 << (max(n, 1) - 1).bit_length())


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


def _logits_at(mod, weights, h, index, cfg):  # h [B, T, D], index i32[B] -> f32[B, V]
    last = jnp.take_along_axis(h, index[:, None, None], axis=1)
    return mod.unembed(weights, last, cfg)[:, 0]


def _sample_step(logits, state, step, stop_ids, min_tokens, num_logprobs):
    masked = smp.mask_tokens_before_min(logits, stop_ids, step, min_tokens)
    tokens = smp.sample(masked, state, step)
    state = smp.update_counts(state, tokens)
    if num_logprobs < 0:  # logprobs not requested by any row: skip the log-softmax
        return tokens, None, state
    chosen, top_ids, top_lp = smp.logprobs_of(logits, tokens, num_logprobs)
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=1)
    rank = 1 + jnp.sum(logits > picked, axis=-1)  # rank under the raw model, as vLLM reports
    return tokens, (chosen, rank, top_ids, top_lp), state


def prefill_step(weights, tokens, lengths, cache, state, stop_ids, min_tokens, *, cfg, num_logprobs):
    """Prompts [B, T] (right-padded) -> first sampled token of each row."""
    mod = family_module(cfg.family)
    B = tokens.shape[0]
    h, cache = mod.forward(weights, tokens, jnp.zeros(B, jnp.int32), cache, cfg=cfg, read_cache=False)
    logits = _logits_at(mod, weights, h, lengths - 1, cfg)
    step = jnp.zeros(B, jnp.int32)
    toks, lp, state = _sample_step(logits, state, step, stop_ids, min_tokens, num_logprobs)
    return toks, lp, cache, state


def decode_step(weights, tokens, positions, step, cache, state, stop_ids, min_tokens, *, cfg, num_logprobs):
    """One token for every row: tokens i32[B] at positions i32[B]; step = tokens so far."""
    mod = family_module(cfg.family)
    h, cache = mod.forward(weights, tokens[:, None], positions, cache, cfg=cfg)
    logits = mod.unembed(weights, h, cfg)[:, 0]
    toks, lp, state = _sample_step(logits, state, step, stop_ids, min_tokens, num_logprobs)
    return toks, lp, cache, state


def prompt_logprobs_step(weights, tokens, *, cfg, num_top):
    """Log-probs of each prompt token given its prefix: tokens i32[1, T] -> [T-1] + top-n."""
    mod = family_module(cfg.family)
    h, _ = mod.forward(weights, tokens, jnp.zeros(1, jnp.int32), None, cfg=cfg)
    lp = jax.nn.log_softmax(mod.unembed(weights, h, cfg)[0, :-1], axis=-1)  # f32[T-1, V]
    chosen = jnp.take_along_axis(lp, tokens[0, 1:, None], axis=1)[:, 0]
    ranks = 1 + jnp.sum(lp > chosen[:, None], axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, max(num_top, 1))
    return chosen, ranks, top_ids[:, :num_top], top_lp[:, :num_top]


class StaticEngine:
    """Runs rows through bucketed static batches on one model."""

    def __init__(self, cfg: ModelConfig, weights, tokenizer, *, max_model_len: int,
                 max_num_seqs: int = 64, seed: int = 0, kv_cache_dtype: str = "auto"):
        self.cfg, self.weights, self.tokenizer = cfg, weights, tokenizer
        self.kv_dtype = kv.kv_storage_dtype(kv_cache_dtype, cfg)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.seed = seed
        donate = ("cache", "state")
        self._prefill = jax.jit(prefill_step, static_argnames=("cfg", "num_logprobs"), donate_argnames=donate)
        self._decode = jax.jit(decode_step, static_argnames=("cfg", "num_logprobs"), donate_argnames=donate)
        self._prompt_lp = jax.jit(prompt_logprobs_step, static_argnames=("cfg", "num_top"))
        self.last_cache_bytes = 0

    # ------------------------------------------------------------------ host loop
    def run(self, rows) -> Iterator[Row]:
        """Run rows (an iterable, read a window at a time) in length-sorted batches; yields
        each row as soon as it finishes."""
        it = iter(rows)
        while window := list(itertools.islice(it, 4 * self.max_num_seqs)):
            window.sort(key=lambda r: len(r.prompt_ids))
            for s in range(0, len(window), self.max_num_seqs):
                yield from self._run_batch(window[s : s + self.max_num_seqs])

    def validate(self, row: Row) -> None:
        """Every row fits a dense cache: nothing to check beyond max_model_len."""

    def _run_batch(self, rows: list[Row]) -> Iterator[Row]:
        cfg, n = self.cfg, len(rows)
        B = bucket(n, BATCH_BUCKETS)
        lens = np.array([len(r.prompt_ids) for r in rows] + [1] * (B - n), np.int32)
        T = len_bucket(int(lens.max()))
        max_new = max(r.max_new for r in rows)
        S = max(T, len_bucket(int(max(len(r.prompt_ids) + r.max_new for r in rows))))
        tokens = np.full((B, T), self.tokenizer.pad_id, np.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r.prompt_ids)] = r.prompt_ids
        params = [r.params for r in rows]
        state = smp.make_sampling_state(
            params, [r.prompt_ids for r in rows], cfg.vocab_size, default_seed=self.seed,
            batch_size=B, request_indices=[r.request_index for r in rows],
        )
        stop_ids, min_tokens = smp.min_tokens_inputs(params, self.tokenizer.eos_ids, batch_size=B)
        stop_ids, min_tokens = jnp.asarray(stop_ids), jnp.asarray(min_tokens)
        want_lp = any(r.params.logprobs is not None for r in rows)
        num_lp = max((r.params.logprobs or 0) for r in rows)
        # three shapes, not twenty-two: none, up to 5, up to 20
        num_lp = -1 if not want_lp else 0 if num_lp == 0 else 5 if num_lp <= 5 else 20
        cache = kv.init_cache(cfg, B, S, self.kv_dtype, max_chunk=T)  # LOCAL layers: a ring of W + T - 1
        self.last_cache_bytes = cache.nbytes()
        now = time.perf_counter()
        for r in rows:
            r.scheduled_time = now
        toks, lp, cache, state = self._prefill(
            self.weights, jnp.asarray(tokens), jnp.asarray(lens), cache, state, stop_ids, min_tokens,
            cfg=cfg, num_logprobs=num_lp,
        )
        live = set(range(n))
        for i in range(max_new):
            nxt = None
            if i + 1 < max_new:  # dispatch the next step before reading this one
                positions = jnp.asarray(lens + i)
                step = jnp.full((B,), i + 1, jnp.int32)
                nxt = self._decode(self.weights, toks, positions, step, cache, state, stop_ids,
                                   min_tokens, cfg=cfg, num_logprobs=num_lp)
            host_toks = np.asarray(toks)
            host_lp = jax.device_get(lp) if want_lp else None
            now = time.perf_counter()
            for b in list(live):
                if record_token(rows[b], int(host_toks[b]), host_lp, b, now, self.tokenizer):
                    live.discard(b)
                    yield rows[b]
            if not live or nxt is None:
                break
            toks, lp, cache, state = nxt
        for b in live:  # cannot happen unless max_new was 0; keep every row finished
            rows[b].finished_time = time.perf_counter()
            yield rows[b]

    # ------------------------------------------------------------------ prompt logprobs
    def prompt_logprobs(self, ids: list[int], num_top: int) -> list[dict[int, Logprob] | None]:
        T = len_bucket(len(ids))
        toks = np.full((1, T), self.tokenizer.pad_id, np.int32)
        toks[0, : len(ids)] = ids
        chosen, ranks, top_ids, top_lp = jax.device_get(
            self._prompt_lp(self.weights, jnp.asarray(toks), cfg=self.cfg, num_top=num_top)
        )
        out: list[dict[int, Logprob] | None] = [None]  # the first token has no prefix
        for t in range(1, len(ids)):
            out.append(position_logprobs(self.tokenizer, ids[t], float(chosen[t - 1]), int(ranks[t - 1]), top_ids[t - 1], top_lp[t - 1]))
        return out


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
