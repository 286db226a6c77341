"""The host scheduler of the paged engine: admission, prefill packing, page bookkeeping,
preemption, prefix and window reuse. It decides what each step computes; it never touches
the device.

Each iteration (``plan``) it admits waiting sequences (FCFS, or shortest prompt first) while
slots and pages allow, gives every decoding sequence a page for the position it writes, and
packs prompt chunks into the prefill row under the token budget ``prefill_chunk``: first the
oldest sequence still prefilling (it may continue an earlier chunk or a cached prefix, so it
is segment 0, the one that reads history from its pages), then fresh prompts from position
0, the last one cut to fit. Prefill never samples: it covers every prompt token but the
last, which is the input of the sequence's first decode step.

When a running sequence needs a page and none is free, the most recently admitted sequence
is preempted: its pages are released and it is recomputed later from its prompt plus what
it had generated, with the same seeds, so its tokens do not change.

Sliding-window layers (Gemma's LOCAL layers) keep only their window: they have a page pool
and allocator of their own, each sequence holds only the window pages its next query can
still see, and a row's window table covers just those pages. The window pool is sized so
that every slot's window (and one prefill chunk) always fits, so only the full-length pool
ever makes sequences wait or be preempted. Prefix caching names window pages with the same
hash chain as the full ones; a cached prefix of k pages is used only if the window pages
before position k*page_size are still cached too (otherwise a shorter prefix, or none), so
outputs never depend on what the cache held.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections import deque

from jaxinfer.engine.pages import ROOT_HASH, PageAllocator, prefix_hashes, root_hash
from jaxinfer.engine.rows import Row


class Scheduling(str, enum.Enum):
    FCFS = "fcfs"
    SHORTEST_PROMPT_FIRST = "spf"


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
    computed: int = 0  # tokens whose keys/values are in the pages (or in flight to them)
    registered: int = 0  # leading full pages named in the prefix cache
    window_pages: list[int] = dataclasses.field(default_factory=list)  # by logical page; 0: not held
    window_lo: int = 0  # first logical page still held in window_pages
    chain: bytes = ROOT_HASH  # hash chain after the registered pages
    inflight: int = 0  # tokens sampled on device that the host has not read yet (0 or 1)
    drafts: list[int] = dataclasses.field(default_factory=list)  # medusa: the heads' drafts for the next step
    branch_drafts: list[list[int]] = dataclasses.field(default_factory=list)  # eagle branches 1..W-1: theirs
    preemptions: int = 0
    aborted: bool = False
    lora_slot: int = -1  # the device slot of the row's LoRA adapter while it runs (-1: none)

    @property
    def root(self) -> bytes:
        """Its prefix hash chain's root: a row with an adapter names its pages apart."""
        lora = self.row.lora
        return ROOT_HASH if lora is None else root_hash(lora.prefix_salt)

    @property
    def tokens(self) -> list[int]:
        return self.row.prompt_ids + self.row.token_ids

    @property
    def hash_tokens(self) -> list[int]:
        """The tokens that name its pages in the prefix cache: its tokens, an image's soft
        tokens replaced by its image's hash (``multimodal.PromptImages.hash_tokens``)."""
        toks = self.tokens
        return toks if self.row.images is None else self.row.images.hash_tokens(toks)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.row.params.prompt_logprobs is not None


@dataclasses.dataclass
class Segment:
    """A prompt chunk in the prefill row: tokens [start, start + n) of seq."""

    seq: Seq
    start: int
    n: int


@dataclasses.dataclass
class StepPlan:
    decode: list[Seq]  # every decoding sequence (row = its slot)
    prefill: list[Segment]  # the prefill row's segments; only the first may have history
    inserted: list[Seq]  # sequences admitted this iteration (their slot state goes to the device)


class Scheduler:
    def __init__(self, *, max_num_seqs: int, page_size: int, num_pages: int, prefill_chunk: int,
                 prefix_caching: bool, scheduling: Scheduling, window: int | None, num_window_pages: int | None,
                 lora=None):
        """lora: the engine's ``lora.LoRAManager`` (a row with an adapter is admitted only
        once its adapter holds a device slot), or None."""
        self.max_num_seqs = max_num_seqs
        self.lora = lora
        self.prefill_chunk = prefill_chunk
        self.scheduling = scheduling
        self.window = window
        self.allocator = PageAllocator(num_pages, page_size, prefix_caching=prefix_caching)
        self.window_allocator = (PageAllocator(num_window_pages, page_size, prefix_caching=prefix_caching)
                                 if window else None)
        self.slots: list[Seq | None] = [None] * max_num_seqs
        self.waiting: deque[Seq] = deque()
        self.arrivals = 0
        self.stats = {"preemptions": 0, "prefill_tokens": 0, "cached_prompt_tokens": 0, "decode_steps": 0,
                      "peak_pages": 0, "peak_window_pages": 0}

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    # ------------------------------------------------------------------ queue
    def add(self, row: Row) -> Seq:
        seq = Seq(row, self.arrivals)
        self.arrivals += 1
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Seq) -> None:
        """Drop a sequence wherever it is; its pages go back to the allocators."""
        seq.aborted = True
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.slot >= 0:
            self.release(seq)

    def running(self) -> list[Seq]:
        return [s for s in self.slots if s is not None]

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    # ------------------------------------------------------------------ one iteration
    def plan(self, lookahead: dict | None = None) -> StepPlan:
        """The next step's rows. lookahead: seq -> the positions past its next one that the step
        writes (speculative decoding's drafts), which need pages too."""
        inserted = self._admit()
        # a sequence whose prefill ends in this step decodes from the next one: its window is
        # trimmed only once the prefill row that still reads it has been dispatched
        decoding = [s for s in self.slots if s is not None and s.state == SeqState.DECODE]
        prefill = self._pack_prefill()
        self._ensure_decode_pages(decoding, lookahead or {})
        inserted = [s for s in inserted if s.slot >= 0]  # preempted again right away: re-inserted later
        decode = sorted((s for s in decoding if s.slot >= 0 and s.state == SeqState.DECODE), key=lambda s: s.slot)
        prefill = [g for g in prefill if g.seq.slot >= 0]
        return StepPlan(decode, prefill, inserted)

    # ------------------------------------------------------------------ admission
    def _admit(self) -> list[Seq]:
        ps = self.page_size
        admitted = []
        # rows whose LoRA adapter has no free device slot wait, and the rows behind them may pass
        # (vLLM's rule): while every slot is held, nothing else could run in their place
        blocked: set[int] = set()
        while self.waiting:
            slot = next((i for i, s in enumerate(self.slots) if s is None), None)
            if slot is None:
                break
            ready = [s for s in self.waiting if id(s) not in blocked] if blocked else self.waiting
            if not ready:
                break
            if self.scheduling == Scheduling.SHORTEST_PROMPT_FIRST:
                seq = min(ready, key=lambda s: (len(s.tokens), s.arrival))
            else:
                seq = ready[0]
            if seq.row.lora is not None and not self.lora.can_acquire(seq.row.lora):
                blocked.add(id(seq))
                continue
            toks = seq.hash_tokens
            # prompt logprobs need every prompt position computed, so they skip the prefix cache
            cached, chain = ([], seq.root) if seq.wants_prompt_logprobs else self.allocator.lookup_prefix(toks, seq.root)
            window_cached: list[int] = []
            if self.window and cached:
                cached, chain, window_cached = self._window_prefix(toks, cached, seq.root)
            need = -(-len(toks) // ps) - len(cached)
            if need > self.allocator.num_free:
                self.allocator.release(cached)
                if self.window:
                    self.window_allocator.release(window_cached)
                break  # wait for pages to free up (FCFS: nobody jumps the queue)
            if seq.row.lora is not None:
                seq.lora_slot = self.lora.acquire(seq.row.lora)
            self.waiting.remove(seq)
            seq.pages = cached + self.allocator.allocate(need)
            seq.computed = len(cached) * ps
            seq.registered = len(cached)
            seq.chain = chain
            seq.window_pages = window_cached
            seq.window_lo = next((i for i, p in enumerate(window_cached) if p), len(window_cached))
            self.stats["cached_prompt_tokens"] += len(cached) * ps
            seq.slot = slot
            self.slots[slot] = seq
            seq.state = SeqState.PREFILL if seq.computed < len(toks) - 1 else SeqState.DECODE
            if seq.row.scheduled_time is None:
                seq.row.scheduled_time = time.perf_counter()
            admitted.append(seq)
        self.stats["peak_pages"] = max(self.stats["peak_pages"], self.allocator.num_used)
        return admitted

    def _window_prefix(self, toks, cached, root: bytes = ROOT_HASH):
        """Trim a cached prefix to the longest whose window pages are cached too: resuming
        at position k*ps needs the window's keys before it. Returns (pages, chain, window
        pages by logical index, 0 before the window), references taken on both."""
        ps, W = self.page_size, self.window
        hashes = prefix_hashes(toks, ps, len(cached), root)
        k, got, lo = len(cached), None, 0
        while k > 0:
            lo = max(0, k * ps - W + 1) // ps
            got = self.window_allocator.acquire_cached(hashes[lo:k])
            if got is not None:
                break
            k -= 1
        self.allocator.release(cached[k:])
        if k == 0:
            return [], root, []
        return cached[:k], hashes[k - 1], [0] * lo + got

    # ------------------------------------------------------------------ prefill row
    def _pack_prefill(self) -> list[Segment]:
        """Prompt chunks for this step's prefill row, at most prefill_chunk tokens in all."""
        budget = self.prefill_chunk
        segments: list[Segment] = []
        for seq in sorted((s for s in self.slots if s is not None and s.state == SeqState.PREFILL),
                          key=lambda s: s.arrival):
            if budget == 0:
                break
            if segments and seq.computed > 0:
                continue  # only segment 0 may read history from its pages; next step
            n = min(len(seq.tokens) - 1 - seq.computed, budget)
            if seq.row.images is not None:  # an image's tokens lie whole in one chunk
                n = seq.row.images.cut(seq.computed, n)
                if n == 0:
                    break
            segments.append(Segment(seq, seq.computed, n))
            self._window_grow(seq, seq.computed + n - 1)
            seq.computed += n
            budget -= n
            self.stats["prefill_tokens"] += n
            if seq.computed >= len(seq.tokens) - 1:
                seq.state = SeqState.DECODE
        return segments

    def prefill_done(self, segments: list[Segment]) -> None:
        """After dispatching the prefill row: its pages are full of real keys; name them."""
        for g in segments:
            if g.seq.slot >= 0:
                self.register_full_pages(g.seq)

    # ------------------------------------------------------------------ decode rows
    def _ensure_decode_pages(self, decoding: list[Seq], lookahead: dict) -> None:
        """Every decoding sequence needs a page for the position it writes this step."""
        ps = self.page_size
        for seq in sorted(decoding, key=lambda s: s.arrival):
            if seq.slot < 0 or seq.state != SeqState.DECODE:
                continue  # preempted below while making room for an earlier sequence
            pos = len(seq.tokens) - 1 + seq.inflight + lookahead.get(seq, 0)
            while pos // ps >= len(seq.pages):
                if self.allocator.num_free == 0:
                    victim = max(self.running(), key=lambda s: s.arrival)
                    self.preempt(victim)
                    if victim is seq:
                        break
                    continue
                seq.pages += self.allocator.allocate(1)
            if seq.slot >= 0:
                self._window_grow(seq, pos)
        self.stats["peak_pages"] = max(self.stats["peak_pages"], self.allocator.num_used)

    def pages_short(self, seq: Seq, last_pos: int) -> int:
        """Full-length pages seq lacks to write every position up to last_pos."""
        return max(0, last_pos // self.page_size + 1 - len(seq.pages))

    def reserve(self, seq: Seq, last_pos: int) -> None:
        """Pages, full-length and window, for every position up to last_pos: allocated before
        a chain of decode steps is dispatched (the caller checked that ``pages_short`` of its
        rows are free). What a row does not use stays its own until it is released."""
        seq.pages += self.allocator.allocate(self.pages_short(seq, last_pos))
        self._window_grow(seq, last_pos)
        self.stats["peak_pages"] = max(self.stats["peak_pages"], self.allocator.num_used)

    # ------------------------------------------------------------------ pages
    def _window_grow(self, seq: Seq, last_pos: int) -> None:
        """Window pages for every logical page up to the one holding ``last_pos``."""
        if not self.window:
            return
        hi = last_pos // self.page_size
        if len(seq.window_pages) < seq.window_lo:
            seq.window_pages += [0] * (seq.window_lo - len(seq.window_pages))
        if hi >= len(seq.window_pages):
            seq.window_pages += self.window_allocator.allocate(hi + 1 - len(seq.window_pages))
        self.stats["peak_window_pages"] = max(self.stats["peak_window_pages"], self.window_allocator.num_used)

    def _window_trim(self, seq: Seq, upto: int) -> None:
        """Give back window pages no later query can see: every position in them is W or
        more behind ``upto``, the earliest position a later query of seq can have."""
        if not self.window:
            return
        lo = max(0, upto - self.window + 1) // self.page_size
        for i in range(seq.window_lo, min(lo, len(seq.window_pages))):
            self.window_allocator.release([seq.window_pages[i]])
            seq.window_pages[i] = 0
        seq.window_lo = max(seq.window_lo, lo)

    def window_row(self, seq: Seq) -> tuple[int, list[int]]:
        row = seq.window_pages[seq.window_lo :]
        assert all(row), (seq.window_lo, row)
        return seq.window_lo, row

    def register_full_pages(self, seq: Seq, computed: int | None = None) -> None:
        """Name the full pages below ``computed`` (default seq.computed) in the prefix cache,
        then trim the window to what a later query can still see."""
        ps = self.page_size
        computed = seq.computed if computed is None else computed
        toks = seq.hash_tokens
        while (seq.registered + 1) * ps <= computed and (seq.registered + 1) * ps <= len(toks):
            i = seq.registered
            if self.window and i < len(seq.window_pages) and seq.window_pages[i]:
                self.window_allocator.register_full_page(seq.window_pages[i], seq.chain, toks[i * ps : (i + 1) * ps])
            seq.chain = self.allocator.register_full_page(seq.pages[i], seq.chain, toks[i * ps : (i + 1) * ps])
            seq.registered += 1
        self._window_trim(seq, computed)

    def release(self, seq: Seq) -> None:
        self.allocator.release(seq.pages)
        seq.pages = []
        if self.window:
            self.window_allocator.release(seq.window_pages)
        seq.window_pages, seq.window_lo = [], 0
        if seq.slot >= 0:
            self.slots[seq.slot] = None
        seq.slot = -1
        if seq.lora_slot >= 0:
            self.lora.release(seq.lora_slot)
            seq.lora_slot = -1

    def preempt(self, victim: Seq) -> None:
        """Give up a running sequence's pages; it is recomputed later (same tokens)."""
        self.release(victim)
        victim.state = SeqState.WAITING
        victim.computed = victim.registered = victim.inflight = 0
        victim.chain = victim.root
        victim.preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(victim)


def window_pool_pages(window: int, page_size: int, max_num_seqs: int, prefill_chunk: int, pages_per_seq: int) -> int:
    """Pages of the window pool (scratch page included) that every slot's window always fits.

    Between steps a sequence holds the pages from the one of position computed - W + 1 to
    the one of its next query, at most W // ps + 2 (a decode query may run one position
    ahead of computed); the prefill row's sequences hold up to a chunk more in all, plus a
    page of rounding each (a chunk of up to prefill_chunk tokens spans that many pages plus
    one per segment). No sequence holds more pages than its whole length."""
    per_seq = min(window // page_size + 2, pages_per_seq)
    return 1 + min(max_num_seqs * pages_per_seq,
                   max_num_seqs * per_seq + prefill_chunk // page_size + max_num_seqs + 1)
