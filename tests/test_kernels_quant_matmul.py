"""Quantized matmuls: the int4 byte format and the references on hand-worked cases and
against exact numpy integer arithmetic, then both kernel variants (interpret mode) against
the references over a grid."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import quant_matmul as qm
from tests.kernel_testing import INTERPRET, skip_unless_runs_here, TOLERANCES, assert_close, covering_grid, run_interpreted


# ----------------------------------------------------------------------------- int4 format
def test_pack_int4_bytes_by_hand():
    # group 4: byte i holds row i (low nibble) and row i + 2 (high nibble).
    values = jnp.array([[-8], [3], [7], [-1]], jnp.int8)
    packed = np.asarray(qm.pack_int4(values, 4))
    # (-8 & 15) | 7 << 4 = 0x78 = 120; (3 & 15) | (-1 & 15) << 4 = 0xF3 = 243 = -13 as int8.
    np.testing.assert_array_equal(packed, [[120], [-13]])
    np.testing.assert_array_equal(np.asarray(qm.unpack_int4(jnp.asarray(packed), 4)), values)


def test_pack_int4_round_trip_every_value():
    rng = np.random.default_rng(0)
    values = jnp.asarray(rng.integers(-8, 8, (256, 24)), jnp.int8)
    round_trip = jax.jit(lambda v, g: qm.unpack_int4(qm.pack_int4(v, g), g), static_argnums=1)
    for group in (2, 128):
        np.testing.assert_array_equal(round_trip(values, group), values)


def test_quantize_rows_bounds():
    x = jnp.array([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]], jnp.float32)
    q, s = qm.quantize_rows(x)
    np.testing.assert_array_equal(np.asarray(q), [[64, -127, 32], [0, 0, 0]])  # 63.5 rounds to even
    np.testing.assert_allclose(np.asarray(s), [1 / 127, 1.0])


# ----------------------------------------------------------------------------- references
def test_int8_reference_by_hand():
    x, xs = jnp.array([[1, 2]], jnp.int8), jnp.array([0.5])
    w, ws = jnp.array([[1, 0], [0, -1]], jnp.int8), jnp.array([2.0, 3.0])
    out = qm.int8_matmul_reference(x, xs, w, ws)  # [1, -2] * 0.5 * [2, 3]
    np.testing.assert_array_equal(np.asarray(out), [[1.0, -3.0]])


def test_weight_only_references_by_hand():
    x = jnp.array([[1.0, 2.0]], jnp.float32)
    w, ws = jnp.array([[1, 2], [3, 4]], jnp.int8), jnp.array([0.5, 0.25])
    np.testing.assert_array_equal(
        np.asarray(qm.weight_only_matmul_reference(x, w, ws)), [[3.5, 2.5]]
    )
    # int4, one group of 2 rows: values [[1, -8], [7, 2]], group scales [[0.5, 2.0]].
    packed = qm.pack_int4(jnp.array([[1, -8], [7, 2]], jnp.int8), 2)
    out = qm.weight_only_matmul_reference(x, packed, jnp.array([[0.5, 2.0]]))
    np.testing.assert_array_equal(np.asarray(out), [[(1 + 14) * 0.5, (-8 + 4) * 2.0]])


def test_references_match_exact_numpy():
    rng = np.random.default_rng(1)
    M, I, O, group = 6, 256, 40, 64
    x = rng.integers(-127, 128, (M, I)).astype(np.int8)
    w = rng.integers(-127, 128, (I, O)).astype(np.int8)
    xs, ws = rng.uniform(0.5, 2, M).astype(np.float32), rng.uniform(0.5, 2, O).astype(np.float32)
    exact = (x.astype(np.int64) @ w.astype(np.int64)).astype(np.float64) * xs[:, None] * ws
    out = jax.jit(qm.int8_matmul_reference)(*map(jnp.asarray, (x, xs, w, ws)))
    np.testing.assert_allclose(np.asarray(out), exact, rtol=1e-6)  # int32 sum is exact
    xf = rng.normal(size=(M, I)).astype(np.float32)
    v4 = rng.integers(-8, 8, (I, O)).astype(np.int8)
    s4 = rng.uniform(0.01, 0.1, (I // group, O)).astype(np.float32)
    want = xf.astype(np.float64) @ (v4 * np.repeat(s4, group, axis=0)).astype(np.float64)
    packed = jax.jit(qm.pack_int4, static_argnums=1)(jnp.asarray(v4), group)
    out = jax.jit(qm.weight_only_matmul_reference)(jnp.asarray(xf), packed, jnp.asarray(s4))
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-4, rtol=1e-5)


# ----------------------------------------------------------------------------- kernel grid
INT8 = {"tpu": qm.int8_matmul_tpu, "gpu": qm.int8_matmul_gpu}
WEIGHT_ONLY = {"tpu": qm.weight_only_matmul_tpu, "gpu": qm.weight_only_matmul_gpu}
# (block_m, block_n, block_k) each variant accepts for I = 256, O = 256 or 384.
BLOCKS = {
    "tpu": [qm.BlockSizes(32, 128, 128), qm.BlockSizes(32, 128, 256)],
    "gpu": [qm.BlockSizes(16, 64, 64), qm.BlockSizes(32, 128, 128)],
}


def _int8_case(variant, M, O, b, out_dtype, seed=0):
    skip_unless_runs_here(variant)
    rng = np.random.default_rng(seed)
    I = 256
    x, xs = qm.quantize_rows(jnp.asarray(rng.normal(size=(M, I)), jnp.float32))
    w = jnp.asarray(rng.integers(-127, 128, (I, O)), jnp.int8)
    ws = jnp.asarray(rng.uniform(1e-3, 1e-2, O), jnp.float32)
    ref = jax.jit(lambda *a: qm.int8_matmul_reference(*a, out_dtype=out_dtype))(x, xs, w, ws)
    out = run_interpreted(
        lambda *a: INT8[variant](
            *a, out_dtype=out_dtype, block_sizes=BLOCKS[variant][b], interpret=INTERPRET
        ),
        x,
        xs,
        w,
        ws,
    )
    assert_close(out, ref)


def _weight_only_case(variant, M, O, b, dtype, group, seed=0):
    skip_unless_runs_here(variant)
    rng = np.random.default_rng(seed)
    I = 256
    x = jnp.asarray(rng.normal(size=(M, I)), dtype)
    if group:
        w = qm.pack_int4(jnp.asarray(rng.integers(-8, 8, (I, O)), jnp.int8), group)
        ws = jnp.asarray(rng.uniform(1e-3, 1e-2, (I // group, O)), jnp.float32)
    else:
        w = jnp.asarray(rng.integers(-127, 128, (I, O)), jnp.int8)
        ws = jnp.asarray(rng.uniform(1e-3, 1e-2, O), jnp.float32)
    ref = jax.jit(qm.weight_only_matmul_reference)(x, w, ws)
    out = run_interpreted(
        lambda *a: WEIGHT_ONLY[variant](*a, block_sizes=BLOCKS[variant][b], interpret=INTERPRET),
        x,
        w,
        ws,
    )
    assert_close(out, ref)


@pytest.mark.parametrize("variant", sorted(INT8))
@pytest.mark.parametrize("M,O,b,out_dtype", [(1, 256, 0, jnp.float32), (37, 384, 1, jnp.bfloat16)])
def test_int8_kernel_matches_reference(variant, M, O, b, out_dtype):
    _int8_case(variant, M, O, b, out_dtype)


@pytest.mark.parametrize("variant", sorted(WEIGHT_ONLY))
@pytest.mark.parametrize(
    "M,O,b,dtype,group",
    [
        (1, 256, 0, jnp.float32, 0),
        (19, 384, 1, jnp.bfloat16, 0),
        (5, 256, 1, jnp.float32, 128),
        (40, 384, 0, jnp.bfloat16, 64),
    ],
)
def test_weight_only_kernel_matches_reference(variant, M, O, b, dtype, group):
    _weight_only_case(variant, M, O, b, dtype, group)


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(INT8))
@pytest.mark.parametrize(
    "M,out_dtype,O,b",
    covering_grid([[1, 16, 33], [jnp.float32, jnp.bfloat16]], [[256, 384], [0, 1]]),
)
def test_int8_kernel_matches_reference_wide(variant, M, out_dtype, O, b):
    _int8_case(variant, M, O, b, out_dtype)


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(WEIGHT_ONLY))
@pytest.mark.parametrize(
    "dtype,group,M,O,b",
    covering_grid([[jnp.float32, jnp.bfloat16], [0, 64, 128], [1, 16, 33]], [[256, 384], [0, 1]]),
)
def test_weight_only_kernel_matches_reference_wide(variant, dtype, group, M, O, b):
    _weight_only_case(variant, M, O, b, dtype, group)


def test_gpu_default_tiles_fit_shared_memory_and_divide_the_weight():
    """The Triton defaults (bytes per pipeline stage, 2 buffered) stay under an H100's 227 KB
    of shared memory per block and divide SmolLM2's 576-wide weights; the TPU defaults did
    neither on the H100 (benchmarks/gpu_check.py)."""
    from pallas_kernels.quant_matmul.kernel import _gpu_rows, _gpu_tile, gpu_block_sizes

    for M in (1, 16, 17, 256, 4096):
        for I, O in ((576, 1536), (1536, 576), (4096, 14336)):
            bs = gpu_block_sizes(M)
            bm = _gpu_rows(M, bs.block_m)
            bn, bk = _gpu_tile(O, bs.block_n, "n", given=False), _gpu_tile(I, bs.block_k, "k", given=False)
            assert O % bn == 0 and I % bk == 0
            assert 2 * (bm * bk * 2 + bk * bn) <= 227 * 1024
    # and the variant takes them: a SmolLM2 projection at decode, default tiles
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(1, 576)), jnp.float32)
    w = jnp.asarray(rng.integers(-127, 128, (576, 1536)), jnp.int8)
    ws = jnp.asarray(rng.uniform(1e-3, 1e-2, 1536), jnp.float32)
    ref = jax.jit(qm.weight_only_matmul_reference)(x, w, ws)
    skip_unless_runs_here("gpu")
    assert_close(run_interpreted(lambda *a: qm.weight_only_matmul_gpu(*a, interpret=INTERPRET), x, w, ws), ref)


def test_tpu_blocks_shrink_to_the_chips_scoped_vmem():
    """fit_vmem: a 70B LM head per chip of 8 (I 8192, O 16032, which no multiple of 128
    divides, so block_n is all of it) at 64 rows needed 19.8 MB of VMEM against v5e's 16 MB;
    the contraction step shrinks (still dividing I), then the rows, until the blocks fit; blocks
    that fit are left alone; a budget nothing fits stops at the smallest legal blocks."""
    from pallas_kernels.quant_matmul.common import fit_vmem

    def wo(m, k, bn=16032):  # weight-only, bf16 activations: double-buffered blocks + f32 accumulator
        return 2 * (m * k * 2 + k * bn + 8 * bn * 4 + m * bn * 2) + m * bn * 4

    budget = (16 << 20) * 3 // 4
    bm, bk = fit_vmem(64, 512, I=8192, k_align=128, m_align=16, footprint=wo, budget=budget)
    assert (bm, bk) == (32, 128) and wo(bm, bk) <= budget < wo(64, 512)
    assert fit_vmem(64, 512, I=4096, k_align=128, m_align=16, footprint=lambda m, k: wo(m, k, 256),
                    budget=budget) == (64, 512)
    assert fit_vmem(64, 384, I=1152, k_align=128, m_align=16, footprint=wo, budget=1) == (16, 128)


def test_dispatch_picks_reference_on_cpu_and_kernel_when_interpreting(monkeypatch):
    calls = []
    monkeypatch.setattr(qm, "int8_matmul_reference", lambda *a, **k: calls.append("ref"))
    monkeypatch.setattr(qm, "int8_matmul_kernel", lambda *a, **k: calls.append("kernel"))
    monkeypatch.setattr(qm, "weight_only_matmul_reference", lambda *a, **k: calls.append("ref"))
    monkeypatch.setattr(qm, "weight_only_matmul_kernel", lambda *a, **k: calls.append("kernel"))
    x, s = jnp.zeros((1, 128), jnp.int8), jnp.ones((1,))
    w, ws = jnp.zeros((128, 128), jnp.int8), jnp.ones((128,))
    qm.int8_matmul(x, s, w, ws, platform="cpu")
    qm.int8_matmul(x, s, w, ws, interpret=True, platform="cpu")
    qm.weight_only_matmul(x.astype(jnp.float32), w, ws, platform="cpu")
    qm.weight_only_matmul(x.astype(jnp.float32), w, ws, interpret=True, platform="cpu")
    qm.int8_matmul(x, s, w, ws, platform="tpu")  # the platform is the caller's, not the host's
    assert calls == ["ref", "kernel", "ref", "kernel", "kernel"]


def test_tolerance_table_has_every_output_dtype():
    assert set(TOLERANCES) == {jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)}


# ----------------------------------------------------------------------------- validation
def test_bad_inputs_have_clear_messages():
    x = jnp.zeros((2, 256), jnp.float32)
    w = jnp.zeros((256, 128), jnp.int8)
    with pytest.raises(ValueError, match=r"w_scale must be \[O\]=128"):
        qm.int8_matmul_reference(x.astype(jnp.int8), jnp.ones(2), w, jnp.ones(64))
    with pytest.raises(
        ValueError, match=r"x.dtype=dtype\('float32'\) and w.dtype=dtype\('int8'\) must be int8"
    ):
        qm.int8_matmul_reference(x, jnp.ones(2), w, jnp.ones(128))
    with pytest.raises(ValueError, match=r"need I=256 \(int8\) or I/2 \(packed int4\)"):
        qm.weight_only_matmul_reference(x, jnp.zeros((100, 128), jnp.int8), jnp.ones(128))
    with pytest.raises(ValueError, match=r"packed int4 weights need w_scale \[I/group, O\]"):
        qm.weight_only_matmul_reference(x, jnp.zeros((128, 128), jnp.int8), jnp.ones((3, 128)))
    with pytest.raises(ValueError, match=r"block_k=96 must divide 256"):
        qm.weight_only_matmul_tpu(
            x, w, jnp.ones(128), block_sizes=qm.BlockSizes(8, 128, 96), interpret=True
        )
    with pytest.raises(
        ValueError, match=r"block_n=48 must be a power of 2 >= 16 dividing 128 on GPU"
    ):
        qm.weight_only_matmul_gpu(
            x, w, jnp.ones(128), block_sizes=qm.BlockSizes(16, 48, 64), interpret=True
        )
    with pytest.raises(ValueError, match=r"int4 group=32 must be a multiple of 64 on TPU"):
        qm.weight_only_matmul_tpu(
            x, jnp.zeros((128, 128), jnp.int8), jnp.ones((8, 128)), interpret=True
        )
