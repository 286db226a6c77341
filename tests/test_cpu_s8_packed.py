"""w8a8's AVX2 kernel on packed weights (``cpu_kernels.s8_gemm_packed``) against XLA's s8 dot of
the same weight: row counts that reach every path (1-4 rows in registers, 6-row groups in
assembly with a remainder of 1-5, several row blocks, several calls of 512 rows), weights with
one, two and many 16-column blocks, one to four threads, and the extremes where an int16
pair sum would saturate or an int32 sum wrap in a narrower scheme; the packed layout's round
trip and column lookup; and the tiny w8a8 model with its weights packed against the same model
through XLA's dots, token for token and logprob for logprob."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import cpu_kernels as ck
from jaxinfer import dispatch, quant

needs_int8 = pytest.mark.usefixtures("int8_kernels")  # AVX2 + FMA; under CI=true a failed build fails


@pytest.fixture
def s8_avx2(int8_kernels):
    if not ck.s8_gemm_available():
        pytest.skip("s8_gemm_packed needs AVX2")


@pytest.mark.parametrize("M,I,O", [(1, 576, 192), (2, 64, 16), (3, 130, 48), (4, 576, 1536), (5, 576, 576),
                                   (6, 2, 16), (11, 1536, 576), (64, 576, 192), (127, 96, 80), (300, 64, 32),
                                   (600, 128, 64)])
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.usefixtures("s8_avx2")
def test_s8_gemm_packed_equals_xla_s8_dot(M, I, O, threads):
    rng = np.random.default_rng(M * 1000 + I + O)
    x = jnp.asarray(rng.integers(-128, 128, (M, I)), jnp.int8)  # -128 too
    w = jnp.asarray(rng.integers(-128, 128, (I, O)), jnp.int8)
    want = np.asarray(jax.jit(ck.int8_gemv_reference)(x, w))
    p = jax.jit(ck.s8_pack)(w)
    got = np.asarray(jax.jit(lambda x, p: ck.s8_gemm_packed(x, p, threads=threads))(x, p))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(jax.jit(ck.s8_gemm_packed_reference)(x, p)), want)


@pytest.mark.parametrize("M", [1, 4, 13])
@pytest.mark.usefixtures("s8_avx2")
def test_extremes_neither_saturate_nor_wrap(M):
    """Every product at +-2^14 (-128 x -128, -128 x 127): a pair of them is 2^15, one past int16,
    which vpmaddubsw's saturating pair sum would clip; 4096 of them sum to 2^26 in int32. Rows of
    all -128 against columns of all -128, all 127 and alternating signs, worked by hand."""
    I = 4096
    x = jnp.full((M, I), -128, jnp.int8)
    cols = [np.full(I, -128), np.full(I, 127), np.where(np.arange(I) % 2, -128, 127)]
    w = jnp.asarray(np.stack(cols * 6, axis=1)[:, :16], jnp.int8)  # [I, 16]
    got = np.asarray(jax.jit(ck.s8_gemm_packed)(x, ck.s8_pack(w)))
    by_hand = [I * 128 * 128, -I * 128 * 127, (I // 2) * (-128 * 127 + 128 * 128)]
    np.testing.assert_array_equal(got, np.tile((by_hand * 6)[:16], (M, 1)))
    np.testing.assert_array_equal(got, np.asarray(ck.int8_gemv_reference(x, w)))


@pytest.mark.parametrize("M", [1, 33])
@pytest.mark.usefixtures("s8_avx2")
def test_four_threads_give_the_integers_of_one(M):
    """512 columns (32 blocks of 16) at threads=4: four ranges of eight blocks, on any machine."""
    rng = np.random.default_rng(M)
    x = jnp.asarray(rng.integers(-128, 128, (M, 576)), jnp.int8)
    p = jax.jit(ck.s8_pack)(jnp.asarray(rng.integers(-128, 128, (576, 512)), jnp.int8))
    f = {t: jax.jit(lambda x, p, t=t: ck.s8_gemm_packed(x, p, threads=t)) for t in (1, 4)}
    one = np.asarray(f[1](x, p))
    f[4](x, p).block_until_ready()  # compiled
    before = ck.split_count("int8_gemv")
    four = np.asarray(f[4](x, p))
    assert ck.split_count("int8_gemv") - before == 4
    np.testing.assert_array_equal(four, one)


@pytest.mark.parametrize("I,O", [(2, 16), (576, 192), (130, 272)])
def test_packed_layout_round_trip_and_columns(I, O):
    """Pure JAX, so it runs anywhere: unpack(pack(w)) == w, the bytes where the kernel reads
    them, and a column lookup on the packed weight equals the columns of w."""
    rng = np.random.default_rng(I + O)
    w = jnp.asarray(rng.integers(-128, 128, (I, O)), jnp.int8)
    p = ck.s8_pack(w)
    assert p.shape == (O // 16, I // 2, 32)
    assert p[0, 0, 1] == w[1, 0] and p[O // 16 - 1, I // 2 - 1, 30] == w[I - 2, O - 1]
    np.testing.assert_array_equal(np.asarray(ck.s8_unpack(p)), np.asarray(w))
    cols = jnp.asarray([0, O - 1, 17 % O, 5, 5], jnp.int32)
    np.testing.assert_array_equal(np.asarray(ck.s8_take_columns(p, cols)), np.asarray(w)[:, np.asarray(cols)])
    with pytest.raises(ValueError, match="even I and O % 16"):
        ck.s8_pack(jnp.zeros((65, 16), jnp.int8))
    with pytest.raises(ValueError, match="even I and O % 16"):
        ck.s8_pack(jnp.zeros((64, 24), jnp.int8))


def test_packed_quant_array_views_equal_unpacked():
    """A w8a8 QuantArray in the "s8p" layout dequantizes, looks up embedding rows and goes back
    to "io" exactly as the unpacked one, whichever backend runs the trace."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(256, 128)), jnp.float32)  # a [V, D] table, contracted over D
    qa = quant.quantize_w8a8(w, (1,), jnp.ones((128,)), alpha=0.5)
    packed = quant.dataclasses.replace(qa, values=ck.s8_pack(qa.values), layout="s8p")
    np.testing.assert_array_equal(np.asarray(packed.dequantize()), np.asarray(qa.dequantize()))
    toks = jnp.asarray([[3, 255], [0, 17]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(packed.take(toks)), np.asarray(qa.take(toks)))
    back = quant.io_layout({"w": packed})["w"]
    assert back.layout == "io"
    np.testing.assert_array_equal(np.asarray(back.values), np.asarray(qa.values))


@pytest.mark.usefixtures("s8_avx2")
def test_w8a8_model_with_packed_weights_equals_xla(tiny_gguf, monkeypatch):
    """The tiny w8a8 model, five sequences (prefill rows, and decode steps of one to five rows):
    on a CPU whose w8a8 dots all run s8_gemm its weights are packed and every dot goes through
    s8_gemm_packed, and it gives the tokens and logprobs of the same model through XLA's s8 dots
    (the same integers into the same epilogue)."""
    from jaxinfer import LLM, SamplingParams

    if not ck.s8_packed_wanted():
        pytest.skip("this CPU's w8a8 dots run int8_gemv, VNNI or AMX, not s8_gemm")
    sp = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2)
    prompts = ["The quick brown fox", "a b c a b c", "one two three", "hello hello", "Once upon a time there"]
    calls, real = [], ck.s8_gemm_packed
    monkeypatch.setattr(ck, "s8_gemm_packed", lambda *a, **k: calls.append(1) or real(*a, **k))
    llm = LLM(str(tiny_gguf), quantization="w8a8", progress=False, max_num_seqs=8)
    leaves = [x for x in jax.tree.leaves(llm.weights, is_leaf=lambda x: isinstance(x, quant.QuantArray))
              if isinstance(x, quant.QuantArray)]
    assert leaves and all(q.layout == "s8p" for q in leaves if q.scheme == quant.QuantScheme.W8A8)
    native = llm.generate(prompts, sp)
    assert calls
    calls.clear()
    xla_dots = dispatch.Kernels(llm.kernels.attention, dispatch.Matmul.XLA)
    xla = LLM(str(tiny_gguf), quantization="w8a8", progress=False, max_num_seqs=8, kernels=xla_dots).generate(prompts, sp)
    assert not calls
    for a, b in zip(native, xla):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob
