"""The engine's seam to the Pallas kernels, exercised on CPU in interpret mode.

On TPU/GPU the paged engine's decode attention and the quantized matmuls run as Pallas
kernels (jaxinfer.kernels). Here ``interpret_kernels()`` traces those same paths in
interpret mode, and they must give what the CPU reference paths give."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams, kernels
from jaxinfer import cache as kv
from jaxinfer.config import AttentionKind, Family, ModelConfig, RopeConfig
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
    f = jax.jit(lambda x: dot("BTD,DNH->BTNH", x, qa))
    ref = f(x)
    assert _pallas_calls(lambda x: dot("BTD,DNH->BTNH", x, qa), x) == 0
    with kernels.interpret_kernels():
        g = jax.jit(lambda x: dot("BTD,DNH->BTNH", x, qa))
        assert _pallas_calls(lambda x: dot("BTD,DNH->BTNH", x, qa), x) == calls
        got = g(x)
    assert_close(got, ref)  # the kernel tests' one table (float32: 5e-6)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_paged_decode_through_the_kernel_equals_reference(family):
    """One decode token per row over NaN-poisoned, scattered pages: kernel == gather path."""
    if family == "llama":
        mod, cfg = llama, ModelConfig(family=Family.LLAMA, vocab_size=97, d_model=48, n_layers=2,
                                      n_heads=6, n_kv_heads=2, head_dim=8, d_ff=64)
    else:  # sliding windows over a full-length page table, and soft-capped logits
        L, G = AttentionKind.LOCAL, AttentionKind.GLOBAL
        mod, cfg = gemma3, ModelConfig(
            family=Family.GEMMA3, vocab_size=97, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2,
            head_dim=8, d_ff=64, rope=RopeConfig(theta=1e6), rope_local=RopeConfig(theta=1e4),
            layer_kinds=(L, G), sliding_window=4, query_pre_attn_scalar=12.0, attn_logit_softcap=2.0)
    w = init_weights(mod.weight_specs(cfg), cfg, jax.random.key(0), scale=0.2)
    ps, P, lens = 8, 12, [5, 17, 2]  # pages of 8: the TPU kernel tiles float32 by 8 rows
    rng = np.random.default_rng(1)
    pool = kv.init_paged_cache(cfg, P, ps)
    pool = kv.PagedKVCache([jnp.full_like(a, jnp.nan) for a in pool.k], [jnp.full_like(a, jnp.nan) for a in pool.v],
                           pool.page_table)
    perm = rng.permutation(np.arange(1, P))
    need = [-(-(n + 1) // ps) for n in lens]
    table = np.zeros((3, max(need) + 1), np.int32)
    off = 0
    for b, k in enumerate(need):
        table[b, :k] = perm[off : off + k]
        off += k
    seqs = [rng.integers(0, cfg.vocab_size, n + 1) for n in lens]
    toks = np.zeros((3, max(lens)), np.int32)
    for b, s in enumerate(seqs):
        toks[b, : lens[b]] = s[: lens[b]]
    fwd = jax.jit(mod.forward, static_argnames=("cfg", "read_cache"))
    _, cache = fwd(w, jnp.asarray(toks), jnp.zeros(3, jnp.int32), pool.with_page_table(jnp.asarray(table)), cfg=cfg)
    step_toks = jnp.asarray([[s[n]] for s, n in zip(seqs, lens)], jnp.int32)
    start = jnp.asarray(lens, jnp.int32)

    def make_step():  # a new function per trace: JAX caches traces by function
        def step(w, cache):
            h, _ = mod.forward(w, step_toks, start, cache, cfg=cfg)
            return mod.unembed(w, h, cfg)
        return step

    ref = jax.jit(make_step())(w, cache)
    assert _pallas_calls(make_step(), w, cache) == 0
    with kernels.interpret_kernels():
        assert _pallas_calls(make_step(), w, cache) == cfg.n_layers
        got = jax.jit(make_step())(w, cache)
    assert np.isfinite(np.asarray(got)).all()
    assert_close(got, ref)  # the kernel tests' one table (float32: 5e-6)


def test_engine_with_kernels_gives_the_reference_tokens(tiny_gguf):
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ref = LLM(str(tiny_gguf), progress=False, max_num_seqs=4, max_model_len=64, page_size=8)
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, sp, use_tqdm=False)]
    with kernels.interpret_kernels():
        llm = LLM(str(tiny_gguf), progress=False, max_num_seqs=4, max_model_len=64, page_size=8, quantize="w8a8")
        ref8 = LLM(str(tiny_gguf), progress=False, max_num_seqs=4, max_model_len=64, page_size=8)
        got = [o.outputs[0].token_ids for o in ref8.generate(PROMPTS, sp, use_tqdm=False)]
        got8 = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    assert got == want
    plain8 = LLM(str(tiny_gguf), progress=False, max_num_seqs=4, max_model_len=64, page_size=8, quantize="w8a8")
    assert got8 == [o.outputs[0].token_ids for o in plain8.generate(PROMPTS, sp, use_tqdm=False)]


def test_kernel_mode_is_part_of_the_step_key(tiny_gguf):
    """An executable traced on the reference path is never reused inside interpret_kernels()
    (issue 14: the switch used to be thread-local state read only while tracing)."""
    from jaxinfer import LLM, kernels

    llm = LLM(str(tiny_gguf), progress=False, max_num_seqs=4, max_model_len=64)
    eng = llm.engine
    batch = eng.idle_batch(4, 8, 0)
    eng.run_step(batch)
    before = eng._step._cache_size()
    eng.run_step(batch)
    assert eng._step._cache_size() == before  # same shape, same mode: reused
    with kernels.interpret_kernels():
        eng.run_step(batch)
    assert eng._step._cache_size() == before + 1  # same shape, other mode: its own executable
