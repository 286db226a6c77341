"""What every checkpoint format shares: the ``Loaded`` result, format detection, and
``assemble``, which builds a weights pytree from per-tensor reads following the family's
one declaration (``weight_specs``).

``checkpoint`` (the dispatcher and GGUF), ``hf`` and ``orbax_io`` import this module and not
each other; ``convert`` sits above them all.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError
from jaxinfer.specs import is_spec, spec_dtype, weight_key


@dataclasses.dataclass
class Loaded:
    cfg: ModelConfig
    weights: dict
    tokenizer: object  # jaxinfer.tokenizer.Tokenizer
    source: str  # "gguf" | "hf" | "orbax"


def detect_format(path: Path) -> str:
    if path.is_file():
        if path.suffix == ".gguf" or _has_gguf_magic(path):
            return "gguf"
        raise CheckpointError(f"{path}: not a GGUF file (expected a .gguf file or a directory)")
    if path.is_dir():
        if (path / "jaxinfer.json").is_file():
            return "orbax"
        if (path / "config.json").is_file():
            return "hf"
        raise CheckpointError(
            f"{path}: a directory with neither config.json (Hugging Face) nor jaxinfer.json "
            "(Orbax checkpoint written by `jaxinfer convert`)"
        )
    raise CheckpointError(f"{path}: no such file or directory")


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def assemble(
    specs: dict,
    cfg: ModelConfig,
    names: dict,
    fetch: Callable[[str, bool], np.ndarray | None],  # (name, transpose) -> array or None
    which: int,  # 0: HF names, 1: GGUF names
    shardings=None,  # same tree as specs, NamedSharding leaves
    quantizer=None,  # loaders.quantize.WeightQuantizer: quantize each weight as it is read
) -> dict:
    """Build the weights pytree from per-tensor reads, one array per declaration. With a
    quantizer, each float weight goes to it right away and is dropped once quantized, so
    the whole float model never exists."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    shard_leaves = jax.tree.leaves(shardings) if shardings is not None else [None] * len(leaves)
    out = [None] * len(leaves)
    for index, ((path, spec), sharding) in enumerate(zip(leaves, shard_leaves)):
        key, layer = weight_key(path)
        entry = names.get(key)
        if entry is None:
            raise CheckpointError(f"no checkpoint name is known for weight {'/'.join(key)}")
        name = entry[which].format(i=layer)
        a = _fit(_need(fetch(name, entry[2]), name), spec.shape, name).astype(spec_dtype(spec, cfg))
        a = jax.device_put(a, sharding) if sharding is not None else jax.device_put(a)
        if quantizer is None:
            out[index] = a
        else:
            for i, leaf in quantizer.add(index, key, layer, spec, a):
                out[i] = place(leaf, shard_leaves[i])
        del a
    if quantizer is not None:
        for i, leaf in quantizer.finish():
            out[i] = place(leaf, shard_leaves[i])
    return jax.tree.unflatten(treedef, out)


def place(leaf, sharding):
    """A quantizer's output on its weight's devices: a QuantArray's parts split as
    ``sharding.quant_shardings`` derives from the float weight's sharding, a float leaf (a
    norm w8a8 folded a smoothing into) as declared. sharding None: left where it is."""
    if sharding is None:
        return leaf
    from jaxinfer.quant import QuantArray
    from jaxinfer.sharding import quant_shardings

    if isinstance(leaf, QuantArray) and isinstance(sharding, jax.sharding.NamedSharding):
        return jax.device_put(leaf, quant_shardings(leaf, sharding))
    return jax.device_put(leaf, sharding)  # one device: every part goes there


def make_quantizer(quantize, specs, cfg, tokenizer):
    """A WeightQuantizer for ``quantize`` (a QuantConfig), or None; checks up front what
    the scheme cannot do with this model, before any tensor is read. Sharded loading
    quantizes each weight where its float shards are and then places the parts (``place``)."""
    if quantize is None:
        return None
    from jaxinfer.loaders.quantize import WeightQuantizer, check_quantizable

    check_quantizable(specs, cfg, quantize)
    return WeightQuantizer(quantize, cfg=cfg, tokenizer=tokenizer)


def checkpoint_names(specs, names: dict, which: int) -> set[str]:
    """Every tensor name (HF: which=0, GGUF: which=1) that ``assemble`` will read from (a
    fused tensor once, however many blocks of it are named)."""
    out = set()
    for path, _ in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]:
        key, layer = weight_key(path)
        if key in names:
            out.add(fused_block(names[key][which].format(i=layer))[0])
    return out


# ----------------------------------------------------------------------------- fused tensors
# A checkpoint may store several of our weights as one tensor (Phi-3's qkv_proj, gate_up_proj).
# Its CHECKPOINT_NAMES entries then name row blocks: "<tensor>[j]" is block j of <tensor>, the
# blocks stacked along the stored tensor's first axis (torch's output features, a GGUF's rows)
# in index order, each as many rows as its weight declares. The format's fetch reads the block
# (``read_block``) before any transpose; our weights stay separate, so sharding sees each one.
_BLOCK = re.compile(r"^(?P<tensor>.+)\[(?P<block>\d+)\]$")


def fused_block(name: str) -> tuple[str, int | None]:
    """A checkpoint name as (tensor, block): ``"m.qkv_proj.weight[1]"`` -> ``("m.qkv_proj.weight", 1)``,
    a plain name -> ``(name, None)``."""
    m = _BLOCK.match(name)
    return (m["tensor"], int(m["block"])) if m else (name, None)


def fused_blocks(specs, names: dict, which: int) -> dict[str, tuple[int, ...]]:
    """Each fused tensor (HF: which=0, GGUF: which=1) -> the sizes (elements) of its blocks,
    in block order, from the weights the blocks hold."""
    sizes: dict[str, dict[int, int]] = {}
    for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]:
        key, layer = weight_key(path)
        if key in names:
            tensor, block = fused_block(names[key][which].format(i=layer))
            if block is not None:
                sizes.setdefault(tensor, {})[block] = int(np.prod(spec.shape))
    out = {}
    for tensor, by_block in sizes.items():
        if sorted(by_block) != list(range(len(by_block))):
            raise ValueError(f"{tensor}: blocks {sorted(by_block)} are not 0 .. {len(by_block) - 1}")
        out[tensor] = tuple(by_block[j] for j in range(len(by_block)))
    return out


def block_reader(blocks: dict[str, tuple[int, ...]], load: Callable[[str], np.ndarray | None]):
    """A reader: checkpoint name -> (tensor name, the array ``load(tensor)`` or the rows of
    the block the name selects, or None where the tensor is missing). A fused tensor is loaded
    once while its blocks are asked for before any other fused tensor's (``assemble`` reads a
    layer's weights together) and let go after its last block."""
    held: list = [None, None]  # (tensor name, array) of the fused tensor being split

    def read(name: str):
        tensor, block = fused_block(name)
        if block is None:
            return tensor, load(tensor)
        if held[0] != tensor:
            held[:] = [tensor, load(tensor)]
        a = held[1]
        if block == len(blocks[tensor]) - 1:
            held[:] = [None, None]
        return tensor, None if a is None else read_block(a, blocks[tensor], block, tensor)

    return read


def read_block(a: np.ndarray, sizes: tuple[int, ...], block: int, tensor: str) -> np.ndarray:
    """Rows of block ``block`` of the fused tensor a [rows, ...] whose blocks hold ``sizes``
    elements each (``fused_blocks``)."""
    row = a.size // a.shape[0] if a.ndim and a.shape[0] else 0
    if not row or sum(sizes) != a.size or any(n % row for n in sizes):
        raise CheckpointError(f"tensor {tensor!r} has shape {a.shape}, which does not split into blocks of "
                              f"{', '.join(map(str, sizes))} elements along its first axis")
    start = sum(sizes[:block]) // row
    return a[start : start + sizes[block] // row]


def refuse_unmapped(path, present, expected: set[str], what: str) -> None:
    """A checkpoint tensor nothing reads would be silently dropped (a bias, a scaling table
    our forward pass does not apply): refuse the checkpoint instead, naming the tensors."""
    extra = sorted(set(present) - expected)
    if extra:
        shown = ", ".join(repr(n) for n in extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise CheckpointError(f"{path}: {what} tensors that this model family does not use: {shown}")


def _need(a, name):
    if a is None:
        raise CheckpointError(f"checkpoint has no tensor {name!r}")
    return a


def _fit(a: np.ndarray, shape, name) -> np.ndarray:
    if a.size != int(np.prod(shape)):
        raise CheckpointError(f"tensor {name!r} has shape {a.shape}, cannot fit declared {tuple(shape)}")
    return a.reshape(shape)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable JSON ({e})") from None
