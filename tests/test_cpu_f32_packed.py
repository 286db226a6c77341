"""The packed float32 kernel (``cpu_kernels.f32_gemm_packed``) against XLA's dot of the same
weight unpacked, over row counts that reach every path (a group of 1-8 rows, several groups,
more than one kernel call's 512 rows), column counts with whole 48-column blocks and a last
block of one or two 16-column panels, one, two and four threads; the packed layout's round trip;
``quant.PackedF32`` against the einsums the models run; and a model whose float32 weights are
packed against the same model through XLA's dots."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import cpu_kernels as ck
from jaxinfer import dispatch, quant

needs_kernel = pytest.mark.usefixtures("f32_packed_kernel")  # AVX-512F; under CI=true a failed build fails


@pytest.mark.parametrize("M,I,O", [(1, 576, 192), (3, 64, 16), (8, 40, 32), (9, 576, 1536), (64, 1536, 576),
                                   (100, 96, 80), (513, 64, 48), (1030, 32, 112)])
@pytest.mark.parametrize("threads", [1, 2, 4])
@needs_kernel
def test_packed_equals_xla_dot(M, I, O, threads):
    rng = np.random.default_rng(M * 1000 + I + O)
    x = jnp.asarray(rng.standard_normal((M, I)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((I, O)), jnp.float32)
    want = np.asarray(jax.jit(lambda x, w: x @ w)(x, w))
    p = jax.jit(ck.f32_pack)(w)
    got = np.asarray(jax.jit(lambda x, p: ck.f32_gemm_packed(x, p, threads=threads))(x, p))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.sqrt(I))
    np.testing.assert_allclose(np.asarray(jax.jit(ck.f32_gemm_packed_reference)(x, p)), want, rtol=1e-6, atol=1e-6)
    if M == 1:  # one row: one FMA chain per output in order, XLA's one-row dot exactly
        np.testing.assert_array_equal(got, want)


@needs_kernel
@pytest.mark.parametrize("M", [1, 9, 100])
def test_four_threads_give_the_bits_of_one(M):
    """768 columns (16 blocks of 48) at threads=4: four ranges of four blocks, on any machine,
    each column computed as at one thread."""
    rng = np.random.default_rng(M)
    x = jnp.asarray(rng.standard_normal((M, 576)), jnp.float32)
    p = jax.jit(ck.f32_pack)(jnp.asarray(rng.standard_normal((576, 768)), jnp.float32))
    f = {t: jax.jit(lambda x, p, t=t: ck.f32_gemm_packed(x, p, threads=t)) for t in (1, 4)}
    one = np.asarray(f[1](x, p))
    f[4](x, p).block_until_ready()  # compiled
    before = ck.split_count("f32_gemv")
    four = np.asarray(f[4](x, p))
    assert ck.split_count("f32_gemv") - before == 4
    np.testing.assert_array_equal(four, one)


def test_packed_layout_round_trip():
    """Pure JAX, so it runs anywhere."""
    w = jnp.asarray(np.random.default_rng(0).standard_normal((40, 96)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(ck.f32_unpack(ck.f32_pack(w))), np.asarray(w))


@needs_kernel
@pytest.mark.parametrize("eq,shape,contract,x_shape", [
    ("BTD,DNH->BTNH", (64, 4, 16), (0,), (2, 3, 64)),  # wq
    ("BTNH,NHD->BTD", (4, 16, 64), (0, 1), (2, 3, 4, 16)),  # wo: two contracted axes
    ("BTF,FD->BTD", (128, 64), (0,), (5, 128)),  # a 2-D x (as the packed step's rows)
])
def test_packed_weight_einsum_and_unpack(eq, shape, contract, x_shape):
    rng = np.random.default_rng(len(eq))
    w = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    if len(x_shape) == 2:
        eq = eq.replace("BT", "T", 1).replace("->BT", "->T")
    free = tuple(a for a in range(len(shape)) if a not in contract)
    pw = quant.PackedF32(dispatch._f32_pack(w, contract, free), shape, contract)
    np.testing.assert_array_equal(np.asarray(pw.unpacked()), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(quant.io_layout({"w": pw})["w"]), np.asarray(w))
    from jaxinfer.models.layers import dot

    np.testing.assert_allclose(np.asarray(jax.jit(lambda x: dot(eq, x, pw))(x)), np.asarray(jnp.einsum(eq, x, w)),
                               rtol=1e-5, atol=1e-4)


@needs_kernel
def test_model_with_packed_float32_weights_equals_xla(tiny_gguf, monkeypatch):
    """The tiny float32 model, five sequences (prefill rows, decode steps of several rows):
    every projection packed and run through the kernel gives the tokens of the same model
    through XLA's dots, and logprobs equal to float32 rounding."""
    from jaxinfer import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2)
    prompts = ["The quick brown fox", "a b c a b c", "one two three", "hello hello", "Once upon a time there"]
    calls, real = [], ck.f32_gemm_packed
    monkeypatch.setattr(ck, "f32_gemm_packed", lambda *a, **k: calls.append(1) or real(*a, **k))
    llm = LLM(str(tiny_gguf), progress=False, max_num_seqs=8)
    packed = [x for x in jax.tree.leaves(llm.weights, is_leaf=lambda x: isinstance(x, quant.PackedF32))
              if isinstance(x, quant.PackedF32)]
    assert len(packed) == 2 * 7  # two layers' seven projections; not the embedding
    native = llm.generate(prompts, sp)
    assert calls
    calls.clear()
    xla_dots = dispatch.Kernels(llm.kernels.attention, dispatch.Matmul.XLA)
    xla = LLM(str(tiny_gguf), progress=False, max_num_seqs=8, kernels=xla_dots).generate(prompts, sp)
    assert not calls
    for a, b in zip(native, xla):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-4)
