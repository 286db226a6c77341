"""Write tiny random GGUF checkpoints that carry a real tokenizer (SmolLM2's vocabulary).

They exercise the whole GGUF -> LLM path in seconds, and make bad-input cases (an unknown
architecture, an unsupported quant type) without touching the real files.
"""

from __future__ import annotations

import gguf
import numpy as np

from jaxinfer.loaders.gguf import read_metadata

TOKENIZER_KEYS = (
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
)


def write_tiny_llama(path, source_gguf, *, arch: str = "llama", layers: int = 2, d: int = 32,
                     heads: int = 4, kv_heads: int = 2, ff: int = 64, context: int = 256,
                     raw_types: dict | None = None, seed: int = 0) -> None:
    """A random Llama-architecture GGUF with the tokenizer of ``source_gguf``.

    raw_types: tensor name -> (uint8 bytes, GGMLQuantizationType) to store instead.
    """
    meta = read_metadata(source_gguf)
    vocab = len(meta["tokenizer.ggml.tokens"])
    hd = d // heads
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", layers)
    w.add_uint32(f"{arch}.context_length", context)
    w.add_uint32(f"{arch}.embedding_length", d)
    w.add_uint32(f"{arch}.feed_forward_length", ff)
    w.add_uint32(f"{arch}.attention.head_count", heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", kv_heads)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    for k in TOKENIZER_KEYS:
        if k not in meta:
            continue
        v = meta[k]
        if isinstance(v, list):
            w.add_array(k, v)
        elif isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        else:
            w.add_string(k, v)
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (d,), f"blk.{i}.ffn_norm.weight": (d,),
            f"blk.{i}.attn_q.weight": (heads * hd, d), f"blk.{i}.attn_k.weight": (kv_heads * hd, d),
            f"blk.{i}.attn_v.weight": (kv_heads * hd, d), f"blk.{i}.attn_output.weight": (d, heads * hd),
            f"blk.{i}.ffn_gate.weight": (ff, d), f"blk.{i}.ffn_up.weight": (ff, d), f"blk.{i}.ffn_down.weight": (d, ff),
        }
    raw_types = raw_types or {}
    for name, shape in shapes.items():
        if name in raw_types:
            data, qtype = raw_types[name]
            w.add_tensor(name, data, raw_dtype=qtype)
        elif len(shape) == 1:
            w.add_tensor(name, np.ones(shape, np.float32))
        else:
            w.add_tensor(name, (0.2 * rng.standard_normal(shape)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
