"""Write a GGUF from a tiny transformers checkpoint (``family_testing.write_tiny``) the way
llama.cpp's converter writes one: tensor names from gguf-py's own name map, the family's
metadata keys written by the caller (as the converter's ``set_gguf_parameters`` would), each
tensor changed as the converter changes it (``modify``), and the checkpoint's word-level
vocabulary t0 .. t95 as a SentencePiece-style token list. The GGUF then loads into the same
model as the directory it came from, and the two can be held equal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
from safetensors.numpy import load_file

from tests.family_testing import V


def hf_to_gguf(hf_dir: Path, path: Path, arch: str, keys: Callable[[gguf.GGUFWriter, dict], None], *,
               modify: Callable[[str, np.ndarray], np.ndarray] = lambda name, a: a,
               extra: dict[str, np.ndarray] | None = None, skip: tuple[str, ...] = ()) -> Path:
    """keys(writer, config.json dict) writes the family's metadata; modify(hf name, tensor)
    -> the tensor the converter stores; extra: further tensors by GGUF name (LongRoPE's
    factors); skip: HF tensors the converter drops."""
    hf = json.loads((Path(hf_dir) / "config.json").read_text())
    n_layers = hf["num_hidden_layers"]
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), n_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    keys(w, hf)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(V)])
    w.add_token_scores([0.0] * V)
    w.add_token_types([int(gguf.TokenType.CONTROL) if i < 4 else int(gguf.TokenType.NORMAL) for i in range(V)])
    w.add_bos_token_id(hf["bos_token_id"])
    w.add_eos_token_id(hf["eos_token_id"])
    w.add_pad_token_id(hf["pad_token_id"])
    w.add_unk_token_id(3)
    for name, a in load_file(str(Path(hf_dir) / "model.safetensors")).items():
        if name in skip:
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"gguf-py has no name for {name}"
        w.add_tensor(gguf_name, np.ascontiguousarray(modify(name, a).astype(np.float32)))
    for name, a in (extra or {}).items():
        w.add_tensor(name, np.asarray(a, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
