"""Continuous batching over a paged KV cache, with chunked prefill and prefix caching.

The engine is shaped like JetStream's:

* ``prefill``: computes the keys/values of one chunk of a prompt into its pages (bucketed
  chunk length). Prefill never samples: it covers every token but the last.
* ``insert``: places a sequence into a decode slot (its sampling row on device).
* ``generate``: one step for every slot; its input is each sequence's last token, so the
  first generated token comes from the first decode step after the prefill. The page
  pools and the sampling state are donated to every step.

The scheduler runs on the host. Each iteration it admits waiting sequences (FCFS, or
shortest prompt first) while slots and pages allow, spends at most ``prefill_chunk`` prompt
tokens on prefill, then runs one decode step for every running sequence, so a long prompt
never stalls running decodes for more than one chunk. When a running sequence needs a page
and none is free, the most recently admitted sequence is preempted: its pages are released
and it is recomputed later from its prompt plus what it had generated, with the same seeds,
so its tokens do not change. The next decode step is dispatched before the host reads the
current one's tokens, so detokenizing and stop checks overlap device work.

Sliding-window layers (``EngineConfig.windowed_kv``, Gemma's LOCAL layers) keep only their
window: they have a page pool and allocator of their own, each sequence holds only the
window pages its next query can still see (a page goes back to the allocator once every
position in it is W or more behind the next position to compute), and a call's window
table covers just those pages. The window pool is sized so that every slot's window (and
one prefill chunk) always fits, so only the full-length pool ever makes sequences wait or
be preempted. Prefix caching names window pages with the same hash chain as the full ones;
a cached prefix of k pages is used only if the window pages before position k*page_size
are still cached too (otherwise a shorter prefix, or none, is reused), so outputs never
depend on what the cache held.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import time
from collections import deque
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import cache as kv
from jaxinfer import sampling as smp
from jaxinfer.config import AttentionKind, ModelConfig
from jaxinfer.engine.pages import ROOT_HASH, SCRATCH_PAGE, PageAllocator, prefix_hashes
from jaxinfer.engine.static import Row, StaticEngine, len_bucket, record_token
from jaxinfer.errors import InvalidRequest
from jaxinfer.models.registry import family_module

STOP_ID_WIDTH = 16  # per-row stop ids masked before min_tokens (EOS ids + stop_token_ids)
MIN_PREFILL_BUCKET = 32  # prompt chunks of up to 32 tokens share one shape
BATCH_BUCKETS = (1, 4, 16, 64, 256, 512)  # powers of 4: batch 1 runs alone, few executables


class Scheduling(str, enum.Enum):
    FCFS = "fcfs"
    SHORTEST_PROMPT_FIRST = "spf"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 64  # decode slots
    page_size: int = 16
    num_pages: int | None = None  # None: from kv_cache_bytes
    kv_cache_bytes: int = 2 << 30  # page pool budget when num_pages is None
    prefill_chunk: int = 512  # prompt tokens per scheduler iteration (per-step token budget)
    prefix_caching: bool = True
    scheduling: Scheduling = Scheduling.FCFS
    windowed_kv: bool = True  # LOCAL layers keep only their window (False: every position)
    kv_cache_dtype: str = "auto"  # page pools' dtype: auto (the model's), a float type, or int8

    def __post_init__(self):
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise InvalidRequest(f"page_size must be a power of two, got {self.page_size}")
        if self.prefill_chunk < 16 or self.prefill_chunk & (self.prefill_chunk - 1):
            raise InvalidRequest(f"prefill_chunk must be a power of two >= 16, got {self.prefill_chunk}")
        if self.max_num_seqs < 1:
            raise InvalidRequest(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.kv_cache_dtype not in kv.KV_CACHE_DTYPES:
            raise InvalidRequest(f"kv_cache_dtype must be one of {', '.join(kv.KV_CACHE_DTYPES)}, "
                                 f"got {self.kv_cache_dtype!r}")


class SeqState(str, enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclasses.dataclass(eq=False)
class Seq:
    row: Row
    arrival: int  # admission order key (FCFS)
    state: SeqState = SeqState.WAITING
    slot: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens whose keys/values are in the pages
    registered: int = 0  # leading full pages named in the prefix cache
    window_pages: list[int] = dataclasses.field(default_factory=list)  # by logical page; 0: not held
    window_lo: int = 0  # first logical page still held in window_pages
    chain: bytes = ROOT_HASH  # hash chain after the registered pages
    inflight: int = 0  # tokens sampled on device that the host has not read yet (0 or 1)
    preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.row.prompt_ids + self.row.token_ids


# ----------------------------------------------------------------------------- device steps
def prefill_step(weights, tokens, start, k_pages, v_pages, page_table, window_table, window_base, *, cfg, windowed):
    """Keys/values of one chunk (tokens i32[1, T] at positions start + t) into its pages."""
    mod = family_module(cfg.family)
    cache = kv.PagedKVCache(k_pages, v_pages, page_table, window_table, window_base, windowed)
    _, cache = mod.forward(weights, tokens, start, cache, cfg=cfg)
    return cache.k, cache.v


def decode_step(weights, tokens, use_prev, last_tokens, positions, page_table, window_table, window_base,
                k_pages, v_pages, state, step, stop_ids, min_tokens, *, cfg, windowed, num_logprobs):
    """One token for the first B slots at positions i32[B]. A row's input is its host token
    (tokens i32[B]) or, where use_prev, the token the previous step sampled for it (still
    on device: the host has not read it yet). last_tokens i32[max_num_seqs] keeps them."""
    mod = family_module(cfg.family)
    B = tokens.shape[0]
    tokens = jnp.where(use_prev, last_tokens[:B], tokens)
    cache = kv.PagedKVCache(k_pages, v_pages, page_table, window_table, window_base, windowed)
    h, cache = mod.forward(weights, tokens[:, None], positions, cache, cfg=cfg)
    logits = mod.unembed(weights, h, cfg)[:, 0]
    sub = jax.tree.map(lambda a: a[:B], state)
    masked = smp.mask_tokens_before_min(logits, stop_ids, step, min_tokens)
    new = smp.sample(masked, sub, step)
    sub = smp.update_counts(sub, new)
    state = jax.tree.map(lambda a, s: a.at[:B].set(s), state, sub)
    lp = None
    if num_logprobs >= 0:
        chosen, top_ids, top_lp = smp.logprobs_of(logits, new, num_logprobs)
        picked = jnp.take_along_axis(logits, new[:, None], axis=1)
        lp = (chosen, 1 + jnp.sum(logits > picked, axis=-1), top_ids, top_lp)
    return new, lp, cache.k, cache.v, state, last_tokens.at[:B].set(new)


def insert_step(state, slot, row):
    """Place one sequence's sampling row (batch 1) into decode slot ``slot``."""
    return jax.tree.map(lambda a, r: a.at[slot].set(r[0]), state, row)


# ----------------------------------------------------------------------------- engine
class PagedEngine:
    """Continuous-batching engine over one model; ``run`` yields rows as they finish."""

    def __init__(self, cfg: ModelConfig, weights, tokenizer, *, max_model_len: int,
                 config: EngineConfig = EngineConfig(), seed: int = 0):
        self.cfg, self.weights, self.tokenizer = cfg, weights, tokenizer
        self.max_model_len = max_model_len
        self.config = config
        self.seed = seed
        self.max_num_seqs = config.max_num_seqs
        ps = config.page_size
        self.pages_per_seq = -(-max_model_len // ps)
        self.kv_dtype = kv_dtype = kv.kv_storage_dtype(config.kv_cache_dtype, cfg)
        W = cfg.sliding_window if config.windowed_kv else None
        self.window = W if W and any(cfg.layer_window(i) for i in range(cfg.n_layers)) else None
        window_bytes, self.window_allocator, num_window_pages = 0, None, None
        if self.window:
            num_window_pages = window_pool_pages(self.window, ps, config.max_num_seqs, config.prefill_chunk,
                                                 self.pages_per_seq)
            self.window_allocator = PageAllocator(num_window_pages, ps, prefix_caching=config.prefix_caching)
            window_bytes = num_window_pages * ps * cfg.kv_bytes_per_token(kv_dtype, kind=AttentionKind.LOCAL)
        full_bytes_per_token = cfg.kv_bytes_per_token(kv_dtype, kind=AttentionKind.GLOBAL if self.window else None)
        # enough for every slot at full length (plus room for cached prefixes), within budget
        num_pages = config.num_pages or max(2, min(
            max(config.kv_cache_bytes - window_bytes, 0) // (max(full_bytes_per_token, 1) * ps),
            2 * config.max_num_seqs * self.pages_per_seq + 1))
        self.allocator = PageAllocator(num_pages, ps, prefix_caching=config.prefix_caching)
        cache = kv.init_paged_cache(cfg, num_pages, ps, kv_dtype, num_window_pages=num_window_pages)
        self.k_pages, self.v_pages, self.windowed = cache.k, cache.v, cache.windowed
        self.state = smp.make_sampling_state([], [], cfg.vocab_size, default_seed=seed, batch_size=config.max_num_seqs)
        # one partial per engine, so each engine's jit caches (and compile counts) are its own
        self._prefill = jax.jit(functools.partial(prefill_step, windowed=self.windowed), static_argnames=("cfg",),
                                donate_argnames=("k_pages", "v_pages"))
        self._decode = jax.jit(functools.partial(decode_step, windowed=self.windowed),
                               static_argnames=("cfg", "num_logprobs"),
                               donate_argnames=("k_pages", "v_pages", "state", "last_tokens"))
        self._insert = jax.jit(functools.partial(insert_step), donate_argnames=("state",))
        self._dense = StaticEngine(cfg, weights, tokenizer, max_model_len=max_model_len, seed=seed,
                                   kv_cache_dtype=kv_dtype)
        B = config.max_num_seqs
        self._last_tokens = jnp.zeros(B, jnp.int32)
        self._stop_ids = np.full((B, STOP_ID_WIDTH), -1, np.int32)
        self._min_tokens = np.zeros(B, np.int32)
        self._slots: list[Seq | None] = [None] * B
        self._waiting: deque[Seq] = deque()
        self._arrivals = 0
        self.stats = {"preemptions": 0, "prefill_tokens": 0, "cached_prompt_tokens": 0, "decode_steps": 0,
                      "peak_pages": 0, "peak_window_pages": 0}

    # ------------------------------------------------------------------ reports
    @property
    def last_cache_bytes(self) -> int:
        return sum(a.nbytes for a in self.k_pages + self.v_pages)

    def num_compilations(self) -> int:
        """Executables compiled so far by the engine's jitted steps."""
        return sum(f._cache_size() for f in (self._prefill, self._decode, self._insert))

    def warmup(self, max_prompt_len: int | None = None, max_len: int | None = None) -> int:
        """Compile every bucket a workload up to these lengths can hit; returns the number
        of executables compiled. Runs the steps on scratch pages (page 0 only)."""
        max_len = min(max_len or self.max_model_len, self.max_model_len)
        max_prompt = min(max_prompt_len or max_len, max_len)
        ps, before = self.allocator.page_size, self.num_compilations()
        chunk = self.config.prefill_chunk
        if self.config.prefix_caching:
            # a cached prefix may end at any page: every chunk bucket with every table width
            # from its own up to the longest prompt's (powers of two: a handful)
            top = self._prefill_shape(0, max_prompt)[1]
            shapes = {(T, w) for n in range(1, min(chunk, max_prompt) + 1)
                      for T, w0 in [self._prefill_shape(0, n)] for w in self._prefill_widths(w0, max(w0, top))}
        else:  # every prompt length, chunk by chunk
            shapes = {self._prefill_shape(computed, min(n - 1 - computed, chunk))
                      for n in range(2, max_prompt + 1) for computed in range(0, n - 1, chunk)}
        for T, width in sorted(shapes):
            self.k_pages, self.v_pages = self._prefill(
                self.weights, jnp.zeros((1, T), jnp.int32), jnp.asarray([0], jnp.int32),
                self.k_pages, self.v_pages, jnp.zeros((1, width), jnp.int32),
                jnp.zeros((1, self._window_width(width, T)), jnp.int32), jnp.zeros(1, jnp.int32), cfg=self.cfg)
        widths = sorted({len_bucket_pages(n, self.pages_per_seq) for n in range(1, -(-max_len // ps) + 1)})
        batches = sorted({_bucket(n, BATCH_BUCKETS, self.max_num_seqs) for n in range(1, self.max_num_seqs + 1)})
        for B in batches:
            for width in widths:
                out = self._decode(
                    self.weights, jnp.zeros(B, jnp.int32), jnp.zeros(B, bool), self._last_tokens,
                    jnp.zeros(B, jnp.int32), jnp.zeros((B, width), jnp.int32),
                    jnp.zeros((B, self._window_width(width, 1)), jnp.int32), jnp.zeros(B, jnp.int32),
                    self.k_pages, self.v_pages,
                    self.state, jnp.zeros(B, jnp.int32), jnp.asarray(self._stop_ids[:B]),
                    jnp.asarray(self._min_tokens[:B]), cfg=self.cfg, num_logprobs=-1)
                _, _, self.k_pages, self.v_pages, self.state, self._last_tokens = out
        dummy = smp.make_sampling_state([], [], self.cfg.vocab_size, default_seed=0, batch_size=1)
        self.state = self._insert(self.state, jnp.int32(0), dummy)  # slot 0 is idle during warm-up
        jax.block_until_ready(self.k_pages)
        return self.num_compilations() - before

    def prompt_logprobs(self, ids, num_top):
        return self._dense.prompt_logprobs(ids, num_top)

    # ------------------------------------------------------------------ admission
    def validate(self, row: Row) -> None:
        """Raise InvalidRequest if the row can never run on this engine."""
        n = len(row.prompt_ids) + row.max_new
        need = -(-n // self.allocator.page_size)
        if need > self.allocator.num_pages - 1:
            raise InvalidRequest(
                f"a sequence of {n} tokens needs {need} KV pages but the pool has only "
                f"{self.allocator.num_pages - 1}; raise num_pages/kv_cache_bytes or lower max_tokens"
            )
        ids = tuple(row.params.stop_token_ids) + (() if row.params.ignore_eos else tuple(self.tokenizer.eos_ids))
        if row.params.min_tokens and len(ids) > STOP_ID_WIDTH:
            raise InvalidRequest(f"min_tokens supports at most {STOP_ID_WIDTH - len(self.tokenizer.eos_ids)} stop_token_ids")

    def _admit(self) -> None:
        ps = self.allocator.page_size
        while self._waiting:
            slot = next((i for i, s in enumerate(self._slots) if s is None), None)
            if slot is None:
                return
            if self.config.scheduling == Scheduling.SHORTEST_PROMPT_FIRST:
                seq = min(self._waiting, key=lambda s: (len(s.tokens), s.arrival))
            else:
                seq = self._waiting[0]
            toks = seq.tokens
            cached, chain = self.allocator.lookup_prefix(toks)
            window_cached: list[int] = []
            if self.window and cached:
                cached, chain, window_cached = self._window_prefix(toks, cached)
            need = -(-len(toks) // ps) - len(cached)
            if need > self.allocator.num_free:
                self.allocator.release(cached)
                if self.window:
                    self.window_allocator.release(window_cached)
                return  # wait for pages to free up (FCFS: nobody jumps the queue)
            self._waiting.remove(seq)
            seq.pages = cached + self.allocator.allocate(need)
            seq.computed = len(cached) * ps
            seq.registered = len(cached)
            seq.chain = chain
            seq.window_pages = window_cached
            seq.window_lo = next((i for i, p in enumerate(window_cached) if p), len(window_cached))
            self.stats["cached_prompt_tokens"] += len(cached) * ps
            seq.slot = slot
            self._slots[slot] = seq
            seq.state = SeqState.PREFILL if seq.computed < len(toks) - 1 else SeqState.DECODE
            if seq.row.scheduled_time is None:
                seq.row.scheduled_time = time.perf_counter()
            self._insert_row(seq)

    def _window_prefix(self, toks, cached):
        """Trim a cached prefix to the longest whose window pages are cached too: resuming
        at position k*ps needs the window's keys before it. Returns (pages, chain, window
        pages by logical index, 0 before the window), references taken on both."""
        ps, W = self.allocator.page_size, self.window
        hashes = prefix_hashes(toks, ps, len(cached))
        k, got = len(cached), None
        while k > 0:
            lo = max(0, k * ps - W + 1) // ps
            got = self.window_allocator.acquire_cached(hashes[lo:k])
            if got is not None:
                break
            k -= 1
        self.allocator.release(cached[k:])
        if k == 0:
            return [], ROOT_HASH, []
        return cached[:k], hashes[k - 1], [0] * lo + got

    def _window_grow(self, seq: Seq, last_pos: int) -> None:
        """Window pages for every logical page up to the one holding ``last_pos``."""
        if not self.window:
            return
        ps = self.allocator.page_size
        hi = last_pos // ps
        if len(seq.window_pages) < seq.window_lo:
            seq.window_pages += [0] * (seq.window_lo - len(seq.window_pages))
        if hi >= len(seq.window_pages):
            seq.window_pages += self.window_allocator.allocate(hi + 1 - len(seq.window_pages))
        self.stats["peak_window_pages"] = max(self.stats["peak_window_pages"], self.window_allocator.num_used)

    def _window_trim(self, seq: Seq) -> None:
        """Give back window pages no later query can see: every position in them is W or
        more behind seq.computed, the earliest position still to be computed."""
        if not self.window:
            return
        lo = max(0, seq.computed - self.window + 1) // self.allocator.page_size
        for i in range(seq.window_lo, min(lo, len(seq.window_pages))):
            self.window_allocator.release([seq.window_pages[i]])
            seq.window_pages[i] = 0
        seq.window_lo = max(seq.window_lo, lo)

    def _window_width(self, width: int, T: int) -> int:
        """Window-table columns of a call whose full table has ``width`` columns and which
        brings T queries per row: a row's chunk at p..p+T-1 needs positions p-W+1 .. p+T-1,
        at most (W + T - 2) // ps + 2 pages (one more past p+T-1 for a decode row whose
        previous step the host has not read: its window starts at the lagging seq.computed)."""
        if not self.window:
            return 1
        return min(width, (self.window + T - 1) // self.allocator.page_size + 2)

    def _window_row(self, seq: Seq, width: int) -> tuple[int, list[int]]:
        row = seq.window_pages[seq.window_lo :]
        assert len(row) <= width and all(row), (seq.window_lo, row, width)
        return seq.window_lo, row

    def _insert_row(self, seq: Seq) -> None:
        row, p = seq.row, seq.row.params
        new = smp.make_sampling_state([p], [row.prompt_ids], self.cfg.vocab_size, default_seed=self.seed,
                                      request_indices=[row.request_index])
        if row.token_ids:  # recomputing after preemption: penalties must see what was generated
            counts = np.bincount(row.token_ids, minlength=self.cfg.vocab_size).astype(np.int32)[None]
            new = dataclasses.replace(new, output_counts=jnp.asarray(counts))
        self.state = self._insert(self.state, jnp.int32(seq.slot), new)
        stop, mins = smp.min_tokens_inputs([p], self.tokenizer.eos_ids)
        self._stop_ids[seq.slot] = -1
        self._stop_ids[seq.slot, : min(stop.shape[1], STOP_ID_WIDTH)] = stop[0, :STOP_ID_WIDTH]
        self._min_tokens[seq.slot] = mins[0]

    def _release(self, seq: Seq) -> None:
        self.allocator.release(seq.pages)
        seq.pages = []
        if self.window:
            self.window_allocator.release(seq.window_pages)
        seq.window_pages, seq.window_lo = [], 0
        if seq.slot >= 0:
            self._slots[seq.slot] = None
        seq.slot = -1

    def _preempt(self, victim: Seq) -> None:
        """Give up a running sequence's pages; it is recomputed later (same tokens)."""
        self._release(victim)
        victim.state = SeqState.WAITING
        victim.computed = victim.registered = victim.inflight = 0
        victim.chain = ROOT_HASH
        victim.preemptions += 1
        self.stats["preemptions"] += 1
        self._waiting.appendleft(victim)

    def _register_full_pages(self, seq: Seq) -> None:
        ps = self.allocator.page_size
        toks = seq.tokens
        while (seq.registered + 1) * ps <= seq.computed:
            i = seq.registered
            if self.window and i < len(seq.window_pages) and seq.window_pages[i]:
                self.window_allocator.register_full_page(seq.window_pages[i], seq.chain, toks[i * ps : (i + 1) * ps])
            seq.chain = self.allocator.register_full_page(seq.pages[i], seq.chain, toks[i * ps : (i + 1) * ps])
            seq.registered += 1
        self._window_trim(seq)

    # ------------------------------------------------------------------ prefill
    def _prefill_shape(self, computed: int, n: int) -> tuple[int, int]:
        """(chunk bucket T, table width) of a chunk of n tokens after `computed` ones: T a
        power of two from 32, the width a power of two from 8 pages covering computed + n. With
        power-of-two page sizes a first chunk's width follows from T alone, and one sequence's
        prefill gathers so few pages that finer widths would only add executables."""
        T = min(max(MIN_PREFILL_BUCKET, len_bucket(n)), self.config.prefill_chunk)
        pages = -(-(computed + n) // self.allocator.page_size)
        return T, min(max(8, 1 << (pages - 1).bit_length()), max(self.pages_per_seq, pages))

    def _prefill_widths(self, lo: int, hi: int) -> list[int]:
        """The prefill table widths from lo to hi (both from _prefill_shape)."""
        out, w = [], lo
        while w < hi:
            out.append(w)
            w = min(w * 2, max(self.pages_per_seq, hi))
        return out + [hi]

    def _run_prefill(self) -> None:
        budget = self.config.prefill_chunk
        for seq in sorted((s for s in self._slots if s is not None and s.state == SeqState.PREFILL),
                          key=lambda s: s.arrival):
            toks = seq.tokens
            target = len(toks) - 1  # the last token is the first decode step's input
            n = min(target - seq.computed, self.config.prefill_chunk)
            if n > budget:
                # a chunk is never cut to fit what is left of the budget: cut chunks made
                # shapes warm-up cannot foresee (4 compiles in the middle of a bench run)
                continue
            T, width = self._prefill_shape(seq.computed, n)
            chunk = np.full((1, T), self.tokenizer.pad_id, np.int32)
            chunk[0, :n] = toks[seq.computed : seq.computed + n]
            table = np.zeros((1, width), np.int32)
            m = min(len(seq.pages), width)
            table[0, :m] = seq.pages[:m]
            wtable = np.zeros((1, self._window_width(width, T)), np.int32)
            wbase = np.zeros(1, np.int32)
            if self.window:
                self._window_grow(seq, seq.computed + n - 1)
                wbase[0], row = self._window_row(seq, wtable.shape[1])
                wtable[0, : len(row)] = row
            self.k_pages, self.v_pages = self._prefill(
                self.weights, jnp.asarray(chunk), jnp.asarray([seq.computed], jnp.int32),
                self.k_pages, self.v_pages, jnp.asarray(table), jnp.asarray(wtable), jnp.asarray(wbase),
                cfg=self.cfg)
            seq.computed += n
            budget -= n
            self.stats["prefill_tokens"] += n
            self._register_full_pages(seq)
            if seq.computed >= target:
                seq.state = SeqState.DECODE

    # ------------------------------------------------------------------ decode
    def _ensure_decode_pages(self) -> None:
        """Every decoding sequence needs a page for the position it writes this step."""
        ps = self.allocator.page_size
        for seq in sorted((s for s in self._slots if s is not None and s.state == SeqState.DECODE),
                          key=lambda s: s.arrival):
            if seq.slot < 0 or seq.state != SeqState.DECODE:
                continue  # preempted below while making room for an earlier sequence
            pos = len(seq.tokens) - 1 + seq.inflight
            while pos // ps >= len(seq.pages):
                if self.allocator.num_free == 0:
                    victims = [s for s in self._slots if s is not None]
                    victim = max(victims, key=lambda s: s.arrival)
                    self._preempt(victim)
                    if victim is seq:
                        break
                    continue
                seq.pages += self.allocator.allocate(1)
            if seq.slot >= 0:
                self._window_grow(seq, pos)
        self.stats["peak_pages"] = max(self.stats["peak_pages"], self.allocator.num_used)

    def _dispatch_decode(self):
        active = [s for s in self._slots if s is not None and s.state == SeqState.DECODE]
        if not active:
            return None
        B = _bucket(max(s.slot for s in active) + 1, BATCH_BUCKETS, self.max_num_seqs)
        width = len_bucket_pages(max(len(s.pages) for s in active), self.pages_per_seq)
        tokens = np.zeros(B, np.int32)
        use_prev = np.zeros(B, np.bool_)
        positions = np.zeros(B, np.int32)
        steps = np.zeros(B, np.int32)
        table = np.full((B, width), SCRATCH_PAGE, np.int32)
        wtable = np.full((B, self._window_width(width, 1)), SCRATCH_PAGE, np.int32)
        wbase = np.zeros(B, np.int32)
        for s in active:
            toks = s.tokens
            tokens[s.slot] = toks[-1]
            use_prev[s.slot] = s.inflight > 0
            positions[s.slot] = len(toks) - 1 + s.inflight
            steps[s.slot] = len(s.row.token_ids) + s.inflight
            table[s.slot, : len(s.pages)] = s.pages
            if self.window:
                wbase[s.slot], row = self._window_row(s, wtable.shape[1])
                wtable[s.slot, : len(row)] = row
            s.inflight += 1
        want_lp = [s.row.params.logprobs for s in active if s.row.params.logprobs is not None]
        num_lp = -1 if not want_lp else 0 if max(want_lp) == 0 else 5 if max(want_lp) <= 5 else 20
        new, lp, self.k_pages, self.v_pages, self.state, self._last_tokens = self._decode(
            self.weights, jnp.asarray(tokens), jnp.asarray(use_prev), self._last_tokens,
            jnp.asarray(positions), jnp.asarray(table), jnp.asarray(wtable), jnp.asarray(wbase),
            self.k_pages, self.v_pages, self.state, jnp.asarray(steps),
            jnp.asarray(self._stop_ids[:B]), jnp.asarray(self._min_tokens[:B]),
            cfg=self.cfg, num_logprobs=num_lp)
        self.stats["decode_steps"] += 1
        return active, new, lp

    # ------------------------------------------------------------------ main loop
    def run(self, rows) -> Iterator[Row]:
        """Run rows (an iterable, consumed as slots free up); yield each row as it finishes."""
        incoming = iter(rows)
        exhausted = False
        inflight = None
        while True:
            # keep the queue topped up without reading the whole input
            while not exhausted and len(self._waiting) < 2 * self.max_num_seqs:
                row = next(incoming, None)
                if row is None:
                    exhausted = True
                    break
                self.validate(row)
                self._waiting.append(Seq(row, self._arrivals))
                self._arrivals += 1
            self._admit()
            self._run_prefill()
            self._ensure_decode_pages()
            # dispatch this step before reading the last one: the host's detokenizing and stop
            # checks run while the device computes (a row that just finished costs one step)
            out = self._dispatch_decode()
            if inflight is not None:
                yield from self._consume(*inflight)
            inflight = out
            if out is None and exhausted and not self._waiting and all(s is None for s in self._slots):
                return

    def _consume(self, active, new, lp) -> Iterator[Row]:
        toks = np.asarray(new)
        host_lp = jax.device_get(lp) if lp is not None else None
        now = time.perf_counter()
        for seq in active:
            if seq.slot < 0 or seq.row.checker.finished:
                continue  # preempted (recomputed later) or finished after this step was sent
            seq.inflight -= 1
            r = seq.row
            b = seq.slot
            tok = int(toks[b])
            seq.computed = len(seq.tokens)  # the input token's keys/values are now in place
            self._register_full_pages(seq)
            if record_token(r, tok, host_lp, b, now, self.tokenizer):
                self._release(seq)
                yield r


def window_pool_pages(window: int, page_size: int, max_num_seqs: int, prefill_chunk: int, pages_per_seq: int) -> int:
    """Pages of the window pool (scratch page included) that every slot's window always fits.

    Between steps a sequence holds the pages from the one of position computed - W + 1 to
    the one of its next query, at most W // ps + 2 (a decode query may run one position
    ahead of computed); the one sequence prefilling at a time holds up to a chunk more. No
    sequence holds more pages than its whole length."""
    per_seq = min(window // page_size + 2, pages_per_seq)
    return 1 + min(max_num_seqs * pages_per_seq, max_num_seqs * per_seq + prefill_chunk // page_size + 1)


def len_bucket_pages(n: int, cap: int) -> int:
    """Page-table width: 8, 16, 24, 32, then steps of about 1.5x (48, 64, 96, 128, 192, ...),
    capped at the per-sequence maximum. A decode step gathers (batch x width) pages per layer,
    the largest cost of a batch-64 step on XLA CPU, so the padding above the longest row
    matters: powers of two left 37% of a 20-page batch masked, 24 leaves 17%. From 8 rather
    than 4: one executable fewer per batch bucket for a few masked positions of short rows."""
    n = max(n, 1)
    w = 8
    while w < n:
        w = w + 8 if w < 32 else (w * 3 // 2 if (w & (w - 1)) == 0 else w * 4 // 3)
    return min(w, max(cap, n))


def _bucket(n: int, buckets, cap: int) -> int:
    for b in buckets:
        if b >= n:
            return min(b, cap)
    return cap
