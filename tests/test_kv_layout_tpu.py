"""The page pools' keys layout on a TPU, read off the compiled program (libtpu's compiler from
this CPU host; nothing runs): the packed step writes and reads its pools in place.

A TPU tiles the two minor dimensions of an array (8, 128). Keys stored transposed, [P, K, H,
ps] with a 16-token page as the minor dimension, made XLA relay out (copy) the whole key pool
after every layer's write: ``bf16[16385,8,128,16] copy(scatter_fusion)`` per layer of a
Llama-3-8B-shaped step. On TPU the engine keeps keys [P, K, ps, H], as the values
(``dispatch.keys_transposed``)."""

from __future__ import annotations

import importlib

import pytest

from jaxinfer import dispatch
from jaxinfer.config import ModelConfig
from tests.conftest import on_ci

# a toy Llama of TPU-sized heads: d 256, 4 query / 2 KV heads of 128, bfloat16
CFG = ModelConfig(family="llama", vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                  head_dim=128, d_ff=512, dtype="bfloat16")
PALLAS = dispatch.Kernels(dispatch.Attention.PALLAS, dispatch.Matmul.PALLAS)


@pytest.fixture(scope="module")
def libtpu():
    """Skip without libtpu, except under CI=true (the test extra installs it)."""
    try:
        return importlib.import_module("libtpu")
    except ImportError as e:
        if on_ci():
            pytest.fail(f"CI=true and libtpu cannot be imported ({e}); install the test extra", pytrace=False)
        pytest.skip("libtpu is not installed")


@pytest.fixture
def tpu_kernels(monkeypatch, libtpu):
    """The Pallas kernels pick their variant (and whether to run one at all) from the default
    backend, which is this host's CPU: report "tpu" while a step is compiled for one. (This
    goes once the kernels take the platform from the devices they are compiled for.)"""
    from pallas_kernels import _common

    monkeypatch.setattr(_common, "platform", lambda: "tpu")


def _compile(topology, kernels, prefill=0, keys_transposed=None):
    from tests.tpu_compiling import compile_packed_step, tpu_device

    return compile_packed_step(CFG, tpu_device(topology), kernels, rows=8, num_pages=300, page_size=16, width=8,
                               prefill=prefill, keys_transposed=keys_transposed)


def _pool_bytes(pools) -> int:
    return sum(a.size * a.dtype.itemsize for a in pools.k + pools.v if a is not None)


@pytest.mark.parametrize("topology,prefill", [
    ("v6e:1x1", 0),
    pytest.param("v5e:1x1", 0, marks=pytest.mark.slow),
    pytest.param("v6e:1x1", 32, marks=pytest.mark.slow),  # a prefill row: the ragged kernel
])
def test_tpu_packed_step_writes_and_reads_its_pools_in_place(tpu_kernels, topology, prefill):
    """The Pallas choice on a TPU: keys pools [P, K, ps, H], no pool-sized copy, transpose or
    fusion in the optimized program besides the in-place writes, and the donated pools aliased
    to the outputs."""
    from tests.tpu_compiling import pool_sized_ops

    assert not dispatch.keys_transposed(PALLAS, "tpu")
    compiled, shapes, pools = _compile(topology, PALLAS, prefill)
    assert shapes == {(300, 2, 16, 128)}  # keys and values pools alike
    hlo = compiled.as_text()
    assert hlo.count("tpu_custom_call") >= CFG.n_layers  # the attention ran as Mosaic kernels
    assert pool_sized_ops(hlo, shapes) == []
    assert compiled.memory_analysis().alias_size_in_bytes >= _pool_bytes(pools)


@pytest.mark.slow
def test_tpu_transposed_keys_are_copied_after_every_write(tpu_kernels):
    """What the layout choice avoids: the same step over keys [P, K, H, ps] copies the whole
    keys pool once per layer (the test above would see it)."""
    from tests.tpu_compiling import pool_sized_ops

    compiled, shapes, _ = _compile("v6e:1x1", PALLAS, keys_transposed=True)
    copies = pool_sized_ops(compiled.as_text(), {(300, 2, 128, 16)}, kinds=("copy",))
    assert len(copies) == CFG.n_layers
