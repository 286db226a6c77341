"""OLMo 2 against transformers float32 on tiny checkpoints transformers writes: norms on the
attention and MLP outputs (none before them), q/k norms over the whole projection; the same
model read from a GGUF written the way llama.cpp's converter writes one; int8 loading;
configs."""

import pytest

from jaxinfer.errors import CheckpointError
from jaxinfer.models import olmo2
from tests import checkpoint_testing as ct
from tests import family_testing as ft

pytestmark = pytest.mark.reference


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return ft.write_tiny(tmp_path_factory.mktemp("olmo2") / "hf", "olmo2")


def test_olmo2_equals_transformers(plain):
    """4 query heads over 2 KV heads: q_norm scales 64 values, k_norm 32, each normalised over
    all its heads at once (tensor parallel 2 splits them across devices)."""
    ft.check_family(plain)


def test_attention_bias_equals_transformers(tmp_path):
    """attention_bias: q, k, v biased before their norms, and the output projection biased."""
    ct.equals_transformers(ft.write_tiny(tmp_path / "olmo2", "olmo2", {"attention_bias": True}))


def test_gguf_equals_hf(plain, tmp_path):
    """llama.cpp keeps OLMo's rotary layout (no Q/K permutation); its q/k norms are [N*H]."""
    gguf = ct.write_gguf_from_hf(plain, tmp_path / "olmo2.gguf", "olmo2")
    loaded = ct.same_model(gguf, plain)
    assert loaded.cfg.family == "olmo2" and not loaded.cfg.tie_embeddings
    assert loaded.weights["layers"][1]["q_norm"].shape == (4, 16)


def test_int8_loads(plain):
    ct.int8_loads(plain)


# ----------------------------------------------------------------------------- configs
# OLMo-2-0425-1B's config.json as published (abridged)
HUB = {"architectures": ["Olmo2ForCausalLM"], "attention_bias": False, "hidden_act": "silu", "hidden_size": 2048,
       "intermediate_size": 8192, "max_position_embeddings": 4096, "num_attention_heads": 16,
       "num_hidden_layers": 16, "num_key_value_heads": 16, "rms_norm_eps": 1e-06, "rope_scaling": None,
       "rope_theta": 500000, "tie_word_embeddings": False, "vocab_size": 100352}


def test_published_config_and_weights():
    cfg = olmo2.config_from_hf(HUB, dtype="bfloat16")
    assert (cfg.family, cfg.head_dim, cfg.rope.theta, cfg.norm_eps, cfg.qkv_bias) == (
        "olmo2", 128, 5e5, 1e-6, False)
    layer = olmo2.weight_specs(cfg)["layers"][0]
    assert "attn_norm" not in layer and "mlp_norm" not in layer
    assert layer["q_norm"].shape == (16, 128) and layer["q_norm"].axes == ("q_heads", "head_dim")
    assert layer["k_norm"].axes == ("kv_heads", "head_dim") and not layer["k_norm"].contract


def test_olmo3_sliding_windows_are_refused():
    """OLMo 3 shares OLMo 2's layers but slides some of them; not this family."""
    types = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"] * 4
    with pytest.raises(CheckpointError, match="OLMo 3"):
        olmo2.config_from_hf(HUB | {"sliding_window": 4096, "layer_types": types}, dtype="float32")
    meta = {"general.architecture": "olmo2", "olmo2.attention.sliding_window": 4096}
    with pytest.raises(CheckpointError, match="OLMo 3"):
        olmo2.config_from_gguf(meta, set(), dtype="float32")
