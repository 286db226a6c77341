"""Engine overhead: continuous-batching decode throughput against a bare jitted decode step.

    python benchmarks/engine_overhead.py --model smollm2-135m-instruct --batch 64 --prompt 128 --new 64

The bare loop calls the engine's own jitted paged decode step back to back with fixed
inputs (no scheduling, no host work) at the same batch size and context; the engine number
is the decode-phase throughput of LLM.generate on `batch` requests of `prompt` tokens
(tokens after each row's first / time from first to last token). Medians of --repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.bench import PASSAGE
    from jaxinfer.engine.buckets import width_bucket as len_bucket_pages

    llm = LLM(a.model, max_model_len=1024, max_num_seqs=a.batch, progress=False)
    eng = llm.engine
    ids = llm.tokenizer.encode(PASSAGE * 20, add_special_tokens=False)
    prompts = [{"prompt_token_ids": ids[i : i + a.prompt]} for i in range(a.batch)]
    sp = SamplingParams(temperature=0, max_tokens=a.new, ignore_eos=True)
    eng.warmup(max_prompt_len=a.prompt, max_len=a.prompt + a.new)

    def engine_run():
        outs = llm.generate(prompts, sp, use_tqdm=False)
        first = min(o.metrics.first_token_time for o in outs)
        last = max(o.metrics.last_token_time for o in outs)
        return sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (last - first)

    B, ps = a.batch, eng.allocator.page_size
    width = len_bucket_pages(-(-(a.prompt + a.new) // ps), eng.pages_per_seq)
    batch = eng.idle_batch(B, width, 0)  # B decode rows, no prefill row
    batch.table[:B] = np.arange(1, B * width + 1).reshape(B, width) % (eng.allocator.num_pages - 1) + 1
    batch.positions[:] = a.prompt + a.new // 2  # the mean context of the engine run
    batch.active[:] = True
    if eng.window:
        wpool = eng.window_allocator.num_pages
        ww = batch.wtable.shape[1]
        batch.wtable[:B] = np.arange(1, B * ww + 1).reshape(B, ww) % (wpool - 1) + 1
        batch.wbase[:B] = max(0, a.prompt + a.new // 2 - eng.window + 1) // ps

    def bare_run():
        t0 = time.perf_counter()
        for _ in range(a.new):
            out = eng.run_step(batch)
        jax.block_until_ready(out.tokens)
        return B * a.new / (time.perf_counter() - t0)

    bare_run()
    pairs = [(bare_run(), engine_run()) for _ in range(a.repeats)]  # interleaved: same noise
    bare = statistics.median(p[0] for p in pairs)
    engine = statistics.median(p[1] for p in pairs)
    print(f"batch {B}, prompt {a.prompt}, new {a.new}: bare decode step {bare:.1f} tok/s, "
          f"engine decode phase {engine:.1f} tok/s, ratio {engine / bare:.3f}")


if __name__ == "__main__":
    main()
