"""Paged decode attention: the reference on hand-worked cases and against a dense numpy
attention over the same tokens laid out contiguously, then both kernel variants (interpret
mode) against the reference over a grid, and against the ragged kernel's reference given the
same rows as segments of one query. Every pool slot that is not a live token is NaN."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa
from pallas_kernels import ragged_paged_attention as rpa
from tests.kernel_testing import (
    INTERPRET,
    skip_unless_runs_here,
    assert_close,
    covering_grid,
    dense_attention_np,
    paged_pool,
    run_interpreted,
)


# ----------------------------------------------------------------------------- hand-worked
def _hand_pool():
    """Pool [P=3, K=1, page_size=2, H=1]: three tokens on pages [2, 0] (page 1 is NaN).
    Keys 0, 0, ln 2 and values 2, 4, 8: a query of 1 weighs them 1 : 1 : 2."""
    k = np.full((3, 1, 2, 1), np.nan, np.float32)
    v = k.copy()
    k[2, 0, :, 0], v[2, 0, :, 0] = [0.0, 0.0], [2.0, 4.0]  # tokens 0, 1
    k[0, 0, 0, 0], v[0, 0, 0, 0] = math.log(2.0), 8.0  # token 2; slot 1 stays NaN
    return jnp.asarray(k), jnp.asarray(v), jnp.array([[2, 0]], jnp.int32)


def test_reference_hand_pages_through_table():
    k, v, table = _hand_pool()
    q = jnp.ones((1, 1, 1), jnp.float32)
    out = pa.paged_attention_reference(q, k, v, table, jnp.array([3]), scale=1.0)
    np.testing.assert_allclose(np.asarray(out).ravel(), [(2 + 4 + 2 * 8) / 4], rtol=1e-6)
    two = pa.paged_attention_reference(q, k, v, table, jnp.array([2]), scale=1.0)  # 2, 4 only
    np.testing.assert_allclose(np.asarray(two).ravel(), [3.0], rtol=1e-6)


def test_reference_hand_window_softcap_empty():
    k, v, table = _hand_pool()
    q = jnp.ones((1, 1, 1), jnp.float32)
    last = pa.paged_attention_reference(q, k, v, table, jnp.array([3]), scale=1.0, window=1)
    np.testing.assert_allclose(np.asarray(last).ravel(), [8.0], rtol=1e-6)
    # softcap 1: logit ln 2 -> tanh(ln 2) = 0.6, so weights 1 : 1 : e^0.6.
    e = math.exp(0.6)
    capped = pa.paged_attention_reference(q, k, v, table, jnp.array([3]), scale=1.0, softcap=1.0)
    np.testing.assert_allclose(np.asarray(capped).ravel(), [(6 + 8 * e) / (2 + e)], rtol=1e-6)
    empty = pa.paged_attention_reference(q, k, v, table, jnp.array([0]), scale=1.0)
    np.testing.assert_array_equal(np.asarray(empty), 0.0)
    # Keys stored transposed [P, K, H, page_size] give the same answer.
    kt = k.transpose(0, 1, 3, 2)
    out = pa.paged_attention_reference(
        q, kt, v, table, jnp.array([3]), scale=1.0, keys_transposed=True
    )
    np.testing.assert_allclose(np.asarray(out).ravel(), [22 / 4], rtol=1e-6)


def test_reference_hand_gqa_heads_share_pages():
    k, v, table = _hand_pool()
    q = jnp.array([[[1.0], [0.0]]], jnp.float32)  # two query heads on the one kv head
    out = pa.paged_attention_reference(q, k, v, table, jnp.array([3]), scale=1.0)
    np.testing.assert_allclose(np.asarray(out).ravel(), [22 / 4, 14 / 3], rtol=1e-6)


# ----------------------------------------------------------------------------- vs numpy
@pytest.mark.parametrize(
    "opts", [dict(), dict(window=5), dict(softcap=2.0), dict(keys_transposed=True)]
)
def test_reference_matches_dense_numpy(opts):
    rng = np.random.default_rng(0)
    lengths = [1, 8, 13, 0, 24]
    kp, vp, table, kd, vd = paged_pool(
        rng,
        lengths,
        K=2,
        H=8,
        page_size=8,
        pages_per_seq=3,
        keys_transposed=opts.get("keys_transposed", False),
    )
    q = jnp.asarray(rng.normal(size=(len(lengths), 4, 8)), jnp.float32)
    out = jax.jit(lambda *a: pa.paged_attention_reference(*a, **opts))(
        q, kp, vp, table, jnp.array(lengths)
    )
    qpos = np.array(lengths)[:, None] - 1
    dense_opts = {k: v for k, v in opts.items() if k != "keys_transposed"}
    want = dense_attention_np(
        np.asarray(q)[:, None], kd, vd, qpos, np.array(lengths), scale=8**-0.5, **dense_opts
    )[:, 0]
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-6, rtol=2e-6)


# ----------------------------------------------------------------------------- kernel grid
VARIANTS = {"tpu": pa.paged_attention_tpu, "gpu": pa.paged_attention_gpu}


def _case(variant, dtype, N, K, page_size, ppb, lengths, pages_per_seq, opts, seed=0):
    skip_unless_runs_here(variant)
    rng = np.random.default_rng(seed)
    H = 16
    kp, vp, table, _, _ = paged_pool(
        rng,
        lengths,
        K=K,
        H=H,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        dtype=dtype,
        keys_transposed=opts.get("keys_transposed", False),
    )
    q = jnp.asarray(rng.normal(size=(len(lengths), N, H)), dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    ref = jax.jit(lambda *a: pa.paged_attention_reference(*a, **opts))(q, kp, vp, table, lengths)
    blocks = pa.BlockSizes(ppb)
    out = run_interpreted(
        lambda *a: VARIANTS[variant](*a, block_sizes=blocks, interpret=INTERPRET, **opts),
        q,
        kp,
        vp,
        table,
        lengths,
    )
    assert_close(out, ref)


# Lengths: 1, a page multiple, non-multiples, 0 (an idle batch slot), the full table.
DEFAULT_GRID = [
    # dtype, (N, K), page_size, pages_per_block, lengths, pages_per_seq, opts
    (jnp.float32, (4, 4), 16, 1, [1, 16, 37], 3, dict()),
    (jnp.float32, (4, 2), 16, 2, [23, 0, 64], 4, dict(window=20, keys_transposed=True)),
    (jnp.bfloat16, (8, 2), 16, 2, [1, 33, 48], 3, dict(softcap=4.0)),
    (
        jnp.bfloat16,
        (8, 1),
        32,
        4,
        [5, 70, 96],
        3,
        dict(window=40, softcap=3.0, keys_transposed=True),
    ),
]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype,heads,ps,ppb,lengths,pps,opts", DEFAULT_GRID)
def test_kernel_matches_reference(variant, dtype, heads, ps, ppb, lengths, pps, opts):
    _case(variant, dtype, *heads, ps, ppb, lengths, pps, opts)


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize(
    "dtype,heads,ps,ppb,opts",
    covering_grid(
        [[jnp.float32, jnp.bfloat16], [(8, 8), (8, 4), (8, 2), (8, 1)], [16, 32]],
        [
            [1, 2, 4],
            [
                dict(),
                dict(window=19, softcap=5.0, keys_transposed=True),
                dict(keys_transposed=True),
                dict(window=1),
            ],
        ],
    ),
)
def test_kernel_matches_reference_wide(variant, dtype, heads, ps, ppb, opts):
    pps = 5
    lengths = [1, ps - 1, ps, ps + 1, 3 * ps + 7, pps * ps, 0]
    _case(variant, dtype, *heads, ps, ppb, lengths, pps, opts)


def test_dispatch_picks_reference_on_cpu_and_kernel_when_interpreting(monkeypatch):
    calls = []
    monkeypatch.setattr(pa, "paged_attention_reference", lambda *a, **k: calls.append("ref"))
    monkeypatch.setattr(pa, "paged_attention_kernel", lambda *a, **k: calls.append("kernel"))
    args = (
        jnp.zeros((1, 1, 8)),
        jnp.zeros((2, 1, 8, 8)),
        jnp.zeros((2, 1, 8, 8)),
        jnp.zeros((1, 2), jnp.int32),
        jnp.ones((1,), jnp.int32),
    )
    pa.paged_attention(*args, platform="cpu")
    pa.paged_attention(*args, interpret=True, platform="cpu")
    pa.paged_attention(*args, platform="tpu")  # the platform is the caller's, not the host's
    assert calls == ["ref", "kernel", "kernel"]


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "fn", [pa.paged_attention_reference, pa.paged_attention_tpu, pa.paged_attention_gpu]
)
def test_bad_inputs_have_clear_messages(fn):
    pool, table, lengths = (
        jnp.zeros((4, 2, 16, 8)),
        jnp.zeros((1, 2), jnp.int32),
        jnp.ones((1,), jnp.int32),
    )
    with pytest.raises(ValueError, match=r"N=3 must be a multiple of kv heads K=2"):
        fn(jnp.zeros((1, 3, 8)), pool, pool, table, lengths)
    q = jnp.zeros((1, 4, 8))
    with pytest.raises(ValueError, match=r"page_table must be \[B=1, pages_per_seq\]"):
        fn(q, pool, pool, jnp.zeros((2, 2), jnp.int32), lengths)
    with pytest.raises(ValueError, match=r"lengths must be integer"):
        fn(q, pool, pool, table, jnp.ones((1,)))
    with pytest.raises(ValueError, match=r"softcap=0"):
        fn(q, pool, pool, table, lengths, softcap=0)
    with pytest.raises(ValueError, match=r"k_pages must be \[P, K, H, page_size\]=\(4, 2, 8, 16\)"):
        fn(q, pool, pool, table, lengths, keys_transposed=True)


def test_kernel_page_size_messages():
    q, table, lengths = (
        jnp.zeros((1, 4, 8)),
        jnp.zeros((1, 2), jnp.int32),
        jnp.ones((1,), jnp.int32),
    )
    pool = jnp.zeros((4, 2, 12, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"page_size=12 must be a multiple of 8"):
        pa.paged_attention_tpu(q, pool, pool, table, lengths, interpret=True)
    with pytest.raises(ValueError, match=r"page_size=12 must be a power of 2 >= 16 on GPU"):
        pa.paged_attention_gpu(q, pool, pool, table, lengths, interpret=True)


# ----------------------------------------------------------------------------- vs ragged
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize(
    "dtype,heads,ps,opts",
    [
        (jnp.float32, (4, 2), 16, dict(keys_transposed=True)),
        (jnp.bfloat16, (8, 2), 16, dict(window=20, softcap=3.0, keys_transposed=True)),
    ],
)
def test_kernel_matches_the_ragged_reference(variant, dtype, heads, ps, opts):
    """Decode rows as the packed step hands them to either kernel (keys transposed, an idle
    row of length 0): the paged kernel gives what the ragged kernel's reference gives for
    the same rows as segments of one query each."""
    skip_unless_runs_here(variant)
    N, K = heads
    rng = np.random.default_rng(5)
    lengths = [1, 40, 0, 17, 64]
    kp, vp, table, _, _ = paged_pool(rng, lengths, K=K, H=16, page_size=ps, pages_per_seq=4, dtype=dtype,
                                     keys_transposed=opts["keys_transposed"])
    B = len(lengths)
    q = jnp.asarray(rng.normal(size=(B, N, 16)), dtype)
    n = jnp.asarray(lengths, jnp.int32)
    ref = jax.jit(lambda *a: rpa.ragged_paged_attention_reference(*a, **opts))(
        q, kp, vp, table, jnp.arange(B, dtype=jnp.int32), (n > 0).astype(jnp.int32), n)
    out = run_interpreted(lambda *a: VARIANTS[variant](*a, interpret=INTERPRET, **opts), q, kp, vp, table, n)
    assert_close(out, ref)


# ----------------------------------------------------------------------------- attention sinks
def test_reference_hand_sinks():
    """A sink of logit ln 4 beside the three keys (weights 1 : 1 : 2) adds 4 to the
    denominator and no value: (2 + 4 + 16) / (4 + 4). A row of length 0 still gives 0."""
    k, v, table = _hand_pool()
    q = jnp.ones((2, 1, 1), jnp.float32)
    sinks = jnp.array([math.log(4.0)], jnp.float32)
    out = pa.paged_attention_reference(q, k, v, jnp.concatenate([table, table]), jnp.array([3, 0]), scale=1.0,
                                       sinks=sinks)
    np.testing.assert_allclose(np.asarray(out).ravel(), [22 / 8, 0.0], rtol=1e-6)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype,window", [(jnp.float32, 20), (jnp.bfloat16, None)])
def test_kernel_with_sinks_matches_both_references(variant, dtype, window):
    """Per-head sinks (some far above the scores, some far below) over NaN-poisoned pools:
    the kernel gives its reference's output and the ragged reference's on the same rows, and
    the sinks change it."""
    skip_unless_runs_here(variant)
    N, K = 8, 2
    rng = np.random.default_rng(7)
    lengths = [1, 40, 0, 17, 64]
    kp, vp, table, _, _ = paged_pool(rng, lengths, K=K, H=16, page_size=16, pages_per_seq=4, dtype=dtype,
                                     keys_transposed=True)
    B = len(lengths)
    q = jnp.asarray(rng.normal(size=(B, N, 16)), dtype)
    n = jnp.asarray(lengths, jnp.int32)
    sinks = jnp.asarray(rng.normal(size=N) * 2 + np.where(np.arange(N) % 2, 3.0, -3.0), jnp.float32)
    opts = dict(window=window, keys_transposed=True)
    ref = jax.jit(lambda *a: pa.paged_attention_reference(*a[:-1], sinks=a[-1], **opts))(q, kp, vp, table, n, sinks)
    ragged = jax.jit(lambda *a: rpa.ragged_paged_attention_reference(*a[:-1], sinks=a[-1], **opts))(
        q, kp, vp, table, jnp.arange(B, dtype=jnp.int32), (n > 0).astype(jnp.int32), n, sinks)
    plain = jax.jit(lambda *a: pa.paged_attention_reference(*a, **opts))(q, kp, vp, table, n)
    assert not np.allclose(np.asarray(ref, np.float32), np.asarray(plain, np.float32), atol=1e-2)
    assert_close(ref, ragged)
    out = run_interpreted(lambda *a: VARIANTS[variant](*a[:-1], interpret=INTERPRET, sinks=a[-1], **opts),
                          q, kp, vp, table, n, sinks)
    assert_close(out, ref)
