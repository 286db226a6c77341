"""The native gemv kernels (jaxinfer.cpu_kernels) against their references, over shapes that
reach every path of each kernel (column blocks, a column tail, an odd last row, 1-4 rows, one,
two and four threads): the int8 gemv gives XLA's s8 dot's integers, the weight-only gemv XLA's
float32 dot's bits at one row, the float32 gemv (each of its vector variants this CPU runs)
XLA's one-row dots' bits; and the models through them equal the models through XLA's dots,
token for token. wo8_gemm (any number of rows) is one FMA chain per output, checked bit for bit
against that chain written out. How a call is cut between threads, the same bits at any thread count (four
on a machine of two cores too), and the libraries' builds: one per source, and under CI=true a
CPU with the instructions but no library fails the run."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import cpu_kernels as ck

# Skipped where the CPU lacks the instructions (or the library did not build; under CI=true that fails)
needs_int8 = pytest.mark.usefixtures("int8_kernels")
needs_f32 = pytest.mark.usefixtures("f32_kernels")
# f32_gemv's vector variants, each where this CPU runs it (an AVX-512 CPU runs both)
ISAS = [pytest.param(isa, marks=pytest.mark.skipif(isa not in ck.isas(), reason=f"no {isa} here"))
        for isa in ck.ISA_FLAGS]


@pytest.mark.parametrize("M,I,O", [(1, 576, 576), (1, 576, 192), (2, 1536, 576), (4, 576, 3072), (3, 577, 1000),
                                   (1, 7, 64), (1, 1, 1), (2, 130, 63), (1, 64, 49152 // 8)])
@pytest.mark.parametrize("threads", [1, 2, 4])
@needs_int8
def test_gemv_equals_xla_s8_dot(M, I, O, threads):
    rng = np.random.default_rng(M * 1000 + I + O)
    x = jnp.asarray(rng.integers(-128, 128, (M, I)), jnp.int8)  # -128 too: the extremes
    w = jnp.asarray(rng.integers(-128, 128, (I, O)), jnp.int8)
    want = np.asarray(jax.jit(ck.int8_gemv_reference)(x, w))
    got = np.asarray(jax.jit(lambda x, w: ck.int8_gemv(x, w, threads=threads))(x, w))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("M,I,O", [(1, 576, 576), (1, 1536, 576), (2, 576, 3072), (4, 577, 1000), (1, 7, 33),
                                   (3, 64, 49152 // 8)])
@pytest.mark.parametrize("threads", [1, 2, 4])
@needs_int8
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


def test_weight_only_reference_by_hand():
    """wo8_gemm's reference, worked by hand: [[1, 2, 3]] @ [[1, -2], [0, 127], [-128, 3]]."""
    x = jnp.asarray([[1.0, 2.0, 3.0]], jnp.float32)
    w = jnp.asarray([[1, -2], [0, 127], [-128, 3]], jnp.int8)
    np.testing.assert_array_equal(np.asarray(ck.wo8_gemm_reference(x, w)), [[1 - 384, -2 + 254 + 9]])


# rows: decode batches of 1-8 and 64-256, prompt chunks of 512 (and past it: two calls); odd
# sizes reach the column tail (O % 16), an uneven last row group (M % 6) and row block (M % 126)
WO8_SHAPES = [(1, 576, 576), (3, 577, 100), (8, 576, 1536), (64, 576, 192), (200, 1536, 576), (512, 576, 1536),
              (7, 33, 17), (127, 130, 63), (600, 96, 48), (1, 1, 1)]


@pytest.mark.parametrize("M,I,O", WO8_SHAPES)
@needs_int8
def test_weight_only_gemm_equals_its_reference(M, I, O):
    rng = np.random.default_rng(M * 1000 + I + O)
    x = jnp.asarray(rng.normal(size=(M, I)), jnp.float32)
    w = jnp.asarray(rng.integers(-128, 128, (I, O)), jnp.int8)
    want = np.asarray(jax.jit(ck.wo8_gemm_reference)(x, w))
    got = np.asarray(jax.jit(ck.wo8_gemm)(x, w))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# O = 149: one row's 64-column blocks, a few rows' 32- or 24-column ones, a 16-column block and a
# tail; 7-16 rows: groups of up to 4 rows on 24-column blocks, then a 16-column block (O = 40, 43)
@pytest.mark.parametrize("M,O", [(1, 37), (1, 149), (2, 149), (3, 37), (3, 149), (4, 149), (5, 149), (8, 37),
                                 (8, 149), (10, 43), (16, 40), (64, 37), (200, 37), (512, 37)])
@needs_int8
def test_weight_only_gemm_is_one_fma_chain_per_output(M, O):
    """Every output is one FMA chain over the input channels in order, whatever code computes
    it (registers, panel, scalar tail, AVX-512 or AVX2) and however many threads share the call:
    the bits of that chain computed here in numpy, and the same bits at 1, 2 and 4 threads."""
    rng = np.random.default_rng(M)
    I = 70
    x = rng.normal(size=(M, I)).astype(np.float32)
    w = rng.integers(-128, 128, (I, O)).astype(np.int8)
    got = {t: np.asarray(jax.jit(lambda x, w, t=t: ck.wo8_gemm(x, w, threads=t))(x, w)) for t in (1, 2, 4)}
    # fma(a, b, c) in float32 is round(a * b + c): the product of a float32 and an int8 is exact
    # in float64, and with terms of like magnitude (as here) so is its sum with a float32, so
    # rounding that to float32 is the FMA
    want = np.zeros((M, O), np.float32)
    for k in range(I):
        want = (x[:, k : k + 1].astype(np.float64) * w[k].astype(np.float64) + want).astype(np.float32)
    for t in (1, 2, 4):
        np.testing.assert_array_equal(got[t], want)


# 1-4 rows: blocks of 64 / 32 / 16 columns, then 16, then the scalar tail
@pytest.mark.parametrize("M,I,O", WO8_SHAPES + [(3, 2048, 40), (1, 31, 85), (2, 96, 90), (4, 65, 33)])
@pytest.mark.parametrize("threads", [1, 3])
@needs_int8
def test_s8_gemm_equals_xla_s8_dot(M, I, O, threads):
    """Exactly XLA's integers, -128 included (int16 pairs neither saturate nor wrap), at any
    thread count."""
    if not ck.s8_gemm_available():
        pytest.skip("s8_gemm needs AVX2")
    rng = np.random.default_rng(M * 1000 + I + O)
    x = jnp.asarray(rng.integers(-128, 128, (M, I)), jnp.int8)
    w = jnp.asarray(rng.integers(-128, 128, (I, O)), jnp.int8)
    if I == 2048:  # the extremes: |sum| up to 2^25
        x, w = jnp.full_like(x, -128), jnp.full_like(w, -128)
    want = np.asarray(jax.jit(ck.int8_gemv_reference)(x, w))
    got = np.asarray(jax.jit(lambda x, w: ck.s8_gemm(x, w, threads=threads))(x, w))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("M", [1, 3, 4])
@needs_int8
def test_weight_only_gemm_and_gemv_agree(M):
    rng = np.random.default_rng(M)
    x = jnp.asarray(rng.normal(size=(M, 576)), jnp.float32)
    w = jnp.asarray(rng.integers(-128, 128, (576, 1000)), jnp.int8)
    np.testing.assert_array_equal(np.asarray(jax.jit(ck.wo8_gemm)(x, w)), np.asarray(jax.jit(ck.wo8_gemv)(x, w)))


@pytest.mark.parametrize("M,I,O", [(2, 576, 960), (5, 576, 3072), (8, 1536, 576), (3, 577, 1000), (7, 7, 33),
                                   (1, 64, 49152 // 8), (6, 130, 63), (4, 1, 1), (10, 576, 960), (16, 1536, 576),
                                   (13, 577, 1000)])
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("isa", ISAS)
@needs_f32
def test_float_gemv_rows_are_xla_one_row_dots(M, I, O, threads, isa):
    """w [I, O]: each output is one FMA chain over the input channels in order, so every row
    has the bits of XLA's float32 dot of that row alone (the rows do not see each other).
    XLA's own last columns past a multiple of 16 round differently: there, float32 rounding."""
    rng = np.random.default_rng(M * 1000 + I + O)
    x = jnp.asarray(rng.normal(size=(M, I)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(I, O)), jnp.float32)
    got = np.asarray(jax.jit(lambda x, w: ck.f32_gemv(x, w, threads=threads, isa=isa))(x, w))
    one_row = jax.jit(ck.f32_gemv_reference)
    for m in range(M):
        want = np.asarray(one_row(x[m : m + 1], w))[0]
        whole = O // 16 * 16
        np.testing.assert_array_equal(got[m, :whole], want[:whole])
        np.testing.assert_allclose(got[m, whole:], want[whole:], rtol=1e-5, atol=1e-5 * np.sqrt(I))


@pytest.mark.parametrize("M,I,O", [(2, 576, 4096), (5, 576, 1000), (8, 640, 513), (3, 577, 64), (6, 15, 7),
                                   (7, 16, 30), (1, 576, 2048), (4, 1, 5), (12, 576, 4096), (16, 640, 513),
                                   (9, 15, 7)])
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("isa", ISAS)
@needs_f32
def test_float_gemv_transposed_equals_xla_dot(M, I, O, threads, isa):
    """w [O, I] (a tied LM head): lanes summed at the end, so float32 rounding apart."""
    rng = np.random.default_rng(M * 1000 + I + O + 1)
    x = jnp.asarray(rng.normal(size=(M, I)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(O, I)), jnp.float32)
    got = np.asarray(jax.jit(lambda x, w: ck.f32_gemv(x, w, transposed=True, threads=threads, isa=isa))(x, w))
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(I))


@pytest.mark.skipif(len(ck.isas()) < 2, reason="one vector variant here")
@needs_f32
@pytest.mark.parametrize("M", [1, 3, 5, 8, 11, 16])
def test_float_gemv_variants_give_the_same_bits(M):
    """w [I, O]: the AVX2 variant runs the AVX-512 one's FMA chains (and the same scalar loop on
    other column tails), so the two agree to the bit on every column."""
    rng = np.random.default_rng(M)
    x = jnp.asarray(rng.normal(size=(M, 577)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(577, 1000)), jnp.float32)
    got = {isa: np.asarray(jax.jit(lambda x, w, isa=isa: ck.f32_gemv(x, w, isa=isa))(x, w)) for isa in ck.isas()}
    np.testing.assert_array_equal(got["avx2"], got["avx512"])


def test_default_threads_are_the_cores_this_process_may_run_on():
    want = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert ck.default_threads() == want


@needs_f32
@pytest.mark.parametrize("width,unit,threads,want", [
    (3072, 64, 4, [(0, 768), (768, 1536), (1536, 2304), (2304, 3072)]),  # 48 blocks, 12 a range
    (1000, 48, 4, [(0, 240), (240, 480), (480, 720), (720, 1000)]),  # 20 blocks; the tail with the last
    (576, 64, 2, [(0, 320), (320, 576)]),  # 9 blocks: the first range one more
    (576, 64, 4, [(0, 320), (320, 576)]),  # at least 4 blocks a range
    (9, 1, 4, [(0, 5), (5, 9)]),  # paged_rows' rows
    (7, 1, 4, [(0, 7)]),
    (4096, 64, 1, [(0, 4096)]),
    (49152, 64, 32, [(1536 * k, 1536 * (k + 1)) for k in range(32)]),  # a 32-core server
])
def test_a_call_is_cut_into_one_range_per_thread(width, unit, threads, want):
    assert ck.split_plan(width, unit=unit, threads=threads) == want


@needs_f32
def test_ranges_cover_the_call_in_whole_units():
    for width in (0, 1, 63, 64, 255, 256, 257, 1000, 4099, 49152):
        for unit in (1, 16, 48, 64):
            for threads in (1, 2, 3, 4, 7, 16, 64):
                ranges = ck.split_plan(width, unit=unit, threads=threads)
                assert len(ranges) == max(1, min(threads, width // unit // 4))
                assert ranges[0][0] == 0 and ranges[-1][1] == width
                assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
                sizes = [c1 - c0 for c0, c1 in ranges[:-1]]
                assert all(s % unit == 0 for s in sizes)
                last = ranges[-1][1] - ranges[-1][0] - width % unit
                assert max(sizes + [last]) - min(sizes + [last]) <= unit


@needs_f32
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("M", [1, 5, 16])
def test_four_threads_give_the_bits_of_one(M, transposed):
    """threads=4 cuts a call into four ranges even on a machine of two cores (the caller runs
    the ranges XLA's pool does not take), and every output is computed as at one thread."""
    rng = np.random.default_rng(M + transposed)
    I, O = 576, 4099
    x = jnp.asarray(rng.normal(size=(M, I)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(O, I) if transposed else (I, O)), jnp.float32)
    f = {t: jax.jit(lambda x, w, t=t: ck.f32_gemv(x, w, transposed=transposed, threads=t)) for t in (1, 4)}
    one = np.asarray(f[1](x, w))
    f[4](x, w).block_until_ready()  # compiled
    before = ck.split_count("f32_gemv")
    four = np.asarray(f[4](x, w))
    assert ck.split_count("f32_gemv") - before == 4
    np.testing.assert_array_equal(four, one)


@needs_int8
@pytest.mark.parametrize("M", [1, 4])
def test_four_threads_give_the_integers_of_one(M):
    rng = np.random.default_rng(M)
    x = jnp.asarray(rng.integers(-128, 128, (M, 576)), jnp.int8)
    w = jnp.asarray(rng.integers(-128, 128, (576, 4099)), jnp.int8)
    xf = jnp.asarray(rng.normal(size=(M, 576)), jnp.float32)
    for kernel, a in ((ck.int8_gemv, x), (ck.wo8_gemv, xf)):
        f = {t: jax.jit(lambda a, w, t=t, kernel=kernel: kernel(a, w, threads=t)) for t in (1, 4)}
        one = np.asarray(f[1](a, w))
        f[4](a, w).block_until_ready()
        before = ck.split_count("int8_gemv")
        four = np.asarray(f[4](a, w))
        assert ck.split_count("int8_gemv") - before == 4
        np.testing.assert_array_equal(four, one)


ROOT = Path(__file__).resolve().parent.parent


def _fake_compiler(tmp_path, fails_on: str) -> Path:
    """A g++ that fails on sources whose name has ``fails_on`` in it (as an old compiler fails
    on AMX's intrinsics) and hands the rest to the real one."""
    cxx = tmp_path / "g++"
    cxx.write_text(f"""#!/bin/sh
case "$*" in
  *--version*) exec g++ --version ;;
  *{fails_on}*) echo "{fails_on}: error: this compiler is too old for it" >&2; exit 1 ;;
esac
exec g++ "$@"
""")
    cxx.chmod(0o755)
    return cxx


def _env(tmp_path, cxx: Path, ci: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env |= {"CXX": str(cxx), "JAXINFER_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}
    if ci:
        env["CI"] = "true"
    return env


@pytest.mark.skipif(not ck.isas(), reason="this CPU runs no native kernel (no AVX2 + FMA)")
@pytest.mark.parametrize("ci", [False, True])
def test_a_failed_build_skips_locally_and_fails_under_ci(tmp_path, ci):
    """A pytest run whose compiler fails on f32_gemv.cc, on a CPU that runs the kernel: the
    float32 kernel's tests skip, and under CI=true fail, naming the compiler's error."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
           "tests/test_cpu_kernels.py", "-k", "test_float_rows_out_of_range_are_refused"]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path, _fake_compiler(tmp_path, "f32_gemv.cc"), ci), check=False,
                       capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    if ci:
        assert r.returncode == 1, out
        assert "CI=true and this CPU runs f32_gemv, but f32_gemv did not build or load" in out
        assert "this compiler is too old for it" in out
    else:
        assert r.returncode == 0, out
        assert "1 skipped" in out and "passed" not in out


@pytest.mark.slow  # builds f32_gemv.cc anew (a minute or two)
@pytest.mark.skipif(not ck.isas(), reason="this CPU runs no native kernel (no AVX2 + FMA)")
def test_one_source_failing_takes_no_other_library_with_it(tmp_path):
    """A compiler that fails on paged_attention.cc: the float32 kernels still build and load,
    and only the attention kernels are off (the engine keeps XLA's readers)."""
    code = """if True:
        from jaxinfer import cpu_kernels as ck
        print(ck.library_status("paged_attention"))
        print(ck.f32_available(), ck.attention_available())
    """
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=False,
                       env=_env(tmp_path, _fake_compiler(tmp_path, "paged_attention.cc"), ci=False),
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    state, available = r.stdout.strip().splitlines()[-2:]
    assert "failed=True" in state and "this compiler is too old for it" in state
    assert available == "True False"
    assert [p.name.split("-")[0] for p in (tmp_path / "home" / "native").glob("*.so")] == ["f32_gemv"]


@needs_int8
def test_extremes_do_not_overflow():
    I, O = 2048, 128  # |sum| up to 2048 * 128 * 128 = 2^25: int32, no int16 wrap
    x = jnp.full((1, I), -128, jnp.int8)
    w = jnp.full((I, O), -128, jnp.int8)
    got = np.asarray(jax.jit(ck.int8_gemv)(x, w))
    np.testing.assert_array_equal(got, np.full((1, O), I * 128 * 128, np.int32))


@needs_int8
def test_int8_rows_out_of_range_are_refused():
    with pytest.raises(ValueError, match="1..4 rows"):
        ck.int8_gemv(jnp.zeros((5, 64), jnp.int8), jnp.zeros((64, 64), jnp.int8))


@needs_f32
def test_float_rows_out_of_range_are_refused():
    with pytest.raises(ValueError, match="1..16 rows"):
        ck.f32_gemv(jnp.zeros((17, 64), jnp.float32), jnp.zeros((64, 64), jnp.float32))


@pytest.mark.parametrize("scheme", ["w8a8", "int8"])
@needs_int8
def test_quantized_model_through_the_kernels_equals_xla(tiny_gguf, monkeypatch, scheme):
    """The tiny model, batch 1, greedy: the native path and XLA's dot give the same tokens, and
    under w8a8 the same logprobs (the same integers feed the same epilogue); weight-only int8
    sums in float32 in another order inside XLA's fused step, so its logprobs agree to
    rounding."""
    from jaxinfer import LLM, SamplingParams, dispatch

    # XLA's own decode reader in both: the native one is a custom call, before which XLA fuses
    # the dot's epilogue differently for its dot and for int8_gemv (q moves by an ulp)
    kernels = dispatch.Kernels(dispatch.Attention.XLA, dispatch.Matmul.NATIVE)
    sp = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    prompt = "The quick brown fox"
    calls = []
    for name in ("int8_gemv", "wo8_gemv", "wo8_gemm", "s8_gemm", "int8_amx"):
        real = getattr(ck, name)
        monkeypatch.setattr(ck, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    native = LLM(str(tiny_gguf), quantization=scheme, progress=False, max_num_seqs=2, kernels=kernels).generate(prompt, sp)[0]
    assert calls  # the steps' dots went through a native kernel
    calls.clear()
    xla = LLM(str(tiny_gguf), quantization=scheme, progress=False, max_num_seqs=2, kernels="xla").generate(prompt, sp)[0]
    assert not calls
    assert native.outputs[0].token_ids == xla.outputs[0].token_ids
    if scheme == "w8a8":
        assert native.outputs[0].cumulative_logprob == xla.outputs[0].cumulative_logprob
    else:
        assert native.outputs[0].cumulative_logprob == pytest.approx(xla.outputs[0].cumulative_logprob, rel=1e-6)


@needs_f32
def test_float_model_through_the_few_row_kernel_equals_xla(tiny_gguf, monkeypatch):
    """The tiny float32 model with n-gram speculation (verification steps of k + 1 rows) and
    four sequences (decode steps of 4 rows): the native few-row dots give XLA's tokens, and
    logprobs equal to float32 rounding."""
    from jaxinfer import LLM, SamplingParams, dispatch

    sp = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1)
    prompts = ["The quick brown fox", "a b c a b c a b c", "one two three one two", "hello hello hello"]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    calls, real = [], ck.f32_gemv
    monkeypatch.setattr(ck, "f32_gemv", lambda *a, **k: calls.append(1) or real(*a, **k))
    make = lambda k: LLM(str(tiny_gguf), progress=False, max_num_seqs=4, speculative_config=spec, kernels=k)
    auto = dispatch.choose("auto")
    native = make(auto).generate(prompts, sp)
    assert calls  # some steps' dots went through the kernel
    calls.clear()
    xla = make(dispatch.Kernels(auto.attention, dispatch.Matmul.XLA)).generate(prompts, sp)
    assert not calls
    for a, b in zip(native, xla):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, rel=1e-5, abs=1e-5)
