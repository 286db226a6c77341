"""Loading streams each weight to its devices: every device receives only its own part, read
from the memory-mapped shards, and the host holds about one tensor at a time, never the model.

Checked on random Llama-shaped checkpoints written here (``tests.random_hf``): each device's
part is the written tensor's, bit for bit (a bfloat16 checkpoint loaded as bfloat16 is never
widened on the way), and a process that loads one peaks at the loaded weights plus at most one
and a half shard files of resident memory, and at most one and a half of its largest tensor
(plus 32 MB for what XLA and the tokenizer allocate). On CPU the weights are host memory
themselves, so they are counted apart from the transient copies the bounds are about.
"""

import json
import mmap
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxinfer.loaders import checkpoint, common
from jaxinfer.loaders.common import StoredTensor, _stored_box
from tests.random_hf import measure_load, write_llama


def test_stored_box_by_hand():
    D, N, H, F = 8, 4, 2, 6
    q_proj = (N * H, D)  # torch [out, in]; ours wq (D, N, H)
    assert _stored_box(q_proj, True, (D, N, H), [(0, D), (2, 4), (0, H)]) == (slice(4, 8), slice(0, 8))
    o_proj = (D, N * H)  # ours wo (N, H, D): a device's heads are columns there
    assert _stored_box(o_proj, True, (N, H, D), [(2, 4), (0, H), (0, D)]) == (slice(0, 8), slice(4, 8))
    down = (D, F)  # ours w_down (F, D)
    assert _stored_box(down, True, (F, D), [(3, 6), (0, D)]) == (slice(0, 8), slice(3, 6))
    # Half of the head_dim of every head: no box of (N*H, D), the whole tensor is read instead.
    assert _stored_box(q_proj, True, (D, N, H), [(0, D), (0, N), (0, 1)]) is None
    assert _stored_box(q_proj, True, (D, N, 3), [(0, D), (0, N), (0, 3)]) is None  # sizes differ


@pytest.mark.parametrize("stored,ours", [
    ((4, 6), (4, 2, 3)), ((6, 4), (4, 2, 3)), ((4, 6), (2, 2, 6)), ((24,), (2, 3, 4)),
    ((2, 3, 4), (6, 4)), ((4, 1, 6), (4, 6)), ((4, 6), (4, 6, 1)), ((12, 2), (2, 6, 2)),
])
@pytest.mark.parametrize("transpose", [False, True])
def test_stored_box_reads_what_the_reshape_holds(stored, ours, transpose):
    """Every box found holds exactly our part of the transposed, reshaped tensor; parts that
    are no box are left to the whole-tensor read (and some are boxes)."""
    src = np.arange(int(np.prod(stored))).reshape(stored)
    ours_full = (src.T if transpose else src).reshape(ours)
    rng = np.random.default_rng(0)
    found = 0
    for _ in range(200):
        bounds = []
        for n in ours:
            lo = int(rng.integers(0, n))
            bounds.append((0, n) if rng.random() < 0.4 else (lo, int(rng.integers(lo + 1, n + 1))))
        box = _stored_box(stored, transpose, ours, bounds)
        if box is None:
            continue
        found += 1
        want = ours_full[tuple(slice(s, b) for s, b in bounds)]
        got = src[box]
        np.testing.assert_array_equal((got.T if transpose else got).reshape(want.shape), want)
    assert found > 20


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_stored_tensor_reads_a_box_in_chunks(tmp_path, monkeypatch, dtype):
    """A box of a mapped tensor, copied a few rows at a time (a 100-byte chunk here: 2 rows of
    a bfloat16 [7, 24]), cast on the way, into a new array jax on CPU can adopt as is."""
    monkeypatch.setattr(common, "READ_CHUNK", 100)
    src = (np.arange(7 * 24, dtype=np.float32).reshape(7, 24) / 8).astype(ml_dtypes.bfloat16)
    (tmp_path / "t").write_bytes(b"x" * 40 + src.tobytes())
    with open(tmp_path / "t", "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    t = StoredTensor(buf, 40, src.shape, src.dtype)
    for box in [(slice(1, 6), slice(3, 17)), (slice(None), slice(20, 24)), (slice(6, 7), slice(None))]:
        got = t.read(box, jnp.dtype(dtype))
        assert got.dtype == jnp.dtype(dtype) and got.flags.c_contiguous and got.ctypes.data % 64 == 0
        np.testing.assert_array_equal(got, src[box].astype(got.dtype))
        del got
    buf.close()  # nothing read still points into the mapping


def test_bfloat16_is_read_as_bfloat16(tmp_path, monkeypatch):
    """A bfloat16 checkpoint loaded as bfloat16 (the default off CPU) goes from the file into
    bfloat16 buffers only: no float32 copy of any tensor is made on the way."""
    reads = []
    read = StoredTensor.read

    def spy(self, box, dtype):
        out = read(self, box, dtype)
        reads.append((self.dtype, out.dtype))
        return out

    monkeypatch.setattr(StoredTensor, "read", spy)
    write_llama(tmp_path, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, vocab=128)
    w = checkpoint.load(tmp_path, dtype="bfloat16").weights
    assert len(reads) == 2 * 9 + 3  # every weight, straight from its stored tensor
    assert set(reads) == {(jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.bfloat16))}
    assert {a.dtype for a in jax.tree.leaves(w)} == {jnp.dtype(jnp.bfloat16)}


_PARTS = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jaxinfer.loaders import checkpoint
    from jaxinfer.sharding import make_mesh, weight_shardings
    from tests.random_hf import llama_arrays, write_llama

    root = sys.argv[1]
    shape = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, vocab=128)
    for stored in ("bfloat16", "float32"):
        path = f"{root}/{stored}"
        write_llama(path, dtype=stored, shards=3, seed=1, **shape)
        t = dict(llama_arrays(1, stored, **shape))
        L = lambda i, n: t[f"model.layers.{i}.{n}.weight"]
        want = {"embed": t["model.embed_tokens.weight"], "final_norm": t["model.norm.weight"],
                "lm_head": t["lm_head.weight"].T}
        for i in range(2):
            want |= {f"{i}/attn_norm": L(i, "input_layernorm"), f"{i}/mlp_norm": L(i, "post_attention_layernorm"),
                     f"{i}/wq": L(i, "self_attn.q_proj").T.reshape(64, 4, 16),
                     f"{i}/wk": L(i, "self_attn.k_proj").T.reshape(64, 2, 16),
                     f"{i}/wv": L(i, "self_attn.v_proj").T.reshape(64, 2, 16),
                     f"{i}/wo": L(i, "self_attn.o_proj").T.reshape(4, 16, 64),
                     f"{i}/w_gate": L(i, "mlp.gate_proj").T, f"{i}/w_up": L(i, "mlp.up_proj").T,
                     f"{i}/w_down": L(i, "mlp.down_proj").T}
        for tp in (1, 2, 4):
            mesh = make_mesh(model=tp, devices=jax.devices()[:tp])
            fn = None if tp == 1 else (lambda specs, cfg: weight_shardings(specs, mesh))
            for dtype in ("bfloat16", "float32"):
                w = checkpoint.load(path, dtype=dtype, shardings_fn=fn).weights
                got = {k: v for k, v in w.items() if k != "layers"}
                got |= {f"{i}/{k}": v for i, layer in enumerate(w["layers"]) for k, v in layer.items()}
                assert got.keys() == want.keys(), (got.keys(), want.keys())
                for k, a in got.items():
                    assert a.dtype == jnp.dtype(dtype), (k, a.dtype)
                    split = 1
                    for shard in a.addressable_shards:
                        part = np.asarray(shard.data)
                        split = max(split, a.size // part.size)
                        # A float32 tensor loaded as bfloat16 rounds once, as numpy's cast does.
                        np.testing.assert_array_equal(part, want[k][shard.index].astype(jnp.dtype(dtype)), err_msg=k)
                    # Split tp ways; norms replicate, and so do wk / wv where 2 KV heads do not divide.
                    whole = "norm" in k or (tp == 4 and k[2:] in ("wk", "wv"))
                    assert split == (1 if whole else tp), (k, tp, split)
    print("ok")
""")


def test_device_parts_are_the_written_tensors(tmp_path):
    """TP 1, 2 and 4 over 4 virtual CPU devices, bfloat16 and float32 checkpoints each loaded
    as both: every device part equals the written tensor's part in our layout (q/k/v and the
    MLP transposed, wo transposed and split by heads), and KV heads split 2 ways at TP 2 and
    whole heads per device at TP 4 (the 2 KV heads do not divide: wk/wv replicate)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=str(os.path.dirname(os.path.dirname(__file__))))
    p = subprocess.run([sys.executable, "-c", _PARTS, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert p.stdout.strip().endswith("ok")


# ~220 MB in bfloat16: 8 layers of width 1024 and an 8192-token vocabulary, 4 shards of ~56 MB.
SHAPE_200MB = dict(d_model=1024, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=2816, vocab=8192)


@pytest.fixture
def checkpoint_dir(tmp_path):
    path = tmp_path / "model"
    yield path
    shutil.rmtree(path, ignore_errors=True)  # hundreds of MB to gigabytes: not kept for later runs


_BYTES = {"bfloat16": 2, "float32": 4}
_SLACK = 32 << 20


def _check_bounds(info, rep, tp, stored_dtype, dtype):
    scale = _BYTES[dtype] / _BYTES[stored_dtype]  # bytes loaded per byte stored
    assert rep["weights_bytes"] == info["weights_bytes"] * scale
    assert rep["dtypes"] == [dtype]
    # Each device holds its own part of every split weight and a copy of the replicated ones.
    per_device = (rep["weights_bytes"] - rep["replicated_bytes"]) / tp + rep["replicated_bytes"]
    assert sorted(rep["device_bytes"].values()) == [per_device] * tp, rep
    if tp > 1:
        assert rep["replicated_bytes"] < 0.01 * rep["weights_bytes"], rep  # only the norms
    transient = rep["peak_rss_above_baseline"] - rep["weights_bytes"]
    assert transient <= 1.5 * info["largest_shard_bytes"], (transient / 2**20, info, rep)
    assert transient <= 1.5 * info["largest_tensor_bytes"] * scale + _SLACK, (transient / 2**20, info, rep)


@pytest.mark.parametrize("stored_dtype", ["bfloat16", "float32"])
def test_peak_host_memory_is_the_weights_and_about_one_shard(checkpoint_dir, stored_dtype):
    """Loaded as bfloat16 on one device and split over two, from a bfloat16 and a float32
    checkpoint: peak resident memory above the weights themselves stays under 1.5 shard files
    and about one tensor. A load that left the mapped shards' pages resident would hold the
    whole file on top of the weights: 465 MB for the float32 one, three times the bound."""
    info = write_llama(checkpoint_dir, dtype=stored_dtype, shards=4, **SHAPE_200MB)
    assert info["shards"] >= 4
    for tp in (1, 2):
        _check_bounds(info, measure_load(checkpoint_dir, dtype="bfloat16", tp=tp), tp, stored_dtype, "bfloat16")


@pytest.mark.slow  # ~2 min: writes 2 GB and loads it three times
def test_peak_host_memory_of_a_2gb_checkpoint(checkpoint_dir):
    """The size ``benchmarks/load_memory.py`` reports on: a 2.02 GB bfloat16 checkpoint in 4
    shards, loaded as bfloat16 on one device and split over two, and as float32 on one."""
    info = write_llama(checkpoint_dir, dtype="bfloat16", shards=4)
    assert info["shards"] == 4
    for dtype, tp in (("bfloat16", 1), ("bfloat16", 2), ("float32", 1)):
        _check_bounds(info, measure_load(checkpoint_dir, dtype=dtype, tp=tp), tp, "bfloat16", dtype)
    print(json.dumps(info))
