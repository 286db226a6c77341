"""Compiling ahead: every step shape a workload up to given lengths can hit, run once on the
scratch page with every slot idle, so no executable is built mid-run (``Engine.warmup``).

The executables are compiled first, several at a time on threads (XLA compiles release the
GIL, and no two share any work), then run one after another: jit runs the
executable compiled from ``lower(...).compile()`` on the same arguments, so the runs build
nothing. On a TPU VM host with tens of cores this divides the warm-up's wall time
(``benchmarks/tpu_startup.py`` measures it for a TPU target)."""

from __future__ import annotations

import concurrent.futures
import os

import jax
import numpy as np

from jaxinfer.engine import buckets, multimodal
from jaxinfer.errors import InvalidRequest


def step_shapes(*, max_num_seqs: int, page_size: int, chunk: int, pages_per_seq: int, max_len: int,
                max_prompt: int) -> list[tuple[int, int, int]]:
    """Every (R decode rows, table width in pages, Tp prefill-row tokens) an engine of
    max_num_seqs slots, page_size-token pages, chunk-token prefill rows (max_num_batched_tokens)
    and pages_per_seq pages a sequence can hit, for sequences of at most max_len tokens whose
    prompts are at most max_prompt (a cached prefix or a long prompt's earlier chunks may give
    the prefill row history of up to max_prompt positions)."""
    rows = sorted({0} | {buckets.bucket(n, buckets.BATCH_BUCKETS, max_num_seqs) for n in range(1, max_num_seqs + 1)})
    top_tp = buckets.bucket(min(max_prompt, chunk), buckets.PREFILL_BUCKETS, chunk)
    tps = sorted({0} | {b for b in buckets.PREFILL_BUCKETS if b <= top_tp} | {top_tp})
    widths = sorted({buckets.width_bucket(n, pages_per_seq) for n in range(1, -(-max_len // page_size) + 1)})
    return [(R, w, Tp) for R in rows for w in widths for Tp in tps if R or Tp]


def warmup_shapes(eng, max_prompt_len: int | None = None, max_len: int | None = None) -> list[tuple]:
    """``step_shapes`` of engine ``eng`` for a workload whose prompts are at most
    max_prompt_len tokens and whose sequences at most max_len (default: max_model_len)."""
    max_len = min(max_len or eng.max_model_len, eng.max_model_len)
    return step_shapes(max_num_seqs=eng.max_num_seqs, page_size=eng.allocator.page_size,
                       chunk=eng.config.max_num_batched_tokens, pages_per_seq=eng.pages_per_seq, max_len=max_len,
                       max_prompt=min(max_prompt_len or max_len, max_len))


def compile_threads() -> int:
    """Executables warm-up compiles at once: one per core this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _compile(eng, lower, batch) -> None:
    """Compile one warm-up executable (``lower()`` lowers it); with ``batch``, it is a plain
    step of that batch that samples apart (``Engine.separate_sampler``), and the sampler of its
    rows is compiled after it, on the logits as the step places them."""
    compiled = lower().compile()
    if batch is not None:
        logits = compiled.out_info[0].logits
        logits = jax.ShapeDtypeStruct(logits.shape, logits.dtype, sharding=compiled.output_shardings[0].logits)
        eng.lower_sampler(logits, batch).compile()


def takes_images(eng) -> bool:
    """Whether ``eng`` runs image requests: it has an image encoder, images are allowed
    (limit_mm_per_prompt), and nothing it runs with refuses them (``multimodal.refusal``)."""
    return (multimodal.refusal(eng) is None and eng.images.limit != 0
            and eng.images.mm_tokens <= eng.config.max_num_batched_tokens)


def image_runs(eng, shapes, loras) -> list:
    """warm's runs for the steps that carry image soft tokens: each shape with a prefill row,
    once per LoRA bucket, in the image variant ``multimodal.ImageInputs.attach`` gives."""
    runs = []
    for R, w, Tp in shapes:
        for n in loras if Tp else ():
            batch = eng.images.idle(eng.idle_batch(R, w, Tp, loras=n))
            runs.append((lambda b=batch: eng.run_step(b), lambda b=batch: eng.lower_step(b), None))
    return runs


def _run_chain(eng, chain) -> None:
    _, eng.state = eng.chainer.run(eng.state, *chain)


def warm(eng, max_prompt_len: int | None = None, max_len: int | None = None, *, threads: int | None = None) -> int:
    """Compile every step of ``warmup_shapes`` (chained and verification steps included,
    with LoRA enabled every adapter bucket of each, and for a model that takes images the image
    encoder and each prefill step's image variant), the sampler of each row bucket where plain
    steps sample apart (``Engine.separate_sampler``), and every slot-insert bucket; returns the
    number of executables compiled. threads: executables compiled at once (default
    ``compile_threads()``; 1: each as it first runs)."""
    if threads is not None and threads < 1:
        raise InvalidRequest(f"compile threads must be >= 1, got {threads}")
    before = eng.num_compilations()
    # with LoRA adapters, each shape once without adapter rows and once per active-set bucket
    # (1, 2, 4, ..., max_loras: ``buckets.lora_buckets``), its tokens on none of them
    loras = [0] + (buckets.lora_buckets(eng.lora.config.max_loras) if eng.lora is not None else [])
    # (run it, lower it, the batch whose rows' sampler is compiled after it or None) in warm-up's order
    runs, sampled = [], set()
    for R, w, Tp in warmup_shapes(eng, max_prompt_len, max_len):
        for n in loras:
            batch = eng.idle_batch(R, w, Tp, loras=n)
            first = eng.separate_sampler and R and R not in sampled  # the first plain step of R rows
            sampled.add(R)
            runs.append((lambda b=batch: eng.run_step(b), lambda b=batch: eng.lower_step(b), batch if first else None))
            if R and not Tp and eng.chainer.enabled:
                chain = (eng.idle_batch(R, w, 0, loras=n), np.zeros(R, np.int32), 0, False, -1)
                runs.append((lambda c=chain: _run_chain(eng, c), lambda c=chain: eng.chainer.lower(eng.state, *c), None))
        for batch, block in eng.drafter.warm_steps(R, w, Tp) if eng.drafter is not None else ():
            runs.append((lambda b=batch, d=block: eng.run_step(b, drafts=d),
                         lambda b=batch, d=block: eng.lower_step(b, drafts=d), None))
    if takes_images(eng):  # the encoder once per image bucket, and each step's image variant
        eng.images.warm_encoder()
        runs += image_runs(eng, warmup_shapes(eng, max_prompt_len, max_len), loras)
    threads = compile_threads() if threads is None else threads
    if threads > 1:
        # lowered on the device state as it is now; each run below donates and replaces it with
        # arrays of the same shapes and placement, so the runs find these executables
        with concurrent.futures.ThreadPoolExecutor(min(threads, len(runs) or 1)) as pool:
            for f in [pool.submit(_compile, eng, lower, batch) for _, lower, batch in runs]:
                f.result()
    for run, _, _ in runs:
        run()
    eng.reset_slots()  # warm-up sampled into idle slots
    # every row bucket of _insert_rows, host state as slot_states_for's, all padding
    for n in sorted({buckets.bucket(k, buckets.BATCH_BUCKETS, eng.max_num_seqs) for k in range(1, eng.max_num_seqs + 1)}):
        pad = jax.tree.map(lambda a: jax.device_put(np.repeat(np.asarray(a[:1]), n, axis=0)), eng.slots)
        eng._insert_at(0, np.full(n, eng.max_num_seqs, np.int32), pad)
    jax.block_until_ready(eng.state)
    return eng.num_compilations() - before
