"""Engine overhead: continuous-batching decode throughput against a bare jitted decode step,
where the engine's host time goes, and how many executables each ``generate`` builds.

    python benchmarks/engine_overhead.py --tiny --batch 1 64 256
    python benchmarks/engine_overhead.py --model smollm2-135m-instruct --batch 64
    python benchmarks/engine_overhead.py --tiny --batch 1 64 --num-scheduler-steps 1 4 8 16

``--tiny``: a random 2-layer, d=64 Llama with SmolLM2's 49,152-token vocabulary and tokenizer
(``loaders.random_weights``), so the sampler, the LM head and the host loop weigh what they
weigh on the real model while the layers cost almost nothing.

The bare loop calls the engine's own jitted paged decode step back to back with fixed inputs
(no scheduling, no host work) at the same batch size and context; the engine number is the
steady decode phase of LLM.generate on ``batch`` requests of ``prompt`` tokens: from the
moment the last row got its first token (every prompt prefilled, every row decoding, as in
the bare step) to the last token, per step. Medians of --repeats, interleaved.
Each generate gets prompts of its own (same lengths), so a warm one runs the shapes the first
ran; the executables each builds are counted (``Engine.num_compilations``, and every
lowering in the process), and once more for the first prompts again, whose prefix-cache hits
make shorter prefill rows with history: new step shapes. ``--num-scheduler-steps``: one engine
per value (decode steps chained on device), their generates interleaved; the host split and
the second pass of the first prompts are the first value's.

The host split wraps the engine's own methods with timers during one more generate: schedule
(``Scheduler.plan``), insert (new rows' slot state), build (the step's host arrays), dispatch
(the jitted step's call, which returns before the device finishes), consume (reading the
step's tokens: mostly waiting for the device) and, inside it, detokenize and stop checks.

The process keeps freed memory in glibc's heap (``jaxinfer.hostmem``), as the ``jaxinfer``
command does: under glibc's own settings (``--malloc default``) each call of a step faults in
and zeroes its temporary buffers again (at batch 64 the f32[64, 49152] logits, 3,072 pages),
a per-call cost that a step looped on device, or a chain of steps, pays once.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import jax
import numpy as np
from jax import monitoring

from jaxinfer.engine.compiles import LOWERING_EVENT

_lowerings = [0]


def _count_lowering(event: str, secs: float, **kwargs) -> None:
    if event == LOWERING_EVENT:
        _lowerings[0] += 1


def add_malloc_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--malloc", choices=["keep", "default"], default="keep",
                    help="keep: freed memory stays in glibc's heap (jaxinfer.hostmem), as the jaxinfer "
                         "command does; default: glibc's own settings")


def use_malloc(malloc: str) -> None:
    if malloc == "keep":
        from jaxinfer.hostmem import keep_freed_memory

        if not keep_freed_memory():
            raise SystemExit("--malloc keep: this C library has no mallopt; pass --malloc default")


def tiny_llm(batch: int, max_model_len: int = 1024, num_scheduler_steps: int | None = None,
             separate_sampler: bool | None = None):
    """The tiny model's LLM: SmolLM2's tokenizer and vocabulary over 2 random layers of width 64."""
    from jaxinfer import LLM, registry
    from jaxinfer.config import ModelConfig
    from jaxinfer.loaders.gguf import GGUFCheckpoint
    from jaxinfer.loaders.random_weights import random_loaded
    from jaxinfer.tokenizer import tokenizer_from_gguf

    path = registry.resolve("smollm2-135m-instruct", progress=False)
    tok = tokenizer_from_gguf(GGUFCheckpoint(path).metadata)
    cfg = ModelConfig("llama", vocab_size=49152, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                      d_ff=128, max_position=max_model_len, name="tiny-smollm2-vocab")
    return LLM(random_loaded(cfg, tokenizer=tok), max_model_len=max_model_len, max_num_seqs=batch, progress=False,
               num_scheduler_steps=num_scheduler_steps, separate_sampler=separate_sampler)


def bare_batch(eng, B: int, prompt: int, new: int):
    """B decode rows (no prefill row) at the mean context of the engine run (prompt + new / 2),
    over distinct pages: the bare step's fixed input (on the replica axis, one replica)."""
    from jaxinfer.engine import replicas
    from jaxinfer.engine.buckets import width_bucket

    ps = eng.allocator.page_size
    width = width_bucket(-(-(prompt + new) // ps), eng.pages_per_seq)
    batch = replicas.only(eng.idle_batch(B, width, 0))
    batch.table[:B] = np.arange(1, B * width + 1).reshape(B, width) % (eng.allocator.num_pages - 1) + 1
    batch.positions[:] = prompt + new // 2
    batch.active[:] = True
    if eng.window:
        wpool = eng.window_allocator.num_pages
        ww = batch.wtable.shape[1]
        batch.wtable[:B] = np.arange(1, B * ww + 1).reshape(B, ww) % (wpool - 1) + 1
        batch.wbase[:B] = max(0, prompt + new // 2 - eng.window + 1) // ps
    return replicas.stack([batch])


class HostSplit:
    """Timers around the engine's host phases (see the module docstring)."""

    def __init__(self, eng):
        from jaxinfer.engine import consume as consume_mod
        from jaxinfer.engine import engine as engine_mod
        from jaxinfer.sampling.stop import StopChecker
        from jaxinfer.tokenizer import IncrementalDetokenizer

        self.t = collections.Counter()
        self._undo = []
        self._wrap(eng.sched, "plan", "schedule")
        self._wrap(eng, "_insert_rows", "insert")
        self._wrap(eng, "build", "build")
        self._wrap(eng, "run_step", "dispatch")
        self._wrap(eng.chainer, "run", "dispatch")
        self._wrap(engine_mod, "consume", "consume")
        self._wrap(consume_mod, "record_token", "record")
        self._wrap(IncrementalDetokenizer, "add", "detokenize")
        self._wrap(StopChecker, "update", "stop checks")

    def _wrap(self, obj, name, label):
        fn = getattr(obj, name)
        had = name in vars(obj)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[label] += time.perf_counter() - t0

        setattr(obj, name, timed)
        self._undo.append(lambda: setattr(obj, name, fn) if had else delattr(obj, name))

    def close(self):
        for u in reversed(self._undo):
            u()


def device_split(eng, B: int, n: int) -> dict:
    """Seconds per call of the bare step's pieces, each jitted alone on the step's own inputs:
    the LM head (hidden f32[B, 1, D] -> logits f32[B, V]) and the sampler (``step.sample_step``
    on those logits with the slots' state); the layers and the rest are what the full step
    costs beyond them."""
    import jax.numpy as jnp

    from jaxinfer.engine.step import sample_step
    from jaxinfer.models.registry import model_family

    mod = model_family(eng.cfg.family)
    h = jax.random.normal(jax.random.key(0), (B, 1, eng.cfg.d_model), jnp.float32)
    head = jax.jit(lambda w, x: mod.unembed(w, x, eng.cfg)[:, 0])
    sub = jax.tree.map(lambda a: a[:B], eng.slots)
    samp = jax.jit(lambda lg, s: sample_step(lg, s.sampling, s.generated, s.stop_ids, s.min_tokens, -1)[0])
    logits = head(eng.weights, h)

    def per_call(fn, *args):
        jax.block_until_ready(fn(*args))
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / n

    return {"LM head": per_call(head, eng.weights, h), "sampler": per_call(samp, logits, sub)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tiny", action="store_true", help="a random 2-layer d=64 model with SmolLM2's vocabulary")
    ap.add_argument("--batch", type=int, nargs="+", default=[64])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-scheduler-steps", type=int, nargs="+", default=[None],
                    help="decode steps chained on device, one engine per value (default: the platform's)")
    ap.add_argument("--separate-sampler", action=argparse.BooleanOptionalAction, default=None,
                    help="plain steps sample in an executable of their own (default: the platform's choice)")
    add_malloc_arg(ap)
    a = ap.parse_args()
    use_malloc(a.malloc)
    monitoring.register_event_duration_secs_listener(_count_lowering)
    rows = []
    for B in a.batch:
        rows.append(run_one(a, B))
    print(f"\n{'batch':>5} {'steps':>5} {'bare ms/step':>12} {'engine ms/step':>14} {'generate tok/s':>14} "
          f"{'engine/bare':>11} {'built 1st':>9} {'built 2nd':>9} {'2nd, all lowerings':>18}")
    for r in rows:
        for S, e in r["engine_ms"].items():
            print(f"{r['B']:5d} {S or 'auto':>5} {r['bare_ms']:12.2f} {e:14.2f} {r['gen'][S]:14.0f} "
                  f"{r['bare_ms'] / e:11.3f} {r['built'][S][0]:9d} {r['built'][S][1]:9d} {r['lowered'][S][1]:18d}")
    if len(rows) > 1:
        print(f"bare step at batch {rows[-1]['B']} / batch {rows[0]['B']}: {rows[-1]['bare_ms'] / rows[0]['bare_ms']:.1f}x")


def run_one(a, B: int) -> dict:
    from jaxinfer import LLM, SamplingParams

    steps = a.num_scheduler_steps
    llms = {S: tiny_llm(B, num_scheduler_steps=S, separate_sampler=a.separate_sampler) if a.tiny else
            LLM(a.model, max_model_len=1024, max_num_seqs=B, progress=False, num_scheduler_steps=S,
                separate_sampler=a.separate_sampler) for S in steps}
    llm = llms[steps[0]]
    eng = llm.engine
    def prompts_of(k):  # the k-th set of B prompts: same lengths, no prefix shared with another set
        rng = np.random.default_rng(k)
        return [{"prompt_token_ids": [int(t) for t in rng.integers(100, 40000, a.prompt)]} for _ in range(B)]

    sp = SamplingParams(temperature=0, max_tokens=a.new, ignore_eos=True)
    # no warm-up: the first generate builds what it runs (counted below)

    built, lowered, walls = {S: [] for S in steps}, {S: [] for S in steps}, {S: [] for S in steps}

    def engine_run(S):
        e = llms[S].engine
        c0, l0 = e.num_compilations(), _lowerings[0]
        t0 = time.perf_counter()
        outs = llms[S].generate(prompts_of(len(built[S])), sp, use_tqdm=False)
        walls[S].append(time.perf_counter() - t0)
        built[S].append(e.num_compilations() - c0)
        lowered[S].append(_lowerings[0] - l0)
        # every row decodes from the last first token on: the last admitted row's new - 1 steps
        first = max(o.metrics.first_token_time for o in outs)
        last = max(o.metrics.last_token_time for o in outs)
        # nan when every decode token came back in one read (a chain as long as the run)
        return (last - first) / (a.new - 1) if last > first else float("nan")  # seconds per decode step

    batch = bare_batch(eng, B, a.prompt, a.new)

    def bare_run():
        t0 = time.perf_counter()
        for _ in range(a.new):
            out = eng.run_step(batch)
        jax.block_until_ready(out.tokens)
        return (time.perf_counter() - t0) / a.new

    for S in steps:
        engine_run(S)  # the first generate builds its step shapes (counted, not timed)
    bare_run()
    dev = device_split(eng, B, a.new)
    eng.reset_slots()  # the bare steps sampled into the slots
    runs = []
    for _ in range(a.repeats):  # interleaved: same noise
        runs.append(({S: engine_run(S) for S in steps}, bare_run()))
    eng.reset_slots()
    bare = statistics.median(p[1] for p in runs)
    engines = {S: statistics.median(p[0][S] for p in runs) for S in steps}
    # tokens a chain samples are read (and stamped) together, so first-to-last token time
    # undercounts a chained engine's decode steps; the whole generate's wall does not
    gen_tok_s = {S: B * a.new / statistics.median(walls[S][1:]) for S in steps}

    split = HostSplit(eng)
    t0 = time.perf_counter()
    llm.generate(prompts_of(len(built[steps[0]])), sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    split.close()
    # the first prompts again: their cached prefixes leave short prefill rows with history,
    # step shapes the first generate did not run
    c0 = eng.num_compilations()
    llm.generate(prompts_of(0), sp, use_tqdm=False)
    again = eng.num_compilations() - c0
    t = split.t
    n_steps = eng.stats.get("decode_steps", 0)
    for S in steps:
        print(f"batch {B}, prompt {a.prompt}, new {a.new}, num_scheduler_steps {S or 'auto'}: bare step "
              f"{bare * 1e3:.2f} ms, engine decode step {engines[S] * 1e3:.2f} ms, engine/bare "
              f"{bare / engines[S]:.3f}; executables built per generate {built[S]}, all lowerings {lowered[S]}; "
              f"chains {llms[S].engine.stats['chains']}, chained steps {llms[S].engine.stats['chained_steps']}; "
              f"generate (prefill included) {gen_tok_s[S]:.0f} tokens/s")
    print(f"  the first prompts again (prefix-cache hits) built {again}")
    print("  device split of the bare step: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in dev.items()))
    other = t["consume"] - t["record"]
    print(f"  host split of one generate ({wall * 1e3:.0f} ms wall, {n_steps} decode steps counted so far): "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in [
              ("schedule", t["schedule"]), ("insert", t["insert"]), ("build", t["build"]),
              ("dispatch", t["dispatch"]), ("consume (waiting on device)", other),
              ("detokenize", t["detokenize"]), ("stop checks", t["stop checks"]),
              ("rest of record", t["record"] - t["detokenize"] - t["stop checks"])]))
    return {"B": B, "bare_ms": bare * 1e3, "engine_ms": {S: e * 1e3 for S, e in engines.items()}, "gen": gen_tok_s,
            "built": built, "lowered": lowered}


if __name__ == "__main__":
    main()
