"""Perplexity cost of the int8 KV cache: teacher-forced perplexity on benchmarks/data/english.txt
with every layer's keys and values read back through a cache of each dtype (evaluate.perplexity
runs without a cache, so it cannot see the KV dtype). Windows of 512 advancing by 256, as there.

    PYTHONPATH=. python benchmarks/kv_int8_perplexity.py smollm2-135m-instruct 8192

Measured (float32 weights, CPU, 2026-11-22):
    smollm2-135m-instruct: 6028 tokens, float32 KV ppl 22.9797, int8 KV ppl 23.0160, +0.158%
    gemma-3-270m:          5911 tokens, float32 KV ppl 47.3152, int8 KV ppl 47.9070, +1.251%
"""

import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import LLM
from jaxinfer import cache as kv
from jaxinfer.models.registry import family_module


@functools.partial(jax.jit, static_argnames=("cfg", "kvd"))
def nll(weights, tokens, *, cfg, kvd):
    """tokens i32[1, T] -> f32[T - 1] negative log-likelihoods, attention over cache reads."""
    mod = family_module(cfg.family)
    c = kv.init_cache(cfg, 1, tokens.shape[1], kvd)
    h, _ = mod.forward(weights, tokens, jnp.zeros(1, jnp.int32), c, cfg=cfg, read_cache=True)
    logp = jax.nn.log_softmax(mod.unembed(weights, h, cfg)[0, :-1], axis=-1)
    return -jnp.take_along_axis(logp, tokens[0, 1:, None], axis=1)[:, 0]

def ppl(llm, ids, kvd, window=512, stride=256):
    """evaluate.perplexity's windows, each scored through a cache of dtype kvd."""
    total, count, scored, begin = 0.0, 0, 1, 0
    while scored < len(ids):
        begin = min(begin, len(ids) - window)
        n = np.asarray(nll(llm.weights, jnp.asarray(ids[None, begin : begin + window]), cfg=llm.cfg, kvd=kvd))
        first = scored - (begin + 1)
        total += float(n[first:].astype(np.float64).sum())
        count += len(n) - first
        scored, begin = begin + window, begin + stride
    return math.exp(total / count), count


if __name__ == "__main__":
    model, ntok = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8192
    llm = LLM(model, max_model_len=1024, progress=False)
    with open("benchmarks/data/english.txt") as f:
        ids = np.asarray(llm.tokenizer.encode(f.read())[:ntok], np.int32)
    f, n = ppl(llm, ids, "float32")
    q, _ = ppl(llm, ids, "int8")
    print(f"{model}: {n} tokens, float32 KV ppl {f:.4f}, int8 KV ppl {q:.4f}, change {100 * (q / f - 1):+.3f}%")
