"""GGUF checkpoints: header parsing, raw tensor access and numpy dequantization.

A GGUF file is a small header (key/value metadata, then one info record per tensor) followed
by the tensor data, memory-mapped here so nothing is read until a tensor is asked for.

The header is parsed by this module rather than by ``gguf.GGUFReader``: the reader builds
Python objects for every array element while it opens the file, which takes ~15 s of CPU for
Gemma 3's 262144-token vocabulary; the loop below takes a fraction of a second. The ``gguf``
package is still the authority for the type ids and block sizes (``gguf.constants``), and the
tests check our parse and our dequantization against ``GGUFReader`` and ``gguf.quants``.

Dequantization follows the block layouts of ggml-quants.c exactly, including the order of
float operations, so results match llama.cpp's reference dequantizers bit for bit. Every
quant type is one vectorised function over a batch of blocks; ``dequantize`` feeds it
cache-sized batches.

Shapes are numpy (row-major) order, i.e. ggml's ``ne`` reversed: a ``Linear(in, out)`` weight
is ``(out, in)`` and quant blocks run along the last axis.
"""

import dataclasses
import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from jaxinfer.errors import CheckpointError
from jaxinfer.hostmem import mapped_empty, release_mapped

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
QK_K = 256  # elements per K-quant super-block

# GGUF value type ids -> struct format for the scalar ones (the spec's gguf_metadata_value_type).
_STRING, _ARRAY = 8, 9
_SCALAR_FORMATS = {
    0: "B",  # uint8
    1: "b",  # int8
    2: "H",  # uint16
    3: "h",  # int16
    4: "I",  # uint32
    5: "i",  # int32
    6: "f",  # float32
    7: "?",  # bool
    10: "Q",  # uint64
    11: "q",  # int64
    12: "d",  # float64
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (ggml dims reversed): Linear(in, out) weight is (out, in)
    qtype: str  # ggml type name: "F32", "F16", "BF16", "Q8_0", "Q4_K", ...
    offset: int = dataclasses.field(default=0, repr=False)  # absolute byte offset in the file
    nbytes: int = dataclasses.field(default=0, repr=False)  # stored size in bytes

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


# ---------------------------------------------------------------------------------------------
# Dequantization. Each function maps uint8[n, type_size] blocks to float32[n, block_size].


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The little-endian float16 at byte ``start`` of every block, as float32[n, 1]."""
    return blocks[:, start : start + 2].view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """uint8[..., m] -> uint8[..., 2m]: all low nibbles first, then all high nibbles.

    This is the element order of every 4-bit ggml format: byte j holds elements j and j + m.
    """
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(qh: np.ndarray) -> np.ndarray:
    """uint8[n, m] -> uint8[n, 8m] of single bits, bit k of byte j at index 8j + k.

    That is the bit numbering of a little-endian integer, as Q5_0/Q5_1 store their 32 high bits.
    """
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _dq_q8_0(b: np.ndarray) -> np.ndarray:
    # d: f16, qs: int8[32]
    return b[:, 2:34].view(np.int8).astype(np.float32) * _f16(b, 0)


def _dq_q4_0(b: np.ndarray) -> np.ndarray:
    # d: f16, qs: uint8[16] nibbles; value (q - 8) * d
    q = _nibbles(b[:, 2:18]).astype(np.int8) - np.int8(8)
    return q.astype(np.float32) * _f16(b, 0)


def _dq_q4_1(b: np.ndarray) -> np.ndarray:
    # d: f16, m: f16, qs: uint8[16] nibbles; value q * d + m
    q = _nibbles(b[:, 4:20]).astype(np.float32)
    return q * _f16(b, 0) + _f16(b, 2)


def _dq_q5_0(b: np.ndarray) -> np.ndarray:
    # d: f16, qh: 32 high bits (bit i belongs to element i), qs: uint8[16] low nibbles
    q = (_nibbles(b[:, 6:22]) | (_bits(b[:, 2:6]) << 4)).astype(np.int8) - np.int8(16)
    return q.astype(np.float32) * _f16(b, 0)


def _dq_q5_1(b: np.ndarray) -> np.ndarray:
    # d: f16, m: f16, qh: 32 high bits, qs: uint8[16] low nibbles; value q * d + m
    q = (_nibbles(b[:, 8:24]) | (_bits(b[:, 4:8]) << 4)).astype(np.float32)
    return q * _f16(b, 0) + _f16(b, 2)


def _q4k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack Q4_K/Q5_K's 12 bytes into 8 six-bit scales and 8 six-bit mins (ggml's
    get_scale_min_k4): sub-blocks 0-3 sit in the low 6 bits of bytes 0-3 (scales) and 4-7
    (mins); sub-blocks 4-7 take their low 4 bits from bytes 8-11 and their top 2 bits from
    the spare top bits of bytes 0-7."""
    lo_sc, lo_m, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo_sc & 63, (hi & 0x0F) | ((lo_sc >> 6) << 4)], axis=-1)
    mn = np.concatenate([lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)  # f32[n, 8] each


def _dq_q4_k(b: np.ndarray) -> np.ndarray:
    # d: f16, dmin: f16, scales: 12 bytes, qs: uint8[128]; 8 sub-blocks of 32.
    # Each 32-byte run of qs holds two sub-blocks: low nibbles then high nibbles.
    n = b.shape[0]
    sc, mn = _q4k_scales(b[:, 4:16])
    d1 = (_f16(b, 0) * sc)[:, :, None]  # f32[n, 8, 1]
    m1 = (_f16(b, 2) * mn)[:, :, None]
    q = _nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32).astype(np.float32)
    return (d1 * q - m1).reshape(n, QK_K)


def _dq_q5_k(b: np.ndarray) -> np.ndarray:
    # d: f16, dmin: f16, scales: 12 bytes, qh: uint8[32], qs: uint8[128].
    # Sub-block s takes its 5th bit from bit s of qh[l] for its element l.
    n = b.shape[0]
    sc, mn = _q4k_scales(b[:, 4:16])
    d1 = (_f16(b, 0) * sc)[:, :, None]  # f32[n, 8, 1]
    m1 = (_f16(b, 2) * mn)[:, :, None]
    lo = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    hi = _bits(b[:, 16:48]).reshape(n, 32, 8).transpose(0, 2, 1)  # u8[n, 8 sub-blocks, 32]
    q = (lo | (hi << 4)).astype(np.float32)
    return (d1 * q - m1).reshape(n, QK_K)


def _dq_q6_k(b: np.ndarray) -> np.ndarray:
    # ql: uint8[128] low nibbles, qh: uint8[64] 2-bit high parts, scales: int8[16], d: f16.
    # Two halves of 128 elements; in each, ql[0:64] gives elements 0-63 (low nibbles) and
    # 64-127 (high nibbles), and qh[l] bits 2k..2k+1 go to element 32k + l.
    n = b.shape[0]
    lo = _nibbles(b[:, 0:128].reshape(n, 2, 64))  # u8[n, 2, 128]
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    hi = (qh & 3).reshape(n, 2, 128)
    q = ((lo | (hi << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
    scales = b[:, 192:208].view(np.int8).astype(np.float32)  # one per 16 elements
    d1 = (_f16(b, 208) * scales)[:, :, None]  # f32[n, 16, 1]
    return (d1 * q.reshape(n, 16, 16)).reshape(n, QK_K)


def _dq_q2_k(b: np.ndarray) -> np.ndarray:
    # scales: uint8[16] (low nibble scale, high nibble min, per 16 elements), qs: uint8[64],
    # d: f16, dmin: f16. In each half of 128, 2-bit field k of qs[l] is element 32k + l.
    n = b.shape[0]
    s = b[:, 0:16]
    dl = (_f16(b, 80) * (s & 0x0F).astype(np.float32))[:, :, None]  # f32[n, 16, 1]
    ml = (_f16(b, 82) * (s >> 4).astype(np.float32))[:, :, None]
    qs = b[:, 16:80].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    q = (qs & 3).reshape(n, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _dq_q3_k(b: np.ndarray) -> np.ndarray:
    # hmask: uint8[32], qs: uint8[64], scales: 12 bytes (16 six-bit scales, offset 32), d: f16.
    # Element e = 32j + l (j = 0..7) has 2 low bits in field j % 4 of qs[32 (j // 4) + l] and
    # bit j of hmask[l]; a *clear* mask bit subtracts 4.
    n = b.shape[0]
    s = b[:, 96:108]
    lo4 = _nibbles(s[:, 0:8])  # u8[n, 16]: scales 0-7 from low nibbles, 8-15 from high
    hi2 = (s[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    scales = ((lo4 | (hi2.reshape(n, 16) << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
    dl = (_f16(b, 108) * scales)[:, :, None]  # f32[n, 16, 1]
    qs = b[:, 32:96].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    low = (qs & 3).reshape(n, 8, 32).astype(np.int8)
    mask = (b[:, None, 0:32] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1  # u8[n, 8, 32]
    q = (low - ((mask ^ 1) << 2).astype(np.int8)).astype(np.float32)
    return (dl * q.reshape(n, 16, 16)).reshape(n, QK_K)


def _dq_q8_k(b: np.ndarray) -> np.ndarray:
    # d: f32, qs: int8[256], bsums: int16[16] (only used by dot products)
    d = b[:, 0:4].view("<f4")
    return b[:, 4:260].view(np.int8).astype(np.float32) * d


# name -> (elements per block, bytes per block, blocks -> values)
_Dequant = Callable[[np.ndarray], np.ndarray]
_QUANTS: dict[str, tuple[int, int, _Dequant]] = {
    "Q8_0": (32, 34, _dq_q8_0),
    "Q4_0": (32, 18, _dq_q4_0),
    "Q4_1": (32, 20, _dq_q4_1),
    "Q5_0": (32, 22, _dq_q5_0),
    "Q5_1": (32, 24, _dq_q5_1),
    "Q2_K": (QK_K, 84, _dq_q2_k),
    "Q3_K": (QK_K, 110, _dq_q3_k),
    "Q4_K": (QK_K, 144, _dq_q4_k),
    "Q5_K": (QK_K, 176, _dq_q5_k),
    "Q6_K": (QK_K, 210, _dq_q6_k),
    "Q8_K": (QK_K, 292, _dq_q8_k),
}
# Plain float types and their stored little-endian dtype.
_FLOATS: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
SUPPORTED_QTYPES: frozenset[str] = frozenset(_QUANTS) | frozenset(_FLOATS)

# Blocks per batch: ~256K output values keeps the temporaries of the formulas above inside
# the CPU caches, several times faster than one pass over a whole embedding matrix.
_BATCH_VALUES = 1 << 18


def _block_layout(qtype: str) -> tuple[int, int]:
    """(elements per block, bytes per block) of any ggml type that gguf knows."""
    if qtype in _QUANTS:
        return _QUANTS[qtype][:2]
    if qtype in _FLOATS:
        return 1, _FLOATS[qtype].itemsize
    return GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]


def _unsupported(qtype: str) -> str:
    return f"quant type {qtype} is not supported (supported: {', '.join(sorted(SUPPORTED_QTYPES))})"


def dequantize(data: np.ndarray, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Dequantize raw GGUF tensor bytes to float32[*shape].

    ``data`` holds the stored bytes (uint8 of any shape, or the stored float array itself);
    ``shape`` is the numpy-order shape, whose last axis is a whole number of blocks.
    """
    shape = tuple(int(s) for s in shape)
    if qtype not in SUPPORTED_QTYPES:
        raise CheckpointError(_unsupported(qtype))
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    block_size, type_size = _block_layout(qtype)
    size = int(np.prod(shape, dtype=np.int64))
    if (shape and shape[-1] % block_size) or raw.size != size // block_size * type_size:
        raise ValueError(
            f"{qtype} data of {raw.size} bytes does not hold a tensor of {shape=} "
            f"({block_size} values per {type_size}-byte block along the last axis)"
        )
    # A mapping of its own: jax on CPU takes it as the device buffer, and dropped it leaves
    # no hole in the heap (``hostmem.mapped_empty``).
    if qtype in _FLOATS:
        out = mapped_empty(shape, np.float32)
        out[...] = raw.view(_FLOATS[qtype]).reshape(shape)
        return out
    fn = _QUANTS[qtype][2]
    blocks = raw.reshape(-1, type_size)  # u8[n_blocks, type_size]
    out = mapped_empty((blocks.shape[0], block_size), np.float32)
    step = max(1, _BATCH_VALUES // block_size)
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = fn(blocks[start : start + step])
    return out.reshape(shape)


def unpermute_llama_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a "llama" attn_q / attn_k weight.

    The converter reorders each head's rows from the Hugging Face half-split rotary layout
    (all first halves of the rotated pairs, then all second halves) to ggml's interleaved one
    (x0, y0, x1, y1, ...). This returns the Hugging Face layout. ``w`` is [n_heads * H, ...]
    (a weight [N*H, D] or a bias [N*H]); for attn_k pass the KV head count.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows=} is not a multiple of 2 * {n_heads=}")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------------------------
# Container parsing.


class _Truncated(Exception):
    """The header runs past the end of the file; ``offset`` is where the cut value starts."""

    def __init__(self, offset: int):
        super().__init__(offset)
        self.offset = offset


class _Header:
    """A forward-only reader over the mapped header bytes."""

    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos, self.end = buf, 0, len(buf)

    def _take(self, n: int) -> int:
        start = self.pos
        self.pos += n
        if self.pos > self.end:
            raise _Truncated(start)
        return start

    def u32(self) -> int:
        return _U32.unpack_from(self.buf, self._take(4))[0]

    def u64(self) -> int:
        return _U64.unpack_from(self.buf, self._take(8))[0]

    def string(self) -> str:
        n = self.u64()
        start = self._take(n)
        return str(self.buf[start : start + n], "utf-8")

    def value(self, vtype: int) -> object:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.u32(), self.u64()
            return self.array(itype, count)
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise ValueError(f"unknown metadata value type {vtype}")
        size = struct.calcsize(fmt)
        return struct.unpack_from("<" + fmt, self.buf, self._take(size))[0]

    def array(self, itype: int, count: int) -> list:
        if itype in _SCALAR_FORMATS:
            # One numpy call per array: the tokenizer's scores and types are 262144 long.
            dtype = np.dtype("<" + _SCALAR_FORMATS[itype])
            start = self._take(count * dtype.itemsize)
            return np.frombuffer(self.buf, dtype, count, start).tolist()
        if itype == _STRING:
            # The vocabulary: a tight loop with the struct call bound locally (~0.1 s / 262144).
            buf, pos, end, unpack, out = self.buf, self.pos, self.end, _U64.unpack_from, []
            append = out.append
            start = pos
            try:
                for _ in range(count):
                    start = pos
                    n = unpack(buf, pos)[0]
                    pos += 8 + n
                    if pos > end:  # the file ends inside this string
                        raise _Truncated(start)
                    append(str(buf[pos - n : pos], "utf-8"))
            except struct.error:  # the file ends inside a string's length
                raise _Truncated(start) from None
            self.pos = pos
            return out
        return [self.value(itype) for _ in range(count)]


class GGUFCheckpoint:
    """A memory-mapped GGUF file: its metadata, its tensor table and dequantized tensors.

    Opening parses only the header; tensor data is read from the mapping on ``load``/``raw``.
    Every problem with the file raises ``CheckpointError`` naming the file.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: no such GGUF file") from None
        except IsADirectoryError:
            raise CheckpointError(f"{self.path}: is a directory, not a GGUF file") from None
        except ValueError:  # mmap refuses an empty file
            raise CheckpointError(f"{self.path}: empty file, not a GGUF file") from None
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read: {e.strerror or e}") from None
        self.file_size = len(self._buf)
        try:
            self._parse()
        except _Truncated as e:
            raise CheckpointError(
                f"{self.path}: truncated GGUF header: the value at offset {e.offset} runs past "
                f"the end of the file ({self.file_size} bytes)"
            ) from None
        except (UnicodeDecodeError, ValueError, KeyError, struct.error, OverflowError) as e:
            raise CheckpointError(f"{self.path}: corrupt GGUF header: {e}") from None
        self.architecture: str = str(self.metadata.get("general.architecture", ""))

    def _parse(self) -> None:
        h = _Header(self._buf)
        if self.file_size < 4 or self._buf[:4] != GGUF_MAGIC:
            raise CheckpointError(
                f"{self.path}: not a GGUF file (magic {self._buf[:4]!r}, expected {GGUF_MAGIC!r})"
            )
        h.pos = 4
        self.version = h.u32()
        if self.version & 0xFFFF == 0:
            raise CheckpointError(f"{self.path}: big-endian GGUF files are not supported")
        if self.version not in (2, 3):
            raise CheckpointError(f"{self.path}: GGUF version {self.version} is not supported")
        n_tensors, n_kv = h.u64(), h.u64()

        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = h.string()
            self.metadata[key] = h.value(h.u32())

        infos = []
        for _ in range(n_tensors):
            name = h.string()
            n_dims = h.u32()
            dims = [h.u64() for _ in range(n_dims)]  # ggml order: dims[0] is the row length
            type_id, offset = h.u32(), h.u64()
            infos.append((name, dims, type_id, offset))

        alignment = self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise CheckpointError(f"{self.path}: bad general.alignment {alignment!r}")
        data_start = -(-h.pos // alignment) * alignment

        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, offset in infos:
            try:
                qtype = GGMLQuantizationType(type_id).name
            except ValueError:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} has unknown ggml type id {type_id}"
                ) from None
            block_size, type_size = _block_layout(qtype)
            if dims and dims[0] % block_size:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} row length {dims[0]} is not a multiple of "
                    f"the {qtype} block size {block_size}"
                )
            shape = tuple(reversed(dims))
            nbytes = int(np.prod(dims, dtype=np.int64)) // block_size * type_size
            start = data_start + offset
            if start + nbytes > self.file_size:
                raise CheckpointError(
                    f"{self.path}: truncated GGUF file: tensor {name!r} needs bytes "
                    f"{start}..{start + nbytes} but the file has only {self.file_size} bytes"
                )
            if name in self.tensors:
                raise CheckpointError(f"{self.path}: duplicate tensor {name!r}")
            self.tensors[name] = TensorInfo(name, shape, qtype, start, nbytes)

    def _info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor named {name!r}") from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored, a read-only view of the mapping (no copy).

        Float types come back as their own dtype (float32, float16, bfloat16) in
        ``TensorInfo.shape``; quantized ones as uint8[*shape[:-1], bytes per row].
        """
        info = self._info(name)
        data = np.frombuffer(self._buf, np.uint8, info.nbytes, info.offset)
        if info.qtype in _FLOATS:
            return data.view(_FLOATS[info.qtype]).reshape(info.shape)
        block_size, type_size = _block_layout(info.qtype)
        rows = info.shape[:-1]
        return data.reshape(*rows, info.shape[-1] // block_size * type_size)

    def load(self, name: str, dtype=np.float32) -> np.ndarray:
        """The tensor dequantized to a new array of ``dtype`` in ``TensorInfo.shape``; its
        mapped pages are handed back afterwards (``release``)."""
        info = self._info(name)
        if info.qtype not in SUPPORTED_QTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r}: {_unsupported(info.qtype)}")
        try:
            return dequantize(self.raw(name), info.qtype, info.shape).astype(dtype, copy=False)
        finally:
            self.release(name)

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process's resident memory (they are read
        again from the file if it is read again): a load that reads every tensor once then
        holds one tensor of the file at a time, not the file."""
        info = self._info(name)
        release_mapped(self._buf, info.offset, info.nbytes)

    @property
    def mapping(self) -> mmap.mmap:
        """The read-only map of the whole file, which ``TensorInfo.offset`` indexes."""
        return self._buf

    def is_float(self, name: str) -> bool:
        """Whether the tensor is stored as plain floats (F32, F16, BF16), not in blocks."""
        return self._info(name).qtype in _FLOATS

    def __repr__(self) -> str:
        return (
            f"GGUFCheckpoint({str(self.path)!r}, architecture={self.architecture!r}, "
            f"{len(self.tensors)} tensors)"
        )


def read_metadata(path: str | os.PathLike) -> dict[str, object]:
    """The key/value metadata of a GGUF file (strings, numbers, bools and lists of them)."""
    return GGUFCheckpoint(path).metadata
