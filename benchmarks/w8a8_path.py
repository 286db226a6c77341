"""The w8a8 path step by step (prefill, 64-row and batch-1 decode): whole model steps and
their parts.

Steps, timed on the real model through its own ``forward`` + ``unembed`` with a dense cache
(no engine, no sampling): a prefill of [1, T] tokens, a decode step of B rows at context C,
and a batch-1 decode step. Each scheme's steps are jitted once and timed interleaved with
the others, ``--repeats`` rounds of ``--reps`` calls each; medians are reported.

``--parts`` also times, on the same model's layer-0 weights, the pieces a w8a8 layer is
made of (activation quantization, each dot, the rescale), so the step can be split into
them. ``--generate`` times batch-1 greedy decoding through ``LLM.generate`` (one prompt,
``--new`` tokens, EOS ignored).

    python benchmarks/w8a8_path.py --schemes float32 w8a8 int8 --parts --generate
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from timing import median_seconds  # noqa: E402


def timed(fn, *args, reps: int) -> float:
    """Median ms of ``reps`` calls (one warm call first)."""
    return 1e3 * median_seconds(fn, *args, reps=reps)


def steps(llm, *, prefill: int, batch: int, context: int):
    """{step name: (jitted fn, args)} for one loaded model."""
    from jaxinfer import cache as kv
    from jaxinfer.models.registry import model_family

    cfg, weights = llm.cfg, llm.weights
    mod = model_family(cfg.family)

    def run(w, tokens, start, cache, read_cache):
        x, cache = mod.forward(w, tokens, start, cache, cfg=cfg, read_cache=read_cache)
        return mod.unembed(w, x[:, -1:], cfg), cache

    pre = jax.jit(lambda w, t, c: run(w, t, jnp.zeros(1, jnp.int32), c, False))
    dec = jax.jit(lambda w, t, s, c: run(w, t, s, c, True))
    rng = np.random.default_rng(0)
    tok = lambda b, t: jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)  # noqa: E731
    return {
        f"prefill [1,{prefill}]": (pre, (weights, tok(1, prefill), kv.init_cache(cfg, 1, prefill))),
        f"decode {batch} rows @{context}": (
            dec, (weights, tok(batch, 1), jnp.full(batch, context, jnp.int32),
                  kv.init_cache(cfg, batch, context + 1))),
        f"decode 1 row @{context}": (
            dec, (weights, tok(1, 1), jnp.full(1, context, jnp.int32), kv.init_cache(cfg, 1, context + 1))),
    }


def parts(llm, M: int, reps: int) -> dict[str, float]:
    """ms of each piece of one w8a8 layer at M rows (layer-0 weights of a w8a8 model)."""
    from jaxinfer import quant
    from jaxinfer.models.layers import dot

    w = llm.weights["layers"][0]
    D, F = llm.cfg.d_model, llm.cfg.d_ff
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(M, 1, D)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(M, 1, F)), jnp.float32)
    out = {}
    out["quantize x [M,D]"] = timed(jax.jit(lambda x: quant.quantize_rows(x)), h[:, 0], reps=reps)
    out["quantize x [M,F]"] = timed(jax.jit(lambda x: quant.quantize_rows(x)), g[:, 0], reps=reps)
    out["smooth*x + quantize [M,D]"] = timed(
        jax.jit(lambda x, s: quant.quantize_rows(x * s)), h[:, 0], jnp.ones(D), reps=reps)
    xq, _ = quant.quantize_rows(h[:, 0])
    gq, _ = quant.quantize_rows(g[:, 0])
    s8 = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                                  preferred_element_type=jnp.int32))
    for n in ("wq", "wk", "wv", "w_gate", "w_up"):
        out[f"s8 dot {n}"] = timed(s8, xq, w[n].values, reps=reps)
    out["s8 dot w_down"] = timed(s8, gq, w["w_down"].values, reps=reps)
    acc = s8(xq, w["w_up"].values)
    out["rescale [M,F]"] = timed(jax.jit(lambda a, xs, s: a.astype(jnp.float32) * xs[:, None] * s),
                                 acc, jnp.ones(M), w["w_up"].scale, reps=reps)
    out["whole dot wq (einsum)"] = timed(jax.jit(lambda x, q: dot("BTD,DNH->BTNH", x, q)), h, w["wq"], reps=reps)
    out["whole dot w_up (einsum)"] = timed(jax.jit(lambda x, q: dot("BTD,DF->BTF", x, q)), h, w["w_up"], reps=reps)
    out["whole dot w_down (einsum)"] = timed(jax.jit(lambda x, q: dot("BTF,FD->BTD", x, q)), g, w["w_down"],
                                             reps=reps)
    return out


def generate_tok_s(llm, new: int) -> float:
    from jaxinfer import SamplingParams
    from jaxinfer.bench import PASSAGE

    ids = llm.tokenizer.encode(PASSAGE, add_special_tokens=False)[:32]
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids}], sp)  # compile
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], sp)
    dt = time.perf_counter() - t
    n = len(out[0].outputs[0].token_ids)
    return n / dt


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--schemes", nargs="+", default=["float32", "w8a8"])
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--no-steps", dest="steps", action="store_false")
    ap.add_argument("--generate", action="store_true")
    ap.add_argument("--new", type=int, default=128)
    a = ap.parse_args()
    from jaxinfer import LLM

    print(f"jax {jax.__version__}, load average {os.getloadavg()[0]:.1f} at start")
    llms = {s: LLM(a.model, quantize=None if s == "float32" else s, max_num_seqs=1, max_model_len=1024,
                   progress=False) for s in a.schemes}
    fns = {s: steps(m, prefill=a.prefill, batch=a.batch, context=a.context) for s, m in llms.items()}
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(a.repeats if a.steps else 0):
        for s, d in fns.items():
            for name, (fn, args) in d.items():
                times.setdefault((s, name), []).append(timed(fn, *args, reps=a.reps))
    print("| scheme | step | median ms | tok/s |")
    print("|---|---|---|---|")
    for (s, name), ts in times.items():
        ms = statistics.median(ts)
        toks = a.prefill if name.startswith("prefill") else (a.batch if " rows" in name else 1)
        print(f"| {s} | {name} | {ms:.2f} | {1e3 * toks / ms:.0f} |")
    if a.parts:
        for s in a.schemes:
            if s != "w8a8":
                continue
            for M in (a.prefill, a.batch, 1):
                print(f"\nw8a8 layer parts at M={M} (ms, median of {a.reps * a.repeats})")
                for k, v in parts(llms[s], M, a.reps * a.repeats).items():
                    print(f"  {k:28s} {v:.3f}")
    if a.generate:
        for s, m in llms.items():
            print(f"batch-1 generate {s}: {generate_tok_s(m, a.new):.1f} tok/s")
    print(f"load average {os.getloadavg()[0]:.1f} at end")


if __name__ == "__main__":
    main()
