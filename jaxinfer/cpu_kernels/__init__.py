"""Native CPU kernels called from jitted code through the XLA FFI, each beside its reference.

``int8_gemv(xq, w)``: int8 rows [M <= 4, I] @ int8 weight [I, O] -> int32 [M, O], the
batch-1 (and small-verify) w8a8 dot. Its reference is XLA's own s8 x s8 -> s32 dot
(``int8_gemv_reference``); the two give the same integers. XLA CPU runs that dot through
YNNPACK, which repacks the whole weight on every call; this kernel streams the weight as it
is stored (``int8_gemv.cc`` says how).

``wo8_gemm(x, w)`` and ``s8_gemm(xq, w)``: the same two products (weight-only int8, unscaled,
and w8a8's int32 sums) for any number of rows, decode batches of 64-256 and prompt chunks of
512, in AVX2 (+ FMA), so that CPUs without AVX-512 or AMX (AMD Zen 2/3, older Intel) run int8
from the stored bytes too. A column block's weight rows are widened once into a panel in L1
(float32, or int16 pairs for vpmaddwd), shared by every row of a block of up to 126 rows, so the
weight streams from memory once per block of rows and is never widened whole in memory, as
XLA's dot does on every call. Their references are ``wo8_gemm_reference`` (equal to float32
rounding; each output is one FMA chain over the input channels, the chain wo8_gemv runs) and
XLA's s8 dot (the same integers). The library picks its AVX-512BW or AVX2 code by cpuid at run
time (``int8_isa``), so one build serves any x86-64 CPU with AVX2.

``int8_amx(xq, p)``: int8 rows [M, I] @ an int8 weight packed once into AMX's tile layout
(``amx_pack``: [O/16, I/64, 16, 16, 4]) -> int32 [M, O], for any M, on Intel AMX (Sapphire
Rapids and later): w8a8's dots wherever ``dispatch.bind`` packed the weights (the native
choice does, on AMX CPUs). Its reference is XLA's s8 dot of the unpacked weight
(``int8_amx_reference``); the two give the same integers. XLA's own dot runs on AMX as well,
through YNNPACK, but repacks the weight on every call (``int8_amx.cc`` says more).

``wo8_gemv(x, w)``: float32 rows [M <= 4, I] @ int8 weight [I, O] -> float32 [M, O], the
weight-only int8 dot before its per-channel scale. XLA widens the whole int8 weight to
float32 on every call; this kernel widens it in registers as it streams it. Its reference is
``x @ w.astype(float32)`` (``wo8_gemv_reference``): at one row the same bits (the same FMA
chain over the input channels), at more rows equal to float32 rounding.

``f32_gemv(x, w, transposed=...)``: float32 rows [M <= 16, I] @ a float32 weight [I, O] (or,
transposed, [O, I]: a tied LM head) -> [M, O]: a speculative verification step's k + 1 rows,
small decode batches. XLA CPU streams a float32 weight at one row but packs it for two or
more rows, so 5 rows cost about twice one; this kernel reads the weight once for all rows
(``f32_gemv.cc``). Its reference is XLA's dot (``f32_gemv_reference``): for [I, O] each row
has the bits of XLA's one-row dot; for [O, I], float32 rounding apart. It has an AVX-512F and
an AVX2 + FMA variant (``isa``; by default the best this CPU has), so it also serves the AMD
EPYC boxes without AVX-512.

``f32_gemm_packed(x, p)``: float32 rows [M, I] @ a float32 weight packed once into panels of
16 columns (``f32_pack``: [O/16, I, 16]) -> [M, O], for any M, on AVX-512: the float32
projections wherever ``dispatch.bind`` packed them (the native choice does, on AVX-512).
XLA CPU transposes a float32 weight for its dot on every call past one row. Its reference is
XLA's dot of the unpacked weight (``f32_gemm_packed_reference``): each row has the bits of
XLA's one-row dot.

``paged_rows(q, k, v, table, ...)`` and ``prefill_row(q, k, v, pos, seg, ...)``: attention
over the page pools (float32, or int8 with per-position scales) for the packed step's decode
rows and its prefill row, reading the pages where they lie (``paged_attention.cc``). Their
references are ``models.packed.paged_rows_attention`` and ``prefill_row_attention`` as XLA
runs them; they agree to float32 rounding (the sums run in another order).

Each C++ source is compiled on first use, as a shared library of its own (``LIBRARIES``; a
compiler too old for one source, AMX's, costs only that one), with the machine's g++ against
jaxlib's FFI headers into ``$JAXINFER_HOME/native/`` (keyed by a hash of the source and headers,
the compiler command, the compiler's ``--version`` and the jaxlib version), then registered with
XLA, where the CPU has the library's instructions. The questions are answered per library, and
callers keep the references where the answer is no: ``available()``, whether the int8 kernels
are usable (their vector loops need AVX2 + FMA, and use AVX-512BW where the CPU has it), ``f32_available()``, whether the float32 kernels
are (AVX2 + FMA or AVX-512F), ``attention_available()``, whether the attention kernels are (the
same), and ``amx_available()``, whether int8_amx is (AMX-INT8, and Linux grants the process its
tiles). ``library_status(name)`` says why one is not: the CPU lacks its instructions, or it failed
to build (with the compiler's error). Whether an engine calls them at all is its ``kernels``
choice (``jaxinfer.dispatch``: "native", the default on one CPU device, or "xla").

Each call runs on ``threads`` threads, by default ``default_threads()``: the cores this process
may run on. A call cuts its output columns (or rows, or attention items) into one contiguous
range of whole column blocks per thread, at least four blocks each (``split_plan``); the calling
thread runs the first and XLA's intra-op pool, which XLA sizes to the same cores, the others
(``gemv_split.h``; ``split_count`` counts the ranges). The cut never changes which code computes
an output, so the results are the same bits at any thread count.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

_HERE = Path(__file__).parent
HEADERS = [_HERE / "gemv_split.h", _HERE / "paged_attention_body.h"]
TARGET = "jaxinfer_int8_gemv"
WO8_TARGET = "jaxinfer_wo8_gemv"
WO8_GEMM_TARGET = "jaxinfer_wo8_gemm"
S8_GEMM_TARGET = "jaxinfer_s8_gemm"
WO8_GEMM_MAX_ROWS = 512  # rows per call of wo8_gemm (more: several calls)
F32_TARGET = "jaxinfer_f32_gemv"
F32_T_TARGET = "jaxinfer_f32_gemv_t"
F32_PACKED_TARGET = "jaxinfer_f32_gemm_packed"
F32_PACKED_MAX_ROWS = 512  # rows per call of f32_gemm_packed (more: several calls)
ROWS_TARGET = "jaxinfer_paged_rows"
ROWS_I8_TARGET = "jaxinfer_paged_rows_i8"
ROWS_MAX_PAGE = 64  # paged_rows: positions per page
PREFILL_TARGET = "jaxinfer_prefill_row"
PREFILL_I8_TARGET = "jaxinfer_prefill_row_i8"
AMX_TARGET = "jaxinfer_int8_amx"
AMX_FLAGS = {"amx_tile", "amx_int8"}
MAX_ROWS = 4  # int8_gemv, wo8_gemv
F32_MAX_ROWS = 16  # f32_gemv: a verification step's k + 1 rows, decode batches of up to 16
# f32_gemv's vector variants, best first, and the CPU flags each needs.
ISA_FLAGS = {"avx512": {"avx512f"}, "avx2": {"avx2", "fma"}}
# The libraries, one per source file (one that fails to compile takes no other with it), and
# the XLA targets each registers: its handler symbols of the same names.
LIBRARIES = {
    "int8_gemv": (TARGET, WO8_TARGET, WO8_GEMM_TARGET, S8_GEMM_TARGET),
    "f32_gemv": (F32_TARGET, F32_T_TARGET, F32_PACKED_TARGET),
    "paged_attention": (ROWS_TARGET, ROWS_I8_TARGET, PREFILL_TARGET, PREFILL_I8_TARGET),
    "int8_amx": (AMX_TARGET,),
}
_lock = threading.Lock()


def default_threads() -> int:
    """The threads a kernel call runs on by default: the cores this process may run on
    (its CPU affinity, as ``taskset`` or a container's cpuset leave it), else all of the
    machine's. XLA sizes the intra-op pool the kernels hand their work to the same way."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        return max(1, os.cpu_count() or 1)


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compiler() -> str:
    return os.environ.get("CXX", "g++")  # make's convention for the C++ compiler


def _command(source: Path, out: Path) -> list[str]:
    return [_compiler(), "-O3", "-std=c++17", "-shared", "-fPIC", f"-I{jax.ffi.include_dir()}", f"-I{_HERE}",
            str(source), "-o", str(out)]


@functools.cache
def _compiler_version() -> str:
    """``$CXX --version`` (its first lines name the compiler and its version): part of the
    build key, so a compiler upgrade rebuilds the libraries."""
    p = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, timeout=60, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{_compiler()} --version failed:\n{p.stderr[-2000:]}")
    return p.stdout


def _build(name: str) -> Path:
    """Compile ``{name}.cc`` into ``$JAXINFER_HOME/native/{name}-{key}.so`` unless that is
    there, key a hash of the source, the headers, the compiler command, the compiler's version
    and jaxlib's version."""
    import jaxlib

    from jaxinfer import registry

    source = _HERE / f"{name}.cc"
    key = hashlib.sha256(b"".join(f.read_bytes() for f in [source, *HEADERS])
                         + " ".join(_command(source, Path("x"))).encode() + _compiler_version().encode()
                         + jaxlib.__version__.encode()).hexdigest()[:16]
    out = registry.home() / "native" / f"{name}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        p = subprocess.run(_command(source, tmp), capture_output=True, text=True, check=False)
        if p.returncode != 0:
            raise RuntimeError(f"building {source.name} failed:\n{p.stderr[-2000:]}")
        tmp.replace(out)  # atomic: a concurrent build by another process is harmless
    return out


@functools.cache
def isas() -> tuple[str, ...]:
    """The vector variants (keys of ``ISA_FLAGS``) this CPU runs, best first."""
    return tuple(isa for isa in ISA_FLAGS if ISA_FLAGS[isa] <= _cpu_flags())


def _not_for_here(name: str) -> str | None:
    """Why library ``name`` is not wanted here (the CPU lacks its instructions), or None where
    it should be built."""
    if name in ("f32_gemv", "paged_attention", "int8_gemv"):
        return None if isas() else f"{name} needs AVX2 + FMA or AVX-512F"
    needs = ("avx512bw", *sorted(AMX_FLAGS))
    if "avx512" not in isas() or not set(needs) <= _cpu_flags():
        names = {"avx512bw": "AVX-512BW", "amx_tile": "AMX-TILE", "amx_int8": "AMX-INT8"}
        return f"{name} needs AVX-512F, {', '.join(names[f] for f in needs)}"
    return None


@dataclasses.dataclass(frozen=True)
class LibraryStatus:
    """Where a native library stands in this process (``library_status``)."""

    loaded: bool  # built, loaded and its handlers registered with XLA
    failed: bool  # wanted here (the CPU has its instructions) but it did not build or load
    reason: str  # why it is not loaded: the missing instructions, or the build's error; "" if loaded


@functools.cache
def _load(name: str):
    """(the loaded library with its handlers registered with XLA, None) or (None, its
    LibraryStatus), once per process."""
    if name not in LIBRARIES:
        raise ValueError(f"{name=}: one of {', '.join(LIBRARIES)}")
    why = _not_for_here(name)
    if why is not None:
        return None, LibraryStatus(loaded=False, failed=False, reason=why)
    with _lock:
        try:
            lib = ctypes.cdll.LoadLibrary(str(_build(name)))
            for target in LIBRARIES[name]:
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)), platform="cpu")
        except Exception as e:  # noqa: BLE001  (no compiler, one too old for the source...): XLA serves
            print(f"jaxinfer: native {name} kernels unavailable, using XLA ({e})", file=sys.stderr)
            return None, LibraryStatus(loaded=False, failed=True, reason=f"{name} did not build or load: {e}")
    return lib, LibraryStatus(loaded=True, failed=False, reason="")


def library_status(name: str) -> LibraryStatus:
    """Whether library ``name`` (a key of ``LIBRARIES``) is loaded here, building it on first
    use, and if not, whether that is the CPU's doing or a failed build's."""
    return _load(name)[1]


def _library(name: str):
    return _load(name)[0]


def split_plan(width: int, *, unit: int, threads: int, library: str = "f32_gemv") -> list[tuple[int, int]]:
    """The column ranges [c0, c1) a kernel call cuts ``width`` outputs in units of ``unit``
    into at ``threads`` threads, one range per thread (``gemv_split.h``), as the loaded
    ``library`` computes them."""
    lib = _library(library)
    if lib is None:
        raise RuntimeError(f"split_plan: {library_status(library).reason}")
    if unit < 1 or threads < 1 or width < 0:
        raise ValueError(f"split_plan needs unit >= 1, threads >= 1 and width >= 0, got {unit=}, {threads=}, {width=}")
    bounds = (ctypes.c_int64 * (min(threads, max(1, width // unit)) + 1))()
    fn = lib.jaxinfer_split_plan
    fn.restype = ctypes.c_int64
    parts = fn(ctypes.c_int64(width), ctypes.c_int64(unit), ctypes.c_int64(threads), bounds)
    return [(bounds[k], bounds[k + 1]) for k in range(parts)]


def split_count(library: str) -> int:
    """How many ranges the calls of the loaded ``library`` have been cut into so far in this
    process (a call left whole counts one): its difference over one call is how many threads
    that call shared its work among, the caller's included."""
    lib = _library(library)
    if lib is None:
        raise RuntimeError(f"split_count: {library_status(library).reason}")
    fn = lib.jaxinfer_split_count
    fn.restype = ctypes.c_int64
    return fn()


def available() -> bool:
    """Whether the int8 kernels (int8_gemv, wo8_gemv, wo8_gemm) are registered here: their
    vector loops need AVX2 + FMA (or AVX-512BW, which int8_gemv and wo8_gemv use where the CPU
    has it); elsewhere they would run their scalar loops, slower than XLA's dot."""
    return library_status("int8_gemv").loaded


def f32_available() -> bool:
    """Whether the float32 kernels (f32_gemv) are registered here: AVX2 + FMA or AVX-512F."""
    return library_status("f32_gemv").loaded


def attention_available() -> bool:
    """Whether the attention kernels (paged_rows, prefill_row) are registered here: AVX2 + FMA
    or AVX-512F."""
    return library_status("paged_attention").loaded


@functools.cache
def amx_available() -> bool:
    """Whether int8_amx runs here: the CPU has AMX-INT8 (Sapphire Rapids and later), Linux
    grants this process AMX's tile state, and the library is built."""
    lib = _library("int8_amx")
    return lib is not None and lib.jaxinfer_amx_ready() == 1


def amx_fits(I: int, O: int) -> bool:
    """Whether an int8 weight [I, O] has a packed form: I a multiple of 64, O of 16."""
    return I % 64 == 0 and O % 16 == 0 and I > 0 and O > 0


def amx_pack(w: jax.Array) -> jax.Array:
    """int8 w [I, O] -> the packed weight [O/16, I/64, 16, 16, 4] int8 that int8_amx reads:
    element (nb, kb, r, n, j) = w[64 kb + 4 r + j, 16 nb + n] (``int8_amx.cc``)."""
    I, O = w.shape
    if not amx_fits(I, O):
        raise ValueError(f"amx_pack needs I % 64 == 0 and O % 16 == 0, got [{I}, {O}]")
    return w.reshape(I // 64, 16, 4, O // 16, 16).transpose(3, 0, 1, 4, 2)


def amx_unpack(p: jax.Array) -> jax.Array:
    """The inverse of amx_pack: [O/16, I/64, 16, 16, 4] -> [I, O]."""
    NB, KB = p.shape[:2]
    return p.transpose(1, 2, 4, 0, 3).reshape(KB * 64, NB * 16)


def amx_take_columns(p: jax.Array, cols: jax.Array) -> jax.Array:
    """Columns ``cols`` i32[n] of the packed weight's [I, O] -> int8 [I, n], reading only
    their tiles' rows (a quantized embedding's lookup)."""
    blocks = jnp.take(p, cols // 16, axis=0)  # [n, KB, 16, 16, 4]
    idx = (cols % 16)[:, None, None, None, None]
    one = jnp.take_along_axis(blocks, idx, axis=3)[:, :, :, 0, :]  # [n, KB, 16, 4]
    return one.reshape(cols.shape[0], -1).T


def int8_amx(xq: jax.Array, p: jax.Array, *, threads: int | None = None) -> jax.Array:
    """int8 [M, I] @ the packed int8 weight p (amx_pack of [I, O]) -> int32 [M, O], for any M,
    on AMX; call only where ``amx_available()``. The same integers as XLA's s8 dot of the
    unpacked weight (``int8_amx_reference``)."""
    if not amx_available():
        raise RuntimeError("int8_amx needs AMX-INT8 and g++ (check amx_available() first)")
    O = p.shape[0] * 16
    if threads is None:
        threads = default_threads()
    call = jax.ffi.ffi_call(AMX_TARGET, jax.ShapeDtypeStruct((xq.shape[0], O), jnp.int32), vmap_method="sequential")
    return call(xq.astype(jnp.int8), p, threads=threads)


def int8_amx_reference(xq: jax.Array, p: jax.Array) -> jax.Array:
    """XLA's s8 dot of the unpacked weight: the same integers as int8_amx."""
    return int8_gemv_reference(xq, amx_unpack(p))


def _gemv(target: str, x: jax.Array, w: jax.Array, x_dtype, out_dtype, threads: int | None) -> jax.Array:
    """x [M, I] @ w [I, O] through the native handler ``target`` (M <= 4)."""
    M, O = x.shape[0], w.shape[1]
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"{target} takes 1..{MAX_ROWS} rows, got {M}")
    if not available():
        raise RuntimeError(f"{target} needs AVX2 + FMA and g++ (check available() first)")
    if threads is None:
        threads = default_threads()
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((M, O), out_dtype), vmap_method="sequential")
    return call(x.astype(x_dtype), w.astype(jnp.int8), threads=threads)


def int8_isa(rows: int) -> str:
    """The vector code the int8 kernels run for ``rows`` rows here, as the library picks it by
    cpuid: "avx512bw" (int8_gemv at any rows it takes, wo8 at up to ``MAX_ROWS``) or "avx2"."""
    return "avx512bw" if "avx512bw" in _cpu_flags() and "avx512" in isas() and rows <= MAX_ROWS else "avx2"


def int8_gemv(xq: jax.Array, w: jax.Array, *, threads: int | None = None) -> jax.Array:
    """int8 [M, I] @ int8 [I, O] -> int32 [M, O] (M <= 4) through the native kernel; call
    only where ``available()``. ``threads`` (default: ``default_threads()``) > 1 cuts the
    columns of a weight at least 512 wide into up to that many ranges of at least 256 columns,
    all but the first offered to XLA's intra-op thread pool (``split_plan``)."""
    return _gemv(TARGET, xq, w, jnp.int8, jnp.int32, threads)


def int8_gemv_reference(xq: jax.Array, w: jax.Array) -> jax.Array:
    """XLA's s8 x s8 -> s32 dot: the same integers as int8_gemv."""
    return jax.lax.dot_general(xq, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)


def wo8_gemv(x: jax.Array, w: jax.Array, *, threads: int | None = None) -> jax.Array:
    """float32 [M, I] @ int8 [I, O] -> float32 [M, O] (M <= 4), unscaled, through the native
    kernel; call only where ``available()``."""
    return _gemv(WO8_TARGET, x, w, jnp.float32, jnp.float32, threads)


def wo8_gemm(x: jax.Array, w: jax.Array, *, threads: int | None = None) -> jax.Array:
    """float32 [M, I] @ int8 [I, O] -> float32 [M, O] for any M (512 rows per kernel call),
    unscaled, through the native kernel; call only where ``available()``. The weight is widened
    to float32 a panel at a time in L1, once per block of rows, never whole in memory; each
    output is one FMA chain over the input channels in order, so the result is the same bits
    as wo8_gemv's at any row count and thread count, and equals ``wo8_gemm_reference`` to
    float32 rounding."""
    if not available():
        raise RuntimeError("wo8_gemm needs AVX2 + FMA and g++ (check available() first)")
    if x.shape[0] < 1:
        raise ValueError(f"wo8_gemm takes at least one row, got {x.shape[0]}")
    return _rows_in_calls(WO8_GEMM_TARGET, x.astype(jnp.float32), w.astype(jnp.int8), jnp.float32, threads)


def wo8_gemv_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """XLA: the weight widened to float32, then the float32 dot."""
    return jax.lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32), (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)


wo8_gemm_reference = wo8_gemv_reference  # the same product, for any number of rows


def _rows_in_calls(target: str, x: jax.Array, w: jax.Array, out_dtype, threads: int | None) -> jax.Array:
    """x [M, I] @ w [I, O] through the any-rows handler ``target``, 512 rows per call."""
    O = w.shape[1]
    if threads is None:
        threads = default_threads()

    def call(rows: jax.Array) -> jax.Array:
        out = jax.ShapeDtypeStruct((rows.shape[0], O), out_dtype)
        return jax.ffi.ffi_call(target, out, vmap_method="sequential")(rows, w, threads=threads)

    M = x.shape[0]
    if M <= WO8_GEMM_MAX_ROWS:
        return call(x)
    return jnp.concatenate([call(x[i : i + WO8_GEMM_MAX_ROWS]) for i in range(0, M, WO8_GEMM_MAX_ROWS)])


def s8_gemm_available() -> bool:
    """Whether s8_gemm runs here: AVX2 and the int8 library built."""
    return available() and "avx2" in _cpu_flags()


def has_vnni() -> bool:
    """Whether the CPU has an int8 dot-product instruction (AVX-512 VNNI or AVX-VNNI's
    vpdpbusd), which XLA's own s8 dot uses where it exists."""
    return bool({"avx512_vnni", "avx_vnni"} & _cpu_flags())


def s8_gemm(xq: jax.Array, w: jax.Array, *, threads: int | None = None) -> jax.Array:
    """int8 [M, I] @ int8 [I, O] -> int32 [M, O] for any M (512 rows per kernel call) through
    the native AVX2 kernel; call only where ``s8_gemm_available()``. The same integers as XLA's
    s8 dot (``int8_gemv_reference``), at any thread count."""
    if not s8_gemm_available():
        raise RuntimeError("s8_gemm needs AVX2 and g++ (check s8_gemm_available() first)")
    if xq.shape[0] < 1:
        raise ValueError(f"s8_gemm takes at least one row, got {xq.shape[0]}")
    return _rows_in_calls(S8_GEMM_TARGET, xq.astype(jnp.int8), w.astype(jnp.int8), jnp.int32, threads)


def f32_gemv(x: jax.Array, w: jax.Array, *, transposed: bool = False, threads: int | None = None,
             isa: str | None = None) -> jax.Array:
    """float32 [M <= 16, I] @ float32 w [I, O] (or, ``transposed``, w [O, I] contracted on its
    second axis) -> float32 [M, O] through the native kernel; call only where
    ``f32_available()``. ``isa``: the vector variant, one of ``isas()`` (default: the first,
    the best this CPU runs)."""
    M, O = x.shape[0], w.shape[0 if transposed else 1]
    if not 1 <= M <= F32_MAX_ROWS:
        raise ValueError(f"f32_gemv takes 1..{F32_MAX_ROWS} rows, got {M}")
    if not f32_available():
        raise RuntimeError("f32_gemv needs AVX2 + FMA and g++ (check f32_available() first)")
    if isa is None:
        isa = isas()[0]
    if isa not in isas():
        raise ValueError(f"{isa=} does not run here: one of {isas()}")
    if threads is None:
        threads = default_threads()
    call = jax.ffi.ffi_call(F32_T_TARGET if transposed else F32_TARGET, jax.ShapeDtypeStruct((M, O), jnp.float32),
                            vmap_method="sequential")
    return call(x.astype(jnp.float32), w.astype(jnp.float32), threads=threads, isa=isa)


@functools.cache
def f32_packed_available() -> bool:
    """Whether f32_gemm_packed runs here: AVX-512F and the library built."""
    return "avx512" in isas() and f32_available()


def f32_packed_fits(I: int, O: int) -> bool:
    """Whether a float32 weight [I, O] can be packed: whole panels of 16 columns."""
    return I >= 1 and O % 16 == 0 and O > 0


def f32_pack(w: jax.Array) -> jax.Array:
    """float32 w [I, O] -> panels of 16 columns [O/16, I, 16]: element (p, k, n) = w[k, 16 p + n]."""
    I, O = w.shape
    if not f32_packed_fits(I, O):
        raise ValueError(f"f32_pack needs O % 16 == 0, got [{I}, {O}]")
    return w.reshape(I, O // 16, 16).transpose(1, 0, 2)


def f32_unpack(p: jax.Array) -> jax.Array:
    """The inverse of f32_pack: [O/16, I, 16] -> [I, O]."""
    return p.transpose(1, 0, 2).reshape(p.shape[1], p.shape[0] * 16)


def f32_gemm_packed(x: jax.Array, p: jax.Array, *, threads: int | None = None) -> jax.Array:
    """float32 x [M, I] @ the packed weight p [O/16, I, 16] -> float32 [M, O], any M (512 rows
    per kernel call); call only where ``f32_packed_available()``."""
    M, O = x.shape[0], p.shape[0] * 16
    if threads is None:
        threads = default_threads()

    def call(rows: jax.Array) -> jax.Array:
        out = jax.ShapeDtypeStruct((rows.shape[0], O), jnp.float32)
        return jax.ffi.ffi_call(F32_PACKED_TARGET, out, vmap_method="sequential")(rows, p, threads=threads)

    x = x.astype(jnp.float32)
    if M <= F32_PACKED_MAX_ROWS:
        return call(x)
    return jnp.concatenate([call(x[i : i + F32_PACKED_MAX_ROWS]) for i in range(0, M, F32_PACKED_MAX_ROWS)])


def f32_gemm_packed_reference(x: jax.Array, p: jax.Array) -> jax.Array:
    """XLA's float32 dot of the unpacked weight."""
    return jax.lax.dot_general(x, f32_unpack(p), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def f32_gemv_reference(x: jax.Array, w: jax.Array, *, transposed: bool = False) -> jax.Array:
    """XLA's float32 dot (at one row and [I, O], the same bits as f32_gemv)."""
    return jax.lax.dot_general(x, w, (((1,), (1 if transposed else 0,)), ((), ())),
                               preferred_element_type=jnp.float32)


def rows_isa() -> str:
    """paged_rows's best vector variant here: its AVX-512 one also needs BW, DQ and VL."""
    if "avx512" in isas() and {"avx512bw", "avx512dq", "avx512vl"} <= _cpu_flags():
        return "avx512"
    return "avx2"


def paged_rows(q, k, v, table, base, qpos, end, *, scale: float, window: int | None = None,
               softcap: float | None = None, k_scale=None, v_scale=None, threads: int | None = None,
               isa: str | None = None) -> jax.Array:
    """Paged attention of decode rows through the native kernel (``paged_attention.cc``): q
    [B, T, N, H] at positions qpos i32[B, T] over the pages table i32[B, n] of the pools k
    [P, K, H, ps] and v [P, K, ps, H] (float32; or int8 with ``k_scale``/``v_scale`` f32[P, K,
    ps]), column c holding logical page base[b] + c, positions < end[b] written -> f32[B, T, N,
    H]. The semantics of ``models.packed.paged_rows_attention`` without ``own`` (its
    reference); call only where ``attention_available()``."""
    if k.shape[3] > ROWS_MAX_PAGE:
        raise ValueError(f"paged_rows takes pages of at most {ROWS_MAX_PAGE} positions, got {k.shape[3]}")
    base = jnp.zeros((q.shape[0],), jnp.int32) if base is None else base
    return _attention("paged_rows", ROWS_I8_TARGET if k_scale is not None else ROWS_TARGET, q.shape,
                      q.astype(jnp.float32), k, v, *_scales(k_scale, v_scale),
                      *(jnp.asarray(a, jnp.int32) for a in (table, base, qpos, end)),
                      scale=scale, window=window, softcap=softcap, threads=threads, isa=isa)


def _scales(k_scale, v_scale) -> list:
    """The int8 pools' scales as float32, or placeholders for float32 pools."""
    return [jnp.zeros((1,), jnp.float32) if a is None else a.astype(jnp.float32) for a in (k_scale, v_scale)]


def _attention(name: str, target: str, out_shape, *args, scale: float, window: int | None, softcap: float | None,
               threads: int | None, isa: str | None) -> jax.Array:
    """Call the attention handler ``target`` of ``paged_attention.cc`` on ``args`` (in its
    order) with the attributes both kernels take -> f32 ``out_shape``."""
    if not attention_available():
        raise RuntimeError(f"{name} needs AVX2 + FMA and g++ (check attention_available() first)")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(out_shape, jnp.float32), vmap_method="sequential")
    return call(*args, scale=np.float32(scale), softcap=np.float32(softcap or 0.0), window=int(window or 0),
                threads=default_threads() if threads is None else threads,
                isa=rows_isa() if isa is None else isa)


def prefill_row_fits(T: int, H: int, page_size: int) -> bool:
    """Whether prefill_row takes a row of T tokens with head dim H over pages of page_size."""
    return T % 16 == 0 and H % 16 == 0 and page_size % 16 == 0


def prefill_row(q, k, v, pos, seg, kpool, vpool, table, base, hist_end, *, scale: float, window: int | None = None,
                softcap: float | None = None, k_scale=None, v_scale=None, threads: int | None = None,
                isa: str | None = None) -> jax.Array:
    """Attention of the packed prefill row through the native kernel (``paged_attention.cc``):
    q [T, N, H] and the row's own keys and values k, v [T, K, H] at positions pos i32[T] in
    segments seg i32[T] (-1: padding, last); a token sees the earlier tokens of its segment,
    and segment 0 also the positions < hist_end of the pages table i32[n] (column c holding
    logical page base + c) of the pools kpool [P, K, H, ps], vpool [P, K, ps, H] (float32, or
    int8 with ``k_scale``/``v_scale``) -> f32[T, N, H]. The semantics of
    ``models.packed.prefill_row_attention`` (its reference); call only where
    ``attention_available()`` and ``prefill_row_fits``."""
    if not prefill_row_fits(q.shape[0], q.shape[2], kpool.shape[3]):
        raise ValueError(f"prefill_row: the row ({q.shape[0]}), head dim ({q.shape[2]}) and page size "
                         f"({kpool.shape[3]}) must be multiples of 16")
    hist = jnp.stack([jnp.asarray(0 if base is None else base, jnp.int32).reshape(()),
                      jnp.asarray(hist_end, jnp.int32).reshape(())])
    return _attention("prefill_row", PREFILL_I8_TARGET if k_scale is not None else PREFILL_TARGET, q.shape,
                      *(a.astype(jnp.float32) for a in (q, k, v)), jnp.asarray(pos, jnp.int32),
                      jnp.asarray(seg, jnp.int32), kpool, vpool, *_scales(k_scale, v_scale),
                      jnp.asarray(table, jnp.int32).reshape(-1), hist,
                      scale=scale, window=window, softcap=softcap, threads=threads, isa=isa)
