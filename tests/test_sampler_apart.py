"""Plain steps that leave their sampling to an executable of its own (``EngineConfig.separate_sampler``,
the default on accelerators): the tokens, logprobs and slot state are the in-step sampler's, bit
for bit, and the step executables no longer multiply by sampling options.

The engine's other suites (sampling, paged engine, golden tokens, guided rows, logprobs, LoRA)
hold either path against independent references; here the two paths run the same requests."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine import config

PROMPTS = ["Hello", "The capital of France", "One two three four", "Why is the sky"]
PARAMS = [SamplingParams(temperature=0, max_tokens=7, logprobs=5, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=7, ignore_eos=True, repetition_penalty=1.3),
          SamplingParams(temperature=1.0, top_k=20, seed=5, max_tokens=7, min_tokens=4, presence_penalty=0.5,
                         logprobs=0),
          SamplingParams(temperature=0.7, seed=7, max_tokens=7, prompt_logprobs=2, ignore_eos=True)]


def _llm(tiny_gguf, apart: bool, **kw):
    llm = LLM(str(tiny_gguf), progress=False, max_num_seqs=4, kv_cache_memory_bytes=64 << 20,
              separate_sampler=apart, **kw)
    assert llm.engine.separate_sampler is apart
    return llm


def _outputs(outs):
    return [(c.token_ids, c.logprobs, c.finish_reason, o.prompt_logprobs) for o in outs for c in o.outputs]


def test_sampling_apart_gives_the_in_step_samplers_tokens_logprobs_and_state(tiny_gguf):
    """Greedy, seeded nucleus and top-k draws, penalties (the [S, V] statistics carried in the
    slot state), min_tokens, logprobs and prompt logprobs in one batch, then structured-output
    rows: every token, logprob and finish reason equal the in-step sampler's."""
    guided = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, guided_decoding={"regex": r"[a-c]{2}[0-9]"})
              for s in range(2)] + [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)]
    got = {}
    for apart in (False, True):
        llm = _llm(tiny_gguf, apart)
        got[apart] = (_outputs(llm.generate(PROMPTS, PARAMS, use_tqdm=False)),
                      _outputs(llm.generate(["x", "y", "one"], guided, use_tqdm=False)))
    assert got[True] == got[False]
    assert all(len(t) == 7 for t, *_ in got[True][0])


def test_the_sampler_takes_the_slots_donated_and_steps_no_longer_split_by_logprobs(tiny_gguf):
    """The sampler's executable aliases the slot state it advances (the old buffers are gone);
    a plain step's executable serves any logprobs width: asking for logprobs builds a sampler,
    not another step."""
    llm = _llm(tiny_gguf, True, enable_prefix_caching=False)
    eng = llm.engine
    sp = dict(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate(["Hello there"], SamplingParams(**sp), use_tqdm=False)
    steps, samplers = eng._step._cache_size(), eng._sampler._cache_size()
    llm.generate(["Howdy there"], SamplingParams(**sp, logprobs=5), use_tqdm=False)
    assert eng._step._cache_size() == steps  # the same step shapes: no step built again
    assert eng._sampler._cache_size() == samplers + 1  # the sampler with 5 logprobs

    batch = eng.idle_batch(1, 8, 0)
    old = eng.state.slots
    out = eng.run_step(batch)
    assert out.logits is None and out.tokens.shape == (1, 1)  # [replicas, rows]
    assert all(a.is_deleted() for a in jax.tree.leaves(old))


def test_warmup_compiles_one_sampler_per_row_bucket_and_leaves_nothing_to_compile(tiny_gguf):
    """Warm-up on threads (``compile_threads``) builds each step shape once and one sampler per
    row bucket beside them, the same count as compiling each as it first runs; a workload after
    it (logprobs off, as warm-up's) compiles nothing."""
    from jaxinfer.engine.warmup import warmup_shapes

    counts = {}
    for threads in (1, 3):
        llm = _llm(tiny_gguf, True, block_size=8, max_num_batched_tokens=32)
        eng = llm.engine
        counts[threads] = eng.warmup(8, 24, compile_threads=threads)
        shapes = warmup_shapes(eng, 8, 24)
        rows = {R for R, _, _ in shapes if R}
        assert counts[threads] == len(shapes) + len(rows) + len(eng.inserts_run), (threads, counts, shapes)
        before = eng.num_compilations()
        llm.generate(["Hello", "The capital of France"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                     use_tqdm=False)
        assert eng.num_compilations() == before
    assert counts[1] == counts[3]


def test_the_platforms_decide_by_default():
    """Accelerators sample apart (each step executable compiled its own sampler, most of its
    compile on a TPU); a CPU keeps the sampler in the step (one dispatch a step)."""
    cfg = config.EngineConfig()
    assert config.separate_sampler(cfg, "tpu") and config.separate_sampler(cfg, "gpu")
    assert not config.separate_sampler(cfg, "cpu")
    assert config.separate_sampler(config.EngineConfig(separate_sampler=True), "cpu")


def test_a_step_that_samples_apart_refuses_what_belongs_to_the_sampler(tiny_gguf):
    from jaxinfer.engine.step import StepInputs

    eng = _llm(tiny_gguf, True).engine
    (weights, inputs, state), kw = eng.step_args(eng.idle_batch(1, 8, 0))
    guide = (np.zeros((1, -(-eng.cfg.vocab_size // 32)), np.int32), np.zeros(1, np.bool_))
    with pytest.raises(ValueError, match="sampler"):
        eng._step.lower(weights, StepInputs(inputs.batch, guide), state, **kw)
