"""Ragged paged attention: the reference on hand-worked cases and against a dense numpy
attention over the same tokens laid out contiguously, then both kernel variants (interpret
mode) against the reference over a grid of segment mixes. Every pool slot that is not a
live token is NaN, and so is every query token that belongs to no segment."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention as rpa
from pallas_kernels.ragged_paged_attention.common import max_items, work_items
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
    return jnp.asarray(k), jnp.asarray(v)


def _hand(q_start, q_len, kv_len, T, **opts):
    k, v = _hand_pool()
    S = len(q_start)
    table = jnp.array([[2, 0]] * S, jnp.int32)
    q = jnp.ones((T, 1, 1), jnp.float32)
    a = lambda x: jnp.array(x, jnp.int32)
    ref = jax.jit(functools.partial(rpa.ragged_paged_attention_reference, scale=1.0, **opts))
    return np.asarray(ref(q, k, v, table, a(q_start), a(q_len), a(kv_len))).ravel()


def test_reference_hand_causal_segments_and_gaps():
    # token 0: a decode row at position 2 (sees all three); token 1: in no segment; tokens
    # 2, 3: a two-query row at positions 1, 2 (the first sees tokens 0, 1 only).
    out = _hand([0, 2], [1, 2], [3, 3], T=4)
    np.testing.assert_allclose(out, [22 / 4, 0.0, 3.0, 22 / 4], rtol=1e-6)
    # a prompt chunk of the first two tokens only: position 0 sees itself, 1 sees 0 and 1
    np.testing.assert_allclose(_hand([0], [2], [2], T=2), [2.0, 3.0], rtol=1e-6)


def test_reference_hand_window_softcap_unused_segment():
    np.testing.assert_allclose(_hand([0], [3], [3], T=3, window=1), [2.0, 4.0, 8.0], rtol=1e-6)
    np.testing.assert_allclose(_hand([0], [2], [3], T=2, window=2), [3.0, 20 / 3], rtol=1e-6)
    # softcap 1: logit ln 2 -> tanh(ln 2) = 0.6, so weights 1 : 1 : e^0.6.
    e = math.exp(0.6)
    np.testing.assert_allclose(_hand([0], [1], [3], T=1, softcap=1.0), [(6 + 8 * e) / (2 + e)], rtol=1e-6)
    # an unused segment (q_len 0) whose q_start points at a live token changes nothing
    np.testing.assert_allclose(_hand([0, 0], [1, 0], [3, 0], T=1), [22 / 4], rtol=1e-6)


def test_reference_hand_gqa_heads_share_pages():
    k, v = _hand_pool()
    q = jnp.array([[[1.0], [0.0]]], jnp.float32)  # two query heads on the one kv head
    a = lambda x: jnp.array(x, jnp.int32)
    out = rpa.ragged_paged_attention_reference(q, k, v, a([[2, 0]]), a([0]), a([1]), a([3]), scale=1.0)
    np.testing.assert_allclose(np.asarray(out).ravel(), [22 / 4, 14 / 3], rtol=1e-6)


def test_work_items_split_segments_into_query_blocks():
    q_len, kv_len = jnp.array([1, 0, 5, 2]), jnp.array([9, 0, 5, 12])
    n = max_items(8, 4, 2)
    it = work_items(q_len, kv_len, n_items=n, bq=2)
    real = int((np.asarray(it.nq) > 0).sum())
    assert real == 1 + 3 + 1
    np.testing.assert_array_equal(np.asarray(it.seq)[:real], [0, 2, 2, 2, 3])
    np.testing.assert_array_equal(np.asarray(it.qoff)[:real], [0, 0, 2, 4, 0])
    np.testing.assert_array_equal(np.asarray(it.nq), [1, 2, 2, 1, 2] + [0] * (n - real))
    np.testing.assert_array_equal(np.asarray(it.qpos0)[:real], [8, 0, 2, 4, 10])


# ----------------------------------------------------------------------------- case builder
def _segments_case(rng, segs, *, K, N, H, page_size, dtype=jnp.float32, keys_transposed=False):
    """segs: (q_len, kv_len, gap) per segment; `gap` NaN query tokens follow the segment.
    Returns the kernel's inputs and, per segment, its contiguous keys/values for numpy."""
    kv = [kv_len for _, kv_len, _ in segs]
    pps = max(1, max(-(-n // page_size) for n in kv))
    kp, vp, table, kd, vd = paged_pool(rng, kv, K=K, H=H, page_size=page_size, pages_per_seq=pps,
                                       dtype=dtype, keys_transposed=keys_transposed)
    starts, t = [], 0
    for q_len, _, gap in segs:
        starts.append(t)
        t += q_len + gap
    T = max(t, 1)
    q = np.full((T, N, H), np.nan, np.float32)
    for (q_len, _, _), s in zip(segs, starts):
        q[s : s + q_len] = rng.normal(size=(q_len, N, H))
    a = lambda x: jnp.asarray(x, jnp.int32)
    args = (jnp.asarray(q, dtype), kp, vp, table, a(starts), a([s[0] for s in segs]), a(kv))
    return args, kd, vd


# ----------------------------------------------------------------------------- vs numpy
@pytest.mark.parametrize(
    "opts", [dict(), dict(window=5), dict(softcap=2.0), dict(keys_transposed=True)]
)
def test_reference_matches_dense_numpy(opts):
    rng = np.random.default_rng(0)
    # a decode row, a three-query row, an unused segment, a fresh prompt, a chunk with history
    segs = [(1, 13, 0), (3, 8, 2), (0, 0, 0), (7, 7, 1), (5, 24, 0)]
    args, kd, vd = _segments_case(rng, segs, K=2, N=4, H=8, page_size=8,
                                  keys_transposed=opts.get("keys_transposed", False))
    out = np.asarray(jax.jit(lambda *a: rpa.ragged_paged_attention_reference(*a, **opts))(*args))
    q, starts = np.asarray(args[0]), np.asarray(args[4])
    dense_opts = {k: v for k, v in opts.items() if k != "keys_transposed"}
    covered = np.zeros(len(q), bool)
    for b, ((q_len, kv_len, _), s) in enumerate(zip(segs, starts)):
        if not q_len:
            continue
        qpos = np.arange(kv_len - q_len, kv_len)[None]
        want = dense_attention_np(q[None, s : s + q_len], kd[b : b + 1], vd[b : b + 1], qpos,
                                  np.array([kv_len]), scale=8**-0.5, **dense_opts)[0]
        np.testing.assert_allclose(out[s : s + q_len], want, atol=2e-6, rtol=2e-6)
        covered[s : s + q_len] = True
    np.testing.assert_array_equal(out[~covered], 0.0)  # NaN query tokens in no segment


# ----------------------------------------------------------------------------- kernel grid
VARIANTS = {"tpu": rpa.ragged_paged_attention_tpu, "gpu": rpa.ragged_paged_attention_gpu}

# Segment mixes (q_len, kv_len, gap): decode rows of one query and of q queries (with the
# padding queries of a verification row left out as a gap), an idle slot, prompt chunks
# shorter and longer than a query block, fresh and continuing a cached history.
MIXES = {
    "decode": [(1, 1, 0), (1, 37, 0), (1, 16, 0), (0, 0, 0)],
    "verify": [(4, 20, 0), (2, 33, 2), (1, 5, 3), (4, 4, 0)],
    "packed": [(1, 30, 0), (1, 2, 0), (3, 17, 1), (9, 40, 0), (16, 16, 0), (2, 2, 3)],
}

DEFAULT_GRID = [
    # dtype, (N, K), page_size, (queries_per_block, pages_per_block), mix, opts
    (jnp.float32, (4, 4), 16, (4, 1), "packed", dict()),
    (jnp.float32, (4, 2), 16, (8, 2), "verify", dict(window=20, keys_transposed=True)),
    (jnp.bfloat16, (8, 2), 16, (16, 2), "packed", dict(softcap=4.0, keys_transposed=True)),
    (jnp.bfloat16, (8, 1), 32, (2, 4), "decode", dict(window=9, softcap=3.0)),
]


def _case(variant, dtype, N, K, page_size, blocks, mix, opts, seed=0):
    skip_unless_runs_here(variant)
    rng = np.random.default_rng(seed)
    args, _, _ = _segments_case(rng, MIXES[mix], K=K, N=N, H=16, page_size=page_size, dtype=dtype,
                                keys_transposed=opts.get("keys_transposed", False))
    ref = jax.jit(lambda *a: rpa.ragged_paged_attention_reference(*a, **opts))(*args)
    bs = rpa.BlockSizes(*blocks)
    out = run_interpreted(lambda *a: VARIANTS[variant](*a, block_sizes=bs, interpret=INTERPRET, **opts), *args)
    assert_close(out, ref)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype,heads,ps,blocks,mix,opts", DEFAULT_GRID)
def test_kernel_matches_reference(variant, dtype, heads, ps, blocks, mix, opts):
    _case(variant, dtype, *heads, ps, blocks, mix, opts)


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize(
    "dtype,heads,ps,mix,blocks,opts",
    covering_grid(
        [[jnp.float32, jnp.bfloat16], [(8, 8), (8, 4), (8, 2), (8, 1)], [16, 32], sorted(MIXES)],
        [
            [(1, 1), (4, 2), (16, 4), (3, 8)],
            [
                dict(),
                dict(window=19, softcap=5.0, keys_transposed=True),
                dict(keys_transposed=True),
                dict(window=1),
            ],
        ],
    ),
)
def test_kernel_matches_reference_wide(variant, dtype, heads, ps, mix, blocks, opts):
    _case(variant, dtype, *heads, ps, blocks, mix, opts)


def test_dispatch_picks_reference_on_cpu_and_kernel_when_interpreting(monkeypatch):
    calls = []
    monkeypatch.setattr(rpa, "ragged_paged_attention_reference", lambda *a, **k: calls.append("ref"))
    monkeypatch.setattr(rpa, "ragged_paged_attention_kernel", lambda *a, **k: calls.append("kernel"))
    one = jnp.ones((1,), jnp.int32)
    args = (jnp.zeros((1, 1, 8)), jnp.zeros((2, 1, 8, 8)), jnp.zeros((2, 1, 8, 8)),
            jnp.zeros((1, 2), jnp.int32), one * 0, one, one)
    rpa.ragged_paged_attention(*args, platform="cpu")
    rpa.ragged_paged_attention(*args, interpret=True, platform="cpu")
    rpa.ragged_paged_attention(*args, platform="gpu")  # the platform is the caller's, not the host's
    assert calls == ["ref", "kernel", "kernel"]


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "fn",
    [rpa.ragged_paged_attention_reference, rpa.ragged_paged_attention_tpu, rpa.ragged_paged_attention_gpu],
)
def test_bad_inputs_have_clear_messages(fn):
    pool, table = jnp.zeros((4, 2, 16, 8)), jnp.zeros((1, 2), jnp.int32)
    one = jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match=r"N=3 must be a multiple of kv heads K=2"):
        fn(jnp.zeros((1, 3, 8)), pool, pool, table, one * 0, one, one)
    q = jnp.zeros((1, 4, 8))
    with pytest.raises(ValueError, match=r"kv_len must be \[S\]=2 \(one per page-table row\)"):
        fn(q, pool, pool, jnp.zeros((2, 2), jnp.int32), jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.int32), one)
    with pytest.raises(ValueError, match=r"q_len must be integer"):
        fn(q, pool, pool, table, one * 0, jnp.ones((1,)), one)
    with pytest.raises(ValueError, match=r"softcap=0"):
        fn(q, pool, pool, table, one * 0, one, one, softcap=0)
    with pytest.raises(ValueError, match=r"k_pages must be \[P, K, H, page_size\]=\(4, 2, 8, 16\)"):
        fn(q, pool, pool, table, one * 0, one, one, keys_transposed=True)
    with pytest.raises(ValueError, match=r"queries_per_block=0 must be a positive int"):
        rpa.BlockSizes(0, 1)


def test_kernel_page_size_messages():
    q, table, one = jnp.zeros((1, 4, 8)), jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    pool = jnp.zeros((4, 2, 12, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"page_size=12 must be a multiple of 8"):
        rpa.ragged_paged_attention_tpu(q, pool, pool, table, one * 0, one, one, interpret=True)
    with pytest.raises(ValueError, match=r"page_size=12 must be a power of 2 >= 16 on GPU"):
        rpa.ragged_paged_attention_gpu(q, pool, pool, table, one * 0, one, one, interpret=True)


def test_kernel_fits_asks_what_the_variants_check():
    """One check for both paged-attention kernels (their page tiles are made alike), asked of
    the platform the caller names."""
    from pallas_kernels import paged_attention as pa

    assert pa.kernel_fits is rpa.kernel_fits
    for plat in ("cpu", "tpu"):  # CPU interprets the TPU variant
        assert rpa.kernel_fits(8, jnp.float32, platform=plat) and rpa.kernel_fits(16, jnp.bfloat16, platform=plat)
        assert not rpa.kernel_fits(8, jnp.bfloat16, platform=plat) and not rpa.kernel_fits(12, jnp.float32,
                                                                                              platform=plat)
    assert rpa.kernel_fits(16, jnp.float32, platform="gpu") and rpa.kernel_fits(32, jnp.bfloat16, platform="gpu")
    assert not rpa.kernel_fits(8, jnp.float32, platform="gpu") and not rpa.kernel_fits(24, jnp.float32, platform="gpu")
    with pytest.raises(ValueError, match="platform='cuda' must be one of"):
        rpa.kernel_fits(16, jnp.float32, platform="cuda")


# ----------------------------------------------------------------------------- attention sinks
def test_reference_hand_sinks():
    """A sink of logit ln 4 beside the three keys (weights 1 : 1 : 2) adds 4 to the
    denominator and no value: (2 + 4 + 16) / (4 + 4). A token in no segment still gives 0."""
    k, v = _hand_pool()
    a = lambda x: jnp.array(x, jnp.int32)
    q = jnp.ones((2, 1, 1), jnp.float32)
    sinks = jnp.array([math.log(4.0)], jnp.float32)
    out = rpa.ragged_paged_attention_reference(q, k, v, a([[2, 0]]), a([0]), a([1]), a([3]), scale=1.0,
                                               sinks=sinks)
    np.testing.assert_allclose(np.asarray(out).ravel(), [22 / 8, 0.0], rtol=1e-6)


SINK_GRID = [
    # dtype, (N, K), page_size, (queries_per_block, pages_per_block), mix, opts
    (jnp.float32, (4, 2), 16, (4, 2), "packed", {"keys_transposed": True}),
    (jnp.float32, (8, 2), 16, (8, 1), "verify", {"window": 9, "keys_transposed": True}),
    (jnp.bfloat16, (4, 1), 16, (2, 4), "decode", {"window": 20}),
]


def test_kernel_with_sinks_matches_reference():
    """The variant interpret mode runs (the engine's kernel path in CPU tests), windowed."""
    _sinks_case("tpu", *SINK_GRID[1])


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype,heads,ps,blocks,mix,opts", SINK_GRID)
def test_kernel_with_sinks_matches_reference_wide(variant, dtype, heads, ps, blocks, mix, opts):
    _sinks_case(variant, dtype, heads, ps, blocks, mix, opts)


def _sinks_case(variant, dtype, heads, ps, blocks, mix, opts):
    """Per-head sinks (some far above the scores, some far below) through a variant against
    the reference, over NaN-poisoned pools; the sinks change the output."""
    skip_unless_runs_here(variant)
    N, K = heads
    rng = np.random.default_rng(7)
    args, _, _ = _segments_case(rng, MIXES[mix], K=K, N=N, H=16, page_size=ps, dtype=dtype,
                                keys_transposed=opts.get("keys_transposed", False))
    sinks = jnp.asarray(rng.normal(size=N) * 2 + np.where(np.arange(N) % 2, 3.0, -3.0), jnp.float32)
    ref = jax.jit(lambda *a: rpa.ragged_paged_attention_reference(*a[:-1], sinks=a[-1], **opts))(*args, sinks)
    plain = jax.jit(lambda *a: rpa.ragged_paged_attention_reference(*a, **opts))(*args)
    assert not np.allclose(np.asarray(ref, np.float32), np.asarray(plain, np.float32), atol=1e-2)
    bs = rpa.BlockSizes(*blocks)
    out = run_interpreted(lambda *a: VARIANTS[variant](*a[:-1], block_sizes=bs, interpret=INTERPRET, sinks=a[-1],
                                                       **opts), *args, sinks)
    assert_close(out, ref)
