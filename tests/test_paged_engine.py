"""Continuous batching over the paged KV cache: the tokens of transformers, and of each
sequence generated alone, paged attention equal to dense with poisoned pages, a leak-free allocator, safe prefix sharing,
waiting and preemption when pages run out, and a counted number of compilations."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import ModelConfig
from jaxinfer.engine.pages import PageAllocator
from jaxinfer.engine.warmup import warmup_shapes
from jaxinfer.errors import InvalidRequest
from jaxinfer.models import llama
from jaxinfer.specs import init_weights
from jaxinfer.models.registry import num_params
from tests.conftest import require_native

CFG = ModelConfig(family="llama", vocab_size=97, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=8, d_ff=64)


# ----------------------------------------------------------------------------- paged attention
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_whole_page_writes_equal_token_writes(kv_dtype):
    """cache.write_pages writing whole pages (a TPU's) leaves every page as the token-by-token
    scatter does: a decode row, a prompt segment from mid-page across three pages, a second
    segment, and padding on the scratch page 0 (whose contents are anyone's)."""
    from jaxinfer import cache as kv

    pools = kv.init_paged_cache(CFG, 12, 4, kv_dtype, keys_transposed=False)
    pool = jax.tree.map(lambda a: jax.random.normal(jax.random.key(1), a.shape).astype(a.dtype)
                        if a.dtype != jnp.int8 else a, pools.v[0])
    page = np.array([5, 7, 7, 8, 8, 8, 8, 9, 3, 3, 0, 0], np.int32)
    pos = np.array([21, 2, 3, 4, 5, 6, 7, 8, 0, 1, 0, 0], np.int32)
    new = jax.random.normal(jax.random.key(2), (1, len(page), CFG.n_kv_heads, CFG.head_dim))
    want = kv.write_pages(pool, jnp.asarray(page), jnp.asarray(pos % 4), new)
    got = kv.write_pages(pool, jnp.asarray(page), jnp.asarray(pos % 4), new, whole_pages=6)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g)[1:], np.asarray(w)[1:])
    with pytest.raises(ValueError, match="whole_pages"):
        kv.write_pages(pool, jnp.asarray(page), jnp.asarray(pos % 4), new, keys_transposed=True, whole_pages=6)


@pytest.mark.parametrize("native,keys_transposed,platform", [(False, True, None), (True, True, None),
                                                               (False, False, None), (False, False, "tpu")])
def test_packed_steps_over_poisoned_pages_equal_the_full_forward(native, keys_transposed, platform):
    """Prompts written to scattered NaN-poisoned pages by one packed step, then decode rows of
    three queries each reading them back: every query's logits equal the full forward pass's
    (no cache) at its position, through XLA's readers and the native CPU kernels, over keys
    pools of either layout (transposed: the CPU's; [P, K, ps, H]: a TPU's, read by XLA), and
    with a TPU's writes of whole pages."""
    from jaxinfer import dispatch
    from tests.kernel_testing import packed_decode_logits

    if native:
        require_native("paged_attention")
    kernels = dispatch.Kernels(dispatch.Attention.NATIVE) if native else dispatch.Kernels(platform=platform)
    w = init_weights(llama.weight_specs(CFG), CFG, jax.random.key(0), scale=0.2)
    lens, T = [5, 11, 2], 3
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, CFG.vocab_size, n + T) for n in lens]
    got = packed_decode_logits(llama, CFG, w, seqs, lens, T, page_size=4, num_pages=24, kernels=kernels,
                               keys_transposed=keys_transposed)
    fwd = jax.jit(llama.forward, static_argnames=("cfg", "read_cache"))
    for b, (s, n) in enumerate(zip(seqs, lens)):
        hd, _ = fwd(w, jnp.asarray(s[None]), jnp.zeros(1, jnp.int32), None, cfg=CFG)
        ref = np.asarray(llama.unembed(w, hd, CFG))[0, n : n + T]
        assert np.isfinite(got[b]).all()
        np.testing.assert_allclose(got[b], ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- allocator
ops = st.lists(st.tuples(st.sampled_from(["admit", "grow", "finish", "preempt", "cancel"]),
                         st.integers(0, 7), st.integers(1, 40)), max_size=80)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_allocator_never_leaks(program):
    ps = 4
    alloc = PageAllocator(24, ps)
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9, 9], [7] * 13]
    running: list[dict] = []
    for op, which, n in program:
        if op == "admit":
            toks = prefixes[which % 3] + [which] * (n % 7)
            cached, chain = alloc.lookup_prefix(toks)
            need = -(-len(toks) // ps) - len(cached)
            try:
                pages = cached + alloc.allocate(need)
            except MemoryError:
                alloc.release(cached)
                continue
            seq = {"toks": toks, "pages": pages, "reg": len(cached), "chain": chain}
            while (seq["reg"] + 1) * ps <= len(toks):  # prefill done: name the full pages
                i = seq["reg"]
                seq["chain"] = alloc.register_full_page(pages[i], seq["chain"], toks[i * ps : (i + 1) * ps])
                seq["reg"] += 1
            running.append(seq)
        elif running:
            seq = running[which % len(running)]
            if op == "grow":
                try:
                    seq["pages"] += alloc.allocate(1)
                except MemoryError:
                    pass
            else:  # finish, preempt and cancel all give every reference back
                alloc.release(seq["pages"])
                running.remove(seq)
        alloc.check_invariants()
    for seq in running:
        alloc.release(seq["pages"])
    alloc.check_invariants()
    assert alloc.num_free == alloc.num_pages - 1  # every page free (or evictable) again


def test_prefix_lookup_shares_and_evicts_lru():
    alloc = PageAllocator(6, 4)
    toks = list(range(13))
    p = alloc.allocate(4)
    chain = b"jaxinfer-prefix-root"
    for i in range(3):
        chain = alloc.register_full_page(p[i], chain, toks[4 * i : 4 * i + 4])
    cached, _ = alloc.lookup_prefix(toks)
    assert cached == p[:3] and alloc.refcount(p[0]) == 2
    alloc.release(cached)
    alloc.release(p)
    assert alloc.num_free == 5
    fresh = alloc.allocate(2)  # one never-cached page, then the LRU cached one
    assert p[0] in fresh or p[3] in fresh
    alloc.check_invariants()


# ----------------------------------------------------------------------------- engine
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog and keeps running far away",
           "1 2 3", "A longer prompt about the history of printing presses in Europe during the fifteenth century and later",
           "x", "Once upon a time", "def f(x): return x * 2", "Rivers carved the valleys where towns grew"]


@pytest.fixture(scope="module")
def alone_llm(tiny_gguf):
    """One decode slot: each sequence runs alone, never beside another."""
    return LLM(str(tiny_gguf), progress=False, max_num_seqs=1)


def _paged(tiny_gguf, **kw):
    kw.setdefault("max_num_seqs", 3)
    return LLM(str(tiny_gguf), progress=False, **kw)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _alone(alone_llm, prompts, sps):
    return [_ids(alone_llm.generate([p], sp, use_tqdm=False))[0] for p, sp in zip(prompts, sps)]


@pytest.mark.reference
def test_continuous_batching_equals_transformers(tmp_path):
    """Several sequences sharing steps, prompts chunked over small pages and steps, and one
    preempted: greedy tokens and prompt log-probs equal transformers float32 on each prompt
    alone (the independent reference for the batching tests below, which compare with each
    sequence run alone)."""
    from tests import family_testing as ft

    path = ft.write_tiny(tmp_path / "llama", "llama")
    ref = ft.reference(path)
    llm = LLM(str(path), progress=False, max_model_len=128, max_num_seqs=3, block_size=4, max_num_batched_tokens=16,
              num_gpu_blocks_override=20)
    ft.assert_matches(ft.generate(llm), ref, what="continuous batching")
    assert llm.engine.stats["preemptions"] > 0


def test_continuous_batching_same_tokens_as_alone(tiny_gguf, alone_llm):
    # 3 slots, 8 requests of different lengths: requests arrive while others decode
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (9, 3, 14, 5, 7, 2, 11, 6)]
    llm = _paged(tiny_gguf, block_size=4, max_num_batched_tokens=16)
    got = _ids(llm.generate(PROMPTS, sps, use_tqdm=False))
    assert got == _alone(alone_llm, PROMPTS, sps)
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages - 1  # nothing leaked


def test_seeded_sampling_unchanged_by_batching(tiny_gguf, alone_llm):
    sps = [SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=8, ignore_eos=True) for i in range(8)]
    got = _ids(_paged(tiny_gguf, block_size=4).generate(PROMPTS, sps, use_tqdm=False))
    assert got == _alone(alone_llm, PROMPTS, sps)


def test_chunked_prefill_of_a_long_prompt(tiny_gguf, alone_llm):
    long = " ".join(["word"] * 150)  # > 2 chunks of 64
    sps = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 3
    prompts = [long, "short one", long + " tail"]
    llm = _paged(tiny_gguf, max_num_batched_tokens=64, block_size=8)
    assert _ids(llm.generate(prompts, sps, use_tqdm=False)) == _alone(alone_llm, prompts, sps)


def test_prefix_cache_on_and_off_agree(tiny_gguf):
    system = "You are a careful assistant. " * 12
    prompts = [system + q for q in ("What is 2+2?", "Name a color.", "Say hi.", "Count to three.")]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    on = _paged(tiny_gguf, block_size=8, max_num_seqs=2)
    got_on = _ids(on.generate(prompts, sp, use_tqdm=False))
    got_on2 = _ids(on.generate(prompts, sp, use_tqdm=False))  # now the whole prefix is cached
    off = _paged(tiny_gguf, block_size=8, max_num_seqs=2, enable_prefix_caching=False)
    assert got_on == got_on2 == _ids(off.generate(prompts, sp, use_tqdm=False))
    assert on.engine.stats["cached_prompt_tokens"] > 4 * 8 * 5
    assert off.engine.stats["cached_prompt_tokens"] == 0


def test_out_of_pages_waits_and_preempts_without_changing_tokens(tiny_gguf, alone_llm):
    sps = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 6
    prompts = PROMPTS[:6]
    # 11 usable pages of 4 tokens: not every sequence fits at once, and growing ones collide
    llm = _paged(tiny_gguf, block_size=4, num_gpu_blocks_override=12, max_num_seqs=4, enable_prefix_caching=False)
    got = _ids(llm.generate(prompts, sps, use_tqdm=False))
    assert got == _alone(alone_llm, prompts, sps)
    assert llm.engine.stats["preemptions"] > 0
    assert llm.engine.allocator.num_free == 11


def test_request_that_can_never_fit_gets_a_clear_error(tiny_gguf):
    llm = _paged(tiny_gguf, block_size=4, num_gpu_blocks_override=5)
    with pytest.raises(InvalidRequest, match="needs .* KV pages but the pool has only 4"):
        llm.generate("Hello", SamplingParams(max_tokens=40), use_tqdm=False)


def test_compilations_are_counted_exactly(tiny_gguf):
    llm = _paged(tiny_gguf, block_size=8, max_num_seqs=4, max_num_batched_tokens=32)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm.generate(PROMPTS, sp, use_tqdm=False)
    first = llm.engine.num_compilations()
    llm.generate(PROMPTS, sp, use_tqdm=False)
    assert llm.engine.num_compilations() == first  # a warm engine compiles nothing more
    # one executable per step shape run (prefill at 1 or 4 rows, then decode only) plus one
    # slot insert per row bucket run, each shape among the ones warm-up compiles
    eng = llm.engine
    assert len(eng.shapes_run) == 3, sorted(eng.shapes_run)
    assert first == len(eng.shapes_run) + len(eng.inserts_run), (first, sorted(eng.shapes_run), eng.inserts_run)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    allowed = set(warmup_shapes(eng, max(map(len, ids)), max(map(len, ids)) + 5))
    assert {(R, w, Tp) for R, w, Tp, *_ in eng.shapes_run} <= allowed
    assert eng.inserts_run <= {1, 4}  # the batch buckets up to max_num_seqs, as warm-up inserts
    # a second engine in the same process counts only its own executables
    other = _paged(tiny_gguf, block_size=8, max_num_seqs=4, max_num_batched_tokens=32)
    other.generate(PROMPTS[:1], sp, use_tqdm=False)
    assert other.engine.num_compilations() == len(other.engine.shapes_run) + len(other.engine.inserts_run)
    assert eng.num_compilations() == first


def test_committed_weights_build_each_shape_once(tiny_gguf):
    """A real checkpoint's weights are committed to their device (packed or placed at load),
    so every step's outputs are: the pools and slots the engine starts with must be committed
    too, or jit builds the first step shape's executable again once the step's own outputs
    replace them (in the middle of the second run)."""
    from jaxinfer.engine.engine import Engine

    llm = _paged(tiny_gguf, block_size=8, max_num_seqs=4, max_num_batched_tokens=32)
    eng = llm.engine = Engine(llm.cfg, jax.device_put(llm.weights, jax.devices()[0]), llm.tokenizer,
                              max_model_len=llm.max_model_len, config=llm.engine.config)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm.generate(PROMPTS, sp, use_tqdm=False)
    first = eng.num_compilations()
    llm.generate(PROMPTS, sp, use_tqdm=False)
    assert eng.num_compilations() == first == len(eng.shapes_run) + len(eng.inserts_run)


def test_warmup_with_one_slot(tiny_gguf):
    """One decode slot: warm-up's last insert took slots[:1], which is then the slots themselves,
    beside the donated slots (JAX refused the call)."""
    llm = _paged(tiny_gguf, max_num_seqs=1)
    assert llm.engine.warmup(max_prompt_len=8, max_len=16) > 0
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    assert len(llm.generate("Hello there", sp)[0].outputs[0].token_ids) == 4


def test_warmup_compiles_on_threads_the_executables_its_steps_run(tiny_gguf):
    """Warm-up compiles its steps several at a time, then runs them: the runs build nothing
    more (jit runs the executables compiled from lower on the same arguments), the count is
    what compiling each as it first runs gives, and a workload after it compiles nothing."""
    from jaxinfer.engine.warmup import warm

    counts = {}
    for threads in (1, 3):
        llm = _paged(tiny_gguf, block_size=8, max_num_seqs=4, max_num_batched_tokens=32, num_scheduler_steps=2)
        eng = llm.engine
        counts[threads] = warm(eng, 8, 24, threads=threads)
        shapes = warmup_shapes(eng, 8, 24)
        chains = sum(1 for R, _, Tp in shapes if R and not Tp)
        assert counts[threads] == len(shapes) + chains + len(eng.inserts_run), (threads, counts, shapes)
        before = eng.num_compilations()
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        llm.generate(["Hello", "The capital of France"], sp, use_tqdm=False)
        assert eng.num_compilations() == before
    assert counts[1] == counts[3]


@pytest.mark.slow  # two whole warm-ups into a cache of its own: over a minute
def test_a_second_start_loads_every_warmup_executable_from_the_cache(tiny_gguf, tmp_path):
    """With JAX's persistent compilation cache (LLM keeps one under $JAXINFER_HOME), a second
    engine's warm-up compiles nothing: every executable it builds is loaded from the cache the
    first one wrote."""
    from jax import monitoring
    from jax._src import compilation_cache

    events: list[str] = []

    def listen(event, **kwargs):
        events.append(event)

    saved = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compilation_cache.reset_cache()
    monitoring.register_event_listener(listen)
    try:
        kw = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=32)
        first = _paged(tiny_gguf, **kw).engine.warmup(8, 24)
        assert events.count("/jax/compilation_cache/cache_misses") >= first > 0  # each written
        events.clear()
        second = _paged(tiny_gguf, **kw).engine.warmup(8, 24)
        assert second == first
        assert events.count("/jax/compilation_cache/cache_misses") == 0  # nothing compiled
        assert events.count("/jax/compilation_cache/cache_hits") >= second
    finally:
        monitoring.unregister_event_listener(listen)
        for k, v in saved.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()


def test_warmup_leaves_nothing_to_compile(tiny_gguf):
    from jaxinfer.bench import WorkloadSpec, run_bench

    llm = _paged(tiny_gguf, block_size=8, max_num_seqs=4, max_num_batched_tokens=32)
    # a shared prefix: cache hits start chunks mid-prompt, at page boundaries warm-up covers
    spec = WorkloadSpec(num_requests=10, prompt_len=(5, 60), output_len=(3, 6), seed=1,
                        shared_prefix_len=20, shared_prefix_share=0.6)
    s = run_bench(llm, spec, peaks={"flops": 1e11, "bytes_s": 1e10}, ttft_slo=60.0)
    assert s["engine"]["cached_prompt_tokens"] > 0
    assert s["compilations"]["during_run"] == 0 and s["compilations"]["warmup"] > 0
    # The counts and rates are the workload's own numbers, worked out here from its requests.
    from jaxinfer.bench import make_workload

    reqs = make_workload(spec, llm.tokenizer)
    n_in, n_out = sum(len(r.prompt_ids) for r in reqs), sum(r.max_tokens for r in reqs)  # EOS ignored
    assert (s["requests"], s["input_tokens"], s["output_tokens"]) == (10, n_in, n_out)
    assert s["output_tok_s"] == pytest.approx(n_out / s["wall_s"])
    cfg = llm.cfg
    ctx = sum(len(r.prompt_ids) + r.max_tokens / 2 for r in reqs) / len(reqs)  # mean attended context
    flops_per_token = 2 * num_params(cfg) + 4 * cfg.n_layers * ctx * cfg.n_heads * cfg.head_dim
    assert s["mfu"] == pytest.approx(flops_per_token * (n_in + n_out) / s["wall_s"] / 1e11)
    assert s["slo"]["met"] == 10 and s["goodput_requests_s"] == s["requests_s"]  # a 60 s TTFT SLO: all met


def test_pools_filled_beside_the_load_are_the_engines(tiny_gguf, monkeypatch):
    """LLM starts zero-filling the page pools on a second thread once the checkpoint's config
    is read; the engine takes those pools, and refuses pools started for another engine."""
    from jaxinfer.engine import config, engine

    started = []
    real = config.start_pools
    monkeypatch.setattr("jaxinfer.llm.start_pools", lambda *a: started.append(real(*a)) or started[-1])
    llm = LLM(str(tiny_gguf), progress=False, max_num_seqs=2, kv_cache_memory_bytes=1 << 20)
    # the same buffers (committed to the weights' device: no copy, no second fill)
    assert len(started) == 1
    assert llm.engine.k_pages[0].unsafe_buffer_pointer() == started[0].result().k[0].unsafe_buffer_pointer()
    assert llm.engine.k_pages[0].committed and llm.engine.slots.last_tokens.committed
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    assert len(llm.generate("hello there", sp)[0].outputs[0].token_ids) == 4
    other = dataclasses.replace(llm.engine.config, max_num_seqs=4)
    with pytest.raises(ValueError, match="another model or engine"):
        engine.Engine(llm.cfg, llm.weights, llm.tokenizer, max_model_len=llm.max_model_len, config=other,
                      pools=config.start_pools(llm.cfg, llm.engine.config, llm.max_model_len))
