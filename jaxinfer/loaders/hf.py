"""Hugging Face checkpoints: a directory with ``config.json`` and safetensors weights.

The weights are one ``model.safetensors`` or several shards listed in
``model.safetensors.index.json``. A shard is a JSON header (each tensor's dtype, shape and
byte range) followed by the raw tensors; each shard is memory-mapped when first needed, and
``assemble`` reads from it only each device's part of each weight, handing the mapped pages
back as it copies them (``StoredTensor.read``), so the host holds about one tensor at a time,
never the checkpoint. Tensors are viewed in their stored dtype (bfloat16 and float8
through ``ml_dtypes``) and cast once, only when the target dtype differs.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import struct
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from jaxinfer.bucket import remote_file
from jaxinfer.errors import CheckpointError
from jaxinfer.loaders.common import (
    Loaded,
    StoredTensor,
    assemble,
    block_reader,
    fused_block,
    fused_blocks,
    make_quantizer,
    read_json,
    refuse_unmapped,
)
from jaxinfer.models.family import TextTower
from jaxinfer.specs import is_spec, weight_key

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors dtype names -> numpy dtypes (little-endian, as the format stores them).
_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
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
    """The model family whose ``hf_architectures`` names this checkpoint's architecture."""
    from jaxinfer.models.registry import family_for_hf

    return family_for_hf(hf, path)


def _check_supported(hf: dict, path, family) -> None:
    """Features of the family's HF configs that our forward pass does not implement."""
    acts = family.hf_activations
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act not in acts:
        raise CheckpointError(f"{path}: unsupported hidden_act {act!r} (supported: {', '.join(sorted(acts))})")
    if hf.get("mlp_bias"):
        raise CheckpointError(f"{path}: unsupported mlp_bias=true")


class SafetensorsShards:
    """Lazy access to the tensors of one safetensors file or an index of shards: each file
    is memory-mapped when first needed and closed with ``stack`` (or, in a directory staged from
    a bucket, read in place by ranges: ``bucket.RemoteFile``)."""

    def __init__(self, path: Path, stack: contextlib.ExitStack):
        self.path = Path(path)
        self._stack = stack
        self._open: dict[str, tuple[mmap.mmap, int, dict]] = {}  # file -> (map, data start, header)
        index = self.path / INDEX_FILE
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no weight_map")
            self.weight_map: dict[str, str] = weight_map
        elif (self.path / SINGLE_FILE).is_file() or remote_file(self.path, SINGLE_FILE) is not None:
            header = self._file(SINGLE_FILE)[2]
            self.weight_map = {name: SINGLE_FILE for name in header if name != "__metadata__"}
        else:
            others = sorted(p.name for pat in ("*.bin", "*.pt*") for p in self.path.glob(pat))
            hint = f" (found {', '.join(others)}: only safetensors are supported)" if others else ""
            raise CheckpointError(f"{self.path}: neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")

    def _file(self, fname: str) -> tuple[mmap.mmap, int, dict]:
        if fname not in self._open:
            fpath = self.path / fname
            buf = remote_file(self.path, fname) if not fpath.is_file() else None  # read in place from a bucket
            if buf is None:
                if not fpath.is_file():
                    raise CheckpointError(f"{fpath}: shard listed in {INDEX_FILE} is missing")
                try:
                    with open(fpath, "rb") as fh:
                        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                except (OSError, ValueError) as e:  # ValueError: mmap refuses an empty file
                    raise CheckpointError(f"{fpath}: not a readable safetensors file ({e})") from None
                self._stack.callback(_close, buf)
            try:
                (n,) = struct.unpack("<Q", buf[:8])
                if 8 + n > len(buf):
                    raise ValueError(f"a header of {n} bytes runs past the end of the file")
                header = json.loads(buf[8 : 8 + n])
                if not isinstance(header, dict):
                    raise ValueError("the header is not a JSON object")
            except (struct.error, ValueError) as e:  # json.JSONDecodeError is a ValueError
                raise CheckpointError(f"{fpath}: not a readable safetensors file ({e})") from None
            self._open[fname] = (buf, 8 + n, header)
        return self._open[fname]

    def tensor(self, name: str) -> StoredTensor | None:
        """The tensor as stored in its file, not read yet; None if the checkpoint lacks it."""
        fname = self.weight_map.get(name)
        if fname is None:
            return None
        fpath = self.path / fname
        buf, data_start, header = self._file(fname)
        info = header.get(name)
        if not isinstance(info, dict):
            raise CheckpointError(f"{fpath}: has no tensor {name!r} (listed in {INDEX_FILE})")
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{fpath}: tensor {name!r} has an unreadable or unsupported header "
                                  f"entry {info}") from None
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise CheckpointError(f"{fpath}: tensor {name!r} has {end - begin} bytes for shape {shape}")
        if data_start + end > len(buf):
            raise CheckpointError(f"{fpath}: truncated inside tensor {name!r}")
        return StoredTensor(buf, data_start + begin, shape, dtype)

    def get(self, name: str) -> np.ndarray | None:
        """The whole tensor in its stored dtype (bfloat16 etc. via ml_dtypes), or None if absent."""
        t = self.tensor(name)
        return None if t is None else t.read(tuple(slice(None) for _ in t.shape), t.dtype)


def _close(buf: mmap.mmap) -> None:
    try:
        buf.close()
    except BufferError:  # an error unwinding a load still holds a view: the map goes with it
        pass


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


# A name with this in it (``{{e}}`` in a family's checkpoint_names, once the layer is filled
# in) stands for one tensor per expert, stacked on the weight's "expert" axis when read.
EXPERT = "{e}"


def _declared_shapes(specs, cfg, names: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> our declared shape (per-expert names -> one expert's shape, and
    the stacked template name -> the whole weight's)."""
    out = {}

    def visit(path, spec):
        key, layer = weight_key(path)
        if key in names:
            name = names[key][0].format(i=layer)
            out[name] = spec.shape
            if EXPERT in name:
                axis = spec.axes.index("expert")
                one = spec.shape[:axis] + spec.shape[axis + 1:]
                out.update({name.format(e=e): one for e in range(spec.shape[axis])})

    jax.tree_util.tree_map_with_path(visit, specs, is_leaf=is_spec)
    return out


def load_hf(path, *, dtype: str, shardings_fn=None, quantize=None, on_config=None) -> Loaded:
    """Load a Hugging Face directory (config.json + safetensors + tokenizer files)."""
    path = Path(path)
    hf = read_config(path)
    family = family_for(hf, path)
    with contextlib.ExitStack() as stack:
        opened: list[SafetensorsShards] = []

        def shards() -> SafetensorsShards:  # opened once, when first needed (config errors come first)
            if not opened:
                opened.append(SafetensorsShards(path, stack))
            return opened[0]

        hf, names, tower = _text_tower(hf, path, family, shards)
        return _load(path, hf, family, names, tower, shards, dtype=dtype, shardings_fn=shardings_fn,
                     quantize=quantize, on_config=on_config)


def _load(path: Path, hf: dict, family, names, tower, open_shards, *, dtype, shardings_fn, quantize, on_config) -> Loaded:
    from jaxinfer.tokenizer import tokenizer_from_hf_dir

    lm_head = "lm_head.weight" if tower is None else tower.lm_head
    _check_supported(hf, path, family)
    try:
        cfg = family.config_from_hf(hf, dtype=dtype)
    except KeyError as e:
        raise CheckpointError(f"{path / 'config.json'}: missing key {e}") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None
    specs = family.weight_specs(cfg)
    declared = _declared_shapes(specs, cfg, names)
    # per-expert names: the template name -> (experts, the axis they stack on)
    stacked = {}
    for path_, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]:
        key, layer = weight_key(path_)
        name = names[key][0].format(i=layer) if key in names else ""
        if EXPERT in name:
            axis = spec.axes.index("expert")
            stacked[name] = (spec.shape[axis], axis)

    shards = open_shards()
    # tensors the family's model does not run (DeepSeek-V3's multi-token-prediction layers)
    skipped = family.hf_skipped_prefixes(hf)
    present = [n for n in shards.weight_map if not n.endswith(_DERIVED_SUFFIXES) and not n.startswith(skipped)
               and not (cfg.tie_embeddings and n == lm_head)
               and (tower is None or n.startswith(tower.prefix) or n == lm_head)]
    # a family that stores some weights otherwise (gpt-oss: fused columns, MXFP4) names the
    # tensors each of its names is read from (``hf_sources``) and reads them (``hf_read``)
    derived = family.hf_read
    sources = family.hf_sources or (lambda n: (n,))
    refuse_unmapped(path, present, {s for n in declared for s in sources(fused_block(n)[0])},
                    "the safetensors carry")
    read = block_reader(fused_blocks(specs, names, 0), shards.get)

    def check_fits(name, shape, transpose):
        """shape: as stored; a transposed read swaps its last two axes (stacked experts
        keep their leading axis)."""
        ours = tuple(shape[:-2]) + tuple(reversed(shape[-2:])) if transpose else tuple(shape)
        want = declared.get(name)
        if want is not None and not _merges_to(ours, tuple(want)):
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {tuple(shape)}, which does not fit the "
                f"declared {tuple(want)}{' (transposed)' if transpose else ''} for this config.json"
            )

    def read_one(name, transpose):
        a = derived(name, shards.get) if derived is not None else read(name)[1]
        if a is None:
            return None
        check_fits(name, a.shape, transpose)
        return np.swapaxes(a, -1, -2) if transpose and a.ndim > 1 else a

    def fetch(name, transpose):
        if name in stacked:  # one tensor per expert, stacked (each checked against one expert's shape)
            n, axis = stacked[name]
            parts = [read_one(name.format(e=e), transpose) for e in range(n)]
            return None if any(p is None for p in parts) else np.stack(parts, axis=axis)
        return read_one(name, transpose)

    def view(name, transpose):
        t = shards.tensor(name)  # None for stacked experts and fused blocks: fetch reads those
        if t is not None:
            check_fits(name, t.shape, transpose)
        return t

    shardings = shardings_fn(specs, cfg) if shardings_fn else None
    if on_config is not None:  # the config is known before any tensor is read
        on_config(cfg)
    tok = tokenizer_from_hf_dir(path)
    quantizer = make_quantizer(quantize, specs, cfg, tok)
    weights = assemble(specs, cfg, names, fetch, 0, shardings=shardings, quantizer=quantizer, view=view)
    return Loaded(cfg, weights, tok, "hf")


def image_encoder_of(path):
    """(the family's ``ImageEncoder``, config.json) of a checkpoint, or (None, its
    config.json) when its family encodes no images of its architecture."""
    path = Path(path)
    hf = read_config(path)
    family = family_for(hf, path)
    archs = hf.get("architectures") or []
    archs = [archs] if isinstance(archs, str) else archs
    return next((family.image_encoders[a] for a in archs if a in family.image_encoders), None), hf


def load_image_encoder(path, *, dtype: str):
    """(config, weights) of the image encoder of a multimodal checkpoint: its weights declared
    by the encoder's ``weight_specs`` and named by its ``checkpoint_names``, each checked
    against its declaration and read as the text weights are."""
    path = Path(path)
    encoder, hf = image_encoder_of(path)
    if encoder is None:
        raise CheckpointError(f"{path}: the checkpoint has no image encoder that jaxinfer runs")
    try:
        cfg = encoder.config_from_hf(hf, dtype=dtype)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None
    specs = encoder.weight_specs(cfg)
    with contextlib.ExitStack() as stack:
        shards = SafetensorsShards(path, stack)
        try:
            names = encoder.checkpoint_names(shards.weight_map)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
        declared = _declared_shapes(specs, cfg, names)

        def fetch(name, transpose):
            a = shards.get(name)
            if a is None:
                return None
            ours = tuple(a.shape[:-2]) + tuple(reversed(a.shape[-2:])) if transpose else tuple(a.shape)
            if not _merges_to(ours, tuple(declared[name])):
                raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(a.shape)}, which does not fit the "
                                      f"declared {tuple(declared[name])} for this config.json")
            return np.swapaxes(a, -1, -2) if transpose and a.ndim > 1 else a

        return cfg, assemble(specs, cfg, names, fetch, 0)


def _text_tower(hf: dict, path, family, shards) -> tuple[dict, dict, TextTower | None]:
    """(config, checkpoint names, text tower layout) of the text decoder in the checkpoint. A
    multimodal architecture the family lists in ``hf_text_towers`` keeps it under a prefix
    ("language_model.model.") with its config in ``text_config`` (or, in older Qwen2.5-VL
    configs, beside the vision tower's ``vision_config``); of its layouts, the one whose
    embedding the checkpoint (``shards()``) holds is read, and the other towers'
    tensors are left unread. Otherwise: the config as it is, the family's names, no tower."""
    archs = hf.get("architectures") or []
    archs = [archs] if isinstance(archs, str) else archs
    towers = family.hf_text_towers
    arch = next((a for a in archs if a in towers), None)
    if arch is None:
        return hf, family.checkpoint_names, None
    text = hf.get("text_config")
    if text is None and "vision_config" in hf:  # the text decoder's keys at the top level
        text = {k: v for k, v in hf.items() if k != "vision_config"}
    if not isinstance(text, dict):
        raise CheckpointError(f"{path / 'config.json'}: {arch} without a text_config")

    def named(tower: TextTower) -> dict:
        return {key: (tower.prefix + name[len("model."):] if name.startswith("model.")
                      else tower.lm_head if name == "lm_head.weight" else name, *rest)
                for key, (name, *rest) in family.checkpoint_names.items()}

    stored = shards().weight_map
    tower = next((t for t in towers[arch] if t.prefix + "embed_tokens.weight" in stored), None)
    if tower is None:
        where = " or ".join(repr(t.prefix) for t in towers[arch])
        raise CheckpointError(f"{path}: {arch} checkpoint without its text decoder's tensors (under {where})")
    # the outer config decides whether the LM head is the text tower's embedding
    tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    return dict(text, architectures=archs, tie_word_embeddings=tie), named(tower), tower
