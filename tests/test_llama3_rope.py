"""Llama 3 rotary scaling through both external formats, against transformers.

One tiny Llama-3-style model (rope_type "llama3", original context 64 so the scaling changes
the angles at the positions used here) is made by transformers with a fixed seed, saved as
safetensors, and written to GGUF the way llama.cpp's converter lays it out: Q/K rows permuted
into ggml's interleaved rotary order, and the scaling carried as ``rope_freqs.weight`` (the
divisor of each inverse frequency). The divisors are taken from transformers' own rotary
buffer, not from our code. Both files must load and give transformers' logits.
"""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import RopeKind
from jaxinfer.errors import CheckpointError
from jaxinfer.loaders import checkpoint
from jaxinfer.models import llama
from tests.conftest import require_reference

pytestmark = pytest.mark.reference
transformers = require_reference()

from tests.test_hf_loader import COMMON, _hf_logits, _make_model, _save  # noqa: E402

ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}
THETA = 500000.0
T = 48  # positions 0..47: the low frequencies are already rotated differently by x8 scaling

_forward = jax.jit(llama.forward, static_argnames=("cfg", "read_cache"))
_unembed = jax.jit(llama.unembed, static_argnames=("cfg",))


@pytest.fixture(scope="module")
def model():
    return _make_model("llama", dict(max_position_embeddings=256, tie_word_embeddings=False, rope_theta=THETA,
                                     rope_scaling=dict(ROPE)))


def _tokens():
    return np.asarray(jax.random.randint(jax.random.key(5), (2, T), 0, COMMON["vocab_size"]), np.int32)


def _logits(loaded, tokens):
    cfg, w = loaded.cfg, loaded.weights
    h, _ = _forward(w, jnp.asarray(tokens), jnp.zeros(tokens.shape[0], jnp.int32), None, cfg=cfg)
    return np.asarray(_unembed(w, h, cfg))


def _interleave_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's layout of a "llama" attn_q/attn_k weight: within each head, HF's rows
    (first halves of the rotated pairs, then second halves) become pairs side by side."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_divisors(model) -> np.ndarray:
    """What llama.cpp stores as rope_freqs.weight: unscaled / scaled inverse frequency, here
    read off transformers' rotary buffer."""
    H = model.config.hidden_size // model.config.num_attention_heads
    base = 1.0 / (THETA ** (np.arange(0, H, 2, dtype=np.float64) / H))
    scaled = model.model.rotary_emb.inv_freq.double().numpy()
    return (base / scaled).astype(np.float32)


def _write_gguf(model, tok_dir, path, *, rope_freqs=True, extra_meta=None, extra_tensors=None):
    import json

    c = model.config
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", c.num_hidden_layers)
    w.add_uint32("llama.context_length", c.max_position_embeddings)
    w.add_uint32("llama.embedding_length", c.hidden_size)
    w.add_uint32("llama.feed_forward_length", c.intermediate_size)
    w.add_uint32("llama.attention.head_count", heads)
    w.add_uint32("llama.attention.head_count_kv", kv_heads)
    w.add_float32("llama.rope.freq_base", THETA)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    for k, v in (extra_meta or {}).items():
        w.add_string(k, v)
    # The byte-level BPE that _save wrote, as llama.cpp's "gpt2" tokenizer keys.
    tj = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = dict(tj["model"]["vocab"])
    specials = {t["content"]: t["id"] for t in tj["added_tokens"]}
    vocab |= specials
    tokens = [None] * c.vocab_size
    for piece, i in vocab.items():
        tokens[i] = piece
    assert None not in tokens
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(specials["<s>"])
    w.add_eos_token_id(specials["</s>"])

    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", _rope_divisors(model))
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _interleave_rows(sd[p + "self_attn.q_proj.weight"], heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _interleave_rows(sd[p + "self_attn.k_proj.weight"], kv_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    for name, a in (extra_tensors or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    return _save(model, tmp_path_factory.mktemp("llama3_hf"))


@pytest.fixture(scope="module")
def reference(model):
    tokens = _tokens()
    ref = _hf_logits(model, tokens)
    assert np.abs(ref).max() > 1.0  # the comparison is not between near-zero numbers
    return tokens, ref


def test_the_scaling_bites(model):
    """At least one frequency is divided by the full factor and one left alone, so an
    unscaled or wrongly scaled rotary gives other logits at these positions."""
    d = _rope_divisors(model)
    assert d.min() == pytest.approx(1.0) and d.max() == pytest.approx(ROPE["factor"])
    assert np.any((d > 1.01) & (d < ROPE["factor"] - 0.01))  # and one is smoothed between


def test_safetensors_equal_transformers(saved, reference):
    tokens, ref = reference
    loaded = checkpoint.load(saved, dtype="float32")
    assert loaded.cfg.rope.kind == RopeKind.LLAMA3
    np.testing.assert_allclose(_logits(loaded, tokens), ref, rtol=1e-5, atol=2e-5)


def test_gguf_with_rope_freqs_equals_transformers(model, saved, reference, tmp_path):
    tokens, ref = reference
    loaded = checkpoint.load(_write_gguf(model, saved, tmp_path / "m.gguf"), dtype="float32")
    assert loaded.source == "gguf"
    np.testing.assert_allclose(np.asarray(loaded.cfg.rope.freq_factors), _rope_divisors(model), rtol=0)
    np.testing.assert_allclose(_logits(loaded, tokens), ref, rtol=1e-5, atol=2e-5)
    # Without the table the same weights give other logits: the test above can fail.
    plain = checkpoint.load(_write_gguf(model, saved, tmp_path / "plain.gguf", rope_freqs=False), dtype="float32")
    assert plain.cfg.rope.freq_factors is None
    assert np.abs(_logits(plain, tokens) - ref).max() > 1e-2


def test_gguf_unmapped_tensor_is_refused(model, saved, tmp_path):
    path = _write_gguf(model, saved, tmp_path / "extra.gguf",
                       extra_tensors={"blk.0.ffn_gate.bias": np.zeros(COMMON["intermediate_size"], np.float32)})
    with pytest.raises(CheckpointError, match=r"GGUF carries tensors that this model family does not use: "
                                              r"'blk\.0\.ffn_gate\.bias'"):
        checkpoint.load(path, dtype="float32")


def test_gguf_unknown_rope_scaling_is_refused(model, saved, tmp_path):
    path = _write_gguf(model, saved, tmp_path / "yarn.gguf", extra_meta={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(CheckpointError, match=r"unsupported GGUF llama\.rope\.scaling\.type 'yarn'"):
        checkpoint.load(path, dtype="float32")
