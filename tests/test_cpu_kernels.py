"""The native gemv kernels (jaxinfer.cpu_kernels) against their references, over shapes that
reach every path of each kernel (column blocks, a column tail, an odd last row, 1-4 rows, one
and two threads): the int8 gemv gives XLA's s8 dot's integers, the weight-only gemv XLA's
float32 dot's bits at one row; and the quantized models through them equal the models
through XLA's dots, token for token."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import cpu_kernels as ck
from jaxinfer import quant

pytestmark = pytest.mark.skipif(not ck.available(), reason="native int8 gemv not built here (needs AVX-512BW, g++)")


@pytest.mark.parametrize("M,I,O", [(1, 576, 576), (1, 576, 192), (2, 1536, 576), (4, 576, 3072), (3, 577, 1000),
                                   (1, 7, 64), (1, 1, 1), (2, 130, 63), (1, 64, 49152 // 8)])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_equals_xla_s8_dot(M, I, O, threads):
    rng = np.random.default_rng(M * 1000 + I + O)
    x = jnp.asarray(rng.integers(-128, 128, (M, I)), jnp.int8)  # -128 too: the extremes
    w = jnp.asarray(rng.integers(-128, 128, (I, O)), jnp.int8)
    want = np.asarray(jax.jit(ck.int8_gemv_reference)(x, w))
    got = np.asarray(jax.jit(lambda x, w: ck.int8_gemv(x, w, threads=threads))(x, w))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("M,I,O", [(1, 576, 576), (1, 1536, 576), (2, 576, 3072), (4, 577, 1000), (1, 7, 33),
                                   (3, 64, 49152 // 8)])
@pytest.mark.parametrize("threads", [1, 2])
def test_weight_only_gemv_equals_xla_float_dot(M, I, O, threads):
    rng = np.random.default_rng(M * 1000 + I + O)
    x = jnp.asarray(rng.normal(size=(M, I)), jnp.float32)
    w = jnp.asarray(rng.integers(-128, 128, (I, O)), jnp.int8)
    want = np.asarray(jax.jit(ck.wo8_gemv_reference)(x, w))
    got = np.asarray(jax.jit(lambda x, w: ck.wo8_gemv(x, w, threads=threads))(x, w))
    if M == 1:
        np.testing.assert_array_equal(got, want)  # the same FMA chain
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_extremes_do_not_overflow():
    I, O = 2048, 128  # |sum| up to 2048 * 128 * 128 = 2^25: int32, no int16 wrap
    x = jnp.full((1, I), -128, jnp.int8)
    w = jnp.full((I, O), -128, jnp.int8)
    got = np.asarray(jax.jit(ck.int8_gemv)(x, w))
    np.testing.assert_array_equal(got, np.full((1, O), I * 128 * 128, np.int32))


def test_rows_out_of_range_are_refused():
    x = jnp.zeros((5, 64), jnp.int8)
    with pytest.raises(ValueError, match="1..4 rows"):
        ck.int8_gemv(x, jnp.zeros((64, 64), jnp.int8))


@pytest.mark.parametrize("scheme", ["w8a8", "int8"])
def test_quantized_model_through_the_kernels_equals_xla(tiny_gguf, monkeypatch, scheme):
    """The tiny model, batch 1, greedy: the native path and XLA's dot give the same tokens, and
    under w8a8 the same logprobs (the same integers feed the same epilogue); weight-only int8
    sums in float32 in another order inside XLA's fused step, so its logprobs agree to
    rounding."""
    from jaxinfer import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    prompt = "The quick brown fox"
    native = LLM(str(tiny_gguf), quantize=scheme, progress=False, max_num_seqs=2).generate(prompt, sp)[0]
    asked = []
    monkeypatch.setattr(quant, "_native_gemv", lambda: asked.append(1) or False)
    xla = LLM(str(tiny_gguf), quantize=scheme, progress=False, max_num_seqs=2).generate(prompt, sp)[0]
    assert asked  # the second engine traced its steps anew, through XLA's dot
    assert native.outputs[0].token_ids == xla.outputs[0].token_ids
    if scheme == "w8a8":
        assert native.outputs[0].cumulative_logprob == xla.outputs[0].cumulative_logprob
    else:
        assert native.outputs[0].cumulative_logprob == pytest.approx(xla.outputs[0].cumulative_logprob, rel=1e-6)
