"""Grouped matmul: the work list and the reference (ragged_dot) on cases worked by hand and
against numpy, then the XLA loop and both kernel variants (interpret mode) against the
reference over a grid of dtypes, group sizes (empty groups, one group holding every row,
rows in no group), tile sizes, int8 weights and a group offset. Rows in no group of the
weight hold NaN, and so do the weights of groups with no rows: a stray read poisons the
result."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_matmul as gm
from tests.kernel_testing import INTERPRET, assert_close, covering_grid, run_interpreted, skip_unless_runs_here


# ----------------------------------------------------------------------------- work list
def test_work_items_by_hand():
    # rows: group 0 [0, 5), group 1 empty, group 2 [5, 17), group 3 [17, 18); tiles of 8:
    # group 0 tile 0; group 2 tiles 0, 1, 2; group 3 tile 2. W = 3 tiles + 4 groups - 1 = 6.
    items = jax.jit(gm.work_items, static_argnums=(2, 3, 4))(jnp.array([5, 0, 12, 1]), 0, 4, 18, 8)
    assert int(items.count) == 5
    np.testing.assert_array_equal(items.group, [0, 2, 2, 2, 3, 3])
    np.testing.assert_array_equal(items.tile, [0, 0, 1, 2, 2, 2])
    np.testing.assert_array_equal(items.lo, [0, 5, 5, 5, 17, 17])
    np.testing.assert_array_equal(items.hi, [5, 17, 17, 17, 18, 17])  # the padding item writes nothing


def test_work_items_with_group_offset_and_no_rows():
    # the weight holds groups 2 and 3 of four: items for those only, numbered 0 and 1
    items = gm.work_items(jnp.array([5, 0, 12, 1]), 2, 2, 18, 8)
    assert int(items.count) == 4
    np.testing.assert_array_equal(items.group, [0, 0, 0, 1])
    np.testing.assert_array_equal(items.tile, [0, 1, 2, 2])
    empty = gm.work_items(jnp.array([5, 0, 0, 13]), 1, 2, 18, 8)  # its groups have no rows
    assert int(empty.count) == 0 and np.all(np.asarray(empty.lo) == np.asarray(empty.hi))


def test_group_windows_by_hand():
    # the loop's windows start at each group's own first row: group 0 [0, 5) one window,
    # group 2 [5, 17) two (5 and 13), group 3 [17, 18) one; group 1 (empty) none
    from pallas_kernels.grouped_matmul.common import group_windows

    win = group_windows(jnp.array([5, 0, 12, 1]), 0, 4, 18, 8)
    n = int(win.count)
    assert n == 4
    np.testing.assert_array_equal(win.group[:n], [0, 2, 2, 3])
    np.testing.assert_array_equal(win.start[:n], [0, 5, 13, 17])
    np.testing.assert_array_equal(win.end[:n], [5, 17, 17, 18])
    win = group_windows(jnp.array([5, 0, 12, 1]), 2, 2, 18, 8)  # groups 2 and 3 only
    np.testing.assert_array_equal(win.start[: int(win.count)], [5, 13, 17])


def test_default_block_m_follows_the_mean_group():
    assert gm.default_block_m(128, 64) == 8  # decode: 2 rows per expert
    assert gm.default_block_m(1024, 8) == 128  # a long prompt over Mixtral's 8 experts
    assert gm.default_block_m(1024, 8, hi=64) == 64


# ----------------------------------------------------------------------------- reference
def test_reference_by_hand():
    x = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    w = jnp.array([[[1.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [1.0, 0.0]], [[2.0, 0.0], [0.0, 2.0]]])
    # row 0 in group 0 (identity), rows 1-2 in group 2 (doubling), group 1 empty
    out = gm.grouped_matmul_reference(x, w, jnp.array([1, 0, 2]))
    np.testing.assert_array_equal(out, [[1.0, 2.0], [6.0, 8.0], [10.0, 12.0]])
    # the weight holds group 2 only: rows of group 0 come out 0
    out = gm.grouped_matmul_reference(x, w[2:], jnp.array([1, 0, 2]), group_offset=2)
    np.testing.assert_array_equal(out, [[0.0, 0.0], [6.0, 8.0], [10.0, 12.0]])


def _numpy(x, dense, sizes, offset=0):
    """y[r] = x[r] @ dense[g - offset] in float64 for rows of the weight's groups, else 0."""
    x = np.asarray(x, np.float64)
    dense = np.asarray(dense, np.float64)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    y = np.zeros((x.shape[0], dense.shape[2]))
    for j in range(dense.shape[0]):
        s, e = starts[offset + j], ends[offset + j]
        y[s:e] = x[s:e] @ dense[j]
    return y


@pytest.mark.parametrize("quant", ["", "int8", "int4"])
def test_reference_matches_numpy(quant):
    from jaxinfer.quant import quantize_int4, quantize_int8

    rng = np.random.default_rng(0)
    M, I, O = 30, 128, 48
    sizes = np.array([4, 0, 11, 9, 0, 6])
    x = jnp.asarray(rng.normal(size=(M, I)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, I, O)), jnp.float32)  # groups 1 .. 4 of six
    kw = dict(group_offset=1)
    if quant:
        qa = quantize_int8(w, (1,)) if quant == "int8" else quantize_int4(w, (1,), 64)
        kw |= dict(w_scale=qa.scale, out_size=O)
        w, dense = qa.values, qa.dequantize()
    else:
        dense = w
    out = jax.jit(lambda a, b, c: gm.grouped_matmul_reference(a, b, c, **kw))(x, w, jnp.asarray(sizes))
    np.testing.assert_allclose(np.asarray(out), _numpy(x, dense, sizes, 1), atol=2e-4, rtol=1e-5)


def test_validation_names_the_sizes():
    x = jnp.zeros((4, 8))
    with pytest.raises(ValueError, match="contracted sizes differ"):
        gm.grouped_matmul_reference(x, jnp.zeros((2, 6, 3)), jnp.array([2, 2]))
    with pytest.raises(ValueError, match="out_size=5 must divide"):
        gm.grouped_matmul_reference(x, jnp.zeros((8, 6), jnp.int8), jnp.array([2, 2]), w_scale=jnp.ones(6),
                                    out_size=5)
    with pytest.raises(ValueError, match="holds 3 groups, more than"):
        gm.grouped_matmul_reference(x, jnp.zeros((3, 8, 3)), jnp.array([2, 2]))


# ----------------------------------------------------------------------------- the grid
M, I, O = 40, 256, 256
# group sizes over 5 groups: even; one group with every row; empty groups between; rows
# past the last group (in no group: they come out 0); no rows at all
SIZES = {
    "even": [8, 8, 8, 8, 8],
    "one": [0, 40, 0, 0, 0],
    "gaps": [13, 0, 0, 27, 0],
    "short": [1, 2, 3, 4, 5],
    "none": [0, 0, 0, 0, 0],
}
TILES = {
    "tpu": [gm.BlockSizes(16, 128, 128), gm.BlockSizes(32, 256, 256)],
    "gpu": [gm.BlockSizes(16, 64, 64), gm.BlockSizes(32, 128, 128)],
    "xla": [gm.BlockSizes(block_m=8), gm.BlockSizes(block_m=32)],  # the loop takes block_m only
}
IMPLS = {"tpu": gm.grouped_matmul_tpu, "gpu": gm.grouped_matmul_gpu, "xla": gm.grouped_matmul_xla}


def _case(impl, dtype, sizes, tiles, quant, offset, seed=0):
    """impl vs the reference. The weight holds groups offset .. 4; rows of other groups are
    NaN in x, and the weights of its groups without rows are NaN (the reference, a dense
    dot over every group, is given zeros there instead)."""
    from jaxinfer.quant import quantize_int8

    if impl != "xla":
        skip_unless_runs_here(impl)
    rng = np.random.default_rng(seed)
    sizes = np.asarray(SIZES[sizes])
    G = 5 - offset
    ends = np.cumsum(sizes)
    starts = ends - sizes
    local = np.zeros(M, bool)
    local[starts[offset] : ends[-1]] = True
    x = np.where(local[:, None], rng.normal(size=(M, I)), np.nan)
    w = rng.normal(size=(G, I, O)) / 8
    empty = sizes[offset:] == 0
    x = jnp.asarray(x, dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    kw = dict(group_offset=offset)
    if quant:
        qa = quantize_int8(jnp.asarray(w, jnp.float32), (1,))
        values, scale = np.asarray(qa.values).reshape(I, G, O).copy(), np.asarray(qa.scale).reshape(G, O).copy()
        ref_values = values.copy()
        values[:, empty], scale[empty] = 127, np.nan
        ref_values[:, empty] = 0
        kw |= dict(out_size=O)
        args = (jnp.asarray(values.reshape(I, -1)), jnp.asarray(scale.reshape(-1)))
        ref_args = (jnp.asarray(ref_values.reshape(I, -1)), jnp.asarray(np.where(np.isnan(scale), 0, scale).reshape(-1)))
    else:
        poisoned = w.copy()
        poisoned[empty] = np.nan
        args = (jnp.asarray(poisoned, dtype), None)
        ref_args = (jnp.asarray(np.where(empty[:, None, None], 0.0, w), dtype), None)
    ref = jax.jit(lambda a, b, s: gm.grouped_matmul_reference(a, b, gs, w_scale=s, **kw))(
        jnp.where(jnp.isnan(x), 0, x), *ref_args)
    out = run_interpreted(lambda a, b, s: IMPLS[impl](a, b, gs, w_scale=s, block_sizes=TILES[impl][tiles],
                                                      interpret=INTERPRET, **kw), x, *args)
    assert_close(out, ref)
    assert not np.any(np.asarray(out, np.float32)[~local]), "rows in no group of the weight must be 0"


@pytest.mark.parametrize("dtype,sizes,tiles,quant,offset", covering_grid(
    [[jnp.float32, jnp.bfloat16], list(SIZES)], [[0, 1], [False, True], [0, 2]]))
def test_xla_loop_matches_reference(dtype, sizes, tiles, quant, offset):
    _case("xla", dtype, sizes, tiles, quant, offset)


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("dtype,sizes,tiles,quant,offset", [
    (jnp.float32, "gaps", 0, False, 0),
    (jnp.bfloat16, "short", 1, True, 2),
    (jnp.float32, "one", 1, True, 1),
    (jnp.bfloat16, "none", 0, False, 0),
])
def test_kernel_matches_reference(impl, dtype, sizes, tiles, quant, offset):
    _case(impl, dtype, sizes, tiles, quant, offset)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("dtype,sizes,tiles,quant,offset", covering_grid(
    [[jnp.float32, jnp.bfloat16], list(SIZES)], [[0, 1], [False, True], [0, 2]]))
def test_kernel_matches_reference_wide(impl, dtype, sizes, tiles, quant, offset):
    _case(impl, dtype, sizes, tiles, quant, offset)


def test_kernel_default_tiles_and_int4_dispatch():
    """Default tiles fit any shape the model gives (no BlockSizes); packed int4 goes to the
    XLA loop from the package's dispatch."""
    from jaxinfer.quant import quantize_int4

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(24, 128)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 128, 64)), jnp.float32)
    gs = jnp.array([10, 0, 14])
    ref = gm.grouped_matmul_reference(x, w, gs)
    for impl in ("tpu", "gpu"):
        skip_unless_runs_here(impl)
        assert_close(run_interpreted(lambda a, b: IMPLS[impl](a, b, gs, interpret=INTERPRET), x, w), ref)
    qa = quantize_int4(w, (1,), 64)
    kw = dict(w_scale=qa.scale, out_size=64)
    assert_close(gm.grouped_matmul(x, qa.values, gs, interpret=True, **kw),
                 gm.grouped_matmul_reference(x, qa.values, gs, **kw))


def test_default_tiles_of_an_output_no_multiple_of_128_divides():
    """gpt-oss's experts are 2,880 wide, which no multiple of 128 divides: a whole-width block
    overflowed a TPU's scoped VMEM, so the TPU kernel's automatic blocks take 128 columns and
    the last runs past O (here 320: blocks of 128, 128 and 64). NaN weights of an empty group
    stay out of the result."""
    skip_unless_runs_here("tpu")
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(24, 192)), jnp.float32)
    w = rng.normal(size=(3, 192, 320)) / 8
    gs = jnp.array([10, 0, 14])
    ref = gm.grouped_matmul_reference(x, jnp.asarray(w, jnp.float32), gs)
    w[1] = np.nan
    out = run_interpreted(lambda a, b: gm.grouped_matmul_tpu(a, b, gs, interpret=INTERPRET), x,
                          jnp.asarray(w, jnp.float32))
    assert_close(out, ref)


def test_dispatch_picks_reference_on_cpu_and_kernel_when_interpreting(monkeypatch):
    calls = []
    monkeypatch.setattr(gm, "grouped_matmul_reference", lambda *a, **k: calls.append("ref"))
    monkeypatch.setattr(gm, "grouped_matmul_kernel", lambda *a, **k: calls.append("kernel"))
    x, w, gs = jnp.zeros((4, 8)), jnp.zeros((2, 8, 8)), jnp.array([2, 2])
    gm.grouped_matmul(x, w, gs)
    gm.grouped_matmul(x, w, gs, interpret=True)
    gm.grouped_matmul(x, w, gs, platform="cpu")
    gm.grouped_matmul(x, w, gs, platform="tpu")  # the platform is the caller's, not the host's
    expect = "ref" if jax.default_backend() == "cpu" else "kernel"
    assert calls == [expect, "kernel", "ref", "kernel"]
