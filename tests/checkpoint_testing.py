"""One tiny model through two doors: a GGUF written from a tiny Hugging Face checkpoint
(``family_testing.write_tiny``) must load to the model the checkpoint itself loads to, and a
quantized load must stay near the float one.

``write_gguf_from_hf`` writes the GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` writes
that architecture: tensor names from the ``gguf`` package's own map (not ours), Q/K rows
permuted into ggml's interleaved rotary layout for the archs the converter permutes, and the
metadata keys its ``TextModel`` writes. The vocabulary is the tiny checkpoint's V word tokens
as a SentencePiece table.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.family_testing import V


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows from the half-split rotary
    layout to the interleaved one."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_from_hf(hf_dir: Path, out: Path, arch: str, *, permuted_qk: bool = False) -> Path:
    """The checkpoint at ``hf_dir`` as the GGUF of architecture ``arch`` ("qwen3", ...)."""
    import gguf
    from safetensors.numpy import load_file

    hp = json.loads((Path(hf_dir) / "config.json").read_text())
    tensors = load_file(str(Path(hf_dir) / "model.safetensors"))
    n_layers, n_heads = hp["num_hidden_layers"], hp["num_attention_heads"]
    n_kv = hp.get("num_key_value_heads") or n_heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(n_layers)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base((hp.get("rope_parameters") or {}).get("rope_theta", hp.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("head_dim"):
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(V)])
    w.add_token_scores([0.0] * V)
    # t0 pad, t1 bos, t2 eos: control; t3 unknown; the rest normal
    w.add_token_types([3, 3, 3, 2] + [1] * (V - 4))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layers)
    for hf_name, a in tensors.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"llama.cpp's {arch} has no tensor for {hf_name}"
        if permuted_qk and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            a = permute_qk(a, n_heads if "q_proj" in hf_name else n_kv)
        w.add_tensor(name, np.ascontiguousarray(a, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)


def logits(loaded, tokens=None) -> np.ndarray:
    """Float32 logits [1, T, V] of a ``checkpoint.load`` result over ``tokens`` (default:
    family_testing's first prompt), through its family's forward pass without a cache."""
    import jax.numpy as jnp

    from jaxinfer.models.registry import model_family
    from tests.family_testing import PROMPTS

    cfg, mod = loaded.cfg, model_family(loaded.cfg.family)
    tokens = jnp.asarray([PROMPTS[0] if tokens is None else tokens], jnp.int32)
    h, _ = mod.forward(loaded.weights, tokens, jnp.zeros(1, jnp.int32), None, cfg=cfg)
    return np.asarray(mod.unembed(loaded.weights, h, cfg))


def same_model(gguf_path: Path, hf_dir: Path, *, atol: float = 1e-5):
    """The GGUF and the HF checkpoint load to the same config (up to its name, and the norm
    epsilon GGUF keeps in float32) and give the same logits; returns the GGUF's load."""
    import dataclasses

    from jaxinfer.loaders import checkpoint

    a, b = checkpoint.load(gguf_path, dtype="float32"), checkpoint.load(hf_dir, dtype="float32")
    assert a.cfg.norm_eps == np.float32(b.cfg.norm_eps)
    assert dataclasses.replace(a.cfg, name="", norm_eps=b.cfg.norm_eps) == dataclasses.replace(b.cfg, name="")
    want = logits(b)
    assert np.abs(want).max() > 0.5  # not comparing near-zero numbers
    np.testing.assert_allclose(logits(a), want, rtol=0, atol=atol)
    return a


def int8_loads(path: Path, *, atol: float = 1e-4):
    """``quantize="int8"`` loads the checkpoint: every matmul weight int8 and within half a
    step of its float value, every norm float, and logits equal to those of the float model
    with each matmul weight replaced by its dequantized value. Returns the int8 load."""
    import dataclasses

    import jax

    from jaxinfer import quant
    from jaxinfer.loaders import checkpoint

    f = checkpoint.load(path, dtype="float32")
    q = checkpoint.load(path, dtype="float32", quantize=quant.quant_config("int8"))
    assert all(isinstance(w, quant.QuantArray) for n, w in q.weights["layers"][0].items() if n.startswith("w"))
    assert all(isinstance(w, jax.Array) for n, w in q.weights["layers"][0].items() if n.endswith("norm"))
    is_q = lambda x: isinstance(x, quant.QuantArray)  # noqa: E731
    for a, b in zip(jax.tree.leaves(q.weights, is_leaf=is_q), jax.tree.leaves(f.weights), strict=True):
        if is_q(a):
            step = np.abs(np.asarray(b)).max() / 127
            assert np.abs(np.asarray(a.dequantize()) - np.asarray(b)).max() <= step / 2 + 1e-7
    dequantized = jax.tree.map(lambda a: a.dequantize() if is_q(a) else a, q.weights, is_leaf=is_q)
    want = logits(dataclasses.replace(f, weights=dequantized))
    np.testing.assert_allclose(logits(q), want, rtol=0, atol=atol)
    return q


def equals_transformers(path: Path, *, atol: float = 1e-4):
    """The HF checkpoint at ``path`` loads to a model whose logits over a prompt equal
    transformers float32's (eager attention): a quick check of one config variant, where
    ``family_testing.check_family`` runs the engine's every path."""
    from jaxinfer.loaders import checkpoint
    from tests.conftest import require
    from tests.family_testing import PROMPTS

    torch, transformers = require("torch"), require("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        want = model(torch.tensor([PROMPTS[0]])).logits.numpy()
    assert np.abs(want).max() > 0.5  # not comparing near-zero numbers
    np.testing.assert_allclose(logits(checkpoint.load(path, dtype="float32")), want, rtol=0, atol=atol)
