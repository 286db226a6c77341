"""The text decoders of the multimodal checkpoints of families we run equal transformers float32
on text: Gemma3ForConditionalGeneration (Gemma 3 4B, 12B, 27B), Mistral3ForConditionalGeneration
(Mistral Small 3.1) and Qwen2_5_VLForConditionalGeneration, each written by transformers with a
tiny vision tower beside a tiny text decoder, and loaded from its language-model prefix. Qwen2.5-VL's
M-RoPE turns each frequency section by its own axis of the position; on text the three are equal,
so it must equal the 1-D rotary exactly."""

import json

import pytest
from safetensors import safe_open

from tests import family_testing as ft

pytestmark = pytest.mark.reference

SIGLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
          "image_size": 28, "patch_size": 14}
CASES = {
    # sliding and global layers; the tower as published (language_model.model.). No logit
    # soft-cap: the published configs set none, and transformers' Gemma3ForConditionalGeneration
    # would skip one that Gemma3ForCausalLM (and vLLM's Gemma 3) applies
    "gemma3": ({"sliding_window": 8, "query_pre_attn_scalar": 24,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                "hidden_activation": "gelu_pytorch_tanh"},
               {"vision_config": SIGLIP, "mm_tokens_per_image": 4}),
    # an untied LM head under language_model.lm_head
    "mistral3": ({"model_type": "mistral"},
                 {"vision_config": SIGLIP | {"head_dim": 16}, "tie_word_embeddings": False}),
    # M-RoPE over 2 + 3 + 3 of the 8 frequencies, Q/K/V biases, the ViT under visual.
    "qwen2_5_vl": ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
                   {"vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                      "out_hidden_size": 64}}),
}
TOWERS = {"gemma3": "language_model.model.", "mistral3": "language_model.model.", "qwen2_5_vl": "model."}


@pytest.mark.parametrize("model_type", list(CASES))
def test_text_tower_equals_transformers(model_type, tmp_path):
    from jaxinfer import LLM

    text, outer = CASES[model_type]
    path = ft.write_tiny(tmp_path / model_type, model_type, text, outer=outer)
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    assert arch.endswith("ForConditionalGeneration")
    with safe_open(path / "model.safetensors", "np") as f:
        names = list(f.keys())
    assert f"{TOWERS[model_type]}embed_tokens.weight" in names  # the tower where the published checkpoints keep it
    assert len(names) > 10 + len([n for n in names if n.startswith(TOWERS[model_type])])  # and a vision tower beside
    ref = ft.reference(path, ft.PROMPTS[:2])
    llm = LLM(str(path), max_model_len=128, progress=False, kv_cache_memory_bytes=4 << 20, max_num_seqs=2)
    assert llm.cfg.vocab_size == ft.V
    ft.assert_matches(ft.generate(llm, ft.PROMPTS[:2]), ref, what=f"{arch} text tower")
    if model_type != "gemma3":  # (Gemma 3 runs its images given a preprocessor_config.json)
        _refuses_images(llm, path)


def _refuses_images(llm, path):
    """A checkpoint whose vision tower jaxinfer does not run: its images get one clear error,
    even with an image processor config beside it, and its text still runs."""
    from PIL import Image

    from jaxinfer.errors import InvalidRequest

    (path / "preprocessor_config.json").write_text(json.dumps({"size": {"height": 28, "width": 28}}))
    img = Image.new("RGB", (8, 8))
    with pytest.raises(InvalidRequest, match="conversation 0: this model takes no images"):
        llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": img}]}], use_tqdm=False)
    with pytest.raises(InvalidRequest, match="prompt 0: this model takes no images"):
        llm.generate({"prompt": "t5 t6", "multi_modal_data": {"image": img}}, use_tqdm=False)


def test_a_tower_in_transformers_4_5x_layout_loads(tmp_path):
    """transformers 4.52 to 4.57 re-saved these checkpoints with the decoder under
    model.language_model. and the head at lm_head: the same weights load from there."""
    from safetensors.numpy import load_file, save_file

    from jaxinfer import LLM

    text, outer = CASES["mistral3"]
    path = ft.write_tiny(tmp_path / "m", "mistral3", text, outer=outer)
    ref = ft.reference(path, ft.PROMPTS[:1])
    t = load_file(path / "model.safetensors")
    renamed = {("model.language_model." + n[len("language_model.model."):] if n.startswith("language_model.model.")
                else "lm_head.weight" if n == "language_model.lm_head.weight" else n): a for n, a in t.items()}
    assert "lm_head.weight" in renamed
    save_file(renamed, path / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(path), max_model_len=128, progress=False, kv_cache_memory_bytes=4 << 20, max_num_seqs=2)
    ft.assert_matches(ft.generate(llm, ft.PROMPTS[:1]), ref, what="4.5x layout")


def test_a_checkpoint_without_its_text_tower_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    from jaxinfer import LLM
    from jaxinfer.errors import CheckpointError

    text, outer = CASES["gemma3"]
    path = ft.write_tiny(tmp_path / "g", "gemma3", text, outer=outer)
    t = load_file(path / "model.safetensors")
    save_file({n: a for n, a in t.items() if not n.startswith("language_model.")}, path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="without its text decoder's tensors"):
        LLM(str(path), max_model_len=128, progress=False)
