"""Orbax checkpoints written by ``jaxinfer convert``: reloads straight into any sharding.

Layout of a converted directory::

    jaxinfer.json                 format version, the ModelConfig, how to rebuild the tokenizer
    weights/                      the weights pytree, one Orbax (OCDBT) checkpoint
    tokenizer_gguf_meta.json      GGUF source: its tokenizer.* and general.architecture keys
    tokenizer/                    HF source: tokenizer.json / tokenizer.model / *_config.json

Loading restores every array straight into its target sharding (the restore target is a
tree of ``jax.ShapeDtypeStruct`` carrying shardings), casting on the way when the requested
dtype differs from the saved one, so no array passes through one host or device first.

Quantized checkpoints (``jaxinfer convert --quantization``) hold each quantized weight as its
QuantArray leaves (``values``, ``scale``, ``smooth``); its static layout (float shape,
contracted axes, scheme, int4 group, whether it is smoothed) is in ``jaxinfer.json`` under
"quantization", from which the restore target is rebuilt. Quantizing a float Orbax
checkpoint while loading restores the float tree in one call first (Orbax restores a list
of layers only whole), so its peak is the float model's; convert once with ``--quantization``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import secrets
import shutil
import types
import typing
from pathlib import Path

import jax

from jaxinfer import quant
from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError, InvalidRequest
from jaxinfer.loaders.common import Loaded, make_quantizer, place, read_json
from jaxinfer.loaders.quantize import weight_name
from jaxinfer.models.registry import model_family
from jaxinfer.sharding import quant_shardings
from jaxinfer.specs import is_spec, spec_dtype, weight_key

FORMAT = "jaxinfer-orbax"
VERSION = 1
META_FILE = "jaxinfer.json"
WEIGHTS_DIR = "weights"
GGUF_TOKENIZER_FILE = "tokenizer_gguf_meta.json"
HF_TOKENIZER_DIR = "tokenizer"
# Files of a Hugging Face directory that tokenizer_from_hf_dir may read (config.json for
# bos/eos ids some tokenizers leave out of their own files).
HF_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "generation_config.json", "chat_template.jinja", "chat_template.json",
    "config.json",
)


# ----------------------------------------------------------------------------- config <-> JSON
def config_to_dict(cfg) -> dict:
    """A frozen config dataclass as plain JSON values (enums by value, nested dataclasses
    as dicts, tuples as lists)."""

    def plain(v):
        if isinstance(v, enum.Enum):
            return v.value
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        return v

    return plain(cfg)


def config_from_dict(d: dict, cls=ModelConfig):
    """Inverse of ``config_to_dict``; field types come from the dataclass annotations (those
    of ``family_config`` from its family's ``config_class``)."""
    if cls is ModelConfig:
        d = _with_family_config(d)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise CheckpointError(
            f"config has fields {sorted(unknown)} unknown to {cls.__name__} (written by a newer jaxinfer?)"
        )
    return cls(**{k: _typed(v, hints[k]) for k, v in d.items()})


def _with_family_config(d: dict) -> dict:
    """``d`` with its family's own knobs as that family's config object. A config written
    when those knobs were fields of ModelConfig itself holds them at the top level: they move
    into the family config."""
    config_class = model_family(d.get("family", "")).config_class if "family" in d else None
    if config_class is None:
        return d
    own = {f.name for f in dataclasses.fields(config_class)}
    inner = dict(d.get("family_config") or {}) | {k: v for k, v in d.items() if k in own}
    rest = {k: v for k, v in d.items() if k not in own}
    return rest | {"family_config": config_from_dict(inner, config_class)}


def _typed(v, tp):
    if v is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _typed(v, args[0]) if len(args) == 1 else v
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_typed(x, args[0]) for x in v)
        return tuple(_typed(x, a) for x, a in zip(v, args)) if args else tuple(v)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(v)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return v if dataclasses.is_dataclass(v) else config_from_dict(v, tp)
    if tp is float and isinstance(v, int):
        return float(v)
    return v


# ----------------------------------------------------------------------------- save / convert
def save(dest, cfg: ModelConfig, weights: dict, tokenizer_source) -> Path:
    """Write an Orbax checkpoint of ``weights`` plus ``jaxinfer.json`` and the tokenizer.

    tokenizer_source: a ``.gguf`` file (its tokenizer metadata is kept), a Hugging Face or
    converted directory (its tokenizer files are copied), a dict of GGUF metadata, or None.
    The directory appears whole or not at all: it is written beside ``dest`` and renamed.
    """
    import orbax.checkpoint as ocp

    dest = Path(dest).absolute()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise CheckpointError(f"{dest}: already exists; remove it or choose another destination")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir()  # not tempfile.mkdtemp: its 0700 mode would stay on the renamed result
    try:
        tok_kind = _save_tokenizer(tmp, tokenizer_source)
        with _quiet(), ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp / WEIGHTS_DIR, quant.io_layout(weights))
            ckptr.wait_until_finished()
        meta = {"format": FORMAT, "version": VERSION, "config": config_to_dict(cfg), "tokenizer": tok_kind}
        layouts = quantized_layouts(weights)
        if layouts:
            meta["quantization"] = {"scheme": quant.model_scheme(weights).value, "weights": layouts}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if dest.exists():
            dest.rmdir()  # empty (checked above)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _is_quant(x) -> bool:
    return isinstance(x, quant.QuantArray)


def quantized_layouts(weights) -> dict:
    """{"layers/3/wo": QuantArray layout, ...} for every quantized weight (JSON values)."""
    leaves = jax.tree_util.tree_flatten_with_path(weights, is_leaf=_is_quant)[0]
    return {weight_name(*weight_key(path)): quant.describe(x) for path, x in leaves if _is_quant(x)}


def _save_tokenizer(dest: Path, source) -> str | None:
    if source is None:
        return None
    if isinstance(source, dict):
        _write_gguf_meta(dest, source)
        return "gguf"
    source = Path(source)
    if source.is_file():
        from jaxinfer.loaders.gguf import GGUFCheckpoint

        _write_gguf_meta(dest, GGUFCheckpoint(source).metadata)
        return "gguf"
    if (source / GGUF_TOKENIZER_FILE).is_file():  # a converted checkpoint
        shutil.copy2(source / GGUF_TOKENIZER_FILE, dest / GGUF_TOKENIZER_FILE)
        return "gguf"
    src_dir = source / HF_TOKENIZER_DIR if (source / META_FILE).is_file() else source
    files = [src_dir / f for f in HF_TOKENIZER_FILES if (src_dir / f).is_file()]
    if not any(f.name in ("tokenizer.json", "tokenizer.model") for f in files):
        raise CheckpointError(f"{source}: no tokenizer.json or tokenizer.model to copy")
    (dest / HF_TOKENIZER_DIR).mkdir()
    for f in files:
        shutil.copy2(f, dest / HF_TOKENIZER_DIR / f.name)
    return "hf"


def _write_gguf_meta(dest: Path, metadata: dict) -> None:
    keep = {k: v for k, v in metadata.items() if k.startswith("tokenizer.") or k == "general.architecture"}
    (dest / GGUF_TOKENIZER_FILE).write_text(json.dumps(keep, ensure_ascii=True))


# ----------------------------------------------------------------------------- load
def _read_meta(path: Path) -> dict:
    meta = read_json(path / META_FILE)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "config" not in meta:
        raise CheckpointError(f"{path / META_FILE}: not a jaxinfer Orbax checkpoint description")
    if meta.get("version") != VERSION:
        raise CheckpointError(
            f"{path / META_FILE}: format version {meta.get('version')!r}, this jaxinfer reads {VERSION}"
        )
    return meta


def read_config(path) -> ModelConfig:
    """The ModelConfig stored in a converted checkpoint, in its saved dtype."""
    try:
        return config_from_dict(_read_meta(Path(path))["config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{Path(path) / META_FILE}: bad config ({e})") from None


def load_orbax(path, *, dtype: str | None, shardings_fn=None, quantize=None, on_config=None) -> Loaded:
    """Restore a converted checkpoint, each array directly into its target sharding (from
    ``shardings_fn(specs, cfg)``, else the default device) and dtype (None: as saved; the
    integer parts of quantized weights keep theirs). quantize (a QuantConfig) must match a
    quantized checkpoint's scheme; a float checkpoint is quantized after the restore."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    meta = _read_meta(path)
    cfg = read_config(path)
    if dtype is not None and dtype != cfg.dtype:
        cfg = dataclasses.replace(cfg, dtype=dtype)
    specs = model_family(cfg.family).weight_specs(cfg)
    saved_quant = meta.get("quantization")
    if saved_quant and quantize is not None and (
        quantize.scheme.value != saved_quant.get("scheme")
        or quantize.group not in (None, *(w.get("group") for w in saved_quant["weights"].values()))
    ):
        raise InvalidRequest(
            f"{path} holds {saved_quant.get('scheme')} weights; it cannot be loaded as "
            f"quantization={quantize.scheme.value!r}"
            + (f" with quant_group={quantize.group}" if quantize.group else "")
            + " (load it without quantize, or convert the float source again)"
        )
    shardings = shardings_fn(specs, cfg) if shardings_fn else None
    if on_config is not None:  # the config is known before any tensor is read
        on_config(cfg)
    # this process's own device: on process > 0 of a jax.distributed job jax.devices()[0]
    # belongs to process 0 and cannot take this process's arrays
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    layouts = (saved_quant or {}).get("weights", {})

    if shardings is None:
        shardings = jax.tree.map(lambda _: default, specs, is_leaf=is_spec)

    def target(path_, spec, sharding):
        layout = layouts.get(weight_name(*weight_key(path_)))
        if layout is not None:
            try:
                qa = quant.abstract_quant_array(layout["shape"], layout["contract"], layout["scheme"],
                                                layout.get("group", 0), layout.get("smooth", False), sharding)
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{path / META_FILE}: bad quantization layout ({e!r})") from None
            if isinstance(sharding, jax.sharding.NamedSharding):  # each part split like its float weight
                qa = jax.tree.map(lambda sds, sh: jax.ShapeDtypeStruct(sds.shape, sds.dtype, sharding=sh),
                                  qa, quant_shardings(qa, sharding))
            return qa
        return jax.ShapeDtypeStruct(spec.shape, spec_dtype(spec, cfg), sharding=sharding)

    abstract = jax.tree_util.tree_map_with_path(target, specs, shardings, is_leaf=is_spec)
    wdir = path / WEIGHTS_DIR
    if not wdir.is_dir():
        raise CheckpointError(f"{path}: no {WEIGHTS_DIR}/ directory")
    with _quiet(), ocp.StandardCheckpointer() as ckptr:
        try:
            saved = ckptr.metadata(wdir).item_metadata.tree
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise CheckpointError(f"{wdir}: not a readable Orbax checkpoint ({e})") from None
        # Compare before restoring: a failed restore leaves Orbax's reader coroutines dangling.
        _check_saved(saved, abstract, wdir)
        weights = ckptr.restore(wdir, abstract)
    tok = _load_tokenizer(path, meta.get("tokenizer"))
    if quantize is not None and not saved_quant:
        weights = _quantize_restored(weights, specs, cfg, tok, quantize, shardings if shardings_fn else None)
    return Loaded(cfg, weights, tok, "orbax")


def _quantize_restored(weights, specs, cfg, tok, qcfg, shardings=None):
    """Quantize a restored float tree weight by weight, in checkpoint order (what w8a8's
    layer-by-layer calibration needs), dropping each float weight as it goes; with
    ``shardings`` (the float weights'), each quantized weight is split like its float one."""
    quantizer = make_quantizer(qcfg, specs, cfg, tok)
    spec_leaves, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    shard_leaves = jax.tree.leaves(shardings) if shardings is not None else [None] * len(spec_leaves)
    arrays = treedef.flatten_up_to(weights)
    del weights
    out = [None] * len(arrays)
    for index, (path_, spec) in enumerate(spec_leaves):
        a, arrays[index] = arrays[index], None
        for i, leaf in quantizer.add(index, *weight_key(path_), spec, a):
            out[i] = place(leaf, shard_leaves[i])
        del a
    for i, leaf in quantizer.finish():
        out[i] = place(leaf, shard_leaves[i])
    return jax.tree.unflatten(treedef, out)


def _path_str(path) -> str:
    """A tree path as "['layers'][0]['wo']['values']", whether the node is a dict (Orbax's
    metadata of a saved QuantArray) or the QuantArray itself (its attributes)."""
    return "".join(f"[{getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k)))!r}]" for k in path)


def _check_saved(saved, abstract, wdir: Path) -> None:
    def shapes(tree):
        leaves = jax.tree_util.tree_leaves_with_path(
            tree, is_leaf=lambda x: hasattr(x, "shape") and not _is_quant(x))
        return {_path_str(p): tuple(x.shape) for p, x in leaves}

    have, want = shapes(saved), shapes(abstract)
    problems = [f"{k} missing" for k in want if k not in have]
    problems += [f"{k} unexpected" for k in have if k not in want]
    problems += [f"{k} saved {have[k]}, declared {want[k]}" for k in want if k in have and have[k] != want[k]]
    if problems:
        raise CheckpointError(
            f"{wdir}: weights do not match the config in {META_FILE}: {'; '.join(problems[:4])}"
            + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else "")
        )


def _load_tokenizer(path: Path, kind: str | None):
    if kind is None:
        return None
    from jaxinfer import tokenizer

    if kind == "gguf":
        return tokenizer.tokenizer_from_gguf(read_json(path / GGUF_TOKENIZER_FILE))
    if kind == "hf":
        return tokenizer.tokenizer_from_hf_dir(path / HF_TOKENIZER_DIR)
    raise CheckpointError(f"{path / META_FILE}: unknown tokenizer kind {kind!r}")


class _quiet:
    """Silence Orbax's and absl's INFO chatter for the duration of a save or restore."""

    _names = ("absl", "orbax", "orbax.checkpoint")

    def __enter__(self):
        self._levels = [(lg, lg.level) for lg in map(logging.getLogger, self._names)]
        for lg, _ in self._levels:
            lg.setLevel(max(lg.level, logging.WARNING))
        return self

    def __exit__(self, *exc):
        for lg, level in self._levels:
            lg.setLevel(level)
        return False
