"""Continuous batching over a paged KV cache: one packed step per scheduler iteration.

Each iteration the scheduler (``engine.scheduler``) decides what to compute, and one jitted
call (``engine.step.packed_step``) runs every decoding sequence and a row of packed prompt
chunks together, so the weights are read once per iteration and the matmuls see every token
of the step. The page pools and the per-slot device state are donated to every step. The
next step is dispatched before the host reads the current one's tokens, so detokenizing and
stop checks overlap device work.

The interface is vLLM's LLMEngine's: ``add(row)``, ``abort(row)``, ``step()`` (returns the
rows that finished), ``has_unfinished()``; ``run(rows)`` drives them for a batch.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import cache as kv
from jaxinfer import kernels
from jaxinfer import sampling as smp
from jaxinfer.config import AttentionKind, ModelConfig
from jaxinfer.engine import buckets
from jaxinfer.engine.batch import build_batch, window_width
from jaxinfer.engine.compiles import CompileCounter
from jaxinfer.engine.rows import Row, position_logprobs, record_token
from jaxinfer.engine.scheduler import Scheduler, Scheduling, Seq, window_pool_pages
from jaxinfer.engine.speculative import SpecMethod, SpeculativeConfig, SpecStats, ngram_propose
from jaxinfer.engine.step import (
    STOP_ID_WIDTH,
    SlotState,
    draft_kv_step,
    insert_step,
    make_slots,
    packed_step,
    slots_with_vocab_state,
    spec_step,
)
from jaxinfer.errors import InvalidRequest
from jaxinfer.models.packed import PackedBatch

# methods whose drafts come out of the previous verification step (the host holds them)
_DRAFTS_FROM_PREVIOUS_STEP = (SpecMethod.MEDUSA, SpecMethod.EAGLE)

__all__ = ["EngineConfig", "PagedEngine", "Scheduling"]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 64  # decode slots
    page_size: int = 16
    num_pages: int | None = None  # None: from kv_cache_bytes
    kv_cache_bytes: int = 2 << 30  # page pool budget when num_pages is None
    prefill_chunk: int = 512  # prompt tokens per scheduler iteration (the prefill row's budget)
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


@dataclasses.dataclass
class _InFlight:
    plan_decode: list[Seq]
    plan_prefill: list  # (seq, start, n, offset in the prefill row) of segments whose prompt logprobs come back
    out: object  # StepOutput (device arrays)


@dataclasses.dataclass
class _SpecInFlight:
    plan_decode: list[Seq]
    drafted: dict[int, int] | None  # slot -> drafts its row verifies; None: chained (known once the previous is read)
    out: object  # SpecOutput (device arrays)


class PagedEngine:
    """Continuous-batching engine over one model.

    Structured output: a row whose ``guided`` is a grammar matcher (``guided.GrammarMatcher``:
    ``fill_bitmask(out)``, ``accept(token)``) samples only what its grammar allows. Its mask is
    filled on the host from the matcher and applied inside the jitted step; steps with no
    constrained row run without any mask. A constrained row's mask needs its previous token,
    so while one is running the host reads each step's tokens before dispatching the next.
    """

    supports_guided_decoding = True

    def __init__(self, cfg: ModelConfig, weights, tokenizer, *, max_model_len: int,
                 config: EngineConfig = EngineConfig(), seed: int = 0,
                 speculative: SpeculativeConfig | None = None, mesh=None, draft=None,
                 pools: concurrent.futures.Future | None = None):
        """draft: (ModelConfig, weights) of the draft model when speculative is draft_model.
        pools: ``start_pools(cfg, config, max_model_len)``, begun while the weights were read
        (one device, no pipeline)."""
        self.cfg, self.weights, self.tokenizer = cfg, weights, tokenizer
        self.max_model_len = max_model_len
        self.config = config
        self.seed = seed
        self.max_num_seqs = config.max_num_seqs
        ps = config.page_size
        self.pages_per_seq = -(-max_model_len // ps)
        self.kv_dtype = kv_dtype = kv.kv_storage_dtype(config.kv_cache_dtype, cfg)
        self.window, num_pages, num_window_pages = pool_sizes(cfg, config, kv_dtype, self.pages_per_seq)
        self.sched = Scheduler(max_num_seqs=config.max_num_seqs, page_size=ps, num_pages=num_pages,
                               prefill_chunk=config.prefill_chunk, prefix_caching=config.prefix_caching,
                               scheduling=config.scheduling, window=self.window, num_window_pages=num_window_pages)
        self.allocator, self.window_allocator = self.sched.allocator, self.sched.window_allocator
        self.mesh = mesh
        self.pipeline = None
        if mesh is not None and mesh.shape.get("stage", 1) > 1:
            # pipeline parallel: each stage's devices hold only their layers' weights and pools
            if speculative is not None:
                raise InvalidRequest("speculative decoding with pipeline_parallel_size > 1 is not supported")
            from jaxinfer.engine.pipeline import (
                PipelineLayout,
                check_pipeline,
                init_pools,
                stack_weights,
            )

            check_pipeline(cfg)
            self.windowed = tuple(num_window_pages is not None and cfg.layer_window(i) is not None
                                  for i in range(cfg.n_layers))
            self.pipeline = PipelineLayout.make(mesh, cfg.n_layers, self.windowed)
            self.weights = stack_weights(weights, self.pipeline)
            self.k_pages, self.v_pages = init_pools(cfg, self.pipeline, num_pages, ps, kv_dtype, num_window_pages)
        else:
            if pools is not None and pools.made_for != (cfg, config, max_model_len):
                raise ValueError("the page pools were started for another model or engine configuration")
            cache = (pools.result() if pools is not None else
                     kv.init_paged_cache(cfg, num_pages, ps, kv_dtype, num_window_pages=num_window_pages))
            self.k_pages, self.v_pages, self.windowed = cache.k, cache.v, cache.windowed
            if mesh is None:
                self.k_pages, self.v_pages = _committed((self.k_pages, self.v_pages), weights)
        self.slots = self._fresh_slots()
        if mesh is not None and self.pipeline is None:  # tensor parallel: pools split over KV heads (or replicated)
            from jaxinfer.sharding import kv_pool_shardings

            pool = kv_pool_shardings(mesh, cfg)
            self.k_pages, self.v_pages = jax.device_put((self.k_pages, self.v_pages), (pool, pool))
        # one partial per engine, so each engine's jit caches are its own; the counter counts
        # the executables they build (engine.compiles)
        self._compiles = CompileCounter()
        self._step = self._compiles.counted(jax.jit(
            functools.partial(packed_step, windowed=self.windowed, pipeline=self.pipeline),
            static_argnames=("cfg", "num_logprobs", "prompt_logprobs", "kernel_mode"),
            donate_argnames=("k_pages", "v_pages", "slots", "eagle_kv")))
        self._insert = self._compiles.counted(jax.jit(functools.partial(insert_step), donate_argnames=("slots",)))
        # speculative decoding (engine.speculative): decode rows carry k + 1 queries, verified on device
        self.spec = SpeculativeConfig.parse(speculative, cfg.n_layers)
        self.spec_stats = SpecStats(self.spec.num_speculative_tokens) if self.spec else None
        self._heads = None
        if self.spec is not None and self.spec.method == SpecMethod.MEDUSA:
            from jaxinfer.models import medusa

            self._heads, _ = medusa.load_heads(self.spec.model, cfg)
            if self.spec.num_speculative_tokens > self._heads["w"].shape[0]:
                raise InvalidRequest(f"speculative_config num_speculative_tokens="
                                     f"{self.spec.num_speculative_tokens} needs as many Medusa heads; "
                                     f"{self.spec.model} has {self._heads['w'].shape[0]}")
        self.draft_cfg = self.draft_weights = self.draft_kv = None
        if self.spec is not None and self.spec.method == SpecMethod.DRAFT_MODEL:
            self._init_draft(draft, num_pages)
        self._eagle = self.eagle_kv = None
        if self.spec is not None and self.spec.method == SpecMethod.EAGLE:
            self._init_eagle(num_pages)
        self._spec_step = self._compiles.counted(jax.jit(
            functools.partial(spec_step, windowed=self.windowed),
            static_argnames=("cfg", "num_logprobs", "prompt_logprobs", "kernel_mode", "draft_layers", "draft_cfg"),
            donate_argnames=("k_pages", "v_pages", "slots", "draft_kv", "eagle_kv")))
        self._draft_step = self._compiles.counted(jax.jit(
            functools.partial(draft_kv_step), static_argnames=("draft_cfg", "kernel_mode"),
            donate_argnames=("draft_kv",)))
        self._seqs: dict[int, Seq] = {}  # id(row) -> its sequence, for abort
        self._inflight: _InFlight | None = None
        self._spec_inflight: _SpecInFlight | None = None  # a verification step the host has not read
        self._bitmask: np.ndarray | None = None  # i32[S, V/32] structured-output masks, made on first use
        self.shapes_run: set[tuple] = set()  # (R, width, Tp, q, logprobs, prompt logprobs) of every step run

    def _init_draft(self, draft, num_pages: int) -> None:
        """The draft model of speculative draft_model and its page pools: as many pages as the
        target's full-length pools, addressed by the same page tables (so a page holds the
        same positions in both, whatever prefix caching, preemption and rejection do to it).
        Its sliding-window layers, if any, keep every position: the window pools' tables
        follow the target's layers, not the draft's."""
        if draft is None:
            raise InvalidRequest("speculative_config method draft_model needs its draft model loaded "
                                 "(LLM loads speculative_config's model)")
        dcfg, dweights = draft
        if dcfg.vocab_size != self.cfg.vocab_size:
            raise InvalidRequest(f"speculative_config draft model {self.spec.model} has a vocabulary of "
                                 f"{dcfg.vocab_size} tokens; the target's has {self.cfg.vocab_size} "
                                 "(a draft model must share the target's vocabulary)")
        if self.mesh is not None:
            raise InvalidRequest("speculative_config method draft_model does not run with tensor parallelism yet")
        pools = kv.init_paged_cache(dcfg, num_pages, self.config.page_size,
                                    kv.kv_storage_dtype(self.config.kv_cache_dtype, dcfg))
        self.draft_cfg, self.draft_weights, self.draft_kv = dcfg, dweights, _committed((pools.k, pools.v), self.weights)

    def _init_eagle(self, num_pages: int) -> None:
        """The EAGLE draft head (its layer, fc, and the LM-head rows of its draft vocabulary)
        and its one-layer page pools, addressed by the target's page tables like a draft model's."""
        from jaxinfer.models import eagle

        if self.mesh is not None:
            raise InvalidRequest("speculative_config method eagle does not run with tensor parallelism yet")
        head, vocab, _ = eagle.load_head(self.spec.model, self.cfg)
        rows = eagle.readout_rows(self.weights, vocab, self.cfg)
        if self.spec.quantization == "int8":  # weight-only int8 matmul weights (norms stay float):
            # a batch-1 draft pass streams a quarter of the bytes through the native int8 kernel
            from jaxinfer.loaders.quantize import quantize_weight
            from jaxinfer.quant import QuantConfig, QuantScheme, quantize_int8
            from jaxinfer.specs import is_spec

            qcfg = QuantConfig(QuantScheme.INT8)
            head = jax.tree.map(lambda spec, w: quantize_weight("eagle", spec, w, qcfg),
                                eagle.head_specs(eagle.layer_cfg(self.cfg)), head, is_leaf=is_spec)
            rows = quantize_int8(rows, (1,))  # [Vd, D], one scale per draft token
        self._eagle = {"head": head, "rows": rows, "vocab": vocab}
        pools = kv.init_paged_cache(eagle.layer_cfg(self.cfg), num_pages, self.config.page_size, jnp.float32)
        self.eagle_kv = _committed((pools.k, pools.v), self.weights)

    # ------------------------------------------------------------------ reports
    @property
    def stats(self) -> dict:
        return self.sched.stats

    @property
    def last_cache_bytes(self) -> int:
        extra = self.draft_kv or self.eagle_kv
        pools = self.k_pages + self.v_pages + (list(extra[0]) + list(extra[1]) if extra else [])
        return sum(a.nbytes for a in pools if a is not None)

    def num_compilations(self) -> int:
        """Executables built so far by the engine's jitted steps (each compiled, or loaded from
        the persistent compilation cache): exact, see ``engine.compiles``."""
        return self._compiles.count

    def num_running(self) -> int:
        return sum(s is not None for s in self.sched.slots)

    def num_waiting(self) -> int:
        return len(self.sched.waiting)

    def kv_usage(self) -> float:
        """Share of the full-length page pool in use (scratch page excluded)."""
        return self.allocator.num_used / max(self.allocator.num_pages - 1, 1)

    def warmup_shapes(self, max_prompt_len: int | None = None, max_len: int | None = None) -> list[tuple]:
        """Every (R, width, Tp) a workload whose prompts are at most max_prompt_len tokens and
        whose sequences at most max_len can hit (a cached prefix or a long prompt's earlier
        chunks may give the prefill row history of up to max_prompt_len positions)."""
        max_len = min(max_len or self.max_model_len, self.max_model_len)
        max_prompt = min(max_prompt_len or max_len, max_len)
        ps, chunk = self.allocator.page_size, self.config.prefill_chunk
        rows = sorted({0} | {buckets.bucket(n, buckets.BATCH_BUCKETS, self.max_num_seqs)
                             for n in range(1, self.max_num_seqs + 1)})
        top_tp = buckets.bucket(min(max_prompt, chunk), buckets.PREFILL_BUCKETS, chunk)
        tps = sorted({0} | {b for b in buckets.PREFILL_BUCKETS if b <= top_tp} | {top_tp})
        widths = sorted({buckets.width_bucket(n, self.pages_per_seq) for n in range(1, -(-max_len // ps) + 1)})
        return [(R, w, Tp) for R in rows for w in widths for Tp in tps if R or Tp]

    def idle_batch(self, rows: int, width: int, prefill: int, q: int = 1) -> PackedBatch:
        """A batch of the given shape that touches only the scratch page (warm-up, tests)."""
        ww = window_width(width, q, self.window, self.allocator.page_size)
        N = rows * q + prefill
        z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        return PackedBatch(tokens=z(N), positions=z(N), write_page=z(N), write_wpage=z(N),
                           active=np.zeros(rows, np.bool_), use_prev=np.zeros(rows, np.bool_), last_q=z(rows), table=z(rows + 1, width),
                           wtable=z(rows + 1, ww), wbase=z(rows + 1), seg=np.full(prefill, -1, np.int32),
                           hist_end=np.int32(0), targets=np.full(prefill, -1, np.int32), rows=rows, q=q,
                           max_segments=min(prefill, self.max_num_seqs))

    def run_step(self, batch: PackedBatch, *, num_logprobs: int = -1, prompt_logprobs: int = -1, guide=None):
        """Run one packed step on the engine's pools and slots (donated); returns its StepOutput.
        guide: None, or (bitmask i32[R, V/32], has_mask bool[R]) for the decode rows."""
        self.shapes_run.add((batch.rows, batch.table.shape[1], batch.prefill_len, batch.q, num_logprobs,
                             prompt_logprobs) + (("guided",) if guide is not None else ()))
        mode = kernels.current_mode()
        if self.draft_cfg is not None:  # the draft writes its keys and values of the same tokens (before
            # the target's step, which donates the slots whose last tokens a use_prev row reads)
            self.draft_kv = self._draft_step(self.draft_weights, batch, self.draft_kv, self.slots.last_tokens,
                                             draft_cfg=self.draft_cfg, kernel_mode=mode)
        if self._eagle is not None and self._eagle_writes(batch.rows):  # the head's entries of the same tokens
            out, self.k_pages, self.v_pages, self.slots, self.eagle_kv = self._step(
                self.weights, batch, self.k_pages, self.v_pages, self.slots, guide, self._eagle, self.eagle_kv,
                cfg=self.cfg, num_logprobs=num_logprobs, prompt_logprobs=prompt_logprobs, kernel_mode=mode)
            return out
        out, self.k_pages, self.v_pages, self.slots = self._step(
            self.weights, batch, self.k_pages, self.v_pages, self.slots, guide, cfg=self.cfg, num_logprobs=num_logprobs,
            prompt_logprobs=prompt_logprobs, kernel_mode=mode)
        return out

    def warmup(self, max_prompt_len: int | None = None, max_len: int | None = None) -> int:
        """Compile every step shape a workload up to these lengths can hit (see
        ``warmup_shapes``); returns the number of executables compiled. Runs the steps on
        the scratch page only, with every slot idle."""
        before = self.num_compilations()
        ps, W = self.allocator.page_size, self.window
        spec_rows = self._spec_rows() if self.spec else 0
        for R, w, Tp in self.warmup_shapes(max_prompt_len, max_len):
            self.run_step(self.idle_batch(R, w, Tp))
            if 0 < R <= spec_rows:  # the verification step of each shape speculation can run at
                q = self.spec.num_speculative_tokens + 1
                draft_layers = self.spec.num_layers if self.spec.method == SpecMethod.EARLY_EXIT else 0
                self._run_spec_step(self.idle_batch(R, w, Tp, q=q), None, num_logprobs=-1, prompt_logprobs=-1,
                                    draft_layers=draft_layers)
                if Tp == 0 and self._chains():  # and the same step chained after an unread one
                    K = self._heads["w"].shape[0] if self._heads is not None else q - 1
                    z = lambda *shape: jnp.zeros(shape, jnp.int32)
                    self._run_spec_step(self.idle_batch(R, w, 0, q=q), None, num_logprobs=-1, prompt_logprobs=-1,
                                        draft_layers=0, chain=(z(R), z(R, K), z(R)))
        self.slots = self._fresh_slots()  # warm-up sampled into idle slots
        # one slot's state from the host, as _insert_row's (slot_state_for) comes
        dummy = jax.tree.map(lambda a: jax.device_put(np.asarray(a[:1])), self.slots)
        self.slots = self._insert(self.slots, jnp.int32(0), dummy)
        jax.block_until_ready(self.k_pages)
        return self.num_compilations() - before

    # ------------------------------------------------------------------ requests
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

    def add(self, row: Row) -> None:
        """Validate and queue a row; it joins the running batch when a slot and pages allow."""
        self.validate(row)
        if row.params.prompt_logprobs is not None:
            row.prompt_logprobs = [None]
        self._seqs[id(row)] = self.sched.add(row)

    def abort(self, row: Row) -> None:
        """Cancel a waiting or running row: its pages are freed and it is never returned."""
        seq = self._seqs.pop(id(row), None)
        if seq is not None:
            self.sched.abort(seq)

    def has_unfinished(self) -> bool:
        return self.sched.has_work() or self._inflight is not None or self._spec_inflight is not None

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[Row]:
        """One scheduler iteration: dispatch the next packed step, then read the previous
        one's tokens while it runs (first, when that step sampled for a constrained row: its
        next mask needs the token). Returns the rows that finished."""
        if self.spec is not None:
            return self._spec_iteration()
        done = []
        if self._inflight is not None and any(s.row.guided is not None for s in self._inflight.plan_decode):
            # a constrained row's next mask depends on the token in flight: read it first
            done = self._consume(self._inflight)
            self._inflight = None
        nxt = self._dispatch() if self.sched.has_work() else None
        if self._inflight is not None:
            done = self._consume(self._inflight)
        self._inflight = nxt
        return done

    def run(self, rows) -> Iterator[Row]:
        """Run rows (an iterable, consumed as slots free up); yield each row as it finishes."""
        incoming = iter(rows)
        exhausted = False
        while True:
            # keep the queue topped up without reading the whole input
            while not exhausted and len(self.sched.waiting) < 2 * self.max_num_seqs:
                row = next(incoming, None)
                if row is None:
                    exhausted = True
                    break
                self.add(row)
            yield from self.step()
            if exhausted and not self.has_unfinished():
                return

    def _dispatch(self) -> _InFlight | None:
        plan = self.sched.plan()
        for seq in plan.inserted:
            self._insert_row(seq)
        if not plan.decode and not plan.prefill:
            return None
        want_plp = [g.seq.row.params.prompt_logprobs for g in plan.prefill if g.seq.wants_prompt_logprobs]
        batch = self._build(plan, 1, want_targets=bool(want_plp))
        num_lp = buckets.logprob_bucket([s.row.params.logprobs for s in plan.decode])
        plp = buckets.logprob_bucket(want_plp)
        out = self.run_step(batch, num_logprobs=num_lp, prompt_logprobs=plp, guide=self._guide(plan.decode, batch.rows))
        for s in plan.decode:
            s.inflight += 1
        self.sched.prefill_done(plan.prefill)
        if plan.decode:
            self.stats["decode_steps"] += 1
        return _InFlight(plan.decode, _prompt_logprob_segments(plan), out)

    def _build(self, plan, q: int, *, want_targets: bool, drafts: dict | None = None) -> PackedBatch:
        """``batch.build_batch`` with the engine's own sizes (an EAGLE head needs every
        prefill token's next token)."""
        return build_batch(plan, self.sched, q=q, pad_id=self.tokenizer.pad_id, pages_per_seq=self.pages_per_seq,
                           max_num_seqs=self.max_num_seqs, prefill_chunk=self.config.prefill_chunk,
                           want_targets=want_targets, drafts=drafts, next_tokens=self._eagle is not None)

    def _guide(self, decode: list[Seq], R: int):
        """The decode rows' structured-output masks (bitmask i32[R, V/32], has_mask bool[R]), or
        None when no row is constrained. Decode row r is slot r."""
        guided = [s for s in decode if s.row.guided is not None]
        if not guided:
            return None
        if self._bitmask is None:
            self._bitmask = np.full((self.max_num_seqs, -(-self.cfg.vocab_size // 32)), -1, np.int32)
        has = np.zeros(R, np.bool_)
        for s in guided:
            s.row.guided.fill_bitmask(self._bitmask[s.slot])
            has[s.slot] = True
        return self._bitmask[:R].copy(), has

    def _consume(self, fl: _InFlight) -> list[Row]:
        out = fl.out
        done = []
        if fl.plan_prefill:
            self._record_prompt_logprobs(fl, jax.device_get(out.prompt_logprobs))
        if not fl.plan_decode:
            return done
        toks = np.asarray(out.tokens)
        host_lp = jax.device_get(out.logprobs) if out.logprobs is not None else None
        now = time.perf_counter()
        for seq in fl.plan_decode:
            if seq.slot < 0 or seq.row.checker.finished:
                continue  # preempted or aborted (recomputed later, or dropped), or finished already
            seq.inflight -= 1
            r = seq.row
            seq.computed = len(seq.tokens)  # the input token's keys/values are now in place
            self.sched.register_full_pages(seq)
            if record_token(r, int(toks[seq.slot]), host_lp, seq.slot, now, self.tokenizer):
                self.sched.release(seq)
                self._seqs.pop(id(r), None)
                done.append(r)
        return done

    def _record_prompt_logprobs(self, fl: _InFlight, plp) -> None:
        """Each prompt-logprob segment's query at position p scores prompt token p + 1."""
        chosen, ranks, top_ids, top_lp = plp
        for seq, start, n, at in fl.plan_prefill:
            r = seq.row
            for t in range(n):
                target = start + t + 1
                if target >= len(r.prompt_ids) or len(r.prompt_logprobs) != target:
                    continue  # past the prompt, or recorded before a preemption
                k = r.params.prompt_logprobs
                r.prompt_logprobs.append(position_logprobs(
                    self.tokenizer, r.prompt_ids[target], float(chosen[at + t]), int(ranks[at + t]),
                    top_ids[at + t][:k], top_lp[at + t][:k]))

    # ------------------------------------------------------------------ speculative decoding
    def _propose(self, decoding) -> dict:
        """Drafts per decoding sequence (at most what its max_tokens leaves room for)."""
        spec, pad = self.spec, self.tokenizer.pad_id
        drafts = {}
        for s in decoding:
            budget = min(spec.num_speculative_tokens, self._draft_room(s.row))
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
        return drafts

    @staticmethod
    def _draft_room(row: Row) -> int:
        """Drafts a block of this row may carry before max_tokens (its last token comes from
        the target): max_new - generated - 1, before the cut to k (<= 0: none)."""
        return row.max_new - len(row.token_ids) - 1

    def _branch_drafts(self, batch: PackedBatch, rows: dict):
        """i32[R, W - 1, k]: the chains of EAGLE branches 1..W-1 of each row, cut to as many
        drafts as its branch 0 carries (None without branches)."""
        W = self.spec.branches
        if W == 1:
            return None
        out = np.full((batch.rows, W - 1, batch.q - 1), self.tokenizer.pad_id, np.int32)
        slots = {s.slot: s for s in self.sched.slots if s is not None}
        for b, d in rows.items():
            for i, chain in enumerate(slots[b].branch_drafts[: W - 1]):
                out[b, i, : len(d)] = chain[: len(d)]
        return out

    def _spec_rows(self) -> int:
        """The largest row bucket a verification step can have (disable_by_batch_size's)."""
        return buckets.bucket(self.spec.disable_by_batch_size, buckets.BATCH_BUCKETS, self.max_num_seqs)

    def _eagle_writes(self, rows: int) -> bool:
        """Whether a plain step of ``rows`` decode rows writes the EAGLE head's entries: only
        where speculation may run (rows up to ``_spec_rows``), so large batches pay nothing for
        it. A row that decoded in a larger batch keeps stale entries for those positions, which
        can only lower its acceptance later."""
        return rows <= self._spec_rows()

    def _run_spec_step(self, batch: PackedBatch, guide, *, num_logprobs: int, prompt_logprobs: int,
                       draft_layers: int, branch_drafts=None, chain=None):
        """One verification step on the engine's pools, slots and draft pools (all donated).
        branch_drafts: i32[R, W - 1, k] with EAGLE branches (zeros when None). chain: see
        ``step.spec_step``."""
        eagle = self._eagle is not None
        W = self.spec.branches
        if W > 1 and branch_drafts is None:
            branch_drafts = np.zeros((batch.rows, W - 1, batch.q - 1), np.int32)
        out, self.k_pages, self.v_pages, self.slots, kv_out = self._spec_step(
            self.weights, batch, self.k_pages, self.v_pages, self.slots, self._heads, guide, self.draft_weights,
            None if eagle else self.draft_kv, self._eagle, self.eagle_kv, branch_drafts, chain,
            cfg=self.cfg, num_logprobs=num_logprobs,
            prompt_logprobs=prompt_logprobs, kernel_mode=kernels.current_mode(), draft_layers=draft_layers,
            draft_cfg=self.draft_cfg)
        if eagle:
            self.eagle_kv = kv_out
        else:
            self.draft_kv = kv_out
        return out

    def _block_guide(self, decode, rows: dict, R: int, q: int):
        """Structured-output masks of every block position (bitmask i32[R, q, V/32], has_mask
        bool[R]): position j's is the grammar's state after the row's drafts before j (the
        drafts were cut to what the grammar allows). None when no row is constrained."""
        constrained = [s for s in decode if s.row.guided is not None]
        if not constrained:
            return None
        masks = np.full((R, q, -(-self.cfg.vocab_size // 32)), -1, np.int32)
        has = np.zeros(R, np.bool_)
        for s in constrained:
            m = s.row.guided.copy()
            m.fill_bitmask(masks[s.slot, 0])
            for j, tok in enumerate(rows.get(s.slot, [])):
                m.accept(tok)
                m.fill_bitmask(masks[s.slot, j + 1])
            has[s.slot] = True
        return masks, has

    def _spec_iteration(self) -> list[Row]:
        """One iteration with speculation. Drafts are proposed from the tokens the host holds,
        the block is dispatched for verification on device, and its accepted tokens are read
        at the next iteration. In steady state with Medusa or EAGLE (``_can_chain``), that
        iteration first dispatches the next block from the unread one's device outputs
        (``step.chain_block``), so reading, detokenizing and stop checks overlap the device's
        work; otherwise it only reads. Steps whose batch is above ``disable_by_batch_size``,
        or where no row has a draft, run as plain decode steps."""
        if self._inflight is not None:  # left over from before speculation was enabled
            done, self._inflight = self._consume(self._inflight), None
            return done
        fl = self._spec_inflight
        if fl is not None:
            self._spec_inflight = self._dispatch_chained(fl) if self._can_chain(fl) else None
            return self._consume_spec(fl)
        if not self.sched.has_work():
            return []
        spec, stats = self.spec, self.spec_stats
        decoding = [s for s in self.sched.slots if s is not None and s.state.value == "decode"]
        constrained = [s for s in decoding if s.row.guided is not None]
        # early-exit and draft-model drafts are made on device, where no grammar can check them:
        # such steps run plain
        on_device = spec.method in (SpecMethod.EARLY_EXIT, SpecMethod.DRAFT_MODEL)
        drafts = self._propose(decoding) if 0 < len(decoding) <= spec.disable_by_batch_size and \
            not (constrained and on_device) else {}
        for s in constrained:  # a row under a grammar drafts only what its grammar allows
            if s in drafts:
                drafts[s] = _grammar_prefix(s.row.guided, drafts[s])
                if not drafts[s] and spec.method == SpecMethod.NGRAM:
                    del drafts[s]
        if not drafts:
            stats.disabled_steps += bool(decoding)
            for s in decoding:
                s.drafts = s.branch_drafts = []  # stale after a step without the heads
            fl = self._dispatch()
            return self._consume(fl) if fl is not None else []
        for s, d in drafts.items():
            s.lookahead = len(d)
        plan = self.sched.plan()
        for s in drafts:
            s.lookahead = 0
        for seq in plan.inserted:
            self._insert_row(seq)
        rows = {s.slot: drafts[s] for s in plan.decode if s in drafts}
        want_plp = [g.seq.row.params.prompt_logprobs for g in plan.prefill if g.seq.wants_prompt_logprobs]
        q = spec.num_speculative_tokens + 1
        batch = self._build(plan, q, want_targets=bool(want_plp), drafts=rows)
        num_lp = buckets.logprob_bucket([s.row.params.logprobs for s in plan.decode])
        plp = buckets.logprob_bucket(want_plp)
        draft_layers = spec.num_layers if spec.method == SpecMethod.EARLY_EXIT else 0
        self.shapes_run.add((batch.rows, batch.table.shape[1], batch.prefill_len, q, num_lp, plp))
        guide = self._block_guide(plan.decode, rows, batch.rows, q)
        out = self._run_spec_step(batch, guide, num_logprobs=num_lp, prompt_logprobs=plp, draft_layers=draft_layers,
                                  branch_drafts=self._branch_drafts(batch, rows))
        self.sched.prefill_done(plan.prefill)
        plp_segments = _prompt_logprob_segments(plan)
        if plp_segments:
            self._record_prompt_logprobs(_InFlight([], plp_segments, None), jax.device_get(out.prompt_logprobs))
        if not plan.decode:
            return []
        self.stats["decode_steps"] += 1
        stats.steps += 1
        self._spec_inflight = _SpecInFlight(plan.decode, {b: len(d) for b, d in rows.items()}, out)
        return []

    def _can_chain(self, fl: _SpecInFlight) -> bool:
        """Whether the next verification step can be dispatched before ``fl`` is read: Medusa
        or EAGLE drafts (one chain, no grammar), the same rows decoding and nothing to admit
        or prefill, and, for every row, pages for everything the two blocks may write
        (without preempting) below max_model_len. No window pools: a windowed row's table
        follows its position, which only the unread step knows."""
        spec, ps = self.spec, self.allocator.page_size
        if not self._chains():
            return False
        running = self.sched.running()
        if len(running) != len(fl.plan_decode) or len(running) > spec.disable_by_batch_size:
            return False
        if self.sched.waiting and len(running) < self.max_num_seqs:
            return False  # a waiting sequence would be admitted
        need = 0
        for s in fl.plan_decode:
            if s.slot < 0 or s.state.value != "decode" or s.row.guided is not None or s.row.checker.finished:
                return False
            if self._draft_room(s.row) <= 0:
                return False  # the unread block ends the row
            last = len(s.tokens) + 2 * spec.num_speculative_tokens  # the unread block's k + 1, then k drafts
            if last >= self.max_model_len:
                return False
            need += max(0, last // ps + 1 - len(s.pages))
        return need <= self.allocator.num_free

    def _chains(self) -> bool:
        """Whether verification steps may be chained at all (see ``_can_chain``)."""
        spec = self.spec
        return (spec.method in _DRAFTS_FROM_PREVIOUS_STEP and spec.branches == 1 and not self.window
                and self.mesh is None)

    def _dispatch_chained(self, fl: _SpecInFlight) -> _SpecInFlight:
        """The next verification step of fl's rows, from fl's device outputs (``_can_chain``)."""
        k = self.spec.num_speculative_tokens
        for s in fl.plan_decode:
            s.lookahead = 2 * k + 1
        plan = self.sched.plan()
        for s in fl.plan_decode:
            s.lookahead = 0
        assert not plan.inserted and not plan.prefill and plan.decode == fl.plan_decode
        batch = self._build(plan, k + 1, want_targets=False, drafts={})
        budget = np.zeros(batch.rows, np.int32)  # room after the unread block's last token
        for s in plan.decode:
            budget[s.slot] = self._draft_room(s.row) - 1
        num_lp = buckets.logprob_bucket([s.row.params.logprobs for s in plan.decode])
        self.shapes_run.add((batch.rows, batch.table.shape[1], 0, k + 1, num_lp, -1, "chained"))
        out = self._run_spec_step(batch, None, num_logprobs=num_lp, prompt_logprobs=-1, draft_layers=0,
                                  chain=(fl.out.accepted, fl.out.next_drafts, budget))
        self.stats["decode_steps"] += 1
        self.spec_stats.steps += 1
        return _SpecInFlight(plan.decode, None, out)

    def _consume_spec(self, fl: _SpecInFlight) -> list[Row]:
        """Read a verification step: each row's accepted drafts and new token, its next drafts."""
        out, stats, k = fl.out, self.spec_stats, self.spec.num_speculative_tokens
        if all(seq.slot < 0 or seq.row.checker.finished for seq in fl.plan_decode):
            return []  # a chained block after its rows ended: nothing to read, no need to wait for it
        toks, accepted = np.asarray(out.tokens), np.asarray(out.accepted)
        nxt = np.asarray(out.next_drafts) if out.next_drafts is not None else None
        host_lp = jax.device_get(out.logprobs) if out.logprobs is not None else None
        now = time.perf_counter()
        done = []
        for seq in fl.plan_decode:
            if seq.slot < 0 or seq.row.checker.finished:
                continue
            r, b = seq.row, seq.slot
            # a chained block drafted what the row's max_tokens left room for after the last one
            n = fl.drafted.get(b, 0) if fl.drafted is not None else min(k, max(0, self._draft_room(r)))
            a = int(accepted[b])
            if n:
                stats.record(n, a)
            seq.drafts = [] if nxt is None else nxt[b].tolist()
            if nxt is not None and nxt.ndim == 3:  # EAGLE branches: [W, k] per row
                seq.drafts, seq.branch_drafts = seq.drafts[0], seq.drafts[1:]
            r.spec_drafted += n
            r.spec_accepted += a
            finished = False
            for j in range(a + 1):
                seq.computed = len(seq.tokens)  # the input of position j is in the pages now
                lp_j = None if host_lp is None else tuple(x[:, j] for x in host_lp)
                if record_token(r, int(toks[b, j]), lp_j, b, now, self.tokenizer):
                    finished = True
                    break
            if finished:
                self.sched.release(seq)
                self._seqs.pop(id(r), None)
                done.append(r)
            else:
                self.sched.register_full_pages(seq)
        return done

    # ------------------------------------------------------------------ slots
    def _fresh_slots(self) -> SlotState:
        """Every slot idle, placed as the steps' own outputs will be: replicated over the mesh,
        or committed to the weights' device."""
        slots = make_slots(self.cfg.vocab_size, self.max_num_seqs, self.seed, vocab_state=False)
        if self.mesh is None:
            return _committed(slots, self.weights)
        from jax.sharding import NamedSharding, PartitionSpec

        return jax.device_put(slots, NamedSharding(self.mesh, PartitionSpec()))

    def _insert_row(self, seq: Seq) -> None:
        # [S, V] penalty statistics only while some running row has penalties
        need = any(s is not None and smp.needs_vocab_state(s.row.params) for s in self.sched.slots)
        self.slots = slots_with_vocab_state(self.slots, self.cfg.vocab_size, need)
        new = slot_state_for(seq.row, self.cfg.vocab_size, self.tokenizer.eos_ids, self.seed, vocab_state=need)
        self.slots = self._insert(self.slots, jnp.int32(seq.slot), new)


def _committed(tree, weights):
    """``tree`` committed to the device of the (one-device) weights, without a copy. jit keys
    its executables on whether each argument is committed: a step's outputs are (its weights
    are), so pools or slots left uncommitted (made by jnp.zeros or a bare device_put) would
    make the first step shape's executable twice, once for them and again for the outputs
    that replace them (a second lowering, 0.5-1 s, in the middle of a run)."""
    leaf = next((a for a in jax.tree.leaves(weights) if getattr(a, "committed", False)), None)
    if leaf is None:  # uncommitted weights: on the default device, where the tree was made too
        leaf = jax.tree.leaves(tree)[0]
    return jax.device_put(tree, next(iter(leaf.devices())))


def pool_sizes(cfg: ModelConfig, config: EngineConfig, kv_dtype, pages_per_seq: int):
    """(window, full-length pages, window pages) of one engine's page pools: the window None
    when no layer is windowed (or windowed_kv is off); enough full-length pages for every slot
    at full length (plus room for cached prefixes), within the byte budget."""
    ps = config.page_size
    W = cfg.sliding_window if config.windowed_kv else None
    window = W if W and any(cfg.layer_window(i) for i in range(cfg.n_layers)) else None
    window_bytes, num_window_pages = 0, None
    if window:
        num_window_pages = window_pool_pages(window, ps, config.max_num_seqs, config.prefill_chunk, pages_per_seq)
        window_bytes = num_window_pages * ps * cfg.kv_bytes_per_token(kv_dtype, kind=AttentionKind.LOCAL)
    full_bytes_per_token = cfg.kv_bytes_per_token(kv_dtype, kind=AttentionKind.GLOBAL if window else None)
    num_pages = config.num_pages or max(2, min(
        max(config.kv_cache_bytes - window_bytes, 0) // (max(full_bytes_per_token, 1) * ps),
        2 * config.max_num_seqs * pages_per_seq + 1))
    return window, num_pages, num_window_pages


def _make_pools(cfg: ModelConfig, config: EngineConfig, max_model_len: int) -> kv.PagedKVCache:
    """The zeroed page pools of an engine on one device."""
    pages_per_seq = -(-max_model_len // config.page_size)
    kv_dtype = kv.kv_storage_dtype(config.kv_cache_dtype, cfg)
    _, num_pages, num_window_pages = pool_sizes(cfg, config, kv_dtype, pages_per_seq)
    return kv.init_paged_cache(cfg, num_pages, config.page_size, kv_dtype, num_window_pages=num_window_pages)


def start_pools(cfg: ModelConfig, config: EngineConfig, max_model_len: int) -> concurrent.futures.Future:
    """Zero-fill an engine's page pools on a second thread (for ``PagedEngine(pools=...)``).
    Filling the default 2 GB of pools takes ~0.5 s of memory writes; begun as soon as the
    checkpoint's config is known, it runs beside the weights being read and dequantized."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxinfer-pools")
    future = pool.submit(_make_pools, cfg, config, max_model_len)
    future.made_for = (cfg, config, max_model_len)
    pool.shutdown(wait=False)
    return future


def slot_state_for(row: Row, vocab_size: int, eos_ids, seed: int, *, vocab_state: bool = True) -> SlotState:
    """One sequence's slot state (batch 1): its sampling state (penalties counting what it
    generated before a preemption; without [V] statistics unless vocab_state), stop ids,
    min_tokens and step count."""
    p = row.params
    sampling = smp.make_sampling_state([p], [row.prompt_ids], vocab_size, default_seed=seed,
                                       request_indices=[row.request_index], vocab_state=vocab_state)
    if row.token_ids and vocab_state:  # recomputing after preemption: penalties must see what was generated
        counts = np.bincount(row.token_ids, minlength=vocab_size).astype(np.int32)[None]
        sampling = dataclasses.replace(sampling, output_counts=jax.device_put(counts))
    stop, mins = smp.min_tokens_inputs([p], eos_ids)
    stop_ids = np.full((1, STOP_ID_WIDTH), -1, np.int32)
    stop_ids[0, : min(stop.shape[1], STOP_ID_WIDTH)] = stop[0, :STOP_ID_WIDTH]
    # host arrays in one transfer (jnp.asarray would compile a small executable per shape)
    return SlotState(sampling, *jax.device_put((np.zeros(1, np.int32), stop_ids, np.asarray(mins, np.int32),
                                                np.asarray([len(row.token_ids)], np.int32))))


def _grammar_prefix(matcher, drafts: list[int]) -> list[int]:
    """The longest prefix of drafts that a copy of the row's grammar matcher accepts."""
    m = matcher.copy()
    for j, tok in enumerate(drafts):
        if not m.accept(tok):
            return drafts[:j]
    return drafts


def _prompt_logprob_segments(plan) -> list:
    """(seq, start, n, offset in the prefill row) of each segment whose prompt logprobs come back."""
    out, at = [], 0
    for g in plan.prefill:
        if g.seq.wants_prompt_logprobs:
            out.append((g.seq, g.start, g.n, at))
        at += g.n
    return out
