"""What every checkpoint format shares: the ``Loaded`` result, format detection, and
``assemble``, which builds a weights pytree from per-tensor reads following the family's
one declaration (``weight_specs``).

``checkpoint`` (the dispatcher and GGUF), ``hf`` and ``orbax_io`` import this module and not
each other; ``convert`` sits above them all.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import re
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError
from jaxinfer.hostmem import mapped_empty, release_mapped
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


# Bytes of a mapped file copied between two hand-backs of their pages (``StoredTensor.read``).
READ_CHUNK = 16 << 20
# Bytes of a file in a bucket fetched at once (by several range requests in flight together).
REMOTE_READ_CHUNK = 32 << 20


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor of a memory-mapped checkpoint file, not yet read: where it lies in the
    mapping, and its stored shape and dtype. ``buf`` may also be a file in a bucket
    (``jaxinfer.bucket.RemoteFile``), read by ranges instead of mapped."""

    buf: mmap.mmap  # or bucket.RemoteFile
    offset: int  # of the tensor's first byte in buf
    shape: tuple[int, ...]
    dtype: np.dtype

    def read(self, box: tuple[slice, ...], dtype) -> np.ndarray:
        """One box of the tensor (a slice per stored dim, step 1) as a new array of ``dtype``
        in the stored layout. It is copied from the mapping a chunk of rows at a time, each
        chunk's pages handed back once copied, so the host never holds the box twice. The
        array is a ``hostmem.mapped_empty``, which jax on CPU adopts as the device buffer
        instead of copying it once more."""
        count = int(np.prod(self.shape, dtype=np.int64))
        bounds = [s.indices(n)[:2] for s, n in zip(box, self.shape)]
        out = mapped_empty([b - s for s, b in bounds], dtype)
        if not isinstance(self.buf, mmap.mmap):
            return self._read_ranges(box, bounds, out)
        view = np.frombuffer(self.buf, self.dtype, count, self.offset).reshape(self.shape)
        if not self.shape or out.size == 0:
            out[...] = view[box]
            release_mapped(self.buf, self.offset, count * self.dtype.itemsize)
            return out
        row = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        step = max(1, READ_CHUNK // max(row, 1))
        (r0, r1), rest = bounds[0], tuple(box[1:])
        for i in range(r0, r1, step):
            j = min(i + step, r1)
            out[i - r0 : j - r0] = view[(slice(i, j),) + rest]
            release_mapped(self.buf, self.offset + i * row, (j - i) * row)
        return out

    def _read_ranges(self, box, bounds, out: np.ndarray) -> np.ndarray:
        """``read`` from a file in a bucket: the box's rows, REMOTE_READ_CHUNK bytes at a time,
        each chunk fetched by parallel range requests, so the host holds the box and one chunk."""
        per_row = int(np.prod(self.shape[1:], dtype=np.int64))
        row = per_row * self.dtype.itemsize
        if not self.shape or out.size == 0:
            count = int(np.prod(self.shape, dtype=np.int64))
            data = self.buf.read(self.offset, self.offset + count * self.dtype.itemsize)
            out[...] = np.frombuffer(data, self.dtype, count).reshape(self.shape)[box]
            return out
        step = max(1, REMOTE_READ_CHUNK // max(row, 1))
        (r0, r1), rest = bounds[0], tuple(box[1:])
        for i in range(r0, r1, step):
            j = min(i + step, r1)
            data = self.buf.read(self.offset + i * row, self.offset + j * row)
            rows = np.frombuffer(data, self.dtype, (j - i) * per_row).reshape((j - i, *self.shape[1:]))
            out[i - r0 : j - r0] = rows[(slice(None),) + rest]
        return out


def assemble(
    specs: dict,
    cfg: ModelConfig,
    names: dict,
    fetch: Callable[[str, bool], np.ndarray | None],  # (name, transpose) -> array or None
    which: int,  # 0: HF names, 1: GGUF names
    shardings=None,  # same tree as specs, NamedSharding leaves
    quantizer=None,  # loaders.quantize.WeightQuantizer: quantize each weight as it is read
    view: Callable[[str, bool], StoredTensor | None] | None = None,  # (name, transpose) -> tensor or None
) -> dict:
    """Build the weights pytree from per-tensor reads, one array per declaration.

    A tensor ``view`` offers is read per device part: each device receives only its part of
    the weight, read from the mapped file, cast and sent before the next part is read. Other
    tensors (block-quantized GGUF, a part that is no box of the stored tensor) come whole
    from ``fetch``, once per weight, and are split on the host. Either way the host holds
    about one tensor at a time, never the model. With a quantizer, each float weight goes to
    it right away and is dropped once quantized, so the whole float model never exists."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    shard_leaves = jax.tree.leaves(shardings) if shardings is not None else [None] * len(leaves)
    out = [None] * len(leaves)
    for index, ((path, spec), sharding) in enumerate(zip(leaves, shard_leaves)):
        key, layer = weight_key(path)
        entry = names.get(key)
        if entry is None:
            raise CheckpointError(f"no checkpoint name is known for weight {'/'.join(key)}")
        name = entry[which].format(i=layer)
        stored = view(name, entry[2]) if view is not None else None
        a = _read_weight(tuple(spec.shape), spec_dtype(spec, cfg), sharding, name, entry[2], fetch, stored)
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


def _read_weight(shape, dtype, sharding, name, transpose, fetch, stored: StoredTensor | None) -> jax.Array:
    """One weight of our ``shape`` and ``dtype`` on the devices of ``sharding`` (None: the
    default device). Devices that hold the same part (replicated dims) share one read."""
    dtype = np.dtype(dtype)
    whole = None

    def part(bounds) -> np.ndarray:  # bounds: ((start, stop), ...) over our shape
        nonlocal whole
        # a transposed read swaps the last two axes (stacked experts keep their leading one):
        # beyond two dims that is not the plain reversal _stored_box maps, so fetch reads it
        direct = stored is not None and not (transpose and len(stored.shape) > 2)
        box = _stored_box(stored.shape, transpose, shape, bounds) if direct else None
        if box is not None:
            # Cast in the stored layout (one pass in memory order); a transposed part stays a
            # strided view: device_put lays it out, several times faster than numpy would.
            a = stored.read(box, dtype)
            return (a.T if transpose else a).reshape([b - s for s, b in bounds])
        if whole is None:
            whole = _fit(_need(fetch(name, transpose), name), shape, name)
        return _cast(whole[tuple(slice(s, b) for s, b in bounds)], dtype)

    # Transfers run asynchronously and keep their host parts alive until done: waiting for
    # each weight keeps what is in flight to one weight.
    if sharding is None:
        return jax.device_put(part([(0, n) for n in shape])).block_until_ready()
    devices_of: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        devices_of.setdefault(bounds, []).append(device)
    arrays = []
    for bounds, devices in devices_of.items():
        host = part(bounds)
        arrays += [jax.device_put(host, d) for d in devices]
        del host
    return jax.make_array_from_single_device_arrays(shape, sharding, jax.block_until_ready(arrays))


def _cast(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``a`` as ``dtype``: itself when it already is (a bfloat16 tensor loaded as bfloat16 is
    never widened), else one pass in its memory order into a ``hostmem.mapped_empty`` array
    (C or Fortran order, as ``a``; a transposed one is laid out by device_put, several times
    faster than a numpy transposing copy)."""
    if a.dtype == dtype:
        return a
    if a.flags.c_contiguous:
        out = mapped_empty(a.shape, dtype)
    elif a.flags.f_contiguous:
        out = mapped_empty(a.shape[::-1], dtype).T
    else:
        return a.astype(dtype)
    out[...] = a
    return out


def _stored_box(stored, transpose: bool, shape, bounds) -> tuple[slice, ...] | None:
    """The box of a stored tensor of shape ``stored`` that holds the part ``bounds`` of our
    ``shape``, or None when that part is not one box there. Our shape is the stored one
    (reversed when ``transpose``) with runs of dims merged or split, e.g. (D, N, H) for
    (D, N*H): dims go in groups of equal size, and a part is a box when, in each group, it
    is one contiguous run of the flattened group that is also a box of the stored dims."""
    t_shape = tuple(reversed(stored)) if transpose else tuple(stored)
    groups = _groups(tuple(shape), t_shape)
    if groups is None:
        return None
    box: list[tuple[int, int]] = []
    for (d0, d1), (t0, t1) in groups:
        run = _run(shape[d0:d1], bounds[d0:d1])
        sub = None if run is None else _box_of_run(t_shape[t0:t1], *run)
        if sub is None:
            return None
        box += sub
    slices = tuple(slice(s, b) for s, b in box)
    return tuple(reversed(slices)) if transpose else slices


def _groups(ours, theirs):
    """Pair runs of adjacent dims of two shapes whose products are equal, smallest runs first:
    ((our dims), (their dims)) index ranges; None when the sizes differ."""
    if int(np.prod(ours, dtype=np.int64)) != int(np.prod(theirs, dtype=np.int64)):
        return None
    out, i, j = [], 0, 0
    while i < len(ours) or j < len(theirs):
        gi, gj, p, q = i, j, 1, 1
        if i < len(ours):
            p, i = p * ours[i], i + 1
        if j < len(theirs):
            q, j = q * theirs[j], j + 1
        while p != q:
            if p < q and i < len(ours):
                p, i = p * ours[i], i + 1
            elif q < p and j < len(theirs):
                q, j = q * theirs[j], j + 1
            else:
                return None
        out.append(((gi, i), (gj, j)))
    return out


def _run(dims, bounds) -> tuple[int, int] | None:
    """The box ``bounds`` of ``dims`` as a run [start, stop) of the row-major flattening, or
    None when it is not one run (a dim before the last partial one spans several indices)."""
    partial = [k for k, ((s, b), n) in enumerate(zip(bounds, dims)) if b - s != n]
    last = partial[-1] if partial else -1
    if any(b - s != 1 for s, b in bounds[: max(last, 0)]):
        return None
    start = 0
    for (s, _), n in zip(bounds, dims):
        start = start * n + s
    if last < 0:
        return start, start + int(np.prod(dims, dtype=np.int64))
    inner = int(np.prod(dims[last + 1:], dtype=np.int64))
    return start, start + (bounds[last][1] - bounds[last][0]) * inner


def _box_of_run(dims, start: int, stop: int) -> list[tuple[int, int]] | None:
    """The run [start, stop) of the row-major flattening of ``dims`` as a box, or None."""
    if not dims:
        return [] if (start, stop) == (0, 1) else None
    for k in range(len(dims) - 1, -1, -1):
        inner = int(np.prod(dims[k + 1:], dtype=np.int64))
        block = inner * dims[k]
        if start % inner or stop % inner or start // block != (stop - 1) // block:
            continue
        outer = []
        rest = start // block
        for n in reversed(dims[:k]):
            rest, i = divmod(rest, n)
            outer.append((i, i + 1))
        lo = start // inner % dims[k]
        return outer[::-1] + [(lo, lo + (stop - start) // inner)] + [(0, n) for n in dims[k + 1:]]
    return None


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
