"""What a decode step over a 49,152-token vocabulary can cost at best on this machine: the LM
head, the greedy sampler and the engine's whole plain step, each run many times inside one
jitted ``lax.fori_loop`` (so no per-call dispatch hides or adds to them), beside the machine's
own f32 matmul rate and copy bandwidth.

    python benchmarks/vocab_ceiling.py --batch 1 64 256

The model is ``engine_overhead.py --tiny``'s (2 random layers of width 64, SmolLM2's
vocabulary). Rows, per batch size B, in ms per iteration:

* LM head: hidden f32[B, 1, 64] x [64, 49152] -> logits, then one max over them, whose result
  feeds the next iteration's hidden (so no iteration can be skipped or hoisted; the greedy
  sampler reads the logits at least once anyway).
* head + sampler: the LM head, then ``step.sample_step`` (greedy, min_tokens bans on), whose
  tokens feed the next hidden.
* step: ``step.packed_step`` on B decode rows at context 160, its pools and slots carried
  through the loop and each row's token the previous iteration's (``use_prev``).
* step, dispatched: the same step called back to back from Python (the bare loop of
  ``engine_overhead.py``).

The machine rows: a [2048, 2048] x [2048, 2048] f32 matmul (GFLOP/s) and an f32 copy of 128 MB
(``x * 2``: GB/s read plus written). Medians of --repeats interleaved rounds. Freed memory
stays in glibc's heap unless ``--malloc default`` (``engine_overhead.py``'s docstring says why).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp

from engine_overhead import add_malloc_arg, bare_batch, tiny_llm, use_malloc


def timed(fn, *args, **kw) -> float:
    """Seconds of one call of fn (its outputs waited for)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args, **kw))
    return time.perf_counter() - t0


def machine_rows():
    a = jax.random.normal(jax.random.key(0), (2048, 2048), jnp.float32)
    x = jnp.ones(32 * 2**20, jnp.float32)  # 128 MB
    mm, cp = jax.jit(lambda a: a @ a), jax.jit(lambda x: x * 2.0)
    jax.block_until_ready((mm(a), cp(x)))
    return {"matmul GFLOP/s": lambda: 2 * 2048**3 / timed(mm, a) / 1e9,
            "copy GB/s (read + write)": lambda: 2 * x.nbytes / timed(cp, x) / 1e9}


def batch_rows(B: int, iters: int):
    from jaxinfer.engine import replicas
    from jaxinfer.engine.step import StepInputs, packed_step, sample_step
    from jaxinfer.models.registry import model_family

    llm = tiny_llm(B)
    eng = llm.engine
    cfg, w = eng.cfg, eng.weights
    mod = model_family(cfg.family)
    slots = eng.slots
    # every row bans its stop ids (min_tokens far off): the ban's cost is in the figure
    slots.stop_ids = slots.stop_ids.at[:, :2].set(jnp.asarray([cfg.vocab_size - 1, 0], jnp.int32))
    slots.min_tokens = jnp.full_like(slots.min_tokens, 1 << 30)
    h0 = jax.random.normal(jax.random.key(1), (B, 1, cfg.d_model), jnp.float32)
    sub = jax.tree.map(lambda a: jnp.copy(a[:B]), slots)  # its own buffers: the step loop donates slots

    @functools.partial(jax.jit, static_argnames="n")
    def head(w, h, n):
        def body(_, h):
            lg = mod.unembed(w, h, cfg)  # f32[B, 1, V]
            return h + 1e-30 * jnp.max(lg, axis=-1, keepdims=True)
        return jax.lax.fori_loop(0, n, body, h)

    @functools.partial(jax.jit, static_argnames="n")
    def head_sampler(w, h, sub, n):
        def body(_, c):
            h, sub = c
            lg = mod.unembed(w, h, cfg)[:, 0]
            tok, _, sampling = sample_step(lg, sub.sampling, sub.generated, sub.stop_ids, sub.min_tokens, -1)
            sub = dataclasses.replace(sub, sampling=sampling, generated=sub.generated + 1)
            return h + 1e-30 * tok[:, None, None].astype(h.dtype), sub
        return jax.lax.fori_loop(0, n, body, (h, sub))

    batch = bare_batch(eng, B, 128, 64)
    batch.use_prev[:] = True  # each row's token is the previous iteration's
    step = functools.partial(packed_step, windowed=eng.windowed, pipeline=eng.pipeline, cfg=cfg, num_logprobs=-1,
                             prompt_logprobs=-1, kernels=eng.kernels)

    @functools.partial(jax.jit, static_argnames="n", donate_argnames=("state",))
    def steps(w, batch, state, n):
        return jax.lax.fori_loop(0, n, lambda _, st: step(w, StepInputs(batch), st)[1], state)

    held = {"state": dataclasses.replace(eng.state, slots=slots)}
    jb = jax.device_put(replicas.only(batch))  # packed_step runs one replica

    def run_steps():
        t0 = time.perf_counter()
        held["state"] = jax.block_until_ready(steps(w, jb, held["state"], n=iters))
        return time.perf_counter() - t0

    def run_dispatched():
        eng.state = held["state"]
        t0 = time.perf_counter()
        for _ in range(iters):
            out = eng.run_step(batch)
        jax.block_until_ready(out.tokens)
        dt = time.perf_counter() - t0
        held["state"] = eng.state
        return dt

    timed(head, w, h0, n=iters), timed(head_sampler, w, h0, sub, n=iters), run_steps(), run_dispatched()
    ms = lambda s: s / iters * 1e3
    return {"LM head": lambda: ms(timed(head, w, h0, n=iters)),
            "head + sampler": lambda: ms(timed(head_sampler, w, h0, sub, n=iters)),
            "step": lambda: ms(run_steps()),
            "step, dispatched": lambda: ms(run_dispatched())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--iters", type=int, default=64, help="loop iterations per timing")
    ap.add_argument("--repeats", type=int, default=5)
    add_malloc_arg(ap)
    a = ap.parse_args()
    use_malloc(a.malloc)
    rows = {"machine": machine_rows()}
    for B in a.batch:
        rows[B] = batch_rows(B, a.iters)
    got = {(g, k): [] for g, r in rows.items() for k in r}
    for _ in range(a.repeats):  # interleaved: every figure sees the same noise
        for g, r in rows.items():
            for k, f in r.items():
                got[g, k].append(f())
    med = {gk: statistics.median(v) for gk, v in got.items()}
    for (g, k), v in med.items():
        if g == "machine":
            print(f"{k}: {v:.1f} (min {min(got[g, k]):.1f}, max {max(got[g, k]):.1f})")
    figures = list(rows[a.batch[0]])
    print(f"\n{'ms per iteration':<18}" + "".join(f"{'batch ' + str(B):>11}" for B in a.batch))
    for k in figures:
        print(f"{k:<18}" + "".join(f"{med[B, k]:11.3f}" for B in a.batch))
    if len(a.batch) > 1:
        for B in a.batch[1:]:
            print(f"batch {B} / batch {a.batch[0]}: " + ", ".join(
                f"{k} {med[B, k] / med[a.batch[0], k]:.1f}x" for k in figures))
    gf = med["machine", "matmul GFLOP/s"]
    bw = med["machine", "copy GB/s (read + write)"]
    V, D = 49152, 64
    for B in a.batch:
        print(f"batch {B}: LM head {2 * B * D * V / 1e6:.0f} MFLOP = {2 * B * D * V / gf / 1e6:.3f} ms at the "
              f"matmul rate; its weights and logits {(D * V + B * V) * 4 / 1e6:.1f} MB = "
              f"{(D * V + B * V) * 4 / bw / 1e6:.3f} ms at the copy rate")


if __name__ == "__main__":
    main()
