"""The engine's seam to the Pallas kernels, exercised on CPU in interpret mode.

On TPU/GPU the paged engine's attention and the quantized matmuls run as Pallas kernels
(jaxinfer.kernels, chosen by jaxinfer.dispatch). Here the choice ``dispatch.INTERPRET``
(``kernels="pallas"`` on CPU) traces those same paths in interpret mode, and they must give
what the reference paths give."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams, dispatch
from jaxinfer.config import AttentionKind, ModelConfig, RopeConfig
from jaxinfer.models import gemma3, llama
from jaxinfer.models.layers import dot
from jaxinfer.quant import quantize
from jaxinfer.specs import init_weights
from tests.kernel_testing import assert_close

PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time"]


def _pallas_calls(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("pallas_call")


@pytest.mark.parametrize("scheme,group,calls", [("int8", 0, 1), ("int4", 64, 1), ("w8a8", 0, 1),
                                                ("int4", 32, 0)])  # groups of 32: no kernel tiling
def test_quantized_dot_through_the_kernel_equals_xla(scheme, group, calls):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(128, 4, 16)).astype(np.float32))
    x = jnp.asarray(rng.normal(size=(2, 3, 128)).astype(np.float32))
    qa = quantize(w, (0,), scheme, group=group or 128)
    ref = jax.jit(lambda x: dot("BTD,DNH->BTNH", x, qa))(x)
    assert _pallas_calls(lambda x: dot("BTD,DNH->BTNH", x, qa), x) == 0
    qk = dataclasses.replace(qa, kernels=dispatch.INTERPRET)  # as dispatch.bind leaves it
    assert _pallas_calls(lambda x: dot("BTD,DNH->BTNH", x, qk), x) == calls
    got = jax.jit(lambda x: dot("BTD,DNH->BTNH", x, qk))(x)
    assert_close(got, ref)  # the kernel tests' one table (float32: 5e-6)


def _step_pallas_calls(llm) -> int:
    """pallas_call equations in the jaxpr of the engine's plain step, traced on an idle batch."""
    eng = llm.engine
    step = functools.partial(eng._step, cfg=eng.cfg, num_logprobs=-1, prompt_logprobs=-1, kernels=eng.kernels)
    from jaxinfer.engine.step import StepInputs

    jaxpr = jax.make_jaxpr(step)(eng.weights, StepInputs(eng.idle_batch(4, 8, 0)), eng.state)
    return str(jaxpr).count("pallas_call")


def test_engine_with_kernels_gives_the_reference_tokens(tiny_gguf):
    """The engine through the Pallas kernels (interpret mode) gives the XLA references' tokens,
    float and w8a8, and its step really calls the kernels (the references' none)."""
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    kw = {"progress": False, "max_num_seqs": 4, "max_model_len": 64, "block_size": 8}
    ref = LLM(str(tiny_gguf), kernels="xla", **kw)
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, sp, use_tqdm=False)]
    llm, llm8 = LLM(str(tiny_gguf), kernels="pallas", **kw), LLM(str(tiny_gguf), quantization="w8a8", kernels="pallas", **kw)
    assert llm.kernels == llm8.kernels == dataclasses.replace(dispatch.INTERPRET, platform="cpu")  # from the device
    # the kernels read keys [P, K, ps, H], as they would on a TPU (dispatch.keys_transposed)
    assert not llm.engine.keys_transposed and llm.engine.k_pages[0].shape[2] == 8
    assert _step_pallas_calls(ref) == 0 and _step_pallas_calls(llm) > 0
    assert _step_pallas_calls(llm8) > _step_pallas_calls(llm)  # the w8a8 matmuls as well
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == want
    got8 = [o.outputs[0].token_ids for o in llm8.generate(PROMPTS, sp, use_tqdm=False)]
    plain8 = LLM(str(tiny_gguf), quantization="w8a8", kernels="xla", **kw)
    assert got8 == [o.outputs[0].token_ids for o in plain8.generate(PROMPTS, sp, use_tqdm=False)]


@pytest.mark.slow
def test_engine_chunked_prefill_among_decode_rows_through_the_ragged_kernel(tiny_gguf):
    """Small prefill chunks make steps that mix decode rows with a chunk continuing its cached
    pages and fresh prompts; through the ragged kernel (interpret mode) the engine gives the
    reference path's tokens and logprobs."""
    prompts = PROMPTS + ["The capital of France is Paris and the capital of Spain is Madrid and " * 2]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)
    kw = {"progress": False, "max_num_seqs": 4, "max_model_len": 96, "block_size": 8, "max_num_batched_tokens": 16}
    ref = LLM(str(tiny_gguf), **kw).generate(prompts, sp, use_tqdm=False)
    got = LLM(str(tiny_gguf), kernels="pallas", **kw).generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    for g, r in zip(got, ref):
        for lg, lr in zip(g.outputs[0].logprobs, r.outputs[0].logprobs):
            assert lg.keys() == lr.keys()
            np.testing.assert_allclose([x.logprob for x in lg.values()], [x.logprob for x in lr.values()],
                                       atol=1e-4)


@pytest.mark.slow  # about a minute of interpret-mode compiles; the hand-built packed step covers q > 1 by default
def test_speculative_rows_through_the_ragged_kernel_give_the_reference_tokens(tiny_gguf):
    """n-gram drafts make verification rows of up to 4 queries (some padded): through the
    ragged kernel (interpret mode) the engine emits the reference path's tokens."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 16}
    prompts = ["a b c a b c a b c a b c a b", "1 2 3 4 1 2 3 4 1 2 3 4 1 2"]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = {"progress": False, "max_num_seqs": 4, "max_model_len": 64, "block_size": 8, "speculative_config": spec}
    want = [o.outputs[0].token_ids for o in LLM(str(tiny_gguf), **kw).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(str(tiny_gguf), kernels="pallas", **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert llm.engine.spec_stats.drafted > 0  # verification rows really ran
    assert got == want


def test_kernel_choice_is_part_of_the_step_key(tiny_gguf):
    """An executable traced with one kernel choice is never reused under another: the choice
    is a static argument of the step (and rides on the weights), part of its cache key."""
    llm = LLM(str(tiny_gguf), progress=False, max_num_seqs=4, max_model_len=64, kernels="xla")
    eng = llm.engine
    batch = eng.idle_batch(4, 8, 0)
    eng.run_step(batch)
    before = eng._step._cache_size()
    eng.run_step(batch)
    assert eng._step._cache_size() == before  # same shape, same choice: reused
    eng.kernels = dispatch.INTERPRET
    eng.run_step(batch)
    assert eng._step._cache_size() == before + 1  # same shape, other choice: its own executable
    q8 = LLM(str(tiny_gguf), progress=False, max_num_seqs=4, max_model_len=64, quantization="int8", kernels="pallas")
    leaves = jax.tree.leaves(q8.weights, is_leaf=lambda x: hasattr(x, "scheme"))
    assert {x.kernels for x in leaves if hasattr(x, "scheme")} == {dataclasses.replace(dispatch.INTERPRET, platform="cpu")}


# ----------------------------------------------------------------------------- packed step
# Sequences of one hand-built packed step, each as (cached positions, query positions,
# full-pool pages, first position its window-pool table holds, window-pool pages from there):
#   A  a verification row: 13 cached, three teacher-forced queries at 13, 14, 15;
#   B  a decode row: 5 cached, one real query and two padding queries (scratch page 0);
#   C  prefill segment 0: a chunk at 9..14 continuing 9 cached positions;
#   D  prefill segment 1: a fresh prompt at 0..4; then three padding tokens.
# Page lists are long enough for pages of 8; pages of 16 use their first entries.
_SEQS = {"A": (13, range(13, 16), [3, 7], 8, [4, 10]), "B": (5, [5], [9], 0, [2]),
         "C": (9, range(9, 15), [5, 1], 0, [6, 3]), "D": (0, range(5), [11], 0, [8])}


def _hand_packed_batch(ps):
    from jaxinfer.models.packed import PackedBatch

    R, Q, Tp = 2, 3, 14
    i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))
    pos, page, wpage, seg = [], [], [], []
    for name in "ABCD":
        _, qpos, pages, wstart, wpages = _SEQS[name]
        qpos, base = list(qpos), wstart // ps
        pad = Q - len(qpos) if name in "AB" else 0  # a decode row's padding queries repeat its last position
        pos += qpos + [qpos[-1]] * pad
        page += [pages[p // ps] for p in qpos] + [0] * pad
        wpage += [wpages[p // ps - base] for p in qpos] + [0] * pad
        seg += [] if name in "AB" else [int(name == "D")] * len(qpos)
    pad = Tp - len(seg)
    pos, page, wpage, seg = pos + [0] * pad, page + [0] * pad, wpage + [0] * pad, seg + [-1] * pad
    A, B, C = _SEQS["A"], _SEQS["B"], _SEQS["C"]
    return PackedBatch(
        tokens=i32(np.random.default_rng(3).integers(0, 97, R * Q + Tp)), positions=i32(pos),
        write_page=i32(page), write_wpage=i32(wpage), active=jnp.ones(R, bool), use_prev=jnp.zeros(R, bool),
        last_q=i32([2, 0]), table=i32([A[2], B[2] + [0], C[2]]), wtable=i32([A[4], B[4] + [0], C[4]]),
        wbase=i32([A[3] // ps, B[3] // ps, C[3] // ps]), seg=i32(seg), hist_end=jnp.int32(C[0]),
        targets=i32([-1] * Tp), rows=R, q=Q, max_segments=3)


def _hand_pools(cfg, windowed, ps, P=12, seed=2, dtype=jnp.float32, keys_transposed=True, lanes=1):
    """NaN everywhere but the cached positions of each sequence, which hold random keys and
    values (what earlier steps wrote; attention does not care where they came from). Keys
    [P, K, H, ps] (keys_transposed) or [P, K, ps, H], holding the same keys; lanes: the head
    dim padded to a multiple of it, zeros in the cached positions' padding (as a TPU's pools)."""
    rng = np.random.default_rng(seed)
    K, H = cfg.n_kv_heads, cfg.head_dim
    Hp = -(-H // lanes) * lanes
    ks, vs = [], []
    for w in windowed:
        k = np.full((P, K, Hp, ps), np.nan, np.float32)
        v = np.full((P, K, ps, Hp), np.nan, np.float32)
        for cached, _, pages, wstart, wpages in _SEQS.values():
            base = wstart // ps
            for p in range(base * ps if w else 0, cached):
                pg = wpages[p // ps - base] if w else pages[p // ps]
                k[pg, :, :, p % ps] = np.pad(rng.normal(size=(K, H)), [(0, 0), (0, Hp - H)])
                v[pg, :, p % ps] = np.pad(rng.normal(size=(K, H)), [(0, 0), (0, Hp - H)])
        ks.append(jnp.asarray(k if keys_transposed else k.swapaxes(-1, -2), dtype))
        vs.append(jnp.asarray(v, dtype))
    return ks, vs


def _as_transposed(pools, keys_transposed):
    """Keys pools as f32 [P, K, H, ps] numpy arrays, whatever their layout."""
    return [np.asarray(a, np.float32) if keys_transposed else np.asarray(a, np.float32).swapaxes(-1, -2)
            for a in pools]


def _tiny_model(family):
    if family == "llama":
        return llama, ModelConfig(family="llama", vocab_size=97, d_model=48, n_layers=2, n_heads=6,
                                  n_kv_heads=2, head_dim=8, d_ff=64), (False, False)
    L, G = AttentionKind.LOCAL, AttentionKind.GLOBAL
    return gemma3, ModelConfig(
        family="gemma3", vocab_size=97, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
        rope=RopeConfig(theta=1e6), rope_local=RopeConfig(theta=1e4), layer_kinds=(L, G), sliding_window=4,
        query_pre_attn_scalar=12.0, attn_logit_softcap=2.0), (True, False)


def _packed_logits_step(mod, cfg, batch, windowed, kernels, keys_transposed=True):
    """(weights, k pools, v pools) -> (logits, k pools, v pools) of one packed step of batch
    through the tiny model, its attention on the given kernels, over keys pools of the given
    layout."""
    from jaxinfer.models.packed import PackedKV

    def step(w, ks, vs):
        cache = PackedKV(ks, vs, batch, windowed, kernels, keys_transposed=keys_transposed)
        h, cache = mod.forward(w, batch.tokens[None], None, cache, cfg=cfg, positions=batch.positions[None])
        return mod.unembed(w, h, cfg)[0], cache.k, cache.v
    return step


@pytest.mark.parametrize("family,pool_dtype,ps,keys_transposed", [
    ("llama", jnp.float32, 8, False), ("gemma3", jnp.float32, 8, False), ("gemma3", jnp.bfloat16, 16, False),
    ("llama", jnp.float32, 8, True)])
def test_packed_step_through_the_ragged_kernel_equals_reference(family, pool_dtype, ps, keys_transposed):
    """Decode rows of 1 and 3 queries (teacher-forced) and a prefill row of two prompt chunks
    (one continuing cached pages) in one packed step over NaN-poisoned pools: the ragged
    kernel (interpret mode) gives the logits of the pure-JAX path (over the CPU's transposed
    keys) at every real position, over keys pools [P, K, ps, H] (the layout the engine gives
    the kernels) or transposed; so do the pure-JAX readers over [P, K, ps, H] keys. Over
    bfloat16 pools of a float32 model the kernel multiplies in bfloat16."""
    mod, cfg, windowed = _tiny_model(family)
    w = init_weights(mod.weight_specs(cfg), cfg, jax.random.key(0), scale=0.2)
    batch = _hand_packed_batch(ps)
    ks, vs = _hand_pools(cfg, windowed, ps, dtype=pool_dtype)
    make_step = functools.partial(_packed_logits_step, mod, cfg, batch, windowed)
    ref, ref_k, _ = jax.jit(make_step(dispatch.XLA))(w, ks, vs)
    assert _pallas_calls(make_step(dispatch.XLA), w, ks, vs) == 0
    kt_ks, kt_vs = _hand_pools(cfg, windowed, ps, dtype=pool_dtype, keys_transposed=keys_transposed)
    kernel_step = make_step(dispatch.INTERPRET, keys_transposed)
    assert _pallas_calls(kernel_step, w, kt_ks, kt_vs) == cfg.n_layers
    got, got_k, _ = jax.jit(kernel_step)(w, kt_ks, kt_vs)
    real = np.asarray(batch.seg) >= 0
    real = np.concatenate([[True] * 3 + [True, False, False], real])  # B's padding queries are scratch
    assert np.isfinite(np.asarray(got)[real]).all()
    assert_close(got[real], ref[real], pool_dtype)  # the kernel tests' one table (float32: 5e-6)
    if not keys_transposed:
        xla, xla_k, _ = jax.jit(make_step(dispatch.XLA, False))(w, kt_ks, kt_vs)
        assert_close(xla[real], ref[real], pool_dtype)
        np.testing.assert_array_equal(_as_transposed(xla_k, False)[0][1:], np.asarray(ref_k[0], np.float32)[1:])
    for a, b in zip(_as_transposed(got_k, keys_transposed), ref_k):  # the same keys at the same slots
        a, b = a[1:], np.asarray(b, np.float32)[1:]  # (page 0: the padding tokens' scratch)
        tol = 2e-5 if pool_dtype == jnp.float32 else 2e-2  # bfloat16: one rounding of the key apart
        np.testing.assert_allclose(a, b, atol=tol, rtol=tol)



# ----------------------------------------------------------------------------- decode-only steps
def _hand_decode_batch(ps):
    """A decode-only step (``PackedBatch.decode_only``): rows A, B and C of ``_SEQS`` with one
    query each at their first query position, then an idle row (position 0, scratch page 0)."""
    from jaxinfer.models.packed import PackedBatch

    i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))
    seqs = [_SEQS[n] for n in "ABC"]
    pos = [list(s[1])[0] for s in seqs] + [0]
    page = [s[2][p // ps] for s, p in zip(seqs, pos)] + [0]
    wpage = [s[4][p // ps - s[3] // ps] for s, p in zip(seqs, pos)] + [0]
    table = [s[2] + [0] * (2 - len(s[2])) for s in seqs] + [[0, 0], [0, 0]]
    wtable = [s[4] + [0] * (2 - len(s[4])) for s in seqs] + [[0, 0], [0, 0]]
    R = 4
    return PackedBatch(
        tokens=i32(np.random.default_rng(4).integers(0, 97, R)), positions=i32(pos), write_page=i32(page),
        write_wpage=i32(wpage), active=jnp.asarray([True, True, True, False]), use_prev=jnp.zeros(R, bool),
        last_q=i32([0] * R), table=i32(table), wtable=i32(wtable), wbase=i32([s[3] // ps for s in seqs] + [0, 0]),
        seg=i32([]), hist_end=jnp.int32(0), targets=i32([]), rows=R, q=1)


@pytest.mark.parametrize("family,pool_dtype,ps,keys_transposed", [
    ("llama", jnp.float32, 8, False), ("gemma3", jnp.float32, 8, False), ("gemma3", jnp.bfloat16, 16, False),
    ("gemma3", jnp.float32, 8, True)])
def test_decode_only_step_through_the_paged_kernel_equals_reference(family, pool_dtype, ps, keys_transposed):
    """A step of decode rows of one query each and no prefill row runs every layer, windowed
    ones included, through the paged decode kernel (not the ragged one), over NaN-poisoned
    pools with keys [P, K, ps, H] (the engine's layout for the kernels) or transposed: the
    logits of the pure-JAX path at every active row."""
    mod, cfg, windowed = _tiny_model(family)
    w = init_weights(mod.weight_specs(cfg), cfg, jax.random.key(0), scale=0.2)
    batch = _hand_decode_batch(ps)
    assert batch.decode_only
    ks, vs = _hand_pools(cfg, windowed, ps, dtype=pool_dtype)
    kt_ks, kt_vs = _hand_pools(cfg, windowed, ps, dtype=pool_dtype, keys_transposed=keys_transposed)
    make_step = functools.partial(_packed_logits_step, mod, cfg, batch, windowed)
    kernel_step = make_step(dispatch.INTERPRET, keys_transposed)
    jaxpr = str(jax.make_jaxpr(kernel_step)(w, kt_ks, kt_vs))
    assert jaxpr.count("pallas_call") == cfg.n_layers
    assert "paged_attention_tpu" in jaxpr and "ragged" not in jaxpr
    ref, ref_k, _ = jax.jit(make_step(dispatch.XLA))(w, ks, vs)
    got, got_k, _ = jax.jit(kernel_step)(w, kt_ks, kt_vs)
    active = np.asarray(batch.active)
    assert np.isfinite(np.asarray(got)[active]).all()
    assert_close(got[active], ref[active], pool_dtype)
    for a, b in zip(_as_transposed(got_k, keys_transposed), ref_k):  # the same keys at the same slots
        tol = 2e-5 if pool_dtype == jnp.float32 else 2e-2  # (page 0: the idle row's scratch)
        np.testing.assert_allclose(a[1:], np.asarray(b, np.float32)[1:], atol=tol, rtol=tol)


@pytest.mark.parametrize("family,decode_only", [("llama", False), ("gemma3", True)])
def test_pools_with_a_padded_head_dim_give_the_same_logits(family, decode_only):
    """Pools whose head dim is padded with zeros (a TPU's, ``cache.init_paged_cache``'s lanes;
    8 padded to 16 here): the step pads its queries and new keys/values, and the kernel
    (interpret mode) and the pure-JAX readers give the logits of unpadded pools, over
    NaN-poisoned pages, the new keys stored in the first H lanes and zeros after them."""
    mod, cfg, windowed = _tiny_model(family)
    H = cfg.head_dim
    w = init_weights(mod.weight_specs(cfg), cfg, jax.random.key(0), scale=0.2)
    ps = 8
    batch = _hand_decode_batch(ps) if decode_only else _hand_packed_batch(ps)
    ks, vs = _hand_pools(cfg, windowed, ps)
    pks, pvs = _hand_pools(cfg, windowed, ps, keys_transposed=False, lanes=16)
    assert pvs[0].shape[-1] == 16 and pks[0].shape[-1] == 16
    make_step = functools.partial(_packed_logits_step, mod, cfg, batch, windowed)
    ref, ref_k, _ = jax.jit(make_step(dispatch.XLA))(w, ks, vs)
    real = (np.asarray(batch.active) if decode_only else
            np.concatenate([[True] * 3 + [True, False, False], np.asarray(batch.seg) >= 0]))
    for kernels in (dispatch.INTERPRET, dispatch.XLA):
        step = make_step(kernels, False)
        assert _pallas_calls(step, w, pks, pvs) == (cfg.n_layers if kernels.pallas else 0)
        got, got_k, _ = jax.jit(step)(w, pks, pvs)
        assert np.isfinite(np.asarray(got)[real]).all()
        assert_close(got[real], ref[real], jnp.float32)
        for a, b in zip(got_k, ref_k):  # the same keys at the same slots, the padding zero
            a, b = np.asarray(a)[1:], np.asarray(b, np.float32)[1:].swapaxes(-1, -2)  # (page 0: scratch)
            written = ~np.isnan(b[..., 0])
            np.testing.assert_allclose(a[..., :H][written], b[written], atol=2e-5, rtol=2e-5)
            assert (a[..., H:][written] == 0).all()


def _counting_paged_kernel(monkeypatch):
    """Counts the paged decode kernel's calls as the engine's steps are traced."""
    from jaxinfer import kernels

    calls = []
    real = kernels.paged_attention
    monkeypatch.setattr(kernels, "paged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _same_outputs(got, want, atol=1e-4):
    for g, r in zip(got, want):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for lg, lr in zip(g.outputs[0].logprobs, r.outputs[0].logprobs):
            assert lg.keys() == lr.keys()
            np.testing.assert_allclose([x.logprob for x in lg.values()], [x.logprob for x in lr.values()], atol=atol)


@pytest.mark.parametrize("family,steps", [("llama", 4), pytest.param("llama", 1, marks=pytest.mark.slow),
                                          pytest.param("gemma3", 1, marks=pytest.mark.slow),
                                          pytest.param("gemma3", 4, marks=pytest.mark.slow)])
def test_engine_decode_steps_through_the_paged_kernel_give_the_reference_outputs(monkeypatch, family, steps):
    """The engine under kernels="pallas" (interpret mode) runs its decode-only steps, single or
    chained (num_scheduler_steps), through the paged decode kernel, and gives the greedy tokens
    and logprobs of kernels="xla"; Gemma 3's windowed layers read their window pools through it."""
    from jaxinfer.loaders.random_weights import random_loaded

    _, cfg, _ = _tiny_model(family)
    loaded = random_loaded(dataclasses.replace(cfg, max_position=128), scale=1.0, seed=1)
    prompts = [[int(t) for t in np.random.default_rng(i).integers(3, 97, 6 + 3 * i)] for i in range(2)]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    kw = {"progress": False, "max_num_seqs": 4, "max_model_len": 64, "block_size": 8, "num_scheduler_steps": steps}
    want = LLM(loaded, kernels="xla", **kw).generate(prompts, sp, use_tqdm=False)
    calls = _counting_paged_kernel(monkeypatch)
    llm = LLM(loaded, kernels="pallas", **kw)
    got = llm.generate(prompts, sp, use_tqdm=False)
    assert len(calls) >= cfg.n_layers  # traced for every layer of a decode-only step
    if steps > 1:
        assert llm.engine.stats["chains"] > 0
    _same_outputs(got, want)
