"""Hugging Face safetensors loading against transformers itself.

Tiny random Llama / Qwen2 models are built and saved with transformers (float32 and bfloat16,
one file and several shards, tied and untied embeddings, q/k/v bias, Llama 3 rotary scaling);
``checkpoint.load`` reads them back and our forward pass must give transformers' logits.
Broken directories must raise CheckpointError naming the problem.
"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.errors import CheckpointError
from jaxinfer.loaders import checkpoint
from jaxinfer.models import llama

from tests.conftest import require

pytestmark = pytest.mark.reference
torch = require("torch")
transformers = require("transformers")

V = 300  # byte-level BPE: 256 bytes, 3 specials, a few merges
CORPUS = "the quick brown fox jumps over the lazy dog; then the dog sleeps and the fox runs. " * 3
COMMON = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
              bos_token_id=1, eos_token_id=2)
CASES = {
    "llama_untied": ("llama", dict(tie_word_embeddings=False)),
    "llama_tied": ("llama", dict(tie_word_embeddings=True)),
    "llama3_rope": ("llama", dict(tie_word_embeddings=False, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=16))),
    "qwen2_bias": ("qwen2", dict(tie_word_embeddings=True)),
}

_forward = jax.jit(llama.forward, static_argnames=("cfg", "read_cache"))
_unembed = jax.jit(llama.unembed, static_argnames=("cfg",))


def _save_tokenizer(path):
    """A small byte-level BPE (the kind SmolLM2 / Llama 3 / Qwen2 ship), trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=V, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS] * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)


def _make_model(kind, extra, seed=0):
    torch.manual_seed(seed)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(COMMON | extra)))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**(COMMON | extra)))
    # Random everything (HF initialises norms to 1 and biases to 0, which would hide a
    # mis-assigned norm or a dropped bias), large enough that logits are O(1).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model.eval()


def _save(model, path, **kw):
    model.save_pretrained(path, safe_serialization=True, **kw)
    _save_tokenizer(path)
    return path


def _tokens():
    return np.asarray(jax.random.randint(jax.random.key(3), (2, 20), 0, V), np.int32)


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def _our_logits(loaded, tokens):
    cfg, w = loaded.cfg, loaded.weights
    h, _ = _forward(w, jnp.asarray(tokens), jnp.zeros(tokens.shape[0], jnp.int32), None, cfg=cfg)
    return np.asarray(_unembed(w, h, cfg))


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(name, tmp_path):
    kind, extra = CASES[name]
    model = _make_model(kind, extra)
    loaded = checkpoint.load(_save(model, tmp_path), dtype="float32")
    assert loaded.source == "hf"
    assert loaded.cfg.tie_embeddings == extra["tie_word_embeddings"]
    assert loaded.cfg.qkv_bias == (kind == "qwen2")
    assert ("lm_head" in loaded.weights) != extra["tie_word_embeddings"]
    tokens = _tokens()
    ref = _hf_logits(model, tokens)
    assert np.abs(ref).max() > 1.0  # the comparison below is not between near-zero numbers
    np.testing.assert_allclose(_our_logits(loaded, tokens), ref, rtol=1e-5, atol=2e-5)


def test_sharded_bfloat16_checkpoint(tmp_path):
    """Several shards via model.safetensors.index.json, stored in bfloat16 (which numpy
    cannot hold): weights are the bf16 values exactly, logits those of the bf16 model."""
    model = _make_model("llama", dict(tie_word_embeddings=False)).to(torch.bfloat16)
    _save(model, tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    loaded = checkpoint.load(tmp_path, dtype="float32")
    sd = model.state_dict()
    np.testing.assert_array_equal(np.asarray(loaded.weights["embed"]),
                                  sd["model.embed_tokens.weight"].float().numpy())
    np.testing.assert_array_equal(np.asarray(loaded.weights["layers"][1]["w_down"]),
                                  sd["model.layers.1.mlp.down_proj.weight"].float().numpy().T)
    # Reference: the saved bf16 weights read back by transformers in float32 (model.float()
    # would also carry the rotary inv_freq buffer through bfloat16).
    ref_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = _tokens()
    ref = _hf_logits(ref_model, tokens)
    np.testing.assert_allclose(_our_logits(loaded, tokens), ref, rtol=1e-5, atol=2e-5)

    bf16 = checkpoint.load(tmp_path, dtype="bfloat16")
    assert bf16.weights["embed"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bf16.weights["embed"], np.float32),
                                  np.asarray(loaded.weights["embed"]))


def test_tokenizer_is_loaded(tmp_path):
    loaded = checkpoint.load(_save(_make_model("llama", dict(tie_word_embeddings=True)), tmp_path),
                             dtype="float32")
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.tokenizer.eos_ids == {2}
    for text in ("the quick brown fox", "The lazy dog runs über 42 foxes!"):
        want = ref(text, add_special_tokens=False)["input_ids"]
        assert len(want) < len(text.encode())  # merges were learned and are used
        assert loaded.tokenizer.encode(text, add_special_tokens=False) == want
        assert loaded.tokenizer.decode(want) == text


# ----------------------------------------------------------------------------- broken directories
@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_base")
    return _save(_make_model("llama", dict(tie_word_embeddings=False)), path)


@pytest.fixture
def broken(saved_dir, tmp_path):
    dest = tmp_path / "model"
    shutil.copytree(saved_dir, dest)
    return dest


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, edit):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_unsupported_architecture(broken):
    _edit_config(broken, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(CheckpointError, match=r"unsupported architecture GPT2LMHeadModel.*LlamaForCausalLM"):
        checkpoint.load(broken, dtype="float32")


def test_missing_tensor(broken):
    _edit_tensors(broken, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"no tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        checkpoint.load(broken, dtype="float32")


def test_transposed_tensor_is_a_shape_mismatch(broken):
    # Same size, wrong layout: a size check alone would load it silently.
    def edit(t):
        t["model.layers.0.mlp.gate_proj.weight"] = np.ascontiguousarray(t["model.layers.0.mlp.gate_proj.weight"].T)

    _edit_tensors(broken, edit)
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight' has shape \(64, 128\)"):
        checkpoint.load(broken, dtype="float32")


def test_unmapped_tensor_is_refused(broken):
    # A bias our forward pass has no place for would otherwise be dropped without a word.
    _edit_tensors(broken, lambda t: t.update({"model.layers.0.mlp.up_proj.bias": np.ones(128, np.float32)}))
    with pytest.raises(CheckpointError, match=r"safetensors carry tensors that this model family does not use: "
                                              r"'model\.layers\.0\.mlp\.up_proj\.bias'"):
        checkpoint.load(broken, dtype="float32")


def test_unknown_rope_type_is_refused(broken):
    _edit_config(broken, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(CheckpointError, match=r"unsupported rope_scaling type 'yarn'"):
        checkpoint.load(broken, dtype="float32")


def test_wrong_size_tensor(broken):
    _edit_tensors(broken, lambda t: t.update({"model.norm.weight": np.ones(63, np.float32)}))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight' has shape \(63,\)"):
        checkpoint.load(broken, dtype="float32")


def test_corrupt_config(broken):
    (broken / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_')
    with pytest.raises(CheckpointError, match=r"config\.json: unreadable JSON"):
        checkpoint.load(broken, dtype="float32")


def test_config_missing_a_field(broken):
    cfg = json.loads((broken / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: missing key 'num_hidden_layers'"):
        checkpoint.load(broken, dtype="float32")


def test_missing_shard(broken):
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"neither model\.safetensors nor model\.safetensors\.index\.json"):
        checkpoint.load(broken, dtype="float32")


def test_convert_to_orbax_keeps_the_saved_dtype_and_tokenizer(tmp_path):
    from jaxinfer.loaders.convert import convert

    src = _save(_make_model("qwen2", dict(tie_word_embeddings=True)).to(torch.bfloat16), tmp_path / "hf")
    dest = convert(src, tmp_path / "orbax")  # dtype None: as saved (bfloat16)
    assert sorted(p.name for p in (dest / "tokenizer").iterdir()) == [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    want = checkpoint.load(src, dtype="bfloat16")
    got = checkpoint.load(dest, dtype="bfloat16")
    assert got.source == "orbax" and got.cfg == want.cfg and got.cfg.dtype == "bfloat16"
    for a, b in zip(jax.tree.leaves(got.weights), jax.tree.leaves(want.weights)):
        assert a.dtype == b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    text = "the lazy fox sleeps"
    assert got.tokenizer.encode(text) == want.tokenizer.encode(text)
    assert got.tokenizer.eos_ids == want.tokenizer.eos_ids
