"""Perplexity cost of the int8 KV cache: teacher-forced perplexity on benchmarks/data/english.txt
with every layer's keys and values read back through a cache of each dtype
(``jaxinfer.evaluate.perplexity(..., kv_cache_dtype=...)``; windows of 512 advancing by 256).

    python benchmarks/kv_int8_perplexity.py smollm2-135m-instruct gemma-3-270m

Measured (float32 weights, CPU, 2026-11-22):
    smollm2-135m-instruct: 6028 tokens, float32 KV ppl 22.9797, int8 KV ppl 23.0160, +0.158%
    gemma-3-270m:          5911 tokens, float32 KV ppl 47.3152, int8 KV ppl 47.9070, +1.251%
"""

import sys
from pathlib import Path

from jaxinfer import LLM
from jaxinfer.evaluate import perplexity

TEXT = (Path(__file__).parent / "data" / "english.txt").read_text()


def main():
    for name in sys.argv[1:] or ["smollm2-135m-instruct"]:
        llm = LLM(name, max_model_len=8192, progress=False)
        f = perplexity(llm, TEXT, kv_cache_dtype="float32")
        q = perplexity(llm, TEXT, kv_cache_dtype="int8")
        print(f"{name}: {f.tokens} tokens, float32 KV ppl {f.perplexity:.4f}, int8 KV ppl "
              f"{q.perplexity:.4f}, {100 * (q.perplexity / f.perplexity - 1):+.3f}%", flush=True)


if __name__ == "__main__":
    main()
