"""Qwen 3 (dense) against transformers float32 on tiny checkpoints transformers writes: the
per-head q/k norms, sliding-window layers, attention biases; the same model read from a GGUF
written the way llama.cpp's converter writes one; int8 loading; configs."""

import json

import pytest

from jaxinfer.config import AttentionKind
from jaxinfer.errors import CheckpointError
from jaxinfer.models import qwen3
from jaxinfer.models.registry import num_params
from tests import checkpoint_testing as ct
from tests import family_testing as ft

pytestmark = pytest.mark.reference

L, G = AttentionKind.LOCAL, AttentionKind.GLOBAL


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Every layer global, tied embeddings (what llama.cpp's qwen3 supports)."""
    return ft.write_tiny(tmp_path_factory.mktemp("qwen3") / "hf", "qwen3", {"tie_word_embeddings": True})


def test_qwen3_equals_transformers(tmp_path):
    """Per-head q/k norms everywhere; layer 0 global, layers 1 and 2 sliding over the last 8
    positions (the prompts hold 23 to 48 tokens)."""
    path = ft.write_tiny(tmp_path / "qwen3", "qwen3",
                         {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1})
    cfg = qwen3.config_from_hf(json.loads((path / "config.json").read_text()), dtype="float32")
    assert cfg.family == "qwen3" and cfg.layer_kinds == (G, L, L) and cfg.sliding_window == 8
    ft.check_family(path)


def test_attention_bias_equals_transformers(tmp_path):
    """attention_bias puts a bias on q, k, v (before the norms) and on the output projection."""
    ct.equals_transformers(ft.write_tiny(tmp_path / "qwen3", "qwen3", {"attention_bias": True}))


def test_gguf_equals_hf(plain, tmp_path):
    """llama.cpp keeps Qwen's rotary layout (no Q/K permutation) and stores q/k norms as is."""
    gguf = ct.write_gguf_from_hf(plain, tmp_path / "qwen3.gguf", "qwen3")
    loaded = ct.same_model(gguf, plain)
    assert loaded.cfg.family == "qwen3" and loaded.cfg.tie_embeddings and loaded.cfg.layer_kinds == ()


def test_int8_loads(plain):
    ct.int8_loads(plain)


# ----------------------------------------------------------------------------- configs
# Qwen3-0.6B's config.json as published (transformers 4: no layer_types)
HUB = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128, "hidden_size": 1024,
       "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
       "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
       "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
       "use_sliding_window": False, "vocab_size": 151936}


def test_published_config():
    cfg = qwen3.config_from_hf(HUB, dtype="bfloat16")
    assert (cfg.family, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.rope.theta, cfg.norm_eps) == (
        "qwen3", 128, 16, 8, 1e6, 1e-6)
    assert cfg.layer_kinds == () and cfg.sliding_window is None and cfg.tie_embeddings and not cfg.qkv_bias
    # what Qwen publishes for Qwen3-0.6B: 0.6B parameters, 0.44B of them outside the embedding
    assert round(num_params(cfg) / 1e9, 1) == 0.6
    assert round((num_params(cfg) - cfg.vocab_size * cfg.d_model) / 1e9, 2) == 0.44


def test_sliding_window_follows_transformers():
    """Without layer_types, layers from max_window_layers on slide, and only with
    use_sliding_window (a window set without it is ignored, as Qwen3Config drops it)."""
    swa = HUB | {"num_hidden_layers": 4, "max_window_layers": 2, "sliding_window": 16}
    assert qwen3.config_from_hf(swa, dtype="float32").layer_kinds == ()
    cfg = qwen3.config_from_hf(swa | {"use_sliding_window": True}, dtype="float32")
    assert cfg.layer_kinds == (G, G, L, L) and cfg.sliding_window == 16 and cfg.layer_window(1) is None
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    cfg = qwen3.config_from_hf(swa | {"use_sliding_window": True, "layer_types": types}, dtype="float32")
    assert cfg.layer_kinds == (L, G, L, G)
    with pytest.raises(CheckpointError, match="no sliding_window"):  # transformers cannot run it either
        qwen3.config_from_hf(swa | {"layer_types": types}, dtype="float32")


def test_unsupported_rope_scaling_is_refused():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    with pytest.raises(CheckpointError, match="yarn"):
        qwen3.config_from_hf(HUB | {"rope_scaling": yarn}, dtype="float32")
