"""Load any supported checkpoint into (ModelConfig, weights pytree, Tokenizer): ``load``
dispatches on the format; GGUF files are assembled here, the others in ``hf`` / ``orbax_io``.

A path may be a ``.gguf`` file, a Hugging Face directory (``config.json`` + safetensors) or
an Orbax directory written by ``jaxinfer convert``. Weights are laid out per the family's one
declaration (``weight_specs``): each tensor is read, reshaped to its declared shape, cast
once to the target dtype and put on device (optionally with a sharding derived from the
logical axes, each device receiving only its part; see ``common.assemble``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxinfer.loaders import hf, orbax_io
from jaxinfer.loaders.common import (  # noqa: F401 (Loaded, read_json, assemble: re-exported)
    Loaded,
    StoredTensor,
    assemble,
    block_reader,
    checkpoint_names,
    detect_format,
    fused_blocks,
    make_quantizer,
    read_json,
    refuse_unmapped,
)
from jaxinfer.models.registry import family_for_gguf


# ----------------------------------------------------------------------------- GGUF
def load_gguf(path: Path, *, dtype: str, shardings_fn=None, quantize=None, on_config=None) -> Loaded:
    from jaxinfer.loaders.gguf import GGUFCheckpoint, unpermute_llama_qk
    from jaxinfer.tokenizer import tokenizer_from_gguf

    ck = GGUFCheckpoint(path)
    arch = ck.architecture
    family = family_for_gguf(arch, path, ck.metadata)
    cfg = family.config_from_gguf(ck.metadata, ck.tensors, dtype=dtype, load_tensor=ck.load)
    specs = family.weight_specs(cfg)
    expected = checkpoint_names(specs, family.checkpoint_names, 1) | set(family.gguf_config_tensors)
    refuse_unmapped(path, ck.tensors, expected, "GGUF carries")
    permuted = arch in family.gguf_permuted_qk
    # A family whose llama.cpp converter rewrote tensors says how to undo it (Gemma's norms).
    undo = family.gguf_tensor
    read = block_reader(fused_blocks(specs, family.checkpoint_names, 1),
                        lambda name: ck.load(name) if name in ck.tensors else None)

    def qk_permuted(name):
        return permuted and (name.endswith("attn_q.weight") or name.endswith("attn_k.weight"))

    def fetch(name, transpose):
        name, a = read(name)
        if a is None:
            return None
        if qk_permuted(name):
            heads = cfg.n_heads if "attn_q" in name else cfg.n_kv_heads
            a = unpermute_llama_qk(a, heads)
        if undo is not None:
            a = undo(name, a)
        # torch's [out, in] on the last two axes (stacked experts keep their leading axis)
        return np.swapaxes(a, -1, -2) if transpose and a.ndim > 1 else a

    def view(name, transpose):
        """Float tensors that need no rewriting are read per device part straight from the
        file, in their stored dtype; block-quantized ones are dequantized whole by fetch."""
        if name not in ck.tensors or not ck.is_float(name) or undo is not None or qk_permuted(name):
            return None
        info = ck.tensors[name]
        return StoredTensor(ck.mapping, info.offset, info.shape, ck.raw(name).dtype)

    shardings = shardings_fn(specs, cfg) if shardings_fn else None
    if on_config is not None:  # the config is known before any tensor is read
        on_config(cfg)
    tok = tokenizer_from_gguf(ck.metadata)
    quantizer = make_quantizer(quantize, specs, cfg, tok)
    weights = assemble(specs, cfg, family.checkpoint_names, fetch, 1, shardings=shardings, quantizer=quantizer,
                       view=view)
    return Loaded(cfg, weights, tok, "gguf")


def load(path, *, dtype: str, shardings_fn=None, quantize=None, on_config=None) -> Loaded:
    """quantize: a ``quant.QuantConfig`` (or None): quantize the matmul weights while
    loading, weight by weight (see ``loaders.quantize``). on_config: called with the
    ModelConfig once it is known, before any tensor is read (so a caller can start work that
    needs only the model's shape, such as zero-filling the KV page pools, beside the read)."""
    path = Path(path)
    fmt = detect_format(path)
    if fmt == "gguf":
        return load_gguf(path, dtype=dtype, shardings_fn=shardings_fn, quantize=quantize, on_config=on_config)
    if fmt == "hf":
        return hf.load_hf(path, dtype=dtype, shardings_fn=shardings_fn, quantize=quantize, on_config=on_config)
    return orbax_io.load_orbax(path, dtype=dtype, shardings_fn=shardings_fn, quantize=quantize,
                                on_config=on_config)
