"""Quantized weights as a pytree, and the int8 KV-cache helpers.

A ``QuantArray`` stands in for a float weight anywhere the model multiplies by it: the one
matmul helper (``models.layers.dot``) calls ``w.einsum(eq, x)``, so model code does not
branch on the scheme. Three schemes:

  int8  weight-only, one scale per output channel. Activations stay float.
  int4  weight-only, one scale per (group of ``group`` contracted rows, output channel),
        two values per byte.
  w8a8  int8 weights and int8 activations quantized per token at run time; the matmul is
        XLA's native int8 x int8 -> int32 dot (on XLA CPU ~10x float32 at batch 256).
        SmoothQuant-style smoothing moves activation outliers into the weights: with
        calibration maxima a_j of input channel j and weight row maxima w_j,
        s_j = a_j**alpha / w_j**(1 - alpha); the weights are stored as diag(s) W and the
        activations divided by s before they are quantized. Where a norm precedes the
        matmul the loader folds 1/s into the norm's weight (one s shared by q/k/v, one by
        gate/up), and where the input is the output of another matmul into that matmul's
        output scale, so nothing is smoothed at run time (``smooth`` None); a QuantArray
        that keeps ``smooth`` (older checkpoints) multiplies x by it before quantizing.

Storage is a matrix [I, O]: the weight's contracted axes flattened (in the weight's order)
into I, its other axes into O, so every scheme is one 2-D matmul and the layout is the one
the Pallas kernels in ``pallas_kernels.quant_matmul`` take (same int4 byte format; a test
holds the two packings equal). ``shape`` and ``contract`` keep the float weight's shape.

Floor: imports only jax, numpy and jaxinfer.errors.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import cpu_kernels
from jaxinfer.errors import InvalidRequest


class QuantScheme(str, enum.Enum):
    INT8 = "int8"
    INT4 = "int4"
    W8A8 = "w8a8"


def parse_scheme(name: str | QuantScheme | None) -> QuantScheme | None:
    """ "int8" / "int4" / "w8a8" (or None: no quantization) -> QuantScheme."""
    if name is None or isinstance(name, QuantScheme):
        return name
    try:
        return QuantScheme(name)
    except ValueError:
        choices = ", ".join(repr(s.value) for s in QuantScheme)
        raise InvalidRequest(
            f"quantize={name!r} is not a quantization scheme; use one of {choices}"
        ) from None


# ----------------------------------------------------------------------------- int math
def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 per row (over the last axis): x [..., I] -> (int8[..., I], f32[...])."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    return jnp.clip(jnp.round(xf / scale[..., None]), -127, 127).astype(jnp.int8), scale


def pack_int4(values: jax.Array, group: int) -> jax.Array:
    """int8[I, O] in [-8, 7] -> int8[I/2, O]: in each group of ``group`` rows, byte i holds
    row i (low nibble) and row i + group/2 (high nibble)."""
    I, O = values.shape
    v = values.astype(jnp.int32).reshape(I // group, 2, group // 2, O)
    packed = (v[:, 0] & 0xF) | ((v[:, 1] & 0xF) << 4)
    return jnp.where(packed > 127, packed - 256, packed).astype(jnp.int8).reshape(I // 2, O)


def unpack_int4(packed: jax.Array, group: int) -> jax.Array:
    """int8[I/2, O] -> int8[I, O]; inverse of pack_int4."""
    half, O = packed.shape
    b = packed.astype(jnp.int32).reshape(2 * half // group, group // 2, O)
    low = jax.lax.shift_right_arithmetic(jax.lax.shift_left(b, 28), 28)
    high = jax.lax.shift_right_arithmetic(b, 4)
    return jnp.concatenate([low, high], axis=1).reshape(2 * half, O).astype(jnp.int8)


def _per_column_int8(w2: jax.Array) -> tuple[jax.Array, jax.Array]:
    amax = jnp.max(jnp.abs(w2), axis=0)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    return jnp.clip(jnp.round(w2 / scale), -127, 127).astype(jnp.int8), scale


_MATMUL = (((1,), (0,)), ((), ()))


# ----------------------------------------------------------------------------- QuantArray
class _Matrix:
    """A matmul weight of ``shape`` whose ``contract`` axes are summed over, stored as (a form
    of) its [I, O] matrix: the contracted axes first, in order, then the free ones."""

    shape: tuple[int, ...]
    contract: tuple[int, ...]

    @property
    def free(self) -> tuple[int, ...]:
        """The weight's axes that survive the matmul, in order."""
        return tuple(a for a in range(len(self.shape)) if a not in self.contract)

    @property
    def in_size(self) -> int:
        return math.prod(self.shape[a] for a in self.contract)

    @property
    def out_size(self) -> int:
        return math.prod(self.shape[a] for a in self.free)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(self))

    def as_rows(self, eq: str, x: jax.Array):
        """The einsum ``eq`` as a 2-D product: (x2 [M, I], done) where ``done(y2 [M, O])``
        gives the einsum's output. Checks ``eq`` against this weight."""
        xs, ws, out = _parse(eq)
        if len(ws) != len(self.shape):
            raise ValueError(
                f"{eq!r}: weight has {len(self.shape)} axes {self.shape}, not {len(ws)}"
            )
        summed = tuple(a for a, c in enumerate(ws) if c in xs and c not in out)
        if summed != self.contract:
            raise ValueError(
                f"{eq!r} sums weight axes {summed}, but this weight was stored "
                f"contracting axes {self.contract}"
            )
        if any(c in xs for c in (ws[a] for a in self.free)):
            raise ValueError(f"{eq!r}: batch axes shared by x and the weight are not supported")
        c_letters = "".join(ws[a] for a in self.contract)
        keep = "".join(c for c in xs if c not in c_letters)
        for a, c in zip(self.contract, c_letters):
            if x.shape[xs.index(c)] != self.shape[a]:
                raise ValueError(
                    f"{eq!r}: x axis {c!r} has {x.shape[xs.index(c)]}, weight {self.shape[a]}"
                )
        x2 = jnp.einsum(f"{xs}->{keep}{c_letters}", x) if xs != keep + c_letters else x
        lead = x2.shape[: len(keep)]
        x2 = x2.reshape(math.prod(lead), self.in_size)
        have = keep + "".join(ws[a] for a in self.free)

        def done(y: jax.Array) -> jax.Array:
            y = y.reshape(*lead, *(self.shape[a] for a in self.free))
            return y if have == out else jnp.einsum(f"{have}->{out}", y)

        return x2, done

    def _from_matrix(self, w: jax.Array) -> jax.Array:
        """The [I, O] matrix ``w`` as the weight in its original shape."""
        order = self.contract + self.free
        w = w.reshape([self.shape[a] for a in order])
        return jnp.transpose(w, np.argsort(order))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantArray(_Matrix):
    """A quantized weight. Pass it wherever the float weight went into ``layers.dot``."""

    values: jax.Array  # int8[I, O]; int4: int8[I/2, O], two values per byte
    scale: jax.Array  # f32[O] per output channel; int4: f32[I/group, O]
    smooth: jax.Array | None  # f32[I] (w8a8 with smoothing): x * smooth is what is quantized
    shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})  # float weight's
    contract: tuple[int, ...] = dataclasses.field(metadata={"static": True})  # its contracted axes
    scheme: QuantScheme = dataclasses.field(metadata={"static": True})
    group: int = dataclasses.field(default=0, metadata={"static": True})  # int4 group size
    # "io": values as above; "amx": w8a8 values packed for the AMX kernel
    # (cpu_kernels.amx_pack, [O/16, I/64, 16, 16, 4]), made by ``dispatch.bind``
    layout: str = dataclasses.field(default="io", metadata={"static": True})
    # the dispatch.Kernels whose matmul multiplies it (``dispatch.bind``); None: XLA's dots
    kernels: object = dataclasses.field(default=None, metadata={"static": True})
    # the mesh axis ("model") splitting I and the one splitting O, or None, as
    # ``sharding.quant_shardings`` placed the values (``dispatch.bind`` reads it for a kernel
    # that runs per shard on a mesh)
    mesh_axes: tuple = dataclasses.field(default=(None, None), metadata={"static": True})

    def values_io(self) -> jax.Array:
        """``values`` in the "io" layout, unpacked where they are packed for AMX."""
        return cpu_kernels.amx_unpack(self.values) if self.layout == "amx" else self.values

    # ------------------------------------------------------------------ float views
    def dequantize_matrix(self, dtype=jnp.float32) -> jax.Array:
        """The float weight as the [I, O] matrix (smoothing undone)."""
        if self.scheme == QuantScheme.INT4:
            w = unpack_int4(self.values, self.group).astype(jnp.float32)
            w = w * jnp.repeat(self.scale, self.group, axis=0)
        else:
            w = self.values_io().astype(jnp.float32) * self.scale
        if self.smooth is not None:
            w = w * self.smooth[:, None]
        return w.astype(dtype)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float weight in its original shape."""
        return self._from_matrix(self.dequantize_matrix(dtype))

    def take(self, indices: jax.Array, dtype=jnp.float32) -> jax.Array:
        """Dequantized output channels ``indices`` -> [*indices.shape, I]: the embedding
        lookup of a quantized tied embedding [V, D] (contracted over D)."""
        if len(self.free) != 1:
            raise ValueError(f"take needs one output axis; this weight has {self.free=}")
        flat = indices.reshape(-1)
        if self.layout == "amx":
            cols = cpu_kernels.amx_take_columns(self.values, flat.astype(jnp.int32))  # [I, n]
        else:
            cols = jnp.take(self.values, flat, axis=1)  # [I or I/2, n]
        if self.scheme == QuantScheme.INT4:
            w = unpack_int4(cols, self.group).astype(jnp.float32)
            w = w * jnp.repeat(jnp.take(self.scale, flat, axis=1), self.group, axis=0)
        else:
            w = cols.astype(jnp.float32) * jnp.take(self.scale, flat)
        if self.smooth is not None:
            w = w * self.smooth[:, None]
        return w.T.reshape(*indices.shape, self.in_size).astype(dtype)

    # ------------------------------------------------------------------ matmul
    def matmul(self, x: jax.Array) -> jax.Array:
        """x [M, I] @ W [I, O] -> [M, O] in x.dtype, by this weight's scheme, with XLA's dots
        (the reference of every kernel ``dispatch.matmul`` may pick instead)."""
        if self.scheme == QuantScheme.W8A8:
            return self.matmul_rows(*self.quantize_input(x), x.dtype)
        if self.scheme == QuantScheme.INT4:
            w = unpack_int4(self.values, self.group).astype(jnp.float32)
            w = (w * jnp.repeat(self.scale, self.group, axis=0)).astype(x.dtype)
            y = jax.lax.dot_general(x, w, _MATMUL, preferred_element_type=jnp.float32)
        else:
            y = jax.lax.dot_general(
                x, self.values.astype(x.dtype), _MATMUL, preferred_element_type=jnp.float32
            )
            y = y * self.scale
        return y.astype(x.dtype)

    def quantize_input(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """w8a8: x [M, I] -> (int8[M, I], f32[M]), smoothed first if this weight still
        carries a run-time ``smooth``."""
        xf = x.astype(jnp.float32)
        if self.smooth is not None:
            xf = xf * self.smooth
        return quantize_rows(xf)

    def matmul_rows(self, xq: jax.Array, xs: jax.Array, dtype=jnp.float32, *, dot=None) -> jax.Array:
        """w8a8 on already quantized rows: int8[M, I] (scales f32[M]) @ W -> [M, O] dtype.
        ``dot(w, xq) -> int32[M, O]``: the integer product (default ``s8_dot``, XLA's)."""
        sums = s8_dot(xq, self.values_io()) if dot is None else dot(self, xq)
        return (sums.astype(jnp.float32) * xs[:, None] * self.scale).astype(dtype)

    def einsum(self, eq: str, x: jax.Array, *, matmul=None) -> jax.Array:
        """``jnp.einsum(eq, x, w)`` with this as w, e.g. "BTD,DNH->BTNH", "BTNH,NHD->BTD",
        "BTD,VD->BTV". The weight letters summed over must be exactly its contracted axes.

        ``matmul(w, x2) -> y2`` replaces the 2-D product ([M, I] -> [M, O]; default
        ``QuantArray.matmul``, plain XLA): the seam where ``dispatch.matmul`` plugs in the
        kernel this weight is bound to without this module importing them."""
        x2, done = self.as_rows(eq, x)
        return done(self.matmul(x2) if matmul is None else matmul(self, x2))


def s8_dot(xq: jax.Array, values: jax.Array) -> jax.Array:
    """XLA's int32 sums of int8 rows xq [M, I] with int8 values [I, O] (every kernel that
    ``dispatch.s8_dot`` may pick gives the same integers)."""
    if xq.shape[0] == 1:
        # XLA CPU rewrites a one-row s8 dot as an s32 one, converting the whole weight
        # every call (measured 30x slower than two rows); pay for a second row.
        return s8_dot(jnp.concatenate([xq, xq]), values)[:1]
    return jax.lax.dot_general(xq, values, _MATMUL, preferred_element_type=jnp.int32)


def einsum_shared(x: jax.Array, *pairs: tuple[str, QuantArray], dot=None) -> tuple[jax.Array, ...]:
    """Several einsums of one activation with w8a8 weights that contract it alike (q/k/v,
    gate/up): x is quantized once, each weight's dot runs on the same int8 rows.
    ``pairs``: (eq, weight) each as for ``QuantArray.einsum``; ``dot``: as for ``matmul_rows``."""
    rows = [w.as_rows(eq, x) for eq, w in pairs]
    ws = [w for _, w in pairs]
    if not shares_input(ws) or any(r[0].shape != rows[0][0].shape for r in rows):
        raise ValueError("einsum_shared needs w8a8 weights contracting the same input alike")
    xq, xs = ws[0].quantize_input(rows[0][0])
    return tuple(done(w.matmul_rows(xq, xs, x.dtype, dot=dot)) for w, (_, done) in zip(ws, rows))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedF32(_Matrix):
    """A float32 matmul weight packed once for ``cpu_kernels.f32_gemm_packed`` (its [I, O]
    matrix in panels of 16 columns, ``cpu_kernels.f32_pack``), made by ``dispatch.bind`` for the
    native kernels. Pass it wherever the float weight went into ``layers.dot``."""

    values: jax.Array  # f32[O/16, I, 16]
    shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})  # the float weight's
    contract: tuple[int, ...] = dataclasses.field(metadata={"static": True})  # its contracted axes

    dtype = jnp.dtype(jnp.float32)

    def unpacked(self) -> jax.Array:
        """The float weight in its original shape."""
        return self._from_matrix(cpu_kernels.f32_unpack(self.values))

    def einsum(self, eq: str, x: jax.Array, *, matmul=None) -> jax.Array:
        """``jnp.einsum(eq, x, w)`` with this as w: ``matmul`` (``dispatch.matmul``) runs the
        2-D product; without it, XLA's dot of the unpacked weight (the reference)."""
        x2, done = self.as_rows(eq, x)
        if matmul is None:
            y = jax.lax.dot_general(x2, cpu_kernels.f32_unpack(self.values), _MATMUL,
                                    preferred_element_type=jnp.float32)
            return done(y.astype(x.dtype))
        return done(matmul(self, x2))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Dense:
    """A float weight bound to a kernel choice (``dispatch.bind``): the array as it was, plus
    the static ``kernels`` that ``dispatch.einsum`` and ``dispatch.grouped_matmul`` read. Pass
    it wherever the float weight went (``layers.dot``, ``layers.take``)."""

    values: jax.Array  # the float weight, any shape
    kernels: object = dataclasses.field(metadata={"static": True})  # a dispatch.Kernels

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return self.values.nbytes

    def dequantize(self, dtype=None) -> jax.Array:
        """The float weight (``QuantArray.dequantize``'s counterpart)."""
        return self.values if dtype is None else self.values.astype(dtype)

    def take(self, indices: jax.Array, dtype=None) -> jax.Array:
        """Rows ``values[indices]`` (an embedding lookup)."""
        rows = jnp.take(self.values, indices, axis=0)
        return rows if dtype is None else rows.astype(dtype)


def io_layout(weights):
    """``weights`` with every weight back in its stored form, packed or bound by
    ``dispatch.bind`` no more: what a checkpoint stores."""
    def one(w):
        if isinstance(w, QuantArray):
            return dataclasses.replace(w, values=w.values_io(), layout="io", kernels=None)
        if isinstance(w, PackedF32):
            return w.unpacked()
        if isinstance(w, Dense):
            return w.values
        return w

    return jax.tree.map(one, weights, is_leaf=lambda x: isinstance(x, (QuantArray, PackedF32, Dense)))


def shares_input(ws) -> bool:
    """Whether weights ``ws`` can share one quantized input (``einsum_shared``): all w8a8,
    none smoothing at run time, all contracting the same number of input channels."""
    return all(isinstance(w, QuantArray) and w.scheme == QuantScheme.W8A8 and w.smooth is None
               and w.in_size == ws[0].in_size for w in ws)


def _parse(eq: str) -> tuple[str, str, str]:
    eq = eq.replace(" ", "")
    try:
        lhs, out = eq.split("->")
        xs, ws = lhs.split(",")
    except ValueError:
        raise ValueError(f"{eq!r} is not an einsum of the form 'x,w->out'") from None
    return xs, ws, out


# ----------------------------------------------------------------------------- quantizers
# The loaders quantize weight by weight; each quantizer is one jitted computation (per
# shape) rather than a dozen eagerly dispatched ops.
def _axes(shape: tuple[int, ...], contract_axes) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(contract, free) axes of a weight, each in order; checks contract_axes."""
    given = tuple(int(a) for a in contract_axes)
    contract = tuple(sorted({a % len(shape) for a in given})) if shape else ()
    if not contract or len(contract) != len(given) or len(contract) == len(shape):
        raise InvalidRequest(
            f"contract_axes={given} must name some, not all, "
            f"distinct axes of a weight of shape {shape}"
        )
    return contract, tuple(a for a in range(len(shape)) if a not in contract)


def as_matrix(w: jax.Array, contract: tuple[int, ...], free: tuple[int, ...]) -> jax.Array:
    """w -> f32[I, O] with the contracted axes first."""
    I, O = math.prod(w.shape[a] for a in contract), math.prod(w.shape[a] for a in free)
    return jnp.transpose(w.astype(jnp.float32), contract + free).reshape(I, O)


@functools.partial(jax.jit, static_argnames=("contract", "free"))
def _int8_matrix(w, contract, free):
    return _per_column_int8(as_matrix(w, contract, free))


@functools.partial(jax.jit, static_argnames=("contract", "free", "group"))
def _int4_matrix(w, contract, free, group):
    w2 = as_matrix(w, contract, free)
    I, O = w2.shape
    g = w2.reshape(I // group, group, O)
    amax = jnp.max(jnp.abs(g), axis=1)  # [I/group, O]
    scale = jnp.where(amax > 0, amax / 7.0, 1.0)
    q = jnp.clip(jnp.round(g / scale[:, None]), -8, 7).astype(jnp.int8).reshape(I, O)
    return pack_int4(q, group), scale


@functools.partial(jax.jit, static_argnames=("contract", "free"))
def _row_absmax(w, contract, free):
    return jnp.max(jnp.abs(as_matrix(w, contract, free)), axis=1)


@functools.partial(jax.jit, static_argnames=("contract", "free"))
def _smoothed_int8_matrix(w, s, contract, free):
    return _per_column_int8(as_matrix(w, contract, free) * s[:, None])


def weight_row_absmax(w: jax.Array, contract_axes) -> jax.Array:
    """max |w| of each contracted input channel over the output channels -> f32[I]."""
    contract, free = _axes(tuple(w.shape), contract_axes)
    return _row_absmax(w, contract, free)


def smoothing_scale(act_absmax: jax.Array, weight_absmax: jax.Array, alpha: float = 0.5) -> jax.Array:
    """SmoothQuant's s f32[I] = a**alpha / w**(1 - alpha) from the calibration maxima of the
    input channels and the weights' row maxima (for weights sharing one input: the max
    over all of them, so one s serves them all)."""
    if not 0.0 <= alpha <= 1.0:
        raise InvalidRequest(f"{alpha=} must lie in [0, 1]")
    a = jnp.maximum(jnp.asarray(act_absmax, jnp.float32).reshape(-1), 1e-5)
    s = a**alpha / jnp.maximum(weight_absmax, 1e-5) ** (1.0 - alpha)
    return jnp.clip(s, 1e-4, 1e4)


def quantize_int8(w: jax.Array, contract_axes) -> QuantArray:
    """Weight-only int8, symmetric, one scale per output channel."""
    contract, free = _axes(tuple(w.shape), contract_axes)
    values, scale = _int8_matrix(w, contract, free)
    return QuantArray(values, scale, None, tuple(w.shape), contract, QuantScheme.INT8)


def quantize_int4(w: jax.Array, contract_axes, group: int = 128) -> QuantArray:
    """Weight-only int4, symmetric, one scale per (group of contracted rows, output channel)."""
    contract, free = _axes(tuple(w.shape), contract_axes)
    I = math.prod(w.shape[a] for a in contract)
    if group <= 0 or group % 2:
        raise InvalidRequest(f"int4 {group=} must be a positive even number")
    if I % group:
        raise InvalidRequest(
            f"int4 needs the contracted size {I} (axes {contract} of a weight of shape "
            f"{tuple(w.shape)}) to divide into groups of {group}; pick a group size that "
            f"divides {I}, or use int8"
        )
    values, scale = _int4_matrix(w, contract, free, group)
    return QuantArray(values, scale, None, tuple(w.shape), contract, QuantScheme.INT4, group)


def quantize_w8a8(
    w: jax.Array, contract_axes, act_absmax: jax.Array | None = None, *, alpha: float = 0.5,
    smooth_in: jax.Array | None = None,
) -> QuantArray:
    """int8 weights for a dynamic-int8-activation matmul. ``act_absmax``: the largest |x|
    seen on each contracted input channel over a calibration set (shape of the contracted
    axes, or flat [I]); None skips smoothing. ``alpha`` moves that much of the activations'
    range into the weights (SmoothQuant's migration strength); x is multiplied by 1/s at
    run time. ``smooth_in`` (s f32[I], from ``smoothing_scale``) instead says the input
    arrives already divided by s (folded into whatever produces it): the weight is stored
    as diag(s) W with no run-time smoothing, and its ``dequantize`` is that product."""
    contract, free = _axes(tuple(w.shape), contract_axes)
    I = math.prod(w.shape[a] for a in contract)
    given = smooth_in if smooth_in is not None else act_absmax
    if given is None:
        values, scale = _int8_matrix(w, contract, free)
        return QuantArray(values, scale, None, tuple(w.shape), contract, QuantScheme.W8A8)
    given = jnp.asarray(given, jnp.float32).reshape(-1)
    if given.shape[0] != I:
        what = "smooth_in" if smooth_in is not None else "act_absmax"
        raise InvalidRequest(
            f"{what} has {given.shape[0]} channels; the weight contracts "
            f"{I} (axes {contract} of {tuple(w.shape)})"
        )
    if smooth_in is not None:
        values, scale = _smoothed_int8_matrix(w, given, contract, free)
        return QuantArray(values, scale, None, tuple(w.shape), contract, QuantScheme.W8A8)
    s = smoothing_scale(given, _row_absmax(w, contract, free), alpha)
    values, scale = _smoothed_int8_matrix(w, s, contract, free)
    return QuantArray(values, scale, 1.0 / s, tuple(w.shape), contract, QuantScheme.W8A8)


def quantize(
    w: jax.Array,
    contract_axes,
    scheme: QuantScheme | str,
    *,
    group: int = 128,
    act_absmax: jax.Array | None = None,
    alpha: float = 0.5,
) -> QuantArray:
    """One entry point for every scheme (what a loader calls per weight)."""
    scheme = parse_scheme(scheme)
    if scheme == QuantScheme.INT8:
        return quantize_int8(w, contract_axes)
    if scheme == QuantScheme.INT4:
        return quantize_int4(w, contract_axes, group)
    return quantize_w8a8(w, contract_axes, act_absmax, alpha=alpha)


def channel_absmax(x: jax.Array, n_contract: int = 1) -> jax.Array:
    """Calibration statistic for quantize_w8a8: max |x| over every axis but the trailing
    ``n_contract`` (the contracted ones, e.g. D of "BTD" or N, H of "BTNH"). Combine batches
    with jnp.maximum."""
    axes = tuple(range(x.ndim - n_contract))
    return jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axes)


# ----------------------------------------------------------------------------- whole models
INT4_GROUPS = (128, 64, 32)  # tried in order when no group is given: the largest that divides


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How a model's matmul weights are quantized while it loads."""

    scheme: QuantScheme
    group: int | None = None  # int4 rows per scale; None: the largest of INT4_GROUPS dividing each weight
    alpha: float = 0.5  # w8a8: SmoothQuant migration strength
    # w8a8: fold the smoothing into the norms and producing matmuls (``loaders.quantize``);
    # False keeps it in each weight, applied to x at run time, so every projection still reads
    # the model's own activation (what a LoRA adapter's A was trained on)
    fold_smoothing: bool = True


def quant_config(quantize: str | QuantScheme | None, group: int | None = None) -> QuantConfig | None:
    """The user's ``quantize=`` / ``quant_group=`` options, checked, -> QuantConfig or None."""
    scheme = parse_scheme(quantize)
    if group is not None and scheme != QuantScheme.INT4:
        raise InvalidRequest(f"quant_group={group} applies to quantize='int4' only, not {quantize!r}")
    if group is not None and (group <= 0 or group % 2):
        raise InvalidRequest(f"quant_group={group} must be a positive even number")
    return None if scheme is None else QuantConfig(scheme, group)


def int4_group(name: str, shape: tuple[int, ...], contract: tuple[int, ...], group: int | None) -> int:
    """The int4 group for weight ``name``: ``group`` if it divides the contracted size, else
    (group None) the largest of INT4_GROUPS that does; InvalidRequest names the weight."""
    I = math.prod(shape[a] for a in contract)
    if group is not None:
        if I % group:
            raise InvalidRequest(
                f"quant_group={group} does not divide weight {name}: it contracts {I} rows "
                f"(axes {contract} of shape {shape}); use a group size dividing {I}"
            )
        return group
    for g in INT4_GROUPS:
        if I % g == 0:
            return g
    raise InvalidRequest(
        f"int4 cannot quantize weight {name}: its contracted size {I} (axes {contract} of shape "
        f"{shape}) is not a multiple of any group size in {INT4_GROUPS}; use int8"
    )


def abstract_quant_array(shape, contract, scheme, group: int = 0, smooth: bool = False,
                         sharding=None) -> QuantArray:
    """A QuantArray of ShapeDtypeStructs: what a checkpoint restore fills in."""
    shape, contract, scheme = tuple(shape), tuple(contract), QuantScheme(scheme)
    I = math.prod(shape[a] for a in contract)
    O = math.prod(shape) // I
    def sds(s, dt):
        return jax.ShapeDtypeStruct(s, dt, sharding=sharding)

    if scheme == QuantScheme.INT4:
        values, scale = sds((I // 2, O), jnp.int8), sds((I // group, O), jnp.float32)
    else:
        values, scale = sds((I, O), jnp.int8), sds((O,), jnp.float32)
    return QuantArray(values, scale, sds((I,), jnp.float32) if smooth else None, shape, contract,
                      scheme, group)


def describe(qa: QuantArray) -> dict:
    """The static layout of a QuantArray as JSON values (inverse: abstract_quant_array)."""
    return {"shape": list(qa.shape), "contract": list(qa.contract), "scheme": qa.scheme.value,
            "group": qa.group, "smooth": qa.smooth is not None}


def model_scheme(weights) -> QuantScheme | None:
    """The scheme a weights pytree was quantized with (int4 and w8a8 models keep their LM
    head int8 weight-only, so they win over int8), or None when nothing is quantized."""
    found = {x.scheme for x in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, QuantArray))
             if isinstance(x, QuantArray)}
    for s in (QuantScheme.W8A8, QuantScheme.INT4, QuantScheme.INT8):
        if s in found:
            return s
    return None


# ----------------------------------------------------------------------------- KV cache
def quantize_kv(
    x: jax.Array, axis: int = -1, scale_dtype=jnp.float32
) -> tuple[jax.Array, jax.Array]:
    """int8 keys or values with one scale per (token, head): the max over the head-dim
    ``axis`` maps to 127. x [..., H, ...] -> (int8 same shape, scale with ``axis`` dropped)."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=axis, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0).astype(scale_dtype)
    q = jnp.clip(jnp.round(xf / scale.astype(jnp.float32)), -127, 127).astype(jnp.int8)
    return q, jnp.squeeze(scale, axis)


def dequantize_kv(q: jax.Array, scale: jax.Array, dtype=jnp.float32, axis: int = -1) -> jax.Array:
    """Inverse of quantize_kv: q * scale (scale broadcast back along ``axis``)."""
    s = jnp.expand_dims(scale.astype(jnp.float32), axis)
    return (q.astype(jnp.float32) * s).astype(dtype)
