"""The engine: continuous batching over a paged KV cache, one packed step per scheduler iteration.

    LLM -> Engine.step -> Scheduler.plan -> batch.build_batch -> step.packed_step -> model

Each iteration the scheduler (``engine.scheduler``) decides what to compute, and one jitted call
runs every decoding sequence and a row of packed prompt chunks together, so the weights are read
once per iteration and the matmuls see every token of the step. The device state
(``state.EngineState``: page pools, per-slot state, the drafter's pools) is held here only,
donated to every step and replaced by what it returns. The next step is dispatched before the
host reads the current one's tokens, so detokenizing and stop checks overlap device work. With
speculative decoding (``engine.drafting``) a step may carry a draft block: its decode rows carry
drafts and it may emit several tokens per row (``consume.StepKind`` says which kind a dispatched
step is); the same consume path reads both kinds. Every engine runs D replicas
(``engine.replicas``; D = 1 without data parallelism), each with its own scheduler, slots and
pools, and one step runs them all: the same path for any D. Options that do not run together
are refused once, where they enter (``config.check_combination``, called by ``LLM``).

The interface is vLLM's LLMEngine's: ``add(row)``, ``abort(row)``, ``step()`` (returns the rows
that finished), ``has_unfinished()``; ``run(rows)`` drives them for a batch.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from collections.abc import Iterator

import jax
import numpy as np

from jaxinfer import cache as kv
from jaxinfer import dispatch
from jaxinfer import sampling as smp
from jaxinfer.config import ModelConfig
from jaxinfer.engine import buckets, multimodal, replicas
from jaxinfer.engine import state as dstate
from jaxinfer.engine.adapters import lora_manager
from jaxinfer.engine.batch import GuideMasks, build_batch, plan_shape, window_width
from jaxinfer.engine.chaining import Chainer
from jaxinfer.engine.compiles import CompileCounter
from jaxinfer.engine.config import (EngineConfig, engine_kernels, kv_budget, pool_sizes, scheduler_steps,
                                    separate_sampler)
from jaxinfer.engine.consume import InFlight, StepKind, consume, prompt_logprob_segments
from jaxinfer.engine.rows import Row
from jaxinfer.engine.scheduler import Scheduler, Seq
from jaxinfer.engine.slots import STOP_ID_WIDTH, SlotState, insert_step, slot_states_for, slots_with_vocab_state
from jaxinfer.engine.speculative import SpeculativeConfig
from jaxinfer.engine.state import EngineState
from jaxinfer.engine.step import StepInputs
from jaxinfer.engine.verify import NO_DRAFTING, DraftBlock
from jaxinfer.engine.warmup import warm
from jaxinfer.errors import InvalidRequest
from jaxinfer.models.packed import PackedBatch

__all__ = ["Engine"]

class Engine:
    """Continuous batching over one model (``config`` is one replica's).

    Structured output: a row whose ``guided`` is a grammar matcher (``guided.GrammarMatcher``:
    ``fill_bitmask(out)``, ``accept(token)``) samples only what its grammar allows. Its mask is
    filled on the host and applied inside the jitted step; steps with no constrained row run
    without any mask. A constrained row's mask needs its previous token, so while one is running
    the host reads each step's tokens before dispatching the next.

    Chained decode steps (``num_scheduler_steps`` N > 1): when every running row decodes and
    none needs the host between tokens, one device call (``chaining.chained_decode``) runs up to N
    decode steps, checking EOS, stop_token_ids, min_tokens and max_tokens on device, and the
    host reads the chain's tokens once. The pages the chain may write are allocated before it
    is dispatched (fewer steps when the pool is short); a row that finishes mid-chain gives back
    what it did not use when it is released. While requests wait for a slot, a chain ends after
    the step in which a row finishes. Speculative decoding, data-parallel replicas and pipeline
    stages do not chain. ``stats`` counts chains, chained steps and why steps ran unchained
    (``chaining.CHAIN_REFUSALS``) or chains were cut short (chain_cut_pages, chain_cut_arrivals)."""

    def __init__(self, cfg: ModelConfig, weights, tokenizer, *, max_model_len: int,
                 config: EngineConfig | None = None, seed: int = 0,
                 speculative: SpeculativeConfig | None = None, mesh=None, draft=None,
                 pools: concurrent.futures.Future | None = None, model_names=(), download_dir=None):
        """mesh: (data, stage, model) axes: data > 1 makes replicas, stage > 1 a pipeline.
        draft: (ModelConfig, weights) of the draft model when speculative is draft_model.
        pools: ``config.start_pools(cfg, config, max_model_len)``, begun while the weights
        were read (one device). model_names: what the served model is called (its argument and
        path), which a LoRA adapter's base_model_name_or_path must name; download_dir: where
        adapters given as Hub ids are downloaded."""
        config = config or EngineConfig()
        self.cfg, self.weights, self.tokenizer = cfg, weights, tokenizer
        self.max_model_len, self.config, self.seed, self.mesh = max_model_len, config, seed, mesh
        self.max_num_seqs = config.max_num_seqs
        self.D = D = replicas.count(mesh)
        self.spec = SpeculativeConfig.parse(speculative, cfg.n_layers)
        # which kernels run attention (the weights carry the matmuls' choice, ``dispatch.bind``),
        # as chosen for the engine's devices: its mesh, or the weights' one device
        self.kernels = engine_kernels(config, mesh=mesh, devices=None if mesh is not None else dstate.devices(weights))
        # the keys pools' layout, for the engine's and its drafter's pools alike (cache module doc)
        self.keys_transposed = dispatch.keys_transposed(self.kernels, self.kernels.platform)
        # the pools' head dims padded to whole tiles on a TPU (cache module doc)
        self.pool_lanes = dispatch.pool_lanes(self.kernels)
        ps = config.block_size
        self.pages_per_seq = -(-max_model_len // ps)
        self.kv_dtype = kv.kv_storage_dtype(config.kv_cache_dtype, cfg)
        budget = kv_budget(config, mesh.devices[0].flat if mesh is not None else dstate.devices(weights))
        self.window, num_pages, num_window_pages = pool_sizes(cfg, config, self.kv_dtype, self.pages_per_seq, budget,
                                                              lanes=self.pool_lanes)
        self.scheds = [Scheduler(max_num_seqs=config.max_num_seqs, page_size=ps, num_pages=num_pages,
                                 prefill_chunk=config.max_num_batched_tokens,
                                 prefix_caching=config.enable_prefix_caching, scheduling=config.scheduling_policy,
                                 window=self.window, num_window_pages=num_window_pages) for _ in range(D)]
        self.sched = self.scheds[0]  # page sizes and counts, the same in every replica
        self.allocator, self.window_allocator = self.sched.allocator, self.sched.window_allocator
        self.lora = None
        if config.lora is not None:
            self.lora = lora_manager(cfg, config.lora, weights, mesh, self.committed, model_names, download_dir)
        for s in self.scheds:
            s.lora = self.lora
        made = dstate.make_pools(cfg, config, weights, mesh, D, self.kv_dtype, self.keys_transposed, num_pages,
                                 num_window_pages, pools, max_model_len, lanes=self.pool_lanes)
        self.weights, self.windowed, self.pipeline = made.weights, made.windowed, made.pipeline
        self.drafter = None
        if self.spec is not None:
            from jaxinfer.engine.drafting import Drafter

            self.drafter = Drafter(self, self.spec, num_pages=num_pages, draft=draft)
        # the one owner of the device state: every jitted call takes it (donated) and returns it
        self.state = EngineState(made.k, made.v, self._fresh_slots(),
                                 self.drafter.take_pools() if self.drafter is not None else None)
        # one partial per engine, so each engine's jit caches are its own; the counter counts
        # the executables they build (engine.compiles)
        self._compiles = CompileCounter()
        statics = dict(windowed=self.windowed, keys_transposed=self.keys_transposed, pipeline=self.pipeline,
                       drafting=self.drafter.drafting if self.drafter is not None else NO_DRAFTING)
        fn = functools.partial(replicas.replicas_step, mesh=mesh, **statics)  # the one step, per replica
        self._step = self._compiles.counted(jax.jit(fn, static_argnames=("cfg", "num_logprobs", "prompt_logprobs",
                                                                         "kernels", "sample"), donate_argnames=("state",)))
        # plain steps' sampling apart: one executable per row bucket and sampling options, shared
        # by every step shape (``step.sample_rows``); replicas and an EAGLE head sample in the step
        self.separate_sampler = (separate_sampler(config, self.kernels.platform or jax.default_backend())
                                 and D == 1 and (self.drafter is None or self.drafter.eagle is None))
        self._sampler = self._compiles.counted(jax.jit(
            functools.partial(replicas.sample_rows), static_argnames=("num_logprobs", "kernels"), donate_argnames="slots"))
        self._insert = self._compiles.counted(jax.jit(functools.partial(insert_step), donate_argnames=("slots",)))
        self.chainer = Chainer(self, scheduler_steps(config),
                               "data_parallel" if D > 1 else "pipeline" if self.pipeline is not None
                               else "speculative" if self.spec is not None else None)
        self.images = None  # the checkpoint's image encoder (``multimodal.ImageInputs``), where it runs one
        self._seqs: dict[int, tuple[int, Seq]] = {}  # id(row) -> (replica, its sequence), for abort
        self._inflight: InFlight | None = None
        self._guide = GuideMasks(D, config.max_num_seqs, cfg.vocab_size)  # each step's structured-output masks
        self.shapes_run: set[tuple] = set()  # (R, width, Tp, q, logprobs, prompt logprobs) of every step run
        self.inserts_run: set[int] = set()  # the row buckets of every slot insert run (one device)

    # ------------------------------------------------------------------ the device state, read-only views
    @property
    def k_pages(self) -> list:
        return self.state.k_pages

    @property
    def v_pages(self) -> list:
        return self.state.v_pages

    @property
    def slots(self) -> SlotState:
        return self.state.slots

    # ------------------------------------------------------------------ reports
    @property
    def stats(self) -> dict:
        """The schedulers' counters (summed over replicas) and the chaining counters."""
        out: dict = {}
        for s in self.scheds:
            for k, v in s.stats.items():  # peak_pages: the sum of the replicas' peaks
                out[k] = out.get(k, 0) + v
        return {**out, **self.chainer.stats}

    @property
    def spec_stats(self):
        """Speculative decoding's acceptance counters (``speculative.SpecStats``), or None."""
        return self.drafter.stats if self.drafter is not None else None

    @property
    def last_cache_bytes(self) -> int:
        return dstate.cache_bytes(self.state)

    def num_compilations(self) -> int:
        """Executables built so far by the engine's jitted steps (each compiled, or loaded from
        the persistent compilation cache): exact, see ``engine.compiles``."""
        return self._compiles.count + (self.images.num_compilations() if self.images is not None else 0)

    def num_running(self) -> int:
        return sum(s is not None for sc in self.scheds for s in sc.slots)

    def num_waiting(self) -> int:
        return sum(len(sc.waiting) for sc in self.scheds)

    def kv_usage(self) -> float:
        """Share of the full-length page pools in use (scratch pages excluded)."""
        return sum(sc.allocator.num_used for sc in self.scheds) / max(self.D * (self.allocator.num_pages - 1), 1)

    # ------------------------------------------------------------------ warm-up
    def idle_batch(self, rows: int, width: int, prefill: int, q: int = 1, loras: int = 0) -> PackedBatch:
        """A batch of the given shape (every replica's) that touches only the scratch page;
        loras: the size of its LoRA active set (0: none; its tokens use none of them)."""
        ww = window_width(width, q + self.chainer.window_ahead(), self.window, self.allocator.page_size)
        N = rows * q + prefill
        z = lambda *shape: np.zeros(shape, np.int32)
        one = PackedBatch(tokens=z(N), positions=z(N), write_page=z(N), write_wpage=z(N),
                          active=np.zeros(rows, np.bool_), use_prev=np.zeros(rows, np.bool_), last_q=z(rows),
                          table=z(rows + 1, width), wtable=z(rows + 1, ww), wbase=z(rows + 1),
                          seg=np.full(prefill, -1, np.int32), hist_end=np.int32(0),
                          targets=np.full(prefill, -1, np.int32), rows=rows, q=q,
                          max_segments=min(prefill, self.max_num_seqs),
                          lora_active=z(loras) if loras else None,
                          lora_index=np.full(N, -1, np.int32) if loras else None)
        return replicas.stack([one] * self.D)

    def warmup(self, max_prompt_len: int | None = None, max_len: int | None = None, *,
               compile_threads: int | None = None) -> int:
        """Compile every step shape a workload up to these lengths can hit; returns the number
        of executables compiled (``engine.warmup``). compile_threads: executables compiled at
        once (default: one per core this process may use)."""
        return warm(self, max_prompt_len, max_len, threads=compile_threads)

    # ------------------------------------------------------------------ requests
    def validate(self, row: Row) -> None:
        """Raise InvalidRequest if the row can never run on this engine."""
        n = len(row.prompt_ids) + row.max_new
        need = -(-n // self.allocator.page_size)
        if need > self.allocator.num_pages - 1:
            raise InvalidRequest(
                f"a sequence of {n} tokens needs {need} KV pages but the pool has only "
                f"{self.allocator.num_pages - 1}; raise kv_cache_memory_bytes or num_gpu_blocks_override, "
                "or lower max_tokens")
        if row.images is not None:
            multimodal.validate(self, row.images)
        ids = tuple(row.params.stop_token_ids) + (() if row.params.ignore_eos else tuple(self.tokenizer.eos_ids))
        if row.params.min_tokens and len(ids) > STOP_ID_WIDTH:
            raise InvalidRequest(f"min_tokens supports at most {STOP_ID_WIDTH - len(self.tokenizer.eos_ids)} stop_token_ids")

    def add(self, row: Row) -> None:
        """Validate and queue a row (on the replica with the least work); it joins the running
        batch when a slot and pages allow."""
        self.validate(row)
        if row.params.prompt_logprobs is not None:
            row.prompt_logprobs = [None]
        d = min(range(self.D), key=lambda i: (len(self.scheds[i].waiting) + len(self.scheds[i].running()), i))
        self._seqs[id(row)] = (d, self.scheds[d].add(row))

    def abort(self, row: Row) -> None:
        """Cancel a waiting or running row: its pages are freed and it is never returned."""
        found = self._seqs.pop(id(row), None)
        if found is not None:
            self.scheds[found[0]].abort(found[1])

    def has_unfinished(self) -> bool:
        return self._has_work() or self._inflight is not None

    def _has_work(self) -> bool:
        return any(s.has_work() for s in self.scheds)

    def run(self, rows) -> Iterator[Row]:
        """Run rows (an iterable, consumed as slots free up); yield each row as it finishes."""
        incoming = iter(rows)
        exhausted = False
        while True:
            # keep the queue topped up without reading the whole input
            while not exhausted and self.num_waiting() < 2 * self.max_num_seqs * self.D:
                row = next(incoming, None)
                if row is None:
                    exhausted = True
                    break
                self.add(row)
            yield from self.step()
            if exhausted and not self.has_unfinished():
                return

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[Row]:
        """One scheduler iteration: dispatch the next step, then read the previous one's tokens
        while it runs. The previous step is read first when the next depends on its tokens: a
        constrained row's mask, a chain's rows, or speculation's drafts (unless the drafter can
        chain the next verification step from the unread one's device outputs). Returns the rows
        that finished."""
        done = []
        fl, self._inflight = self._inflight, None
        if fl is not None and (fl.kind.read_first or (self.drafter is not None and not self.drafter.can_chain(fl))):
            done, fl = consume(self, fl), None  # (a chain's rows advanced by as many steps as it ran)
        after = fl if self.drafter is not None else None  # an unread verification step to chain to
        if after is not None or self._has_work():
            self._inflight = self._dispatch(after)
        if fl is not None:
            done = consume(self, fl)
        return done

    def _dispatch(self, after: InFlight | None = None) -> InFlight | None:
        """Plan every replica and dispatch their step: a chain of decode steps, a verification
        step where the drafter has drafts, one chained to ``after`` (an unread verification
        step the drafter can chain to), else a plain one."""
        drafts, ahead = {}, {}
        if after is not None:
            ahead = self.drafter.chained_lookahead(after)
        elif self.drafter is not None:
            drafts = self.drafter.propose([s for s in self.sched.slots if s is not None and s.state.value == "decode"])
            ahead = {s: len(d) for s, d in drafts.items()}
        plans = [s.plan(ahead) for s in self.scheds]
        for d, plan in enumerate(plans):
            if plan.inserted:
                self._insert_rows(d, plan.inserted)
        if not any(p.decode or p.prefill for p in plans):
            return None
        want_plp = [g.seq.row.params.prompt_logprobs for p in plans for g in p.prefill if g.seq.wants_prompt_logprobs]
        num_lp = buckets.logprob_bucket([s.row.params.logprobs for p in plans for s in p.decode])
        plp = buckets.logprob_bucket(want_plp)
        n = self.chainer.length(plans)
        if n > 1:
            fl, self.state = self.chainer.dispatch(plans[0], n, num_lp, self.state)
            return fl
        decode = plans[0].decode
        q, guide, block, rows = 1, None, None, None
        if after is not None:
            kind, q = StepKind.VERIFY_CHAINED, self.spec.num_speculative_tokens + 1
            batch = self.build(plans, q, want_targets=False)
            block = self.drafter.chained_block(after, decode, batch)
        elif drafts:
            kind, q = StepKind.VERIFY, self.spec.num_speculative_tokens + 1
            rows = {s.slot: drafts[s] for s in decode if s in drafts}
            batch = self.build(plans, q, want_targets=bool(want_plp), drafts=rows)
            guide = self.drafter.block_guide(decode, rows, batch.rows, q)
            guide = None if guide is None else replicas.stack([guide])
            block = self.drafter.block(batch.rows, q - 1, rows)
        else:
            batch = self.build(plans, 1, want_targets=bool(want_plp))
            guide = self._guide(plans, batch.rows)
            kind = StepKind.GUIDED if guide is not None else StepKind.PLAIN
        out = self.run_step(batch, num_logprobs=num_lp, prompt_logprobs=plp, guide=guide, drafts=block)
        if kind.verifies and decode:
            self.drafter.stats.steps += 1
            self.drafter.stats.chained_steps += kind == StepKind.VERIFY_CHAINED
        for p, sched in zip(plans, self.scheds):
            for s in p.decode if not kind.verifies else ():
                s.inflight += 1
            sched.prefill_done(p.prefill)
            if p.decode:
                sched.stats["decode_steps"] += 1
        drafted = {b: len(d) for b, d in rows.items()} if rows is not None else None
        return InFlight([p.decode for p in plans], [prompt_logprob_segments(p) for p in plans], out, kind, drafted)

    def build(self, plans, q: int, *, want_targets: bool, drafts: dict | None = None) -> PackedBatch:
        """``batch.build_batch`` of every replica's plan with the engine's own sizes, padded to
        one shape and stacked on the replica axis (an EAGLE head needs every prefill token's
        next token). drafts: the drafter's replica's (the first: speculation runs one)."""
        kw = {"q": q, "pages_per_seq": self.pages_per_seq, "max_num_seqs": self.max_num_seqs,
              "prefill_chunk": self.config.max_num_batched_tokens}
        eagle = self.drafter is not None and self.drafter.eagle is not None
        shape = tuple(int(x) for x in np.max([plan_shape(p, s, **kw) for p, s in zip(plans, self.scheds)], axis=0))
        out = []
        for d, (plan, sched) in enumerate(zip(plans, self.scheds)):
            batch = build_batch(plan, sched, pad_id=self.tokenizer.pad_id, want_targets=want_targets,
                                drafts=drafts if d == 0 else None, next_tokens=eagle, shape=shape,
                                chain=1 + self.chainer.window_ahead(),
                                max_loras=self.lora.config.max_loras if self.lora is not None else 0, **kw)
            out.append(batch if self.images is None else self.images.attach(batch, plan))
        return replicas.stack(out)

    def run_step(self, batch: PackedBatch, *, num_logprobs: int = -1, prompt_logprobs: int = -1, guide=None,
                 drafts: DraftBlock | None = None):
        """Run the one engine step on the engine's device state (donated, replaced by the
        step's); returns its StepOutput. guide: None, or the decode rows' structured-output
        masks (``step.StepInputs``); drafts: a verification step's draft block, or None."""
        tag = ()
        if drafts is None:
            tag = (("guided",) if guide is not None else ()) + (
                (("lora", len(batch.lora_active)),) if batch.lora_active is not None else ())
        elif drafts.chain is not None:
            tag = ("chained",)
        self.shapes_run.add((batch.rows, batch.table.shape[-1], batch.seg.shape[-1], batch.q, num_logprobs,
                             prompt_logprobs) + tag)
        args, kwargs = self.step_args(batch, num_logprobs=num_logprobs, prompt_logprobs=prompt_logprobs, guide=guide,
                                      drafts=drafts)
        out, self.state = self._step(*args, **kwargs)
        if out.logits is not None:  # the step left its sampling to the sampler's executable
            args, kwargs = self.sampler_args(out.logits, batch, num_logprobs=num_logprobs, guide=guide)
            tokens, lp, slots = self._sampler(*args, **kwargs)
            self.state = dataclasses.replace(self.state, slots=slots)
            out = dataclasses.replace(out, tokens=tokens, logprobs=lp, logits=None)
        return out

    def step_args(self, batch: PackedBatch, *, num_logprobs: int = -1, prompt_logprobs: int = -1, guide=None,
                  drafts: DraftBlock | None = None):
        """The (args, kwargs) ``run_step`` calls the jitted step with, on the engine's device
        state (warm-up lowers the step on them ahead of running it). A plain step whose
        sampling runs apart (``separate_sampler``) takes neither the logprobs width nor the
        masks: one executable per shape serves every sampling option."""
        apart = self.separate_sampler and drafts is None
        if apart:
            num_logprobs, guide = -1, None
        models = self.drafter.models(batch.rows, drafts is not None) if self.drafter is not None else None
        inputs = StepInputs(batch, guide, self.lora.stacks if self.lora is not None else None, drafts, models)
        return (self.weights, inputs, self.state), dict(cfg=self.cfg, num_logprobs=num_logprobs,
                                                        prompt_logprobs=prompt_logprobs, kernels=self.kernels,
                                                        sample=not apart)

    def sampler_args(self, logits, batch: PackedBatch, *, num_logprobs: int = -1, guide=None):
        """The (args, kwargs) ``run_step`` calls the sampler's executable with: logits f32[1, R, V]
        on the replica axis (a step's, or their abstract value, which warm-up lowers the sampler on)."""
        return (logits, self.state.slots, batch.active, guide), dict(num_logprobs=num_logprobs, kernels=self.kernels)

    def lower_step(self, batch: PackedBatch, **kw):
        """``run_step``'s step executable lowered on the same arguments (``step_args``'s
        keywords): warm-up compiles it ahead, and the run then builds nothing."""
        args, kwargs = self.step_args(batch, **kw)
        return self._step.lower(*args, **kwargs)

    def lower_sampler(self, logits, batch: PackedBatch, **kw):
        """The sampler's executable (``separate_sampler``) lowered on ``sampler_args``."""
        args, kwargs = self.sampler_args(logits, batch, **kw)
        return self._sampler.lower(*args, **kwargs)

    # ------------------------------------------------------------------ slots
    def committed(self, tree):
        """``tree`` committed to the device of the (one-device) weights (``state.committed``)."""
        return dstate.committed(tree, self.weights)

    def _fresh_slots(self) -> SlotState:
        return dstate.fresh_slots(self.cfg.vocab_size, self.max_num_seqs, self.seed, self.weights, self.mesh, self.D)

    def reset_slots(self) -> None:
        """Every slot idle again (after warm-up sampled into idle slots)."""
        self.state = dataclasses.replace(self.state, slots=self._fresh_slots())

    def _insert_rows(self, replica: int, seqs: list[Seq]) -> None:
        """The slot state of the sequences one plan of replica ``replica`` admitted, in one
        call, padded to a batch bucket (a wave of 64 new rows was 64 calls)."""
        # [S, V] penalty statistics only while some running row (of any replica) has penalties
        need = any(s is not None and smp.needs_vocab_state(s.row.params) for sched in self.scheds for s in sched.slots)
        self.state = dataclasses.replace(self.state, slots=slots_with_vocab_state(self.slots, self.cfg.vocab_size,
                                                                                   need))
        state = functools.partial(slot_states_for, vocab_size=self.cfg.vocab_size, eos_ids=self.tokenizer.eos_ids,
                                  seed=self.seed, vocab_state=need)
        n = buckets.bucket(len(seqs), buckets.BATCH_BUCKETS, self.max_num_seqs)
        at = np.full(n, self.max_num_seqs, np.int32)  # padding rows: dropped
        at[: len(seqs)] = [s.slot for s in seqs]
        self._insert_at(replica, at, state([s.row for s in seqs], batch_size=n))

    def _insert_at(self, replica: int, slot: np.ndarray, new: SlotState) -> None:
        """new (batch n) into replica ``replica``'s slots ``slot`` i32[n] (max_num_seqs: padding,
        dropped)."""
        self.inserts_run.add(len(slot))
        at = replicas.folded_slots(replica, slot, self.max_num_seqs, self.D)
        self.state = dataclasses.replace(self.state, slots=self._insert(self.slots, at, new))
