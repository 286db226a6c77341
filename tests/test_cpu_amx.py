"""The AMX int8 kernel (``cpu_kernels.int8_amx``) against XLA's s8 dot of the same weight,
over row counts that reach every path (whole 32-row blocks, a tail of 1-16 and of 17-31 rows),
column counts with an odd 16-column block and with too few blocks to split, one, two and four
threads; the packed layout's round trip and column lookup; and w8a8 models whose weights are
packed against the same models through XLA's dots, token for token and logprob for logprob."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import cpu_kernels as ck
from jaxinfer import dispatch, quant

needs_amx = pytest.mark.usefixtures("amx_kernel")  # AMX-INT8; under CI=true a failed build fails


@pytest.mark.parametrize("M,I,O", [(1, 576, 192), (4, 64, 16), (5, 576, 1536), (16, 128, 48), (17, 576, 576),
                                   (32, 1536, 576), (33, 576, 1536), (64, 576, 49152 // 16), (100, 640, 272),
                                   (512, 576, 1536)])
@pytest.mark.parametrize("threads", [1, 2, 4])
@needs_amx
def test_amx_equals_xla_s8_dot(M, I, O, threads):
    rng = np.random.default_rng(M * 1000 + I + O)
    x = jnp.asarray(rng.integers(-128, 128, (M, I)), jnp.int8)  # -128 too: the extremes
    w = jnp.asarray(rng.integers(-128, 128, (I, O)), jnp.int8)
    want = np.asarray(jax.jit(ck.int8_gemv_reference)(x, w))
    p = jax.jit(ck.amx_pack)(w)
    got = np.asarray(jax.jit(lambda x, p: ck.int8_amx(x, p, threads=threads))(x, p))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(jax.jit(ck.int8_amx_reference)(x, p)), want)


@needs_amx
@pytest.mark.parametrize("M", [1, 33])
def test_four_threads_give_the_integers_of_one(M):
    """512 columns (16 blocks of 32) at threads=4: four ranges of four blocks, on any machine."""
    rng = np.random.default_rng(M)
    x = jnp.asarray(rng.integers(-128, 128, (M, 576)), jnp.int8)
    p = jax.jit(ck.amx_pack)(jnp.asarray(rng.integers(-128, 128, (576, 512)), jnp.int8))
    f = {t: jax.jit(lambda x, p, t=t: ck.int8_amx(x, p, threads=t)) for t in (1, 4)}
    one = np.asarray(f[1](x, p))
    f[4](x, p).block_until_ready()  # compiled
    before = ck.split_count("int8_amx")
    four = np.asarray(f[4](x, p))
    assert ck.split_count("int8_amx") - before == 4
    np.testing.assert_array_equal(four, one)


@pytest.mark.parametrize("I,O", [(64, 16), (576, 192), (128, 272)])
def test_packed_layout_round_trip_and_columns(I, O):
    """Pure JAX, so it runs anywhere: unpack(pack(w)) == w, and a column lookup on the packed
    weight equals the columns of w."""
    rng = np.random.default_rng(I + O)
    w = jnp.asarray(rng.integers(-128, 128, (I, O)), jnp.int8)
    p = ck.amx_pack(w)
    assert p.shape == (O // 16, I // 64, 16, 16, 4)
    np.testing.assert_array_equal(np.asarray(ck.amx_unpack(p)), np.asarray(w))
    cols = jnp.asarray([0, O - 1, 17 % O, 5, 5], jnp.int32)
    np.testing.assert_array_equal(np.asarray(ck.amx_take_columns(p, cols)), np.asarray(w)[:, np.asarray(cols)])
    with pytest.raises(ValueError, match="I % 64"):
        ck.amx_pack(jnp.zeros((65, 16), jnp.int8))


def test_packed_quant_array_views_equal_unpacked():
    """A w8a8 QuantArray in the "amx" layout dequantizes, looks up embedding rows and goes back
    to "io" exactly as the unpacked one, whichever backend runs the trace."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(256, 128)), jnp.float32)  # a [V, D] table, contracted over D
    qa = quant.quantize_w8a8(w, (1,), jnp.ones((128,)), alpha=0.5)
    packed = quant.dataclasses.replace(qa, values=ck.amx_pack(qa.values), layout="amx")
    np.testing.assert_array_equal(np.asarray(packed.dequantize()), np.asarray(qa.dequantize()))
    toks = jnp.asarray([[3, 255], [0, 17]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(packed.take(toks)), np.asarray(qa.take(toks)))
    back = quant.io_layout({"w": packed})["w"]
    assert back.layout == "io"
    np.testing.assert_array_equal(np.asarray(back.values), np.asarray(qa.values))


@needs_amx
def test_w8a8_model_with_packed_weights_equals_xla(tiny_gguf, monkeypatch):
    """The tiny w8a8 model, five sequences (prefill rows and decode steps of more than four
    rows, where only the AMX kernel serves): its weights packed and every dot through int8_amx
    gives the tokens and logprobs of the same model through XLA's s8 dots (the same integers
    into the same epilogue)."""
    from jaxinfer import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2)
    prompts = ["The quick brown fox", "a b c a b c", "one two three", "hello hello", "Once upon a time there"]
    calls, real = [], ck.int8_amx
    monkeypatch.setattr(ck, "int8_amx", lambda *a, **k: calls.append(1) or real(*a, **k))
    llm = LLM(str(tiny_gguf), quantization="w8a8", progress=False, max_num_seqs=8)
    leaves = [x for x in jax.tree.leaves(llm.weights, is_leaf=lambda x: isinstance(x, quant.QuantArray))
              if isinstance(x, quant.QuantArray)]
    assert any(q.layout == "amx" for q in leaves)
    native = llm.generate(prompts, sp)
    assert calls
    calls.clear()
    xla_dots = dispatch.Kernels(llm.kernels.attention, dispatch.Matmul.XLA)
    xla = LLM(str(tiny_gguf), quantization="w8a8", progress=False, max_num_seqs=8, kernels=xla_dots).generate(prompts, sp)
    assert not calls
    for a, b in zip(native, xla):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob
