"""Hugging Face checkpoints: a directory with ``config.json`` and safetensors weights.

The weights are one ``model.safetensors`` or several shards listed in
``model.safetensors.index.json``. Shards are opened lazily with ``safetensors.safe_open``
(memory-mapped) and read one tensor at a time as ``assemble`` asks for it, so at most one
stacked weight plus one source tensor is in host memory at once.

numpy has no bfloat16 or float8, and ``safe_open(framework="numpy")`` refuses those
tensors; they are read as raw bytes from the offsets in the file's header and viewed with
the ``ml_dtypes`` types.
"""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxinfer.errors import CheckpointError
from jaxinfer.loaders.common import Loaded, assemble, make_quantizer, read_json, refuse_unmapped
from jaxinfer.specs import is_spec, weight_key

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors dtypes numpy cannot hold natively, read as raw bytes.
_RAW_DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
# Tensors some checkpoints carry beside the weights that carry nothing config.json does not:
# rotary buffers older transformers saved, and the lm_head copy of a tied embedding.
_DERIVED_SUFFIXES = (".rotary_emb.inv_freq",)
_HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def read_config(path: Path) -> dict:
    """``config.json`` of a Hugging Face directory, as a dict (CheckpointError if unusable)."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{path}: no config.json (not a Hugging Face checkpoint directory)")
    hf = read_json(cfg_path)
    if not isinstance(hf, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object, got {type(hf).__name__}")
    return hf


def saved_dtype(hf: dict) -> str:
    """The dtype the checkpoint was saved in (``torch_dtype``, or ``dtype`` since
    transformers 5), float32 when absent or unusual."""
    return _HF_DTYPES.get(str(hf.get("torch_dtype") or hf.get("dtype") or ""), "float32")


def family_for(hf: dict, path):
    """The model family module whose HF_ARCHITECTURES names this checkpoint's architecture."""
    from jaxinfer.config import Family
    from jaxinfer.models.registry import family_module

    archs = hf.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    supported: set[str] = set()
    for fam in Family:
        try:
            mod = family_module(fam)
        except (ImportError, KeyError):
            continue
        names = set(getattr(mod, "HF_ARCHITECTURES", ()))
        supported |= names
        if names & set(archs):
            return mod
        # Configs without "architectures" still carry model_type ("llama", "qwen2", ...).
        if not archs and hf.get("model_type") in getattr(mod, "GGUF_ARCHITECTURES", ()):
            return mod
    what = f"architecture {', '.join(map(str, archs))}" if archs else f"model_type {hf.get('model_type')!r}"
    raise CheckpointError(
        f"{path}: unsupported {what} in config.json (supported: {', '.join(sorted(supported))})"
    )


def _check_supported(hf: dict, path, mod) -> None:
    """Features of the family's HF configs that our forward pass does not implement."""
    acts = getattr(mod, "HF_ACTIVATIONS", ("silu",))
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act not in acts:
        raise CheckpointError(f"{path}: unsupported hidden_act {act!r} (supported: {', '.join(sorted(acts))})")
    if hf.get("mlp_bias"):
        raise CheckpointError(f"{path}: unsupported mlp_bias=true")


class SafetensorsShards:
    """Lazy access to the tensors of one safetensors file or an index of shards."""

    def __init__(self, path: Path, stack: contextlib.ExitStack):
        self.path = Path(path)
        self._stack = stack
        self._open: dict[str, object] = {}
        self._headers: dict[str, tuple[int, dict]] = {}
        index = self.path / INDEX_FILE
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no weight_map")
            self.weight_map: dict[str, str] = weight_map
        elif (self.path / SINGLE_FILE).is_file():
            self.weight_map = {name: SINGLE_FILE for name in self._file(SINGLE_FILE).keys()}
        else:
            others = sorted(p.name for pat in ("*.bin", "*.pt*") for p in self.path.glob(pat))
            hint = f" (found {', '.join(others)}: only safetensors are supported)" if others else ""
            raise CheckpointError(f"{self.path}: neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")

    def _file(self, fname: str):
        if fname not in self._open:
            fpath = self.path / fname
            if not fpath.is_file():
                raise CheckpointError(f"{fpath}: shard listed in {INDEX_FILE} is missing")
            try:
                self._open[fname] = self._stack.enter_context(safe_open(str(fpath), framework="numpy"))
            except Exception as e:  # safetensors raises its own error types for a bad header
                raise CheckpointError(f"{fpath}: not a readable safetensors file ({e})") from None
        return self._open[fname]

    def get(self, name: str) -> np.ndarray | None:
        """The tensor in its stored dtype (bfloat16 etc. via ml_dtypes), or None if absent."""
        fname = self.weight_map.get(name)
        if fname is None:
            return None
        f = self._file(fname)
        try:
            dtype = f.get_slice(name).get_dtype()
        except Exception:
            raise CheckpointError(
                f"{self.path / fname}: has no tensor {name!r} (listed in {INDEX_FILE})"
            ) from None
        if dtype in _RAW_DTYPES:
            return self._raw(fname, name, _RAW_DTYPES[dtype])
        try:
            return f.get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{self.path / fname}: cannot read tensor {name!r} ({e})") from None

    def _raw(self, fname: str, name: str, dtype: np.dtype) -> np.ndarray:
        fpath = self.path / fname
        if fname not in self._headers:
            with open(fpath, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                self._headers[fname] = (8 + n, json.loads(fh.read(n)))
        data_start, header = self._headers[fname]
        info = header[name]
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise CheckpointError(f"{fpath}: tensor {name!r} has {end - begin} bytes for shape {shape}")
        a = np.fromfile(fpath, dtype=np.uint8, count=end - begin, offset=data_start + begin)
        if a.size != end - begin:
            raise CheckpointError(f"{fpath}: truncated inside tensor {name!r}")
        return a.view(dtype).reshape(shape)


def _merges_to(shape: tuple[int, ...], declared: tuple[int, ...]) -> bool:
    """Whether ``shape`` is ``declared`` with runs of adjacent dimensions merged, e.g.
    (D, N*H) for (D, N, H). A plain size check would accept a transposed square-free
    matrix such as (F, D) for (D, F)."""
    shape = tuple(d for d in shape if d != 1)  # size-1 dims merge with anything
    declared = tuple(d for d in declared if d != 1)
    i = 0
    for dim in shape:
        prod = 1
        start = i
        while i < len(declared) and (prod < dim or i == start):
            prod *= declared[i]
            i += 1
        if prod != dim:
            return False
    return i == len(declared)


def _declared_shapes(specs, cfg, names: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> our declared shape."""
    import jax

    out = {}

    def visit(path, spec):
        key, layer = weight_key(path)
        if key in names:
            out[names[key][0].format(i=layer)] = spec.shape

    jax.tree_util.tree_map_with_path(visit, specs, is_leaf=is_spec)
    return out


def load_hf(path, *, dtype: str, shardings_fn=None, quantize=None, on_config=None) -> Loaded:
    """Load a Hugging Face directory (config.json + safetensors + tokenizer files)."""
    from jaxinfer.tokenizer import tokenizer_from_hf_dir

    path = Path(path)
    hf = read_config(path)
    mod = family_for(hf, path)
    hf, names, prefix = _text_tower(hf, path, mod)
    _check_supported(hf, path, mod)
    try:
        cfg = mod.config_from_hf(hf, dtype=dtype)
    except KeyError as e:
        raise CheckpointError(f"{path / 'config.json'}: missing key {e}") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None
    specs = mod.weight_specs(cfg)
    declared = _declared_shapes(specs, cfg, names)

    with contextlib.ExitStack() as stack:
        shards = SafetensorsShards(path, stack)
        present = [n for n in shards.weight_map if not n.endswith(_DERIVED_SUFFIXES)
                   and not (cfg.tie_embeddings and n == "lm_head.weight")
                   and (prefix is None or n.startswith(prefix) or n == "lm_head.weight")]
        refuse_unmapped(path, present, set(declared), "the safetensors carry")

        def fetch(name, transpose):
            a = shards.get(name)
            if a is None:
                return None
            a = a.T if transpose else a
            want = declared.get(name)
            if want is not None and not _merges_to(tuple(a.shape), tuple(want)):
                stored = tuple(reversed(a.shape)) if transpose else tuple(a.shape)
                raise CheckpointError(
                    f"{path}: tensor {name!r} has shape {stored}, which does not fit the "
                    f"declared {tuple(want)}{' (transposed)' if transpose else ''} for this config.json"
                )
            return a

        shardings = shardings_fn(specs, cfg) if shardings_fn else None
        if on_config is not None:  # the config is known before any tensor is read
            on_config(cfg)
        tok = tokenizer_from_hf_dir(path)
        quantizer = make_quantizer(quantize, specs, cfg, tok)
        weights = assemble(specs, cfg, names, fetch, 0, shardings=shardings, quantizer=quantizer)
    return Loaded(cfg, weights, tok, "hf")


def _text_tower(hf: dict, path, mod) -> tuple[dict, dict, str | None]:
    """(config, checkpoint names, tensor prefix) of the text decoder in the checkpoint. A
    multimodal architecture the family lists in ``HF_TEXT_TOWERS`` keeps it under a prefix
    ("model.language_model.") with its config in ``text_config``; the other towers' tensors
    are left unread. Otherwise: the config as it is, the family's names, no prefix."""
    archs = hf.get("architectures") or []
    archs = [archs] if isinstance(archs, str) else archs
    towers = getattr(mod, "HF_TEXT_TOWERS", {})
    arch = next((a for a in archs if a in towers), None)
    if arch is None:
        return hf, mod.CHECKPOINT_NAMES, None
    prefix, text = towers[arch], hf.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{path / 'config.json'}: {arch} without a text_config")
    names = {key: (name.replace("model.", prefix, 1) if name.startswith("model.") else name, *rest)
             for key, (name, *rest) in mod.CHECKPOINT_NAMES.items()}
    # the outer config decides whether the LM head is the text tower's embedding
    tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    return dict(text, architectures=archs, tie_word_embeddings=tie), names, prefix
