"""The one kernel choice (jaxinfer.dispatch): what each option gives on each platform, the
refusals, and how the weights carry the matmul choice."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import cpu_kernels, dispatch, quant
from jaxinfer.config import ModelConfig
from jaxinfer.dispatch import Attention, Kernels, Matmul
from jaxinfer.errors import InvalidRequest
from jaxinfer.models import llama
from jaxinfer.models.layers import dot
from jaxinfer.sharding import make_mesh
from jaxinfer.specs import init_weights

CFG = ModelConfig(family="llama", vocab_size=97, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2,
                  head_dim=16, d_ff=128)


def on(platform: str, n: int = 1) -> list:
    """n stand-ins for devices of a platform (what ``choose`` reads of a device: its platform),
    so each platform's choice is checked on any host; the TPU compile tests use real ones."""
    return [types.SimpleNamespace(platform=platform)] * n


def test_each_option_on_each_platform():
    assert dispatch.choose("xla", devices=on("tpu", 8)) == Kernels(platform="tpu")
    assert dispatch.choose("auto", devices=on("tpu", 8)) == Kernels(Attention.PALLAS, Matmul.PALLAS, platform="tpu")
    assert dispatch.choose("pallas", devices=on("cuda")) == Kernels(Attention.PALLAS, Matmul.PALLAS, platform="gpu")
    interpret = dispatch.choose("pallas", devices=on("cpu"))
    assert interpret == dataclasses.replace(dispatch.INTERPRET, platform="cpu")
    assert dispatch.choose("auto", devices=on("cpu", 8)) == Kernels(platform="cpu")  # a custom call has no sharding rule
    auto = dispatch.choose("auto", devices=on("cpu"))
    assert auto.attention == (Attention.NATIVE if cpu_kernels.attention_available() else Attention.XLA)
    assert auto.matmul == (Matmul.NATIVE if cpu_kernels.f32_available() or cpu_kernels.available() else Matmul.XLA)
    assert dispatch.choose("native", devices=on("cpu")) == auto
    assert dispatch.choose(auto, devices=on("cpu")) is auto
    # the default: every device of the default backend
    assert dispatch.choose("xla").platform == dispatch.device_platform(jax.devices()[0])


def test_the_choice_follows_the_mesh():
    """On a mesh the choice takes the mesh's devices' platform and the mesh itself (so the
    Pallas calls run per "model" shard); a Kernels given gains both, and one naming another
    platform or mesh is refused."""
    mesh = make_mesh(model=1, devices=jax.devices()[:1])
    k = dispatch.choose("pallas", mesh=mesh)
    assert (k.platform, k.mesh, k.interpret) == ("cpu", mesh, True)
    mine = Kernels(Attention.PALLAS, Matmul.XLA)
    assert dispatch.choose(mine, mesh=mesh) == dataclasses.replace(mine, platform="cpu", mesh=mesh)
    assert dispatch.choose(k, mesh=mesh) is k  # the engine chooses again what LLM chose: the same
    with pytest.raises(InvalidRequest, match="kernels platform=tpu differs from the engine's cpu"):
        dispatch.choose(Kernels(platform="tpu"), mesh=mesh)
    with pytest.raises(ValueError, match="platform must be one of"):
        Kernels(platform="cuda")
    hash(k)  # a jit static argument


@pytest.mark.parametrize("option,platform,devices,match", [
    ("native", "tpu", 1, "kernels='native' needs one CPU device; this is 1 tpu"),
    ("native", "cpu", 8, "kernels='native' needs one CPU device; this is 8 cpu"),
    ("mosaic", "cpu", 1, "kernels must be one of auto, pallas, native, xla, got 'mosaic'"),
])
def test_bad_options_are_refused(option, platform, devices, match):
    with pytest.raises(InvalidRequest, match=match):
        dispatch.choose(option, devices=on(platform, devices))


def test_a_native_choice_off_one_cpu_device_is_refused():
    native = Kernels(Attention.XLA, Matmul.NATIVE, platform="cpu")
    assert dispatch.choose(native, devices=on("cpu")) is native
    with pytest.raises(InvalidRequest, match="native CPU kernels need one CPU device; this is 8 cpu"):
        dispatch.choose(native, devices=on("cpu", 8))
    with pytest.raises(InvalidRequest, match="this is 1 gpu"):
        dispatch.choose(Kernels(Attention.NATIVE), devices=on("gpu"))


def test_llm_refuses_a_bad_option_before_loading(tmp_path):
    from jaxinfer import LLM

    with pytest.raises(InvalidRequest, match="kernels must be one of"):
        LLM(str(tmp_path / "no-such-model"), kernels="fast", progress=False)


def test_interpret_needs_a_pallas_choice():
    with pytest.raises(ValueError, match="interpret=True needs a Pallas choice"):
        Kernels(Attention.XLA, Matmul.NATIVE, interpret=True)


def test_bind_carries_the_matmul_choice_and_io_layout_undoes_it():
    specs = llama.weight_specs(CFG)
    w = init_weights(specs, CFG, jax.random.key(0), scale=0.2)
    assert dispatch.bind(w, specs, dispatch.XLA) is w  # the reference: weights as they are
    w = dict(w, layers=[dict(w["layers"][0], wq=quant.quantize_int8(w["layers"][0]["wq"], (0,)))])
    native = dispatch.bind(w, specs, Kernels(Attention.NATIVE, Matmul.NATIVE))
    layer = native["layers"][0]
    assert layer["wq"].kernels == Kernels(Attention.NATIVE, Matmul.NATIVE)
    assert isinstance(layer["attn_norm"], jax.Array)  # not multiplied: left alone
    assert isinstance(layer["w_up"], (quant.Dense, quant.PackedF32)) and isinstance(native["embed"], quant.Dense)
    pallas = dispatch.bind(w, specs, dispatch.INTERPRET)
    assert pallas["layers"][0]["wq"].kernels == dispatch.INTERPRET
    assert isinstance(pallas["layers"][0]["w_up"], jax.Array)  # dense float dots stay XLA's
    back = quant.io_layout(native)
    assert jax.tree.structure(back) == jax.tree.structure(w)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(w)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.skipif(not cpu_kernels.f32_available(), reason="f32_gemv not built here")
def test_a_bound_float_weight_takes_the_native_dot_and_a_plain_one_xla():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(64, 4, 16)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(3, 1, 64)), jnp.float32)
    bound = quant.Dense(w, Kernels(matmul=Matmul.NATIVE))
    text = jax.jit(lambda x: dot("BTD,DNH->BTNH", x, bound)).lower(x).as_text()
    assert cpu_kernels.F32_TARGET in text
    assert cpu_kernels.F32_TARGET not in jax.jit(lambda x: dot("BTD,DNH->BTNH", x, w)).lower(x).as_text()
    np.testing.assert_allclose(np.asarray(jax.jit(lambda x: dot("BTD,DNH->BTNH", x, bound))(x)),
                               np.asarray(jnp.einsum("BTD,DNH->BTNH", x, w)), rtol=1e-5, atol=1e-5)


def test_each_pool_takes_the_reader_its_choice_allows():
    """``dispatch.paged_path``: float pools go to the ragged kernel under Pallas (attention
    sinks included: the kernel takes them) unless writes are deferred, and a decode-only step
    to the paged decode kernel (sinks included too); the native kernels take
    float32 or int8 pools and no sinks; a latent pool (no keys pool) and int8 pools under Pallas
    keep the XLA readers."""
    from jaxinfer.cache import init_paged_cache

    f32 = init_paged_cache(CFG, 4, 16, "float32")
    i8 = init_paged_cache(CFG, 4, 16, "int8")
    k, v, qk, qv = f32.k[0], f32.v[0], i8.k[0], i8.v[0]
    native = Kernels(Attention.NATIVE, Matmul.NATIVE)
    path = dispatch.paged_path
    assert path(dispatch.INTERPRET, k, v, defer_writes=False) == dispatch.PagedPath.RAGGED
    assert path(dispatch.INTERPRET, k, v, defer_writes=False, sinks=True) == dispatch.PagedPath.RAGGED
    assert path(dispatch.INTERPRET, k, v, defer_writes=True) == dispatch.PagedPath.XLA
    assert path(dispatch.INTERPRET, k, v, defer_writes=False, decode_only=True) == dispatch.PagedPath.DECODE
    assert path(dispatch.INTERPRET, k, v, defer_writes=False, decode_only=True, sinks=True) == dispatch.PagedPath.DECODE
    assert path(dispatch.INTERPRET, k, v, defer_writes=True, decode_only=True) == dispatch.PagedPath.XLA
    assert path(dispatch.INTERPRET, qk, qv, defer_writes=False, decode_only=True) == dispatch.PagedPath.XLA
    for kernels in (dispatch.XLA, native):  # the choice, not the batch, picks the family of readers
        assert path(kernels, k, v, defer_writes=False, decode_only=True) != dispatch.PagedPath.DECODE
    assert path(dispatch.INTERPRET, qk, qv, defer_writes=False) == dispatch.PagedPath.XLA
    for kernels in (dispatch.INTERPRET, native, dispatch.XLA):  # latent pools: XLA's readers only
        assert path(kernels, None, v, defer_writes=False) == dispatch.PagedPath.XLA
    assert path(dispatch.XLA, k, v, defer_writes=False) == dispatch.PagedPath.XLA
    if cpu_kernels.attention_available():
        assert path(native, k, v, defer_writes=False) == dispatch.PagedPath.NATIVE
        assert path(native, qk, qv, defer_writes=False) == dispatch.PagedPath.NATIVE
        assert path(native, k, v, defer_writes=False, sinks=True) == dispatch.PagedPath.XLA
    # keys pools [P, K, ps, H]: the native kernels read transposed keys only
    u8 = init_paged_cache(CFG, 4, 16, "int8", keys_transposed=False)
    assert path(native, u8.k[0], u8.v[0], defer_writes=False, keys_transposed=False) == dispatch.PagedPath.XLA
    assert path(native, k.swapaxes(-1, -2), v, defer_writes=False, keys_transposed=False) == dispatch.PagedPath.XLA


def test_keys_are_transposed_only_for_the_cpu_readers():
    """``dispatch.keys_transposed``: the native kernels and XLA's readers on CPU get keys
    [P, K, H, ps]; the Pallas kernels (interpret mode on CPU too) and every reader on TPU/GPU
    [P, K, ps, H], where a page-sized minor dimension would be relaid out."""
    native = Kernels(Attention.NATIVE, Matmul.NATIVE)
    pallas = Kernels(Attention.PALLAS, Matmul.PALLAS)
    assert dispatch.keys_transposed(dispatch.XLA, "cpu") and dispatch.keys_transposed(native, "cpu")
    assert dispatch.keys_transposed(Kernels(Attention.XLA, Matmul.NATIVE), "cpu")
    assert not dispatch.keys_transposed(dispatch.INTERPRET, "cpu")
    assert not dispatch.keys_transposed(Kernels(Attention.PALLAS, Matmul.XLA, interpret=True), "cpu")
    for platform in ("tpu", "gpu"):
        assert not dispatch.keys_transposed(pallas, platform) and not dispatch.keys_transposed(dispatch.XLA, platform)
