"""From a scheduler plan to the arrays of one packed step (``models.packed.PackedBatch``),
every shape bucketed: R decode rows (batch buckets over the highest busy slot), q queries per
row, Tp prefill-row tokens (prefill buckets), and the page-table widths (width buckets over the
longest row, the prefill row's history included)."""

from __future__ import annotations

import numpy as np

from jaxinfer.engine import buckets
from jaxinfer.engine.pages import SCRATCH_PAGE
from jaxinfer.engine.scheduler import Scheduler, StepPlan
from jaxinfer.models.packed import PackedBatch


def window_width(width: int, q: int, window: int | None, page_size: int) -> int:
    """Window-table columns for rows of q queries whose full tables have ``width`` columns:
    a row's queries at p..p+q-1 need positions p-W+1 .. p+q-1, at most (W + q - 2) // ps + 2
    pages, one more for a decode row whose previous step the host has not read (its window
    starts at the lagging seq.computed)."""
    if not window:
        return 1
    return min(width, (window + q - 1) // page_size + 2)


def step_shapes(sched: Scheduler, *, rows_needed: int, max_pages: int, prefill_tokens: int, q: int,
                pages_per_seq: int, max_num_seqs: int, prefill_chunk: int) -> tuple[int, int, int]:
    """(R, width, Tp) of a step: the buckets warm-up compiles and the engine runs."""
    R = 0 if rows_needed == 0 else buckets.bucket(rows_needed, buckets.BATCH_BUCKETS, max_num_seqs)
    width = buckets.width_bucket(max_pages, pages_per_seq)
    Tp = 0 if prefill_tokens == 0 else buckets.bucket(prefill_tokens, buckets.PREFILL_BUCKETS, prefill_chunk)
    return R, width, Tp


def plan_shape(plan: StepPlan, sched: Scheduler, *, q: int, pages_per_seq: int, max_num_seqs: int,
               prefill_chunk: int) -> tuple[int, int, int]:
    """(R, width, Tp) of the step that runs ``plan``."""
    ps = sched.page_size
    rows_needed = max((s.slot for s in plan.decode), default=-1) + 1
    n_pre = sum(g.n for g in plan.prefill)
    hist = plan.prefill[0] if plan.prefill and plan.prefill[0].start > 0 else None
    max_pages = max([len(s.pages) for s in plan.decode] + [-(-hist.start // ps) if hist else 1])
    return step_shapes(sched, rows_needed=rows_needed, max_pages=max_pages, prefill_tokens=n_pre, q=q,
                       pages_per_seq=pages_per_seq, max_num_seqs=max_num_seqs, prefill_chunk=prefill_chunk)


def lora_arrays(slots: np.ndarray, max_loras: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A step's LoRA adapters from its tokens' device slots i32[N] (-1: none): (active i32[n],
    the distinct slots in use, sorted, padded to ``buckets.lora_bucket`` by repeating the last;
    index i32[N], each token's position in active, -1: none), or (None, None) when no token
    uses one (the step then does no adapter work)."""
    used = np.unique(slots[slots >= 0]).astype(np.int32)
    if used.size == 0:
        return None, None
    n = buckets.lora_bucket(used.size, max_loras)
    active = np.concatenate([used, np.full(n - used.size, used[-1], np.int32)])
    index = np.where(slots >= 0, np.searchsorted(used, slots), -1).astype(np.int32)
    return active, index


def build_batch(plan: StepPlan, sched: Scheduler, *, q: int, pad_id: int, pages_per_seq: int,
                max_num_seqs: int, prefill_chunk: int, want_targets: bool,
                drafts: dict[int, list[int]] | None = None, next_tokens: bool = False,
                shape: tuple[int, int, int] | None = None, chain: int = 1, max_loras: int = 0) -> PackedBatch:
    """The host arrays of one step (numpy; jit moves them). Inflight bookkeeping is the
    caller's: this only reads the sequences. With ``drafts`` (slot -> the row's drafted
    tokens, at most q - 1), a decode row carries its last token then its drafts at the
    following positions; its unused queries repeat the last position and write to the
    scratch page. ``last_q[r]`` is then the row's number of drafts. ``shape``: (R, width, Tp)
    at least this plan's own (``plan_shape``), so data-parallel replicas share one shape.
    ``next_tokens``: every prefill token's next token goes in ``targets`` (an EAGLE head's
    entries need it), not only those of sequences that want prompt logprobs. ``chain``: the
    decode steps the batch is chained over (``chaining.chained_decode``), so the window tables
    cover each row's last chained position. ``max_loras``: the engine's LoRA device slots (0:
    it runs no adapters); a step whose tokens use any carries them (``lora_arrays``)."""
    ps, W = sched.page_size, sched.window
    hist = plan.prefill[0] if plan.prefill and plan.prefill[0].start > 0 else None
    R, width, Tp = shape or plan_shape(plan, sched, q=q, pages_per_seq=pages_per_seq, max_num_seqs=max_num_seqs,
                                       prefill_chunk=prefill_chunk)
    ww = window_width(width, q + chain - 1, W, ps)
    N = R * q + Tp
    tokens = np.full(N, pad_id, np.int32)
    positions = np.zeros(N, np.int32)
    wpage = np.full(N, SCRATCH_PAGE, np.int32)
    wwpage = np.full(N, SCRATCH_PAGE, np.int32)
    active = np.zeros(R, np.bool_)
    use_prev = np.zeros(R, np.bool_)
    last_q = np.zeros(R, np.int32)
    table = np.full((R + 1, width), SCRATCH_PAGE, np.int32)
    wtable = np.full((R + 1, ww), SCRATCH_PAGE, np.int32)
    wbase = np.zeros(R + 1, np.int32)
    seg = np.full(Tp, -1, np.int32)
    targets = np.full(Tp, -1, np.int32)
    lora = max_loras > 0
    lora_slots = np.full(N, -1, np.int32) if lora else None

    def put_window(r, seq):
        if W:
            wbase[r], row = sched.window_row(seq)
            wtable[r, : len(row)] = row

    for s in plan.decode:  # the row's input is its last token (or the one in flight), then its drafts
        r = s.slot
        toks = s.tokens
        pos = len(toks) - 1 + s.inflight
        i = r * q
        d = drafts.get(r, []) if drafts is not None else []
        tokens[i] = toks[-1]
        active[r] = True
        use_prev[r] = s.inflight > 0
        last_q[r] = len(d)
        for j in range(q):
            p = pos + min(j, len(d))
            positions[i + j] = p
            if j <= len(d):
                if j:
                    tokens[i + j] = d[j - 1]
                wpage[i + j] = s.pages[p // ps]
                if W:
                    wwpage[i + j] = s.window_pages[p // ps]
        table[r, : len(s.pages)] = s.pages
        put_window(r, s)
        if lora:
            lora_slots[i : i + q] = s.lora_slot
    off = R * q
    for k, g in enumerate(plan.prefill):
        toks = g.seq.tokens
        sl = slice(off, off + g.n)
        p = np.arange(g.start, g.start + g.n)
        tokens[sl] = toks[g.start : g.start + g.n]
        positions[sl] = p
        wpage[sl] = np.asarray(g.seq.pages)[p // ps]
        if W:
            wwpage[sl] = np.asarray(g.seq.window_pages)[p // ps]
        seg[off - R * q : off - R * q + g.n] = k
        if lora:
            lora_slots[sl] = g.seq.lora_slot
        if next_tokens or (want_targets and g.seq.wants_prompt_logprobs):
            targets[off - R * q : off - R * q + g.n] = toks[g.start + 1 : g.start + g.n + 1]
        off += g.n
    hist_end = 0
    if hist is not None:
        hist_end = hist.start
        pages = hist.seq.pages[: -(-hist.start // ps)]
        table[R, : len(pages)] = pages
        if W:
            lo = hist.seq.window_lo
            row = hist.seq.window_pages[lo : -(-hist.start // ps)]
            wbase[R] = lo
            wtable[R, : len(row)] = row
    lora_active, lora_index = lora_arrays(lora_slots, max_loras) if lora else (None, None)
    return PackedBatch(tokens=tokens, positions=positions, write_page=wpage, write_wpage=wwpage,
                       active=active, use_prev=use_prev, last_q=last_q, table=table, wtable=wtable, wbase=wbase, seg=seg,
                       hist_end=np.int32(hist_end), targets=targets, rows=R, q=q,
                       max_segments=min(Tp, max_num_seqs), lora_active=lora_active, lora_index=lora_index)


class GuideMasks:
    """The decode rows' structured-output masks of each step, in one host buffer
    i32[D, S, V/32] reused step to step (made on first use): ``masks(plans, R)`` ->
    (bitmask i32[D, R, V/32], has_mask bool[D, R], each replica's own), or None when no row is
    constrained. Decode row r is slot r."""

    def __init__(self, replicas: int, max_num_seqs: int, vocab_size: int):
        self.shape = (replicas, max_num_seqs, -(-vocab_size // 32))
        self.bitmask: np.ndarray | None = None

    def __call__(self, plans: list[StepPlan], R: int):
        guided = [(d, s) for d, p in enumerate(plans) for s in p.decode if s.row.guided is not None]
        if not guided:
            return None
        if self.bitmask is None:
            self.bitmask = np.full(self.shape, -1, np.int32)
        has = np.zeros((self.shape[0], R), np.bool_)
        for d, s in guided:
            s.row.guided.fill_bitmask(self.bitmask[d, s.slot])
            has[d, s.slot] = True
        return self.bitmask[:, :R].copy(), has
