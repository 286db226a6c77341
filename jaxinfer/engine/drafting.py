"""Speculative decoding's host side inside the engine loop: what the drafter holds (Medusa heads,
a draft model, an EAGLE head; their pools are the engine state's ``draft_kv``), which drafts each
decoding row carries, the draft block that makes a step a verification step, and what a read
verification step teaches each row.

``Engine.step`` asks ``propose`` for drafts; with any, it dispatches the one engine step with a
draft block (``block``: each decode row carries its last token and its drafts), else a plain
step (whose ``models`` keep a draft model's or EAGLE head's pages in step). The engine's one
consume path reads both kinds of step; ``took`` records a row's acceptance. With Medusa, EAGLE or
n-gram drafts (``can_chain``), the next verification step is dispatched from the unread one's
device outputs (``chained_block``), so reading it overlaps the device's work: Medusa's and
EAGLE's next drafts come out of the unread step, and n-gram drafts are looked up on device in
each row's history (the host's, extended by the unread block's tokens). Methods and their
configuration: ``engine.speculative``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import cache as kv
from jaxinfer.engine import buckets, replicas
from jaxinfer.engine.rows import Row
from jaxinfer.engine.scheduler import Seq
from jaxinfer.engine.speculative import SpecMethod, SpecStats, SpeculativeConfig, ngram_propose
from jaxinfer.engine.consume import StepKind
from jaxinfer.engine.state import committed
from jaxinfer.engine.verify import DraftBlock, DraftModels, Drafting
from jaxinfer.errors import InvalidRequest
from jaxinfer.models.packed import PackedBatch

# methods whose drafts come out of the previous verification step (the host holds them)
_DRAFTS_FROM_PREVIOUS_STEP = (SpecMethod.MEDUSA, SpecMethod.EAGLE)
# methods whose next verification step can be dispatched before the host reads the last one
_CHAINS = (*_DRAFTS_FROM_PREVIOUS_STEP, SpecMethod.NGRAM)


class Drafter:
    """The speculative host state of one engine (one replica). ``eng`` is the engine whose
    scheduler and sizes it reads; the device state, its pools included, is the engine's."""

    def __init__(self, eng, spec: SpeculativeConfig, *, num_pages: int, draft=None):
        """Loads what drafts (heads, a draft model, an EAGLE head); the pools it drafts into
        are the engine's (``state.EngineState.draft_kv``), made by ``pools``."""
        self.eng, self.spec = eng, spec
        self.stats = SpecStats(spec.num_speculative_tokens)
        self._drafted_seen = 0  # stats.drafted when can_chain last looked (n-gram)
        self.heads = self.draft_cfg = self.draft_weights = self.eagle = None
        self._pools = None  # the draft model's or the EAGLE head's page pools, until the engine takes them
        if spec.method == SpecMethod.MEDUSA:
            from jaxinfer.models import medusa

            self.heads, _ = medusa.load_heads(spec.model, eng.cfg)
            if spec.num_speculative_tokens > self.heads["w"].shape[0]:
                raise InvalidRequest(f"speculative_config num_speculative_tokens={spec.num_speculative_tokens} "
                                     f"needs as many Medusa heads; {spec.model} has {self.heads['w'].shape[0]}")
        elif spec.method == SpecMethod.DRAFT_MODEL:
            self._init_draft(draft, num_pages)
        elif spec.method == SpecMethod.EAGLE:
            self._init_eagle(num_pages)
        # the static options of every step of the engine (one executable per shape for both kinds)
        self.drafting = Drafting(
            cfg=self.draft_cfg, layers=spec.num_layers if spec.method == SpecMethod.EARLY_EXIT else 0,
            lookup=(spec.prompt_lookup_min, spec.prompt_lookup_max) if spec.method == SpecMethod.NGRAM else None,
            page_size=eng.config.block_size)

    def take_pools(self):
        """The draft model's or EAGLE head's page pools (k, v), or None: the engine's state holds
        them from then on."""
        pools, self._pools = self._pools, None
        return pools

    def _init_draft(self, draft, num_pages: int) -> None:
        """The draft model of speculative draft_model and its page pools: as many pages as the
        target's full-length pools, addressed by the same page tables (so a page holds the
        same positions in both, whatever prefix caching, preemption and rejection do to it).
        Its sliding-window layers, if any, keep every position: the window pools' tables
        follow the target's layers, not the draft's."""
        eng = self.eng
        if draft is None:
            raise InvalidRequest("speculative_config method draft_model needs its draft model loaded "
                                 "(LLM loads speculative_config's model)")
        dcfg, dweights = draft
        if dcfg.vocab_size != eng.cfg.vocab_size:
            raise InvalidRequest(f"speculative_config draft model {self.spec.model} has a vocabulary of "
                                 f"{dcfg.vocab_size} tokens; the target's has {eng.cfg.vocab_size} "
                                 "(a draft model must share the target's vocabulary)")
        pools = kv.init_paged_cache(dcfg, num_pages, eng.config.block_size,
                                    kv.kv_storage_dtype(eng.config.kv_cache_dtype, dcfg),
                                    keys_transposed=eng.keys_transposed)
        self.draft_cfg, self.draft_weights = dcfg, dweights
        self._pools = committed((pools.k, pools.v), eng.weights)

    def _init_eagle(self, num_pages: int) -> None:
        """The EAGLE draft head (its layer, fc, and the LM-head rows of its draft vocabulary)
        and its one-layer page pools, addressed by the target's page tables like a draft model's."""
        from jaxinfer.models import eagle

        eng = self.eng
        head, vocab, _ = eagle.load_head(self.spec.model, eng.cfg)
        rows = eagle.readout_rows(eng.weights, vocab, eng.cfg)
        if self.spec.quantization == "int8":  # weight-only int8 matmul weights (norms stay float):
            # a batch-1 draft pass streams a quarter of the bytes through the native int8 kernel
            from jaxinfer.loaders.quantize import quantize_weight
            from jaxinfer.quant import QuantConfig, QuantScheme, quantize_int8
            from jaxinfer.specs import is_spec

            qcfg = QuantConfig(QuantScheme.INT8)
            head = jax.tree.map(lambda spec, w: quantize_weight("eagle", spec, w, qcfg),
                                eagle.head_specs(eagle.layer_cfg(eng.cfg)), head, is_leaf=is_spec)
            rows = quantize_int8(rows, (1,))  # [Vd, D], one scale per draft token
        self.eagle = {"head": head, "rows": rows, "vocab": vocab}
        pools = kv.init_paged_cache(eagle.layer_cfg(eng.cfg), num_pages, eng.config.block_size, jnp.float32,
                                    keys_transposed=eng.keys_transposed)
        self._pools = committed((pools.k, pools.v), eng.weights)

    # ------------------------------------------------------------------ plain steps
    def max_rows(self) -> int:
        """The largest row bucket a verification step can have (disable_by_batch_size's)."""
        n = self.eng.max_num_seqs
        return buckets.bucket(self.spec.max_rows(n), buckets.BATCH_BUCKETS, n)

    def models(self, rows: int, verifies: bool) -> DraftModels:
        """The drafter's weights a step of ``rows`` decode rows reads: the draft model's in every
        step (a plain step writes its keys and values of the same tokens); the EAGLE head's where
        speculation may run (rows up to ``max_rows``; a row that decoded in a larger batch keeps
        stale entries for those positions, which can only lower its acceptance later); Medusa
        heads in verification steps."""
        eagle = self.eagle if verifies or rows <= self.max_rows() else None
        return DraftModels(heads=self.heads if verifies else None, draft_weights=self.draft_weights, eagle=eagle)

    # ------------------------------------------------------------------ drafts
    def propose(self, decoding: list[Seq]) -> dict:
        """Drafts per decoding sequence (at most what its max_tokens leaves room for), cut to
        what each row's grammar allows; {} when the step runs plain (too many rows, no drafts)."""
        spec, pad = self.spec, self.eng.tokenizer.pad_id
        constrained = [s for s in decoding if s.row.guided is not None]
        # early-exit and draft-model drafts are made on device, where no grammar can check them
        on_device = spec.method in (SpecMethod.EARLY_EXIT, SpecMethod.DRAFT_MODEL)
        drafts = {}
        if decoding and spec.speculates(len(decoding)) and not (constrained and on_device):
            for s in decoding:
                budget = min(spec.num_speculative_tokens, draft_room(s.row))
                if budget <= 0:
                    continue
                if spec.method == SpecMethod.NGRAM:
                    d = ngram_propose(s.tokens, budget, spec.prompt_lookup_min, spec.prompt_lookup_max)
                elif spec.method in _DRAFTS_FROM_PREVIOUS_STEP:  # the heads' guesses from the previous step
                    d = list(s.drafts[:budget])
                else:  # early_exit, draft_model: placeholders, drafted on device inside the step
                    d = [pad] * budget
                if d or spec.method in _DRAFTS_FROM_PREVIOUS_STEP:  # such rows need the step that runs the heads
                    drafts[s] = d
        for s in constrained:  # a row under a grammar drafts only what its grammar allows
            if s in drafts:
                drafts[s] = _grammar_prefix(s.row.guided, drafts[s])
                if not drafts[s] and spec.method == SpecMethod.NGRAM:
                    del drafts[s]
        if not drafts:
            self.stats.disabled_steps += bool(decoding)
            for s in decoding:
                s.drafts = s.branch_drafts = []  # stale after a step without the heads
        return drafts

    def block_guide(self, decode: list[Seq], rows: dict, R: int, q: int):
        """Structured-output masks of every block position (bitmask i32[R, q, V/32], has_mask
        bool[R]): position j's is the grammar's state after the row's drafts before j (the
        drafts were cut to what the grammar allows). None when no row is constrained."""
        constrained = [s for s in decode if s.row.guided is not None]
        if not constrained:
            return None
        masks = np.full((R, q, -(-self.eng.cfg.vocab_size // 32)), -1, np.int32)
        has = np.zeros(R, np.bool_)
        for s in constrained:
            m = s.row.guided.copy()
            m.fill_bitmask(masks[s.slot, 0])
            for j, tok in enumerate(rows.get(s.slot, [])):
                m.accept(tok)
                m.fill_bitmask(masks[s.slot, j + 1])
            has[s.slot] = True
        return masks, has

    def block(self, R: int, k: int, rows: dict) -> DraftBlock:
        """The draft block of a verification step whose drafts the host made (slot -> drafts),
        on the replica axis (the drafter's one replica)."""
        return replicas.stack([DraftBlock(branch_drafts=self.branch_drafts(R, k, rows))])

    def branch_drafts(self, R: int, k: int, rows: dict):
        """i32[R, W - 1, k]: the chains of EAGLE branches 1..W-1 of each row, cut to as many
        drafts as its branch 0 carries (None without branches)."""
        W = self.spec.branches
        if W == 1:
            return None
        out = np.full((R, W - 1, k), self.eng.tokenizer.pad_id, np.int32)
        slots = {s.slot: s for s in self.eng.sched.slots if s is not None}
        for b, d in rows.items():
            for i, chain in enumerate(slots[b].branch_drafts[: W - 1]):
                out[b, i, : len(d)] = chain[: len(d)]
        return out

    def warm_steps(self, R: int, width: int, Tp: int) -> list:
        """(batch, draft block) of the verification steps of this shape, and of its chained form,
        for ``warmup`` to compile."""
        if not 0 < R <= self.max_rows():
            return []
        q = self.spec.num_speculative_tokens + 1
        out = [(self.eng.idle_batch(R, width, Tp, q=q), self.block(R, q - 1, {}))]
        if Tp == 0 and self.chains():
            K = self.heads["w"].shape[0] if self.heads is not None else q - 1
            z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
            ngram = self.spec.method == SpecMethod.NGRAM
            history = (z(R, width * self.eng.allocator.page_size), z(R), z(R, q)) if ngram else None
            block = DraftBlock(chain=(z(R), None if ngram else z(R, K), z(R)), history=history)
            out.append((self.eng.idle_batch(R, width, 0, q=q), replicas.stack([block])))
        return out

    # ------------------------------------------------------------------ chaining
    def chains(self) -> bool:
        """Whether verification steps may be chained at all (see ``can_chain``): one chain per
        row (branches draft on the host), and no window pools (a windowed row's window table
        follows its position, which only the unread step knows). On a mesh too: the chained
        block is moved on inside the one step, wherever it runs."""
        return self.spec.method in _CHAINS and self.spec.branches == 1 and not self.eng.window

    def can_chain(self, fl) -> bool:
        """Whether the next verification step can be dispatched before the unread ``fl`` is read:
        Medusa, EAGLE or n-gram drafts (one chain, no grammar), the same rows decoding and nothing to
        admit or prefill, and, for every row, pages for everything the two blocks may write
        (without preempting) below max_model_len. No window pools: a windowed row's table
        follows its position, which only the unread step knows."""
        eng, k = self.eng, self.spec.num_speculative_tokens
        (decode,) = fl.decode
        if not fl.kind.verifies or not decode or not self.chains():
            return False
        if self.spec.method == SpecMethod.NGRAM:
            # a chained n-gram step verifies k + 1 queries per row whether or not its lookup
            # finds drafts; when the last block read drafted nothing, go back to the host,
            # which runs a plain step while no row finds a draft
            seen, self._drafted_seen = self._drafted_seen, self.stats.drafted
            if fl.kind == StepKind.VERIFY_CHAINED and self.stats.drafted == seen:
                return False
        running = eng.sched.running()
        if len(running) != len(decode) or not self.spec.speculates(len(running)):
            return False
        if eng.sched.waiting and len(running) < eng.max_num_seqs:
            return False  # a waiting sequence would be admitted
        ps, need = eng.allocator.page_size, 0
        for s in decode:
            if s.slot < 0 or s.state.value != "decode" or s.row.guided is not None or s.row.checker.finished:
                return False
            if draft_room(s.row) <= 0:
                return False  # the unread block ends the row
            last = len(s.tokens) + 2 * k  # the unread block's k + 1, then k drafts
            if last >= eng.max_model_len:
                return False
            need += max(0, last // ps + 1 - len(s.pages))
        return need <= eng.allocator.num_free

    def chained_lookahead(self, fl) -> dict:
        """What the next step of fl's rows writes past each row's last read token: the unread
        block's k + 1 positions, then its own k drafts."""
        (decode,) = fl.decode
        return {s: 2 * self.spec.num_speculative_tokens + 1 for s in decode}

    def chained_block(self, fl, decode: list[Seq], batch: PackedBatch) -> DraftBlock:
        """The draft block of the verification step chained to the unread ``fl`` (``can_chain``),
        from fl's device outputs: its rows move on by what fl accepted, within what each row's
        max_tokens leaves after fl's block; Medusa's and EAGLE's drafts are fl's next drafts,
        n-gram's are looked up on device in each row's history. On the replica axis, as fl's
        outputs are (the drafter's one replica)."""
        assert decode == fl.decode[0], "a chained step runs the unread step's rows"
        budget = np.zeros(batch.rows, np.int32)  # room after the unread block's last token
        for s in decode:
            budget[s.slot] = draft_room(s.row) - 1
        history = self._history(decode, batch, fl.out.tokens) if self.spec.method == SpecMethod.NGRAM else None
        ahead = None if history is not None else fl.out.next_drafts  # n-gram: looked up on device
        return DraftBlock(chain=(fl.out.accepted, ahead, budget[None]), history=history)

    def _history(self, decode: list[Seq], batch: PackedBatch, block) -> tuple:
        """n-gram chaining's ``verify.DraftBlock.history``: each row's tokens as the host last
        read them (i32[R, L], L the pages the batch's tables cover: room for the unread block
        and the next), their counts, and the unread block's tokens (block, still on device),
        on the replica axis."""
        L = batch.table.shape[-1] * self.eng.allocator.page_size
        tokens, lengths = np.zeros((batch.rows, L), np.int32), np.zeros(batch.rows, np.int32)
        for s in decode:
            t = s.tokens
            assert len(t) + self.spec.num_speculative_tokens + 1 <= L, (len(t), L)  # can_chain's pages
            tokens[s.slot, : len(t)] = t
            lengths[s.slot] = len(t)
        return tokens[None], lengths[None], block

    # ------------------------------------------------------------------ reading
    def took(self, seq: Seq, drafted: dict | None, accepted: int, next_drafts, carried: int | None = None) -> None:
        """Record what a read verification step did for one row: its acceptance, and the drafts
        its heads made for the next block (next_drafts: i32[K], or [W, K] with EAGLE branches).
        carried: the drafts a chained block looked up on device carried (n-gram), else None."""
        r, k = seq.row, self.spec.num_speculative_tokens
        # a chained block drafted what the row's max_tokens left room for after the last one
        # (n-gram: what its lookup found, within that)
        n = (drafted.get(seq.slot, 0) if drafted is not None else carried if carried is not None
             else min(k, max(0, draft_room(r))))
        if n:
            self.stats.record(n, accepted)
        seq.drafts = [] if next_drafts is None else next_drafts.tolist()
        if next_drafts is not None and next_drafts.ndim == 2:  # EAGLE branches: [W, k] per row
            seq.drafts, seq.branch_drafts = seq.drafts[0], seq.drafts[1:]
        r.spec_drafted += n
        r.spec_accepted += accepted


def draft_room(row: Row) -> int:
    """Drafts a block of this row may carry before max_tokens (its last token comes from the
    target): max_new - generated - 1, before the cut to k (<= 0: none)."""
    return row.max_new - len(row.token_ids) - 1


def _grammar_prefix(matcher, drafts: list[int]) -> list[int]:
    """The longest prefix of drafts that a copy of the row's grammar matcher accepts."""
    m = matcher.copy()
    for j, tok in enumerate(drafts):
        if not m.accept(tok):
            return drafts[:j]
    return drafts
