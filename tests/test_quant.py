"""jaxinfer.quant: round-trip error bounds, einsum against the float weight on the model's
equations, the int4 byte format (and that it is the kernels' format), SmoothQuant, error
messages, and that w8a8 really lowers to an s8 x s8 -> s32 dot."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import quant
from jaxinfer.errors import InvalidRequest
from jaxinfer.quant import QuantScheme

# The model's weight contractions: (einsum, weight shape, contracted weight axes, x shape).
EQUATIONS = [
    ("BTD,DNH->BTNH", (256, 4, 16), (0,), (2, 3, 256)),
    ("BTD,DF->BTF", (256, 384), (0,), (2, 3, 256)),
    ("BTNH,NHD->BTD", (4, 64, 128), (0, 1), (2, 3, 4, 64)),
    ("BTD,VD->BTV", (300, 256), (1,), (2, 3, 256)),
]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _deq(qa):
    return jax.jit(lambda qa: qa.dequantize())(qa)


def _weight(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * 0.05, jnp.float32)


# ----------------------------------------------------------------------------- round trips
def test_int8_round_trip_within_half_a_step():
    w = _weight((256, 384))
    qa = quant.quantize_int8(w, (0,))
    assert (
        qa.values.dtype == jnp.int8 and qa.values.shape == (256, 384) and qa.scale.shape == (384,)
    )
    err = np.abs(np.asarray(_deq(qa)) - np.asarray(w))
    assert (err <= np.asarray(qa.scale) / 2 * (1 + 1e-5)).all()
    # The largest weight of each column maps to +-127 exactly.
    np.testing.assert_array_equal(np.abs(np.asarray(qa.values)).max(axis=0), 127)


def test_int4_round_trip_within_half_a_step_per_group():
    w = _weight((256, 384))
    qa = quant.quantize_int4(w, (0,), group=128)
    assert qa.values.shape == (128, 384) and qa.scale.shape == (2, 384)
    err = np.abs(np.asarray(_deq(qa)) - np.asarray(w)).reshape(2, 128, 384)
    assert (err <= np.asarray(qa.scale)[:, None] / 2 * (1 + 1e-5)).all()


def test_int4_packing_is_exact_and_is_the_kernels_format():
    from pallas_kernels.quant_matmul import pack_int4, unpack_int4

    values = jnp.asarray(np.random.default_rng(0).integers(-8, 8, (256, 40)), jnp.int8)
    ours = jax.jit(
        lambda v, g: (p := quant.pack_int4(v, g), quant.unpack_int4(p, g)), static_argnums=1
    )
    kernels = jax.jit(lambda v, g: (p := pack_int4(v, g), unpack_int4(p, g)), static_argnums=1)
    for group in (64, 128):
        (packed, back), (kpacked, kback) = ours(values, group), kernels(values, group)
        np.testing.assert_array_equal(packed, kpacked)
        np.testing.assert_array_equal(back, values)
        np.testing.assert_array_equal(kback, values)
    # By hand, group 4: byte i = row i (low nibble) | row i + 2 (high nibble).
    hand = quant.pack_int4(jnp.array([[-8], [3], [7], [-1]], jnp.int8), 4)
    np.testing.assert_array_equal(hand, [[0x78], [0xF3 - 256]])


def test_quantize_rows_is_the_kernels():
    from pallas_kernels.quant_matmul import quantize_rows

    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 64)), jnp.float32)
    for a, b in zip(quant.quantize_rows(x), quantize_rows(x)):
        np.testing.assert_array_equal(a, b)


def test_kv_round_trip_per_token_per_head():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 4, 16)), jnp.float32)  # [B,T,K,H]
    quantize_kv = jax.jit(quant.quantize_kv, static_argnames=("axis", "scale_dtype"))
    dequantize_kv = jax.jit(quant.dequantize_kv, static_argnames=("dtype", "axis"))
    q, s = quantize_kv(x)
    assert q.dtype == jnp.int8 and s.shape == (2, 3, 4)
    err = np.abs(np.asarray(dequantize_kv(q, s)) - np.asarray(x))
    assert (err <= np.asarray(s)[..., None] / 2 * (1 + 1e-5)).all()
    # Keys cached transposed [B, K, H, S]: the head dim is axis 2.
    kt = x.transpose(0, 2, 3, 1)
    qt, st = quantize_kv(kt, axis=2)
    assert st.shape == (2, 4, 3)
    np.testing.assert_array_equal(
        dequantize_kv(qt, st, axis=2), dequantize_kv(q, s).transpose(0, 2, 3, 1)
    )
    # A zero token gets scale 1 and comes back zero; bfloat16 scales are allowed.
    z, zs = quantize_kv(jnp.zeros((1, 8)), scale_dtype=jnp.bfloat16)
    assert zs.dtype == jnp.bfloat16 and float(dequantize_kv(z, zs).max()) == 0.0


# ----------------------------------------------------------------------------- einsum
@pytest.mark.parametrize("scheme", list(QuantScheme))
@pytest.mark.parametrize("eq,shape,contract,xshape", EQUATIONS)
def test_einsum_matches_float(scheme, eq, shape, contract, xshape):
    w = _weight(shape)
    x = jnp.asarray(np.random.default_rng(1).normal(size=xshape), jnp.float32)
    qa = quant.quantize(w, contract, scheme, group=64)
    got = jax.jit(lambda x, qa: qa.einsum(eq, x))(x, qa)
    # Against the dequantized weight: only activation rounding (w8a8) may differ.
    deq = jnp.einsum(eq, x, _deq(qa))
    assert _rel(got, deq) < {QuantScheme.W8A8: 1e-2}.get(scheme, 1e-6)
    # Against the float weight: the scheme's whole error.
    assert (
        _rel(got, jnp.einsum(eq, x, w))
        < {QuantScheme.INT8: 1e-2, QuantScheme.INT4: 0.12, QuantScheme.W8A8: 2e-2}[scheme]
    )


def test_einsum_bfloat16_activations_keep_their_dtype():
    w = _weight((256, 384))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 256)), jnp.bfloat16)
    for scheme in QuantScheme:
        qa = quant.quantize(w, (0,), scheme)
        y = jax.jit(lambda x, qa: qa.einsum("BTD,DF->BTF", x))(x, qa)
        assert y.dtype == jnp.bfloat16
        assert (
            _rel(y.astype(jnp.float32), jnp.einsum("BTD,DF->BTF", x.astype(jnp.float32), w)) < 0.12
        )


def test_model_dot_helper_takes_a_quant_array():
    from jaxinfer.models.layers import dot

    w = _weight((256, 384))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 256)), jnp.float32)
    qa = quant.quantize_int8(w, (0,))
    np.testing.assert_allclose(dot("BTD,DF->BTF", x, qa), qa.einsum("BTD,DF->BTF", x))


def test_einsum_matmul_seam_takes_the_pallas_kernels():
    """What an ops layer would plug in on TPU/GPU: the kernels (here interpreted) on the
    QuantArray's own [I, O] storage give what the XLA path gives."""
    from pallas_kernels import quant_matmul as qm

    def kernel_matmul(w, x2):
        if w.scheme == QuantScheme.W8A8:
            xq, xs = qm.quantize_rows(x2 * w.smooth)
            return qm.int8_matmul(xq, xs, w.values, w.scale, interpret=True).astype(x2.dtype)
        return qm.weight_only_matmul(x2, w.values, w.scale, interpret=True)

    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 256)), jnp.float32)
    for scheme in QuantScheme:
        qa = quant.quantize(_weight((256, 256)), (0,), scheme, act_absmax=jnp.ones(256))
        want = jax.jit(lambda x, qa: qa.einsum("BTD,DF->BTF", x))(x, qa)
        got = jax.jit(lambda x, qa: qa.einsum("BTD,DF->BTF", x, matmul=kernel_matmul))(x, qa)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_take_is_the_embedding_lookup():
    emb = _weight((300, 256))  # [V, D], tied: contracted over D
    tokens = jnp.array([[0, 299, 7], [7, 5, 1]])
    for scheme in QuantScheme:
        qa = quant.quantize(
            emb,
            (1,),
            scheme,
            group=64,
            act_absmax=jnp.linspace(0.5, 4.0, 256) if scheme == QuantScheme.W8A8 else None,
        )
        np.testing.assert_allclose(
            jax.jit(lambda qa, t: qa.take(t))(qa, tokens),
            jnp.take(_deq(qa), tokens, axis=0),
            rtol=1e-6,
            atol=1e-7,
        )


def test_quant_array_is_a_pytree_with_static_layout():
    qa = quant.quantize_w8a8(_weight((256, 384)), (0,), jnp.ones(256))
    leaves, treedef = jax.tree.flatten(qa)
    assert [a.dtype for a in leaves] == [jnp.int8, jnp.float32, jnp.float32]
    back = jax.tree.unflatten(treedef, leaves)
    assert (back.shape, back.contract, back.scheme) == ((256, 384), (0,), QuantScheme.W8A8)
    assert qa.nbytes == 256 * 384 + 4 * 384 + 4 * 256


def test_weight_bytes_shrink():
    w = _weight((576, 1536))
    f32 = w.nbytes
    assert quant.quantize_int8(w, (0,)).nbytes / f32 < 0.26
    assert quant.quantize_int4(w, (0,), group=64).nbytes / f32 < 0.16


# ----------------------------------------------------------------------------- SmoothQuant
def test_smoothing_tames_activation_outliers():
    rng = np.random.default_rng(2)
    w = _weight((256, 384))
    x = rng.normal(size=(64, 256)).astype(np.float32)
    x[:, :4] *= 60.0  # a few outlier channels, as LLM activations have
    x = jnp.asarray(x)
    want = x @ w
    einsum = jax.jit(lambda qa, x: qa.einsum("MD,DF->MF", x))
    plain = einsum(quant.quantize_w8a8(w, (0,)), x)
    smooth = einsum(quant.quantize_w8a8(w, (0,), quant.channel_absmax(x)), x)
    assert _rel(smooth, want) < 0.5 * _rel(plain, want)
    assert _rel(smooth, want) < 2e-2


def test_channel_absmax_keeps_the_contracted_axes():
    x = jnp.arange(2 * 3 * 4 * 5, dtype=jnp.float32).reshape(2, 3, 4, 5) - 60
    np.testing.assert_array_equal(
        quant.channel_absmax(x, 2), np.abs(np.asarray(x)).max(axis=(0, 1))
    )
    assert quant.channel_absmax(x).shape == (5,)


# ----------------------------------------------------------------------------- int8 on XLA
@pytest.mark.parametrize("B", [4, 1])  # 1: a one-row dot, which XLA CPU would widen to s32
def test_w8a8_lowers_to_an_s8_s8_s32_dot(B):
    """Through XLA's dot (a weight bound to no kernel; the few-row native kernel is checked
    below and in test_cpu_kernels)."""
    qa = quant.quantize_w8a8(_weight((256, 384)), (0,), jnp.ones(256))
    x = jnp.ones((B, 3 if B > 1 else 1, 256), jnp.float32)
    M = max(2, x.shape[0] * x.shape[1])
    lowered = jax.jit(lambda x, qa: qa.einsum("BTD,DF->BTF", x)).lower(x, qa)
    dots = re.findall(r"stablehlo\.dot_general.*", lowered.as_text())
    want = rf"\(tensor<{M}x256xi8>, tensor<256x384xi8>\) -> tensor<{M}x384xi32>"
    assert len(dots) == 1 and re.search(want, dots[0]), dots
    # And XLA CPU keeps it integer after optimisation: an s32 dot whose operands are s8
    # (inside whatever fusion XLA wraps it in), and no wider copy of the weight anywhere.
    hlo = lowered.compile().as_text()
    types = dict(re.findall(r"(%[\w.-]+) = (\w+)\[", hlo))
    int_dots = [
        operands
        for operands in re.findall(rf"= s32\[{M},384\]\{{[^}}]*\}} dot\(([^)]*)\)", hlo)
        if all(types.get(o.strip()) == "s8" for o in operands.split(","))
    ]
    assert len(int_dots) == 1, hlo
    assert not re.search(r"(f32|s32)\[256,384\]", hlo), "the int8 weight was widened"


def test_w8a8_one_row_goes_to_a_native_kernel_where_built(int8_kernels):
    """int8_gemv with AVX-512BW; on AVX2 s8_gemm, whose panels beat int8_gemv's AVX2 code."""
    from jaxinfer import cpu_kernels, dispatch

    qa = quant.quantize_w8a8(_weight((256, 384)), (0,), jnp.ones(256))
    qa = dataclasses.replace(qa, kernels=dispatch.Kernels(matmul=dispatch.Matmul.NATIVE))
    x = jnp.ones((1, 1, 256), jnp.float32)
    text = jax.jit(lambda x, qa: dispatch.einsum("BTD,DF->BTF", x, qa)).lower(x, qa).as_text()
    target = cpu_kernels.TARGET if cpu_kernels.int8_isa(1) == "avx512bw" else cpu_kernels.S8_GEMM_TARGET
    assert f"@{target}" in text and "stablehlo.dot_general" not in text
    assert re.search(r"\(tensor<1x256xi8>, tensor<256x384xi8>\) -> tensor<1x384xi32>", text), text


# ----------------------------------------------------------------------------- bad input
def test_int4_groups_must_divide_the_contraction():
    with pytest.raises(
        InvalidRequest,
        match=r"contracted size 576 .* groups of 128; "
        r"pick a group size that divides 576, or use int8",
    ):
        quant.quantize_int4(_weight((576, 64)), (0,), group=128)
    with pytest.raises(InvalidRequest, match=r"group=3 must be a positive even number"):
        quant.quantize_int4(_weight((576, 64)), (0,), group=3)


def test_bad_scheme_axes_and_einsum_messages():
    with pytest.raises(
        InvalidRequest,
        match=r"quantize='fp8' is not a quantization scheme; use one of 'int8', 'int4', 'w8a8'",
    ):
        quant.parse_scheme("fp8")
    assert quant.parse_scheme("w8a8") == QuantScheme.W8A8 and quant.parse_scheme(None) is None
    with pytest.raises(InvalidRequest, match=r"must name some, not all"):
        quant.quantize_int8(_weight((4, 5)), (0, 1))
    with pytest.raises(InvalidRequest, match=r"act_absmax has 3 channels; the weight contracts 4"):
        quant.quantize_w8a8(_weight((4, 5)), (0,), jnp.ones(3))
    qa = quant.quantize_int8(_weight((256, 384)), (0,))
    with pytest.raises(
        ValueError,
        match=r"sums weight axes \(1,\), but this weight was stored contracting axes \(0,\)",
    ):
        qa.einsum("BTF,DF->BTD", jnp.ones((1, 1, 384)))
    with pytest.raises(ValueError, match=r"x axis 'D' has 255, weight 256"):
        qa.einsum("BTD,DF->BTF", jnp.ones((1, 1, 255)))
