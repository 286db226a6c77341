"""Static-batch generation: bucketed prefill, then one jitted decode step per token.

Rows are sorted by prompt length and cut into batches of at most ``max_num_seqs``. Batch
size, prompt length and cache length each go through a small set of buckets, so the number
of compiled executables is bounded. The cache and the sampling state are donated to every
step. The host dispatches step i+1 before it reads step i's tokens, so detokenizing and stop
checks overlap device work; each row stops on its own EOS or stop condition.
"""

from __future__ import annotations

import itertools
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import cache as kv
from jaxinfer import kernels
from jaxinfer import sampling as smp
from jaxinfer.config import ModelConfig
from jaxinfer.models.registry import family_module
from jaxinfer.engine.buckets import BATCH_BUCKETS, bucket, len_bucket, logprob_bucket
from jaxinfer.engine.rows import Row, position_logprobs, record_token
from jaxinfer.engine.step import sample_step
from jaxinfer.outputs import Logprob

def _logits_at(mod, weights, h, index, cfg):  # h [B, T, D], index i32[B] -> f32[B, V]
    last = jnp.take_along_axis(h, index[:, None, None], axis=1)
    return mod.unembed(weights, last, cfg)[:, 0]


def prefill_step(weights, tokens, lengths, cache, state, stop_ids, min_tokens, *, cfg, num_logprobs):
    """Prompts [B, T] (right-padded) -> first sampled token of each row."""
    mod = family_module(cfg.family)
    B = tokens.shape[0]
    h, cache = mod.forward(weights, tokens, jnp.zeros(B, jnp.int32), cache, cfg=cfg, read_cache=False)
    logits = _logits_at(mod, weights, h, lengths - 1, cfg)
    step = jnp.zeros(B, jnp.int32)
    toks, lp, state = sample_step(logits, state, step, stop_ids, min_tokens, num_logprobs)
    return toks, lp, cache, state


def decode_step(weights, tokens, positions, step, cache, state, stop_ids, min_tokens, *, cfg, num_logprobs):
    """One token for every row: tokens i32[B] at positions i32[B]; step = tokens so far."""
    mod = family_module(cfg.family)
    h, cache = mod.forward(weights, tokens[:, None], positions, cache, cfg=cfg)
    logits = mod.unembed(weights, h, cfg)[:, 0]
    toks, lp, state = sample_step(logits, state, step, stop_ids, min_tokens, num_logprobs)
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
        # the kernel mode is static: an executable traced with one mode is never reused under another
        static = ("cfg", "num_logprobs", "kernel_mode")
        self._prefill = jax.jit(kernels.keyed(prefill_step), static_argnames=static, donate_argnames=donate)
        self._decode = jax.jit(kernels.keyed(decode_step), static_argnames=static, donate_argnames=donate)
        self._prompt_lp = jax.jit(kernels.keyed(prompt_logprobs_step), static_argnames=("cfg", "num_top", "kernel_mode"))
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
        num_lp = logprob_bucket([r.params.logprobs for r in rows])
        want_lp = num_lp >= 0
        cache = kv.init_cache(cfg, B, S, self.kv_dtype, max_chunk=T)  # LOCAL layers: a ring of W + T - 1
        self.last_cache_bytes = cache.nbytes()
        now = time.perf_counter()
        for r in rows:
            r.scheduled_time = now
        toks, lp, cache, state = self._prefill(
            self.weights, jnp.asarray(tokens), jnp.asarray(lens), cache, state, stop_ids, min_tokens,
            cfg=cfg, num_logprobs=num_lp, kernel_mode=kernels.current_mode(),
        )
        live = set(range(n))
        for i in range(max_new):
            nxt = None
            if i + 1 < max_new:  # dispatch the next step before reading this one
                positions = jnp.asarray(lens + i)
                step = jnp.full((B,), i + 1, jnp.int32)
                nxt = self._decode(self.weights, toks, positions, step, cache, state, stop_ids,
                                   min_tokens, cfg=cfg, num_logprobs=num_lp,
                                   kernel_mode=kernels.current_mode())
            host_toks = np.asarray(toks)
            host_lp = jax.device_get(lp) if want_lp else None
            now = time.perf_counter()
            for b in list(live):
                if record_token(rows[b], int(host_toks[b]), host_lp, b, now, self.tokenizer):
                    live.discard(b)
                    yield self._with_prompt_logprobs(rows[b])
            if not live or nxt is None:
                break
            toks, lp, cache, state = nxt
        for b in live:  # cannot happen unless max_new was 0; keep every row finished
            rows[b].finished_time = time.perf_counter()
            yield self._with_prompt_logprobs(rows[b])

    def _with_prompt_logprobs(self, row: Row) -> Row:
        if row.params.prompt_logprobs is not None and row.prompt_logprobs is None:
            row.prompt_logprobs = self.prompt_logprobs(row.prompt_ids, row.params.prompt_logprobs)
        return row

    # ------------------------------------------------------------------ prompt logprobs
    def prompt_logprobs(self, ids: list[int], num_top: int) -> list[dict[int, Logprob] | None]:
        T = len_bucket(len(ids))
        toks = np.full((1, T), self.tokenizer.pad_id, np.int32)
        toks[0, : len(ids)] = ids
        chosen, ranks, top_ids, top_lp = jax.device_get(
            self._prompt_lp(self.weights, jnp.asarray(toks), cfg=self.cfg, num_top=num_top,
                            kernel_mode=kernels.current_mode())
        )
        out: list[dict[int, Logprob] | None] = [None]  # the first token has no prefix
        for t in range(1, len(ids)):
            out.append(position_logprobs(self.tokenizer, ids[t], float(chosen[t - 1]), int(ranks[t - 1]), top_ids[t - 1], top_lp[t - 1]))
        return out
