"""Checkpoints loaded from a bucket (the GCS emulator through gcsfs, moto's S3 server through
s3fs) equal the same checkpoints loaded from local disk, and the values written: a Hugging Face
directory whose safetensors are read in place by range requests (sharded over devices too), a
GGUF file and an Orbax directory copied in."""

from pathlib import Path

import jax
import numpy as np
import pytest

from jaxinfer import bucket, registry, storage
from jaxinfer.errors import CheckpointError
from jaxinfer.loaders import checkpoint, orbax_io
from tests.random_hf import llama_arrays, write_llama

SHAPE = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, vocab=259)


def _upload_dir(local: Path, url: str) -> None:
    for p in sorted(local.rglob("*")):
        if p.is_file():
            storage.put(storage.parse(f"{url}/{p.relative_to(local).as_posix()}"), p.read_bytes())


def _assert_same(got, want):
    assert got.cfg == want.cfg
    assert jax.tree.structure(got.weights) == jax.tree.structure(want.weights)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got.weights), jax.tree.leaves(want.weights)):
        assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny"
    write_llama(path, dtype="bfloat16", shards=2, **SHAPE)
    return path


def test_hf_directory_from_a_bucket_reads_the_safetensors_in_place(store, hf_dir, tmp_path, monkeypatch):
    url = f"{store.scheme}://{store.bucket()}/models/tiny"
    _upload_dir(hf_dir, url)
    reads = []
    real = bucket.RemoteFile.read
    monkeypatch.setattr(bucket.RemoteFile, "read", lambda self, a, b: reads.append((a, b)) or real(self, a, b))

    staged = registry.resolve(url, download_dir=tmp_path / "staged")
    # the small files came; the weights did not
    assert (staged / "config.json").is_file() and (staged / "tokenizer.json").is_file()
    assert not list(staged.glob("*.safetensors"))
    got = checkpoint.load(staged, dtype="float32")
    want = checkpoint.load(hf_dir, dtype="float32")
    _assert_same(got, want)
    assert reads  # by ranges, never the whole file at once
    whole = {p.name: p.stat().st_size for p in hf_dir.glob("*.safetensors")}
    assert max(b - a for a, b in reads) < min(whole.values())
    # and the values are those written
    written = dict(llama_arrays(0, "bfloat16", **SHAPE))
    np.testing.assert_array_equal(np.asarray(got.weights["embed"]),
                                  written["model.embed_tokens.weight"].astype(np.float32))


def test_each_device_reads_its_part_from_the_bucket(store, hf_dir, tmp_path):
    """Column and row parts of each weight over the devices there are (8 virtual CPU devices
    when XLA_FLAGS asks for them): equal to the local sharded load."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    n = len(jax.devices())
    mesh = Mesh(np.array(jax.devices()).reshape(n), ("model",))

    def shardings(specs, cfg):
        from jaxinfer.specs import is_spec

        def one(spec):
            axes = [None] * len(spec.shape)
            for i, d in enumerate(spec.shape):
                if d % n == 0:
                    axes[i] = "model"
                    break
            return NamedSharding(mesh, PartitionSpec(*axes))

        return jax.tree.map(one, specs, is_leaf=is_spec)

    url = f"{store.scheme}://{store.bucket()}/tiny"
    _upload_dir(hf_dir, url)
    got = checkpoint.load(registry.resolve(url, download_dir=tmp_path), dtype="float32", shardings_fn=shardings)
    want = checkpoint.load(hf_dir, dtype="float32", shardings_fn=shardings)
    _assert_same(got, want)
    for a, b in zip(jax.tree.leaves(got.weights), jax.tree.leaves(want.weights)):
        assert a.sharding == b.sharding


def test_gguf_and_orbax_from_a_bucket(store, tiny_gguf, tmp_path):
    b = store.bucket()
    url = f"{store.scheme}://{b}/tiny.gguf"
    storage.put(storage.parse(url), Path(tiny_gguf).read_bytes())
    want = checkpoint.load(tiny_gguf, dtype="float32")
    _assert_same(checkpoint.load(registry.resolve(url, download_dir=tmp_path / "a"), dtype="float32"), want)

    ck = orbax_io.save(tmp_path / "orbax", want.cfg, want.weights, tiny_gguf)
    _upload_dir(ck, f"{store.scheme}://{b}/orbax")
    got = checkpoint.load(registry.resolve(f"{store.scheme}://{b}/orbax", download_dir=tmp_path / "b"),
                          dtype="float32")
    _assert_same(got, want)


def test_what_is_not_a_checkpoint_says_so(store, tmp_path):
    b = store.bucket()
    with pytest.raises(CheckpointError, match="no such object or directory"):
        registry.resolve(f"{store.scheme}://{b}/nothing", download_dir=tmp_path)
    storage.put(storage.parse(f"{store.scheme}://{b}/dir/notes.txt"), b"hello")
    with pytest.raises(CheckpointError, match="neither a .gguf object nor a directory"):
        registry.resolve(f"{store.scheme}://{b}/dir", download_dir=tmp_path)
    with pytest.raises(storage.StorageError, match="does not exist"):
        registry.resolve(f"{store.scheme}://no-such-bucket-{b}/model", download_dir=tmp_path)


def test_convert_writes_orbax_into_a_bucket(store, tiny_gguf, tmp_path, capsys):
    from jaxinfer.cli import main

    url = f"{store.scheme}://{store.bucket()}/ckpt"
    assert main(["convert", str(tiny_gguf), url]) == 0
    assert capsys.readouterr().out.strip() == url
    assert "jaxinfer.json" in storage.listing(storage.parse(url))
    got = checkpoint.load(registry.resolve(url, download_dir=tmp_path), dtype="float32")
    _assert_same(got, checkpoint.load(tiny_gguf, dtype="float32"))
    assert main(["convert", str(tiny_gguf), url]) == 2  # never over an existing checkpoint
    assert "already holds objects" in capsys.readouterr().err
