"""TTFT with and without a cached 1,000-token prefix, on one engine in one run.

    python benchmarks/prefix_cache.py --model smollm2-135m-instruct --prefix 1000 --repeats 3

Each repeat uses a fresh prefix (so the first request is truly uncached), sends it with one
suffix, then sends the same prefix with another suffix; both TTFTs are measured after the
engine's buckets are compiled. Prints medians and the ratio cached/uncached.
"""

from __future__ import annotations

import argparse
import statistics


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.bench import PASSAGE

    llm = LLM(a.model, max_model_len=2048, max_num_seqs=4, progress=False)
    ids = llm.tokenizer.encode(PASSAGE * 60, add_special_tokens=False)
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    suffix_a, suffix_b = ids[5:25], ids[40:60]
    llm.engine.warmup(max_prompt_len=a.prefix + 40, max_len=a.prefix + 64)

    def ttft(prompt):
        return llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].metrics.ttft

    cold, warm = [], []
    for r in range(a.repeats + 1):
        prefix = ids[100 + 37 * r : 100 + 37 * r + a.prefix]  # a new prefix each repeat
        c, w = ttft(prefix + suffix_a), ttft(prefix + suffix_b)
        if r:  # the first repeat compiles the cached-prefix chunk shapes
            cold.append(c)
            warm.append(w)
    mc, mw = statistics.median(cold), statistics.median(warm)
    print(f"prefix {a.prefix} tokens: uncached TTFT {mc * 1e3:.1f} ms, cached TTFT {mw * 1e3:.1f} ms, "
          f"ratio {mw / mc:.3f}  (cached prompt tokens so far: {llm.engine.stats['cached_prompt_tokens']})")


if __name__ == "__main__":
    main()
