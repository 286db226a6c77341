"""Orbax checkpoints written by ``jaxinfer convert``: the round trip is exact.

Tiny random configs round-trip bit for bit (config included), the real SmolLM2 GGUF converts
through the CLI and reloads equal to loading the GGUF itself (tokenizer included), and a
restore onto an 8-device mesh puts every array in its target sharding directly.
"""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import ModelConfig, RopeConfig, RopeKind
from jaxinfer.errors import CheckpointError
from jaxinfer.loaders import checkpoint, convert, orbax_io
from jaxinfer.models import llama
from jaxinfer.specs import init_weights

TINY = ModelConfig(family="llama", vocab_size=128, d_model=64, n_layers=2, n_heads=8,
                   n_kv_heads=2, head_dim=8, d_ff=96, norm_eps=1e-6, name="tiny")
CONFIGS = {
    "tied": TINY,
    "untied_bias_llama3": dataclasses.replace(
        TINY, tie_embeddings=False, qkv_bias=True, max_position=4096,
        rope=RopeConfig(theta=500000.0, kind=RopeKind.LLAMA3, factor=8.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position=16)),
    "bfloat16_linear": dataclasses.replace(TINY, dtype="bfloat16", rope=RopeConfig(kind=RopeKind.LINEAR, factor=2.0)),
}


def _weights(cfg, seed=0):
    return init_weights(llama.weight_specs(cfg), cfg, jax.random.key(seed), scale=0.3)


def _assert_trees_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_dict_round_trip(name):
    cfg = CONFIGS[name]
    d = orbax_io.config_to_dict(cfg)
    assert json.loads(json.dumps(d)) == d  # plain JSON values only
    assert d["family"] == "llama" and isinstance(d["rope"], dict)
    assert orbax_io.config_from_dict(json.loads(json.dumps(d))) == cfg


def test_a_family_config_round_trips_and_older_flat_configs_still_read():
    """A family's own knobs (``family_config``) come back as that family's config class; a
    config written when they were fields of ModelConfig itself reads into the same place."""
    from jaxinfer.models.gpt_oss import GptOssConfig
    from jaxinfer.models.granite import GraniteConfig

    cfg = dataclasses.replace(TINY, family="granite", family_config=GraniteConfig(embedding_multiplier=12.0,
                                                                                  logits_scaling=8.0))
    d = json.loads(json.dumps(orbax_io.config_to_dict(cfg)))
    assert d["family_config"]["embedding_multiplier"] == 12.0
    assert orbax_io.config_from_dict(d) == cfg
    flat = orbax_io.config_to_dict(dataclasses.replace(TINY, family="gpt_oss"))
    flat = {k: v for k, v in flat.items() if k != "family_config"} | {"swiglu_alpha": 1.5, "swiglu_limit": 6.0}
    got = orbax_io.config_from_dict(flat)
    assert got.family_config == GptOssConfig(swiglu_alpha=1.5, swiglu_limit=6.0)


def test_config_from_dict_refuses_unknown_fields():
    d = orbax_io.config_to_dict(TINY) | {"no_such_field": 4096}
    with pytest.raises(CheckpointError, match="no_such_field"):
        orbax_io.config_from_dict(d)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_load_round_trip_is_exact(name, tmp_path):
    cfg = CONFIGS[name]
    w = _weights(cfg)
    dest = orbax_io.save(tmp_path / "ck", cfg, w, None)
    assert sorted(p.name for p in dest.iterdir()) == ["jaxinfer.json", "weights"]
    assert checkpoint.detect_format(dest) == "orbax"
    loaded = checkpoint.load(dest, dtype=cfg.dtype)
    assert loaded.source == "orbax" and loaded.cfg == cfg
    _assert_trees_equal(loaded.weights, w)


def test_load_casts_to_the_requested_dtype(tmp_path):
    cfg = CONFIGS["untied_bias_llama3"]
    w = _weights(cfg)
    dest = orbax_io.save(tmp_path / "ck", cfg, w, None)
    loaded = orbax_io.load_orbax(dest, dtype="bfloat16")
    assert loaded.cfg == dataclasses.replace(cfg, dtype="bfloat16")
    _assert_trees_equal(loaded.weights, jax.tree.map(lambda a: a.astype(jnp.bfloat16), w))


def test_saved_directory_has_ordinary_permissions(tmp_path):
    dest = orbax_io.save(tmp_path / "ck", TINY, _weights(TINY), None)
    (tmp_path / "plain").mkdir()
    assert dest.stat().st_mode == (tmp_path / "plain").stat().st_mode


def test_save_refuses_a_non_empty_destination(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists"):
        orbax_io.save(tmp_path / "ck", TINY, _weights(TINY), None)
    assert os.listdir(tmp_path) == ["ck"]  # no temporary directory left behind
    assert os.listdir(tmp_path / "ck") == ["keep.txt"]


def test_weights_not_matching_the_config(tmp_path):
    dest = orbax_io.save(tmp_path / "ck", TINY, _weights(TINY), None)
    meta = json.loads((dest / "jaxinfer.json").read_text())
    meta["config"]["d_ff"] = 100
    (dest / "jaxinfer.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"do not match the config.*\['w_gate'\] saved \(64, 96\), declared \(64, 100\)"):
        orbax_io.load_orbax(dest, dtype="float32")
    meta["config"].update(d_ff=96, qkv_bias=True)
    (dest / "jaxinfer.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"\['layers'\]\[0\]\['bq'\] missing"):
        orbax_io.load_orbax(dest, dtype="float32")


def test_corrupt_description(tmp_path):
    dest = orbax_io.save(tmp_path / "ck", TINY, _weights(TINY), None)
    (dest / "jaxinfer.json").write_text("{")
    with pytest.raises(CheckpointError, match="unreadable JSON"):
        checkpoint.load(dest, dtype="float32")


def test_bare_destination_goes_to_the_local_store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert convert.default_dest("smollm2") == tmp_path / "checkpoints" / "smollm2"
    assert convert.default_dest("./smollm2") == tmp_path / "smollm2"
    assert convert.default_dest("out/smollm2").parts[-2:] == ("out", "smollm2")
    assert convert.default_dest(tmp_path / "x") == tmp_path / "x"


# ----------------------------------------------------------------------------- sharded restore
_SHARDED = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from jaxinfer.loaders import orbax_io
    from jaxinfer.models import llama
    from jaxinfer.sharding import make_mesh, weight_shardings

    assert len(jax.devices()) == 8
    mesh = make_mesh(data=1, model=8)
    loaded = orbax_io.load_orbax(sys.argv[1], dtype="float32",
                                 shardings_fn=lambda specs, cfg: weight_shardings(specs, mesh))
    want = weight_shardings(llama.weight_specs(loaded.cfg), mesh)
    ref = np.load(sys.argv[2])
    n_split = 0
    targets = dict(jax.tree_util.tree_leaves_with_path(want))
    for path, a in jax.tree_util.tree_leaves_with_path(loaded.weights):
        key = jax.tree_util.keystr(path)
        target = targets[path]
        assert a.sharding == target, (key, a.sharding, target)
        n_split += any(s is not None for s in target.spec)
        np.testing.assert_array_equal(np.asarray(a), ref[key], err_msg=key)
    assert n_split >= 5, n_split  # the mesh really splits most weights
    print("ok", n_split)
""")


def test_restore_into_a_sharding_on_8_devices(tmp_path):
    cfg = CONFIGS["untied_bias_llama3"]
    w = _weights(cfg)
    dest = orbax_io.save(tmp_path / "ck", cfg, w, None)
    np.savez(tmp_path / "ref.npz", **{jax.tree_util.keystr(p): np.asarray(a)
                                     for p, a in jax.tree_util.tree_leaves_with_path(w)})
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-c", _SHARDED, str(dest), str(tmp_path / "ref.npz")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok")


# ----------------------------------------------------------------------------- real checkpoint + CLI
def _cli(*args, cwd=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "jaxinfer", *map(str, args)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def smollm2_converted(smollm2_gguf, tmp_path_factory):
    dest = tmp_path_factory.mktemp("convert") / "smollm2"
    proc = _cli("convert", smollm2_gguf, dest)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(dest)
    return dest


def test_cli_convert_of_the_real_gguf_is_exact(smollm2_gguf, smollm2_converted):
    assert sorted(p.name for p in smollm2_converted.iterdir()) == ["jaxinfer.json", "tokenizer_gguf_meta.json", "weights"]
    want = checkpoint.load(smollm2_gguf, dtype="float32")
    got = checkpoint.load(smollm2_converted, dtype="float32")
    assert got.source == "orbax" and got.cfg == want.cfg
    _assert_trees_equal(got.weights, want.weights)
    del want.weights, got.weights
    for text in ("Hello, world!", "  The quick brown fox\njumps über 42 lazy dogs. 🦊",
                 "<|im_start|>user\nhi<|im_end|>\n"):
        assert list(got.tokenizer.encode(text)) == list(want.tokenizer.encode(text)), text


def test_cli_convert_errors_exit_2(tmp_path, smollm2_converted):
    proc = _cli("convert", "no-such-model", tmp_path / "out")
    assert proc.returncode == 2
    assert proc.stderr.startswith("jaxinfer: error: unknown model 'no-such-model'")
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()

    proc = _cli("convert", smollm2_converted, smollm2_converted)  # destination exists
    assert proc.returncode == 2
    assert "already exists" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
