"""SmolLM3 against transformers float32 on tiny checkpoints transformers writes: NoPE layers
(no rotary) among rotary ones, sliding-window layers; the same model read from a GGUF written
the way llama.cpp's converter writes one (Q/K rows permuted, every 4th layer NoPE); int8
loading; configs."""

import json

import pytest

from jaxinfer.config import AttentionKind
from jaxinfer.errors import CheckpointError
from jaxinfer.loaders import orbax_io
from jaxinfer.models import smollm3
from jaxinfer.models.registry import num_params
from tests import checkpoint_testing as ct
from tests import family_testing as ft

pytestmark = pytest.mark.reference

L, G = AttentionKind.LOCAL, AttentionKind.GLOBAL


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Four layers, the fourth NoPE (the default interval, which llama.cpp fixes), tied."""
    return ft.write_tiny(tmp_path_factory.mktemp("smollm3") / "hf", "smollm3",
                         {"num_hidden_layers": 4, "tie_word_embeddings": True})


def test_smollm3_equals_transformers(tmp_path):
    """Every second layer NoPE, and (as SmolLM3's config derives it) those layers sliding over
    the last 8 positions: layer 1 of 3 has no rotary and a window."""
    path = ft.write_tiny(tmp_path / "smollm3", "smollm3",
                         {"no_rope_layer_interval": 2, "use_sliding_window": True, "sliding_window": 8})
    cfg = smollm3.config_from_hf(json.loads((path / "config.json").read_text()), dtype="float32")
    assert cfg.family == "smollm3" and cfg.nope_layers == (1,) and cfg.layer_kinds == (G, L, G)
    ft.check_family(path)


def test_nope_without_window_equals_transformers(tmp_path):
    """NoPE layers 0 and 2 of 3, every layer global: position reaches them only through layer 1."""
    path = ft.write_tiny(tmp_path / "smollm3", "smollm3", {"no_rope_layers": [0, 1, 0]})
    cfg = smollm3.config_from_hf(json.loads((path / "config.json").read_text()), dtype="float32")
    assert cfg.nope_layers == (0, 2) and cfg.layer_kinds == ()
    ct.equals_transformers(path)


def test_gguf_equals_hf(plain, tmp_path):
    """llama.cpp converts SmolLM3 as a Llama: Q/K rows permuted (undone on load); its NoPE
    interval is fixed at 4, which the GGUF does not carry."""
    gguf = ct.write_gguf_from_hf(plain, tmp_path / "smollm3.gguf", "smollm3", permuted_qk=True)
    loaded = ct.same_model(gguf, plain)
    assert loaded.cfg.family == "smollm3" and loaded.cfg.nope_layers == (3,) and loaded.cfg.tie_embeddings


def test_int8_loads(plain):
    ct.int8_loads(plain)


def test_w8a8_calibrates_each_layer_as_the_model_runs_it(plain):
    """w8a8 calibration runs layer i as a one-layer model: NoPE layers must stay NoPE there."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer import quant
    from jaxinfer.loaders import checkpoint, quantize

    loaded = checkpoint.load(plain, dtype="float32")
    cfg, layers = loaded.cfg, loaded.weights["layers"]
    x = jax.random.normal(jax.random.key(0), (1, 12, cfg.d_model))
    positions = jnp.arange(12, dtype=jnp.int32)[None]
    for i in range(cfg.n_layers):
        want, _ = smollm3.decoder_layers(layers[i : i + 1], x, positions, None, None, cfg=cfg, first=i)
        got, _ = smollm3.decoder_layers(layers[i : i + 1], x, positions, None, None,
                                        cfg=quantize.one_layer_config(cfg, i))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6, err_msg=f"layer {i}")
    w8a8 = checkpoint.load(plain, dtype="float32", quantize=quant.quant_config("w8a8"))
    assert w8a8.weights["layers"][3]["wq"].scheme == quant.QuantScheme.W8A8


# ----------------------------------------------------------------------------- configs
# SmolLM3-3B's config.json as published (abridged: no_rope_layers derived below)
HUB = {"architectures": ["SmolLM3ForCausalLM"], "attention_bias": False, "hidden_act": "silu", "hidden_size": 2048,
       "intermediate_size": 11008, "max_position_embeddings": 65536, "mlp_bias": False,
       "no_rope_layer_interval": 4, "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 4,
       "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 5000000.0, "sliding_window": None,
       "use_sliding_window": False, "vocab_size": 128256}


def test_published_config():
    cfg = smollm3.config_from_hf(HUB, dtype="bfloat16")
    assert cfg.nope_layers == tuple(range(3, 36, 4)) and cfg.layer_kinds == ()
    assert cfg.tie_embeddings and cfg.rope.theta == 5e6 and cfg.head_dim == 128  # SmolLM3Config's defaults
    assert round(num_params(cfg) / 1e9, 2) == 3.08  # SmolLM3-3B
    assert orbax_io.config_from_dict(orbax_io.config_to_dict(cfg)) == cfg  # as `jaxinfer convert` stores it


def test_no_rope_layers_flags_mark_the_layers_that_use_rotary():
    """transformers' no_rope_layers[i] is 1 where layer i DOES apply rotary."""
    cfg = smollm3.config_from_hf(HUB | {"num_hidden_layers": 4, "no_rope_layers": [1, 1, 0, 1]}, dtype="float32")
    assert cfg.nope_layers == (2,)
    with pytest.raises(CheckpointError, match="no_rope_layers lists 3"):
        smollm3.config_from_hf(HUB | {"num_hidden_layers": 4, "no_rope_layers": [1, 1, 0]}, dtype="float32")


def test_sliding_layers_need_use_sliding_window():
    """transformers' eager attention slides the layers layer_types names, its flash attention
    only with use_sliding_window: a config where the two disagree is refused."""
    types = ["full_attention", "full_attention", "full_attention", "sliding_attention"]
    hf = HUB | {"num_hidden_layers": 4, "sliding_window": 16, "layer_types": types}
    with pytest.raises(CheckpointError, match="use_sliding_window"):
        smollm3.config_from_hf(hf, dtype="float32")
    cfg = smollm3.config_from_hf(hf | {"use_sliding_window": True}, dtype="float32")
    assert cfg.layer_kinds == (G, G, G, L) and cfg.sliding_window == 16


def test_attention_bias_is_refused():
    with pytest.raises(CheckpointError, match="attention_bias"):
        smollm3.config_from_hf(HUB | {"attention_bias": True}, dtype="float32")
