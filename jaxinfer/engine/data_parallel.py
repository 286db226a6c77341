"""Data parallelism within one process: D replicas of the paged engine over the mesh's
"data" axis, each with its own decode slots and page pools, run by one host loop in one
jitted step.

Every device array of the one-replica engine gains a leading replica axis of size D, split
over "data": the page pools [D, P, K, ps, H] (and split over "model" like one replica's, see
``sharding.kv_pool_shardings``), the slot state [D, S, ...] and each step's ``PackedBatch``
[D, ...]. The step is ``jax.vmap`` of ``step.packed_step`` over that axis with the weights
shared (replicated over "data", split over "model"), so each data group of devices computes
its own replica and no replica reads another's pages.

On the host each replica has its own ``Scheduler`` (admission, pages, preemption, prefix
cache); a new row goes to the replica with the least work queued or running. Every
iteration plans each replica, pads every replica's batch to the largest replica's bucketed
shape (R, width, Tp) so one executable runs them all, and reads the step's tokens before
planning the next (synchronous: no overlap of host and device work, unlike
``PagedEngine.step``). Speculative decoding and structured output are refused here.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer import cache as kv
from jaxinfer import kernels
from jaxinfer.config import ModelConfig
from jaxinfer.engine import buckets
from jaxinfer.engine.batch import build_batch, plan_shape
from jaxinfer.engine.compiles import CompileCounter
from jaxinfer.engine.paged import (EngineConfig, PagedEngine, kv_budget, _InFlight, _prompt_logprob_segments, pool_sizes,
                                   slot_state_for)
from jaxinfer.engine.rows import Row, record_token
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.step import make_slots, packed_step
from jaxinfer.errors import InvalidRequest
from jaxinfer.models.packed import PackedBatch
from jaxinfer.sharding import kv_pool_shardings


def data_parallel_step(weights, batch: PackedBatch, k_pages, v_pages, slots, *, mesh, cfg, windowed,
                       num_logprobs: int, prompt_logprobs: int, kernel_mode: kernels.KernelMode):
    """``packed_step`` of every replica at once: batch, pools and slots carry a leading
    replica axis [D, ...] split over "data"; the weights are shared -> (StepOutput [D, ...],
    pools, slots). A ``shard_map`` manual over "data" only (the "model" axis stays with the
    partitioner, as in one replica): each data group runs its own replica and nothing crosses
    replicas. (``jax.vmap`` over the replica axis let the partitioner all-gather the sampling
    step's logits across replicas.)"""
    def one(w, b, k, v, s):
        b, k, v, s = jax.tree.map(lambda a: a[0], (b, k, v, s))
        out, k, v, s = packed_step(w, b, k, v, s, None, cfg=cfg, windowed=windowed, num_logprobs=num_logprobs,
                                   prompt_logprobs=prompt_logprobs, kernel_mode=kernel_mode)
        return jax.tree.map(lambda a: a[None], (out, k, v, s))

    rep, split = PartitionSpec(), PartitionSpec("data")
    return jax.shard_map(one, mesh=mesh, in_specs=(rep, split, split, split, split), out_specs=split,
                         axis_names={"data"}, check_vma=False)(weights, batch, k_pages, v_pages, slots)


def _insert_replica(slots, replica, slot, row):
    """Place one sequence's slot state (batch 1) into slot ``slot`` of replica ``replica``."""
    return jax.tree.map(lambda a, r: a.at[replica, slot].set(r[0]), slots, row)


class DataParallelEngine(PagedEngine):
    """The paged engine's interface (``add``, ``abort``, ``step``, ``run``, ``warmup``) over D
    replicas. ``config`` is one replica's: each has max_num_seqs slots and its own pools."""

    supports_guided_decoding = False

    def __init__(self, cfg: ModelConfig, weights, tokenizer, *, max_model_len: int,
                 config: EngineConfig = EngineConfig(), seed: int = 0, mesh):
        self.cfg, self.weights, self.tokenizer = cfg, weights, tokenizer
        self.max_model_len, self.config, self.seed, self.mesh = max_model_len, config, seed, mesh
        self.D = D = mesh.shape["data"]
        self.max_num_seqs = config.max_num_seqs
        ps = config.block_size
        self.pages_per_seq = -(-max_model_len // ps)
        self.kv_dtype = kv_dtype = kv.kv_storage_dtype(config.kv_cache_dtype, cfg)
        self.window, num_pages, num_window_pages = pool_sizes(cfg, config, kv_dtype, self.pages_per_seq,
                                                              kv_budget(config, mesh.devices[0].flat))
        self.scheds = [Scheduler(max_num_seqs=config.max_num_seqs, page_size=ps, num_pages=num_pages,
                                 prefill_chunk=config.max_num_batched_tokens, prefix_caching=config.enable_prefix_caching,
                                 scheduling=config.scheduling_policy, window=self.window,
                                 num_window_pages=num_window_pages) for _ in range(D)]
        self.sched = self.scheds[0]  # page sizes and counts, the same in every replica
        self.allocator, self.window_allocator = self.sched.allocator, self.sched.window_allocator
        cache = kv.init_paged_cache(cfg, num_pages, ps, kv_dtype, num_window_pages=num_window_pages)
        self.windowed = cache.windowed
        pool = kv_pool_shardings(mesh, cfg, leading=("data",))
        stack = lambda a: jnp.broadcast_to(a, (D,) + a.shape)  # noqa: E731
        self.k_pages, self.v_pages = jax.device_put(jax.tree.map(stack, (cache.k, cache.v)), (pool, pool))
        self._slot_sharding = NamedSharding(mesh, PartitionSpec("data"))
        self.slots = self._fresh_slots()
        self._compiles = CompileCounter()  # PagedEngine.num_compilations reads it
        self.draft_kv = self.eagle_kv = None  # no draft pools: speculation is refused under data parallelism
        self._step = self._compiles.counted(jax.jit(
            functools.partial(data_parallel_step, mesh=mesh, windowed=self.windowed),
            static_argnames=("cfg", "num_logprobs", "prompt_logprobs", "kernel_mode"),
            donate_argnames=("k_pages", "v_pages", "slots")))
        self._insert = self._compiles.counted(jax.jit(_insert_replica, donate_argnames=("slots",)))
        self.pipeline = None
        self.spec, self.spec_stats, self._heads = None, None, None
        self._seqs: dict[int, tuple[int, object]] = {}  # id(row) -> (replica, its sequence)
        self._inflight = None
        self.shapes_run: set[tuple] = set()

    def _fresh_slots(self):
        one = make_slots(self.cfg.vocab_size, self.max_num_seqs, self.seed)
        return jax.device_put(jax.tree.map(lambda a: jnp.broadcast_to(a, (self.D,) + a.shape), one),
                              self._slot_sharding)

    # ------------------------------------------------------------------ reports
    @property
    def stats(self) -> dict:
        out: dict = {}
        for s in self.scheds:
            for k, v in s.stats.items():  # peak_pages: the sum of the replicas' peaks
                out[k] = out.get(k, 0) + v
        return out

    def num_running(self) -> int:
        return sum(s is not None for sc in self.scheds for s in sc.slots)

    def num_waiting(self) -> int:
        return sum(len(sc.waiting) for sc in self.scheds)

    def kv_usage(self) -> float:
        return sum(sc.allocator.num_used for sc in self.scheds) / max(self.D * (self.allocator.num_pages - 1), 1)

    # ------------------------------------------------------------------ requests
    def add(self, row: Row) -> None:
        """Validate a row and queue it on the replica with the least work."""
        if row.guided is not None:
            raise InvalidRequest("structured output (guided_decoding) is not supported with data_parallel_size > 1")
        self.validate(row)
        if row.params.prompt_logprobs is not None:
            row.prompt_logprobs = [None]
        d = min(range(self.D), key=lambda i: (len(self.scheds[i].waiting) + len(self.scheds[i].running()), i))
        self._seqs[id(row)] = (d, self.scheds[d].add(row))

    def abort(self, row: Row) -> None:
        found = self._seqs.pop(id(row), None)
        if found is not None:
            self.scheds[found[0]].abort(found[1])

    def has_unfinished(self) -> bool:
        return any(s.has_work() for s in self.scheds)

    def run(self, rows):
        incoming = iter(rows)
        exhausted = False
        while True:
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
        """One iteration: plan every replica, run them in one step, read back its tokens."""
        plans = [s.plan() for s in self.scheds]
        for d, plan in enumerate(plans):
            for seq in plan.inserted:
                new = slot_state_for(seq.row, self.cfg.vocab_size, self.tokenizer.eos_ids, self.seed)
                self.slots = self._insert(self.slots, jnp.int32(d), jnp.int32(seq.slot), new)
        if not any(p.decode or p.prefill for p in plans):
            return []
        kw = dict(q=1, pages_per_seq=self.pages_per_seq, max_num_seqs=self.max_num_seqs,
                  prefill_chunk=self.config.max_num_batched_tokens)
        shape = tuple(int(x) for x in np.max([plan_shape(p, s, **kw) for p, s in zip(plans, self.scheds)], axis=0))
        want = [g.seq.row.params.prompt_logprobs for p in plans for g in p.prefill if g.seq.wants_prompt_logprobs]
        batches = [build_batch(p, s, pad_id=self.tokenizer.pad_id, want_targets=bool(want), shape=shape, **kw)
                   for p, s in zip(plans, self.scheds)]
        batch = jax.tree.map(lambda *a: np.stack(a), *batches)
        num_lp = buckets.logprob_bucket([s.row.params.logprobs for p in plans for s in p.decode])
        plp = buckets.logprob_bucket(want)
        out = _host_readable(self.run_step(batch, num_logprobs=num_lp, prompt_logprobs=plp))
        for p, s in zip(plans, self.scheds):
            for seq in p.decode:
                seq.inflight += 1
            s.prefill_done(p.prefill)
            if p.decode:
                s.stats["decode_steps"] += 1
        toks = np.asarray(out.tokens) if out.tokens is not None else None
        host_lp = jax.device_get(out.logprobs) if out.logprobs is not None else None
        host_plp = jax.device_get(out.prompt_logprobs) if out.prompt_logprobs is not None else None
        now = time.perf_counter()
        done = []
        for d, (p, sched) in enumerate(zip(plans, self.scheds)):
            segs = _prompt_logprob_segments(p)
            if segs:
                self._record_prompt_logprobs(_InFlight([], segs, None), tuple(x[d] for x in host_plp))
            for seq in p.decode:
                if seq.slot < 0 or seq.row.checker.finished:
                    continue
                seq.inflight -= 1
                seq.computed = len(seq.tokens)
                sched.register_full_pages(seq)
                lp = None if host_lp is None else tuple(x[d] for x in host_lp)
                if record_token(seq.row, int(toks[d, seq.slot]), lp, seq.slot, now, self.tokenizer):
                    sched.release(seq)
                    self._seqs.pop(id(seq.row), None)
                    done.append(seq.row)
        return done

    def run_step(self, batch: PackedBatch, *, num_logprobs: int = -1, prompt_logprobs: int = -1, guide=None):
        """One step of every replica (batch with a leading replica axis); returns its StepOutput."""
        if guide is not None:
            raise InvalidRequest("structured output is not supported with data_parallel_size > 1")
        self.shapes_run.add((batch.rows, batch.table.shape[-1], batch.seg.shape[-1], batch.q, num_logprobs,
                             prompt_logprobs))
        out, self.k_pages, self.v_pages, self.slots = self._step(
            self.weights, batch, self.k_pages, self.v_pages, self.slots, cfg=self.cfg, num_logprobs=num_logprobs,
            prompt_logprobs=prompt_logprobs, kernel_mode=kernels.current_mode())
        return out

    def idle_batch(self, rows: int, width: int, prefill: int, q: int = 1) -> PackedBatch:
        one = super().idle_batch(rows, width, prefill, q)
        return jax.tree.map(lambda a: np.stack([a] * self.D), one)

    def warmup(self, max_prompt_len: int | None = None, max_len: int | None = None) -> int:
        before = self.num_compilations()
        for R, w, Tp in self.warmup_shapes(max_prompt_len, max_len):
            self.run_step(self.idle_batch(R, w, Tp))
        self.slots = self._fresh_slots()
        jax.block_until_ready(self.k_pages)
        return self.num_compilations() - before


def _host_readable(out):
    """A step's output, readable on this host: on a mesh spanning several processes each holds
    only its own replicas' rows, so they are gathered (every process plans every replica)."""
    leaves = [x for x in jax.tree.leaves(out) if isinstance(x, jax.Array)]
    if all(x.is_fully_addressable for x in leaves):
        return out
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(out, tiled=True)

