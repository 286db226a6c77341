"""Compiling ahead: every step shape a workload up to given lengths can hit, run once on the
scratch page with every slot idle, so no executable is built mid-run (``Engine.warmup``)."""

from __future__ import annotations

import jax
import numpy as np

from jaxinfer.engine import buckets


def warmup_shapes(eng, max_prompt_len: int | None = None, max_len: int | None = None) -> list[tuple]:
    """Every (R, width, Tp) a workload whose prompts are at most max_prompt_len tokens and
    whose sequences at most max_len can hit on ``eng`` (a cached prefix or a long prompt's
    earlier chunks may give the prefill row history of up to max_prompt_len positions)."""
    max_len = min(max_len or eng.max_model_len, eng.max_model_len)
    max_prompt = min(max_prompt_len or max_len, max_len)
    ps, chunk = eng.allocator.page_size, eng.config.max_num_batched_tokens
    rows = sorted({0} | {buckets.bucket(n, buckets.BATCH_BUCKETS, eng.max_num_seqs)
                         for n in range(1, eng.max_num_seqs + 1)})
    top_tp = buckets.bucket(min(max_prompt, chunk), buckets.PREFILL_BUCKETS, chunk)
    tps = sorted({0} | {b for b in buckets.PREFILL_BUCKETS if b <= top_tp} | {top_tp})
    widths = sorted({buckets.width_bucket(n, eng.pages_per_seq) for n in range(1, -(-max_len // ps) + 1)})
    return [(R, w, Tp) for R in rows for w in widths for Tp in tps if R or Tp]


def warm(eng, max_prompt_len: int | None = None, max_len: int | None = None) -> int:
    """Compile every step of ``warmup_shapes`` (chained and verification steps included, and
    with LoRA enabled every adapter bucket of each) and every slot-insert bucket; returns the
    number of executables compiled."""
    before = eng.num_compilations()
    # with LoRA adapters, each shape once without adapter rows and once per active-set bucket
    # (1, 2, 4, ..., max_loras: ``buckets.lora_buckets``), its tokens on none of them
    loras = [0] + (buckets.lora_buckets(eng.lora.config.max_loras) if eng.lora is not None else [])
    for R, w, Tp in warmup_shapes(eng, max_prompt_len, max_len):
        for n in loras:
            eng.run_step(eng.idle_batch(R, w, Tp, loras=n))
            if R and not Tp and eng.chainer.enabled:
                _, eng.state = eng.chainer.run(eng.state, eng.idle_batch(R, w, 0, loras=n), np.zeros(R, np.int32), 0,
                                               False, -1)
        for batch, block in eng.drafter.warm_steps(R, w, Tp) if eng.drafter is not None else ():
            eng.run_step(batch, drafts=block)
    eng.reset_slots()  # warm-up sampled into idle slots
    if eng.D == 1:  # every row bucket of _insert_rows, host state as slot_states_for's, all padding
        for n in sorted({buckets.bucket(k, buckets.BATCH_BUCKETS, eng.max_num_seqs)
                         for k in range(1, eng.max_num_seqs + 1)}):
            pad = jax.tree.map(lambda a: jax.device_put(np.repeat(np.asarray(a[:1]), n, axis=0)), eng.slots)
            eng._insert_at(0, np.full(n, eng.max_num_seqs, np.int32), pad)
    jax.block_until_ready(eng.state)
    return eng.num_compilations() - before
