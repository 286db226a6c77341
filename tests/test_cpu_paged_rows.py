"""The native attention kernels against their references run by XLA: decode rows
(``cpu_kernels.paged_rows`` against ``models.packed.paged_rows_attention``) and the packed
prefill row (``cpu_kernels.prefill_row`` against ``prefill_row_attention``). Over float32 and
int8 pools, one and several queries per row, segments and history pages, windows,
soft-capping, logical page bases, pages of 8 (decode's plain loop) and 16 or 32 positions,
head dims of 16 to 256, one, two and four threads, each vector variant this CPU runs, with pages
past each row's end and padding tokens poisoned with NaN. Then the tiny model through them
equals the model through XLA's readers, token for token."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import cpu_kernels as ck
from jaxinfer.cache import QuantKV
from jaxinfer.models import packed
from jaxinfer.quant import quantize_kv

# Skipped where the CPU lacks AVX2 + FMA (or the library did not build; under CI=true that fails)
pytestmark = pytest.mark.usefixtures("attention_kernels")
VARIANTS = [pytest.param(isa, marks=pytest.mark.skipif(
    isa == "avx512" and ck.rows_isa() != "avx512", reason="no AVX-512 BW/DQ/VL here")) for isa in ("avx512", "avx2")]


def _case(rng, B, T, N, K, H, ps, n, *, int8, base):
    """Pools with each row's pages scattered through them, positions past each row's end NaN."""
    P = B * n + 3
    k = rng.standard_normal((P, K, H, ps)).astype(np.float32)
    v = rng.standard_normal((P, K, ps, H)).astype(np.float32)
    table = rng.permutation(np.arange(1, P))[: B * n].reshape(B, n).astype(np.int32)
    bases = rng.integers(0, 3, B).astype(np.int32) if base else np.zeros(B, np.int32)
    lens = rng.integers(1, n * ps + 1, B)
    lens[0] = n * ps  # one row fills its table
    qpos = (lens[:, None] - T + np.arange(T)[None]).clip(0) + bases[:, None] * ps
    end = qpos.max(axis=1) + 1
    for b in range(B):
        for c in range(n):
            for o in range(ps):
                if (bases[b] + c) * ps + o >= end[b]:
                    k[table[b, c], :, :, o] = np.nan
                    v[table[b, c], :, o, :] = np.nan
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    if int8:
        kq, ks = quantize_kv(jnp.asarray(np.nan_to_num(k)), axis=-2)
        vq, vs = quantize_kv(jnp.asarray(np.nan_to_num(v)), axis=-1)
        pools = QuantKV(kq, ks, -2), QuantKV(vq, vs, -1)
    else:
        pools = jnp.asarray(k), jnp.asarray(v)
    return q, pools, table, (jnp.asarray(bases) if base else None), qpos, end


@pytest.mark.parametrize("B,T,N,K,H,ps,n", [
    (4, 1, 9, 3, 64, 16, 5),    # SmolLM2's heads, decode
    (9, 3, 9, 3, 64, 16, 7),    # a k = 2 verification block; 9 rows: split between threads
    (3, 2, 4, 1, 256, 16, 4),   # Gemma 3's heads
    (10, 1, 4, 2, 16, 32, 3),   # two 16-wide blocks per page
    (5, 4, 8, 2, 16, 8, 6),     # pages of 8: the plain loop
    (8, 9, 8, 4, 32, 16, 3),    # more queries per KV head than one register group (4)
])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_equals_the_reference(B, T, N, K, H, ps, n, int8, threads):
    rng = np.random.default_rng(B * 100 + T * 10 + ps + int8)
    q, (kp, vp), table, base, qpos, end = _case(rng, B, T, N, K, H, ps, n, int8=int8, base=False)
    want = packed.paged_rows_attention(q, kp, vp, table, base, qpos, end, scale=H ** -0.5)
    extra = {"k_scale": kp.scale, "v_scale": vp.scale} if int8 else {}
    ka, va = (kp.values, vp.values) if int8 else (kp, vp)
    got = jax.jit(lambda q: ck.paged_rows(q, ka, va, table, base, qpos, end, scale=H ** -0.5, threads=threads,
                                          **extra))(q)
    assert not np.isnan(np.asarray(got)).any()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("window,softcap,base", [(20, None, False), (None, 5.0, False), (30, None, True),
                                                 (7, 3.0, True)])
@pytest.mark.parametrize("ps", [8, 16])
@pytest.mark.parametrize("isa", VARIANTS)
def test_windows_softcaps_and_bases(window, softcap, base, ps, isa):
    rng = np.random.default_rng(ps + (window or 0))
    q, (kp, vp), table, bases, qpos, end = _case(rng, 9, 3, 9, 3, 64, ps, 6, int8=False, base=base)
    opts = {"scale": 0.125, "window": window, "softcap": softcap}
    want = packed.paged_rows_attention(q, kp, vp, table, bases, qpos, end, **opts)
    got = jax.jit(lambda q: ck.paged_rows(q, kp, vp, table, bases, qpos, end, isa=isa, **opts))(q)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)


def test_a_row_that_sees_nothing_gives_zeros():
    rng = np.random.default_rng(0)
    q, (kp, vp), table, _, qpos, end = _case(rng, 2, 1, 4, 2, 16, 16, 2, int8=False, base=False)
    end = np.array([0, end[1]], np.int32)  # row 0: nothing written yet
    got = np.asarray(jax.jit(lambda q: ck.paged_rows(q, kp, vp, table, None, qpos, end, scale=0.25))(q))
    want = np.asarray(packed.paged_rows_attention(q, kp, vp, table, None, qpos, end, scale=0.25))
    np.testing.assert_array_equal(got[0], 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_the_model_through_the_kernel_equals_xla_reader(tiny_gguf, monkeypatch, kv):
    """Greedy and seeded, with prompt logprobs of a batch of rows: the same tokens, and logprobs
    equal to float32 rounding, with decode rows read by the kernel and by XLA."""
    from jaxinfer import LLM, SamplingParams, dispatch

    prompts = ["The quick brown fox", "Once upon a time there was", "1, 2, 3,"]
    params = [SamplingParams(temperature=0.0, max_tokens=24, logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, logprobs=2)]
    outs = {}
    auto = dispatch.choose("auto")
    for native in (True, False):
        kernels = auto if native else dispatch.Kernels(dispatch.Attention.XLA, auto.matmul)
        llm = LLM(str(tiny_gguf), kv_cache_dtype=kv, progress=False, max_num_seqs=4, kernels=kernels)
        outs[native] = [o.outputs[0] for sp in params for o in llm.generate(prompts, sp)]
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, rel=1e-5, abs=1e-5)


def _prefill_case(rng, T, N, K, H, ps, lens, hist, *, int8, base):
    """A packed prefill row: segments of ``lens`` tokens then padding (NaN keys and values);
    segment 0 continues ``hist`` positions held in pages (past them NaN), the others start at 0."""
    seg = np.full(T, -1, np.int32)
    pos = np.zeros(T, np.int32)
    at = 0
    for s, n in enumerate(lens):
        seg[at : at + n] = s
        pos[at : at + n] = np.arange(n) + (hist if s == 0 else 0)
        at += n
    n_pages = -(-(hist + 1) // ps) + 1
    P = n_pages + 5
    b0 = 2 if base else 0  # the table's first column holds logical page b0
    kp = rng.standard_normal((P, K, H, ps)).astype(np.float32)
    vp = rng.standard_normal((P, K, ps, H)).astype(np.float32)
    table = rng.permutation(np.arange(1, P))[:n_pages].astype(np.int32)
    for c in range(n_pages):
        for o in range(ps):
            if (b0 + c) * ps + o >= hist:
                kp[table[c], :, :, o] = np.nan
                vp[table[c], :, o, :] = np.nan
    k = rng.standard_normal((1, T, K, H)).astype(np.float32)
    v = rng.standard_normal((1, T, K, H)).astype(np.float32)
    k[0, seg < 0] = np.nan
    v[0, seg < 0] = np.nan
    q = jnp.asarray(rng.standard_normal((1, T, N, H)), jnp.float32)
    if int8:
        (kq, ks), (vq, vs) = quantize_kv(jnp.asarray(np.nan_to_num(kp)), axis=-2), quantize_kv(
            jnp.asarray(np.nan_to_num(vp)), axis=-1)
        pools = QuantKV(kq, ks, -2), QuantKV(vq, vs, -1)
    else:
        pools = jnp.asarray(kp), jnp.asarray(vp)
    bases = jnp.asarray([b0], jnp.int32) if base else None  # positions before page b0: none
    return (q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos), jnp.asarray(seg), *pools, jnp.asarray(table[None]),
            bases, jnp.int32(hist))


@pytest.mark.parametrize("T,N,K,H,ps,lens,hist", [
    (128, 9, 3, 64, 16, [40, 30, 20], 0),      # three prompts, no history
    (64, 9, 3, 64, 16, [64], 37),              # one chunk continuing 37 positions
    (96, 4, 1, 256, 16, [23, 50], 70),         # Gemma's heads; a chunk then a new prompt
    (48, 4, 2, 16, 32, [5, 1, 9, 17], 100),    # short segments across query blocks
])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_prefill_row_equals_the_reference(T, N, K, H, ps, lens, hist, int8, threads):
    rng = np.random.default_rng(T + hist + int8)
    q, k, v, pos, seg, kp, vp, table, base, hist_end = _prefill_case(rng, T, N, K, H, ps, lens, hist, int8=int8,
                                                                     base=False)
    want = packed.prefill_row_attention(q, k, v, pos, seg, kp, vp, table, base, hist_end, scale=H ** -0.5)
    quant = {"k_scale": kp.scale, "v_scale": vp.scale} if int8 else {}
    pools = (kp.values, vp.values) if int8 else (kp, vp)
    got = jax.jit(lambda q: ck.prefill_row(q[0], k[0], v[0], pos, seg, *pools, table, None, hist_end,
                                           scale=H ** -0.5, threads=threads, **quant))(q)
    assert not np.isnan(np.asarray(got)).any()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want)[0], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("window,softcap,base", [(20, None, False), (None, 5.0, False), (30, None, True),
                                                 (7, 3.0, True)])
@pytest.mark.parametrize("isa", VARIANTS)
def test_prefill_row_windows_softcaps_and_bases(window, softcap, base, isa):
    rng = np.random.default_rng(window or 1)
    q, k, v, pos, seg, kp, vp, table, bases, hist_end = _prefill_case(rng, 80, 9, 3, 64, 16, [45, 20], 60,
                                                                      int8=False, base=base)
    opts = {"scale": 0.125, "window": window, "softcap": softcap}
    want = packed.prefill_row_attention(q, k, v, pos, seg, kp, vp, table, bases, hist_end, **opts)
    got = jax.jit(lambda q: ck.prefill_row(q[0], k[0], v[0], pos, seg, kp, vp, table,
                                           None if bases is None else bases[0], hist_end, isa=isa, **opts))(q)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want)[0], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("int8", [False, True])
def test_four_threads_give_the_bits_of_one(int8):
    """16 decode rows and a prefill row of 24 (query block, KV head) items at threads=4: four
    ranges of items even on a machine of two cores (the caller runs what XLA's pool does not
    take), each item computed alone as at one thread, so the same bits."""
    rng = np.random.default_rng(16 + int8)
    q, (kp, vp), table, base, qpos, end = _case(rng, 16, 2, 8, 2, 64, 16, 4, int8=int8, base=True)
    extra = {"k_scale": kp.scale, "v_scale": vp.scale} if int8 else {}
    ka, va = (kp.values, vp.values) if int8 else (kp, vp)
    rows = {t: jax.jit(lambda q, t=t: ck.paged_rows(q, ka, va, table, base, qpos, end, scale=0.125, threads=t,
                                                    **extra)) for t in (1, 4)}
    q2, k, v, pos, seg, kp2, vp2, table2, _, hist_end = _prefill_case(rng, 128, 9, 3, 64, 16, [40, 30, 20], 37,
                                                                      int8=int8, base=False)
    extra2 = {"k_scale": kp2.scale, "v_scale": vp2.scale} if int8 else {}
    pools = (kp2.values, vp2.values) if int8 else (kp2, vp2)
    prefill = {t: jax.jit(lambda q, t=t: ck.prefill_row(q[0], k[0], v[0], pos, seg, *pools, table2, None, hist_end,
                                                        scale=0.125, threads=t, **extra2)) for t in (1, 4)}
    for fns, x in ((rows, q), (prefill, q2)):
        one = np.asarray(fns[1](x))
        fns[4](x).block_until_ready()  # compiled
        before = ck.split_count("paged_attention")
        four = np.asarray(fns[4](x))
        assert ck.split_count("paged_attention") - before == 4
        assert not np.isnan(four).any()
        np.testing.assert_array_equal(four, one)
