"""Which kernel runs each op: one choice per engine, made here, and the ops that follow it.

An engine runs every attention and every matmul of its steps through one of three families of
code:

* ``pallas``: the Pallas kernels (``pallas_kernels``, adapted by ``jaxinfer.kernels``), the
  compiled ones on TPU/GPU, or on CPU in Pallas interpret mode (``interpret``: the TPU/GPU path
  traced and checked on CPU, slowly);
* ``native``: the C++ CPU kernels (``jaxinfer.cpu_kernels``), on a one-device CPU backend where
  the library of each op built for this CPU;
* ``xla``: the pure-JAX references, on any backend.

``choose(option, mesh=..., devices=...)`` turns the user's ``kernels=`` option ("auto",
"pallas", "native", "xla"; ``LLM(kernels=...)``, ``--kernels``) into a frozen ``Kernels`` once,
from the devices the engine runs on: their platform and count, and the engine's mesh. The
kernels follow those devices, not ``jax.default_backend()``, so an engine's step compiles for a
TPU topology (``jax.experimental.topologies``) from a CPU host. On a mesh every Pallas call runs
inside ``shard_map`` over the "model" axis (``sharding.per_model_shard``), each device on its
shard: attention on its KV heads, a quantized matmul on its part of the weight, the experts'
grouped matmul inside the mixture-of-experts block's own ``shard_map``. Nothing reads the
choice from a global: it travels with the step's inputs as static data, so it is part of every
executable's cache key (an executable traced with one choice is never reused under another):

* the matmuls' choice rides on the weights: ``bind`` gives every quantized weight the choice as
  a static field and, where a kernel is chosen for float weights, wraps them (``quant.Dense``,
  or packed once as ``quant.PackedF32`` / the AMX layout for the native kernels);
* the attention's choice rides on the page pools' view the model writes and reads
  (``models.packed.PackedKV.kernels``); the engine's jitted steps take it as the static
  argument ``kernels``.

Each op below then picks kernel or reference from that choice and the shapes it is given. A
pass outside the engine (perplexity over a dense ``cache.KVCache``, calibration) runs the
reference attention.

Compiling an engine step for a TPU slice from any host (libtpu installed, no TPU needed):
``devices = jax.experimental.topologies.get_topology_desc(platform="tpu",
topology_name="v5e:2x2", chips_per_host_bounds=(2, 2, 1)).devices``, ``mesh =
sharding.make_mesh(model=4, devices=devices)``, ``k = choose("pallas", mesh=mesh)`` (platform
"tpu", not interpreted), weights and pools as ``jax.ShapeDtypeStruct``s carrying their
shardings on that mesh (``sharding.weight_shardings`` / ``quant_shardings`` /
``kv_pool_sharding``; experts through ``sharding.place_experts``), ``bind(weights, specs, k)``,
then ``jax.jit(step.packed_step, ...).lower(...)`` with ``kernels=k`` and ``.compile()``
(``tests/test_kernels_mesh.py`` does this for toy models; a one-chip target is a mesh of one).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxinfer import cpu_kernels, kernels, quant
from jaxinfer import einsum as einsums
from jaxinfer.sampling import SamplerKernels
from jaxinfer.errors import InvalidRequest
from jaxinfer.sharding import per_model_shard
from pallas_kernels import _common
from pallas_kernels import grouped_matmul as gm
from pallas_kernels import lora as lora_kernels


class Attention(str, enum.Enum):
    PALLAS = "pallas"  # paged decode / ragged paged attention over the page pools
    NATIVE = "native"  # cpu_kernels.paged_rows / prefill_row over float32 or int8 pages
    XLA = "xla"  # the blockwise pure-JAX readers in models.packed


class Matmul(str, enum.Enum):
    PALLAS = "pallas"  # quantized matmuls and expert matmuls as Pallas kernels
    NATIVE = "native"  # int8_gemv / wo8_gemv / int8_amx / f32_gemv / f32_gemm_packed
    XLA = "xla"  # XLA's dots


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The kernel choice of an engine and where it runs (hashable: a jit static argument and a
    static pytree field; a ``Mesh`` hashes by its devices and axes)."""

    attention: Attention = Attention.XLA
    matmul: Matmul = Matmul.XLA
    interpret: bool = False  # Pallas kernels in interpret mode (CPU tests of the TPU/GPU path)
    # "cpu", "gpu" or "tpu": the engine's devices' (``choose``); None: the default backend's
    # (a Kernels made by hand, run where JAX runs by default)
    platform: str | None = None
    # the engine's (data, stage, model) mesh, or None on one device: the Pallas calls then run
    # inside shard_map over its "model" axis
    mesh: Mesh | None = None

    def __post_init__(self):
        object.__setattr__(self, "attention", Attention(self.attention))
        object.__setattr__(self, "matmul", Matmul(self.matmul))
        if self.interpret and Attention.PALLAS not in (self.attention, self.matmul):
            raise ValueError(f"interpret=True needs a Pallas choice, got {self}")
        if self.platform is not None and self.platform not in PLATFORMS:
            raise ValueError(f"platform must be one of {PLATFORMS} or None, got {self.platform!r}")
        if self.mesh is not None and "model" not in self.mesh.axis_names:
            raise ValueError(f"the kernels' mesh needs a 'model' axis, got axes {self.mesh.axis_names}")

    @property
    def pallas(self) -> bool:
        """Whether the step's other Pallas kernels (speculative verification) run too."""
        return self.attention == Attention.PALLAS


PLATFORMS = _common.PLATFORMS

# Which code each matmul took, counted as steps are traced (once per executable, not per call):
# keys like "wo8_gemm/avx2" or "s8_dot/xla". A record for tests and benchmarks, read nowhere.
traced: collections.Counter = collections.Counter()


def _ran(op: str, kernel: str) -> None:
    traced[f"{op}/{kernel}"] += 1


XLA = Kernels()
INTERPRET = Kernels(Attention.PALLAS, Matmul.PALLAS, interpret=True)
CHOICES = ("auto", "pallas", "native", "xla")


def sampler_kernels(k: Kernels) -> SamplerKernels:
    """Where the sampler's wide top-k / top-p bisections run under choice ``k``: the Pallas
    kernel (``pallas_kernels.sample_threshold``) where the engine runs Pallas on a TPU
    (interpreted if ``k`` interprets); XLA's passes elsewhere: on GPU XLA's fused reduction
    streams a row at bandwidth and there is no Triton variant, and an engine interpreting the
    TPU kernels on a CPU keeps its sampler out of interpret mode, whose 32-step loops over the
    vocabulary compile for minutes (the kernel's own tests interpret it by name)."""
    on = k.pallas and _common.resolve_platform(k.platform) == "tpu"
    return SamplerKernels(pallas=True, interpret=k.interpret, mesh=k.mesh) if on else SamplerKernels()


def device_platform(device) -> str:
    """A device's platform as the kernels name it: "cpu", "gpu" (CUDA or ROCm) or "tpu"."""
    p = device.platform
    return "gpu" if p in ("cuda", "rocm", "gpu") else p


def choose(option: str | Kernels = "auto", *, mesh: Mesh | None = None, devices=None) -> Kernels:
    """The ``Kernels`` of the user's ``kernels=`` option for an engine on ``mesh`` (its
    (data, stage, model) mesh: the Pallas calls then run per "model" shard), or, without one, on
    ``devices`` (a device or a list of them: the weights' device; default every device of the
    default backend). The platform ("cpu", "gpu", "tpu") is the devices', and it decides:

    * "auto": Pallas on TPU/GPU; on one CPU device the native kernels for each op whose library
      built here (``cpu_kernels.library_status`` says why one did not), XLA for the others; XLA
      on several CPU devices (a custom call has no sharding rule);
    * "pallas": the Pallas kernels; on CPU in interpret mode (for tests: slow);
    * "native": as "auto" on one CPU device; refused elsewhere;
    * "xla": the pure-JAX references everywhere.

    The native int8 kernels run AVX-512BW code where the CPU has it and AVX2 + FMA code elsewhere
    (``cpu_kernels.int8_isa``), picked by cpuid inside the library; which kernel each traced
    matmul took is counted in ``traced``.

    A ``Kernels`` given keeps its choice and gains the platform and mesh, unless it names a
    native kernel off one CPU device, or another platform or mesh than these devices'."""
    if mesh is not None:
        found = list(mesh.devices.flat)
    elif devices is None:
        found = jax.devices()
    else:
        found = list(devices) if isinstance(devices, (list, tuple)) else [devices]
    platform, count = device_platform(found[0]), len(found)
    where = {"platform": platform, "mesh": mesh}
    if isinstance(option, Kernels):
        if (option.attention == Attention.NATIVE or option.matmul == Matmul.NATIVE) and (platform != "cpu" or count != 1):
            raise InvalidRequest(f"the native CPU kernels need one CPU device; this is {count} {platform} device(s)")
        for name, value in where.items():
            if getattr(option, name) not in (None, value):
                raise InvalidRequest(f"kernels {name}={getattr(option, name)} differs from the engine's {value}")
        return option if (option.platform, option.mesh) == (platform, mesh) else dataclasses.replace(option, **where)
    if option not in CHOICES:
        raise InvalidRequest(f"kernels must be one of {', '.join(CHOICES)}, got {option!r}")
    if option == "xla":
        return Kernels(**where)
    if option == "pallas" or (option == "auto" and platform in _common.KERNEL_PLATFORMS):
        return Kernels(Attention.PALLAS, Matmul.PALLAS, interpret=platform not in _common.KERNEL_PLATFORMS, **where)
    if platform != "cpu" or count != 1:
        if option == "native":
            raise InvalidRequest(f"kernels='native' needs one CPU device; this is {count} {platform} device(s)")
        return Kernels(**where)
    attention = Attention.NATIVE if cpu_kernels.attention_available() else Attention.XLA
    matmul = Matmul.NATIVE if cpu_kernels.f32_available() or cpu_kernels.available() else Matmul.XLA
    return Kernels(attention, matmul, **where)


# ----------------------------------------------------------------------------- weights
def bind(weights, specs, k: Kernels):
    """``weights`` carrying the matmul choice of ``k`` (see the module docstring); ``specs``:
    the model's ``weight_specs`` (which weights are multiplied, which hold experts). The native
    choice packs, once, what its kernels read better packed: w8a8 weights into AMX tiles (AMX
    CPUs: XLA's own s8 dot repacks the whole weight on every call) and float32 weights whose
    outputs come in panels of 16 into ``PackedF32`` (AVX-512: XLA's float32 dot transposes its
    weight on every call past one row); not the embedding, which is also looked up, nor expert
    weights, which the grouped matmul reads expert by expert."""
    if k.matmul == Matmul.XLA:
        return weights
    from jaxinfer.sharding import Placed
    from jaxinfer.specs import is_spec

    amx = k.matmul == Matmul.NATIVE and cpu_kernels.amx_available()
    packed = k.matmul == Matmul.NATIVE and cpu_kernels.f32_packed_available()

    def one(spec, w):
        if isinstance(w, Placed):
            return dataclasses.replace(w, value=one(spec, w.value))
        expert = "expert" in spec.axes
        if isinstance(w, quant.QuantArray):
            if amx and w.scheme == quant.QuantScheme.W8A8 and w.layout == "io" and cpu_kernels.amx_fits(
                    w.in_size, w.out_size):
                w = dataclasses.replace(w, values=_amx_pack(w.values), layout="amx")
            return dataclasses.replace(w, kernels=k, mesh_axes=_model_axes(w.values) if k.mesh else (None, None))
        if not isinstance(w, (jax.Array, jax.ShapeDtypeStruct)) or not spec.contract_axes or w.shape != tuple(spec.shape):
            return w
        if k.matmul == Matmul.PALLAS:  # float dense dots stay XLA's; the experts' grouped matmul is a kernel
            return quant.Dense(w, k) if expert else w
        if expert or w.dtype != jnp.float32:
            return w
        contract = tuple(sorted(a % w.ndim for a in spec.contract_axes))
        free = tuple(a for a in range(w.ndim) if a not in contract)
        I, O = math.prod(w.shape[a] for a in contract), math.prod(w.shape[a] for a in free)
        if packed and "vocab" not in spec.axes and cpu_kernels.f32_packed_fits(I, O):
            return quant.PackedF32(_f32_pack(w, contract, free), tuple(w.shape), contract)
        return quant.Dense(w, k)

    return jax.tree.map(one, specs, weights, is_leaf=is_spec)


def _model_axes(values) -> tuple:
    """Whether "model" splits the rows (I) and the columns (O) of a quantized weight's values
    (a jax.Array, or a ShapeDtypeStruct with a sharding when a step is lowered abstractly)."""
    sharding = getattr(values, "sharding", None)
    spec = tuple(getattr(sharding, "spec", ())) + (None, None)
    return tuple("model" if a == "model" or (isinstance(a, tuple) and "model" in a) else None for a in spec[:2])


_amx_pack = jax.jit(cpu_kernels.amx_pack)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _f32_pack(w: jax.Array, contract: tuple[int, ...], free: tuple[int, ...]) -> jax.Array:
    return cpu_kernels.f32_pack(quant.as_matrix(w, contract, free))


# ----------------------------------------------------------------------------- matmuls
def einsum(eq: str, x: jax.Array, w) -> jax.Array:
    """``jnp.einsum(eq, x, w)`` of an activation with a weight (``layers.dot``), by the kernel
    the weight carries: a plain array or a weight bound to XLA runs XLA's dot. A ``LoRAWeight``
    adds each row's adapter term to its base weight's product."""
    if isinstance(w, LoRAWeight):
        return w.add_delta(eq, x, einsum(eq, x, w.base))
    if isinstance(w, quant.Dense):
        y = _few_rows_f32(eq, x, w.values) if w.kernels.matmul == Matmul.NATIVE else None
        return xla_einsum(eq, x, w.values) if y is None else y
    if hasattr(w, "einsum"):  # QuantArray, PackedF32 and other weights with a contraction of their own
        return w.einsum(eq, x, matmul=matmul)
    return xla_einsum(eq, x, w)


def xla_einsum(eq: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """The reference: XLA's einsum (``jnp.einsum``'s program), in x's dtype."""
    w = w.astype(x.dtype) if w.dtype != x.dtype else w
    lhs, out = eq.split("->")
    xs, ws = lhs.split(",")
    c = "".join(ch for ch in xs if ch in ws and ch not in out)
    if len(c) > 1 and xs.endswith(c) and ws.startswith(c):
        # several contracted axes, trailing in x and leading in w ("BTNH,NHD->BTD"): merge
        # them (free reshapes) so XLA CPU does not transpose the weight on every call
        n = len(c)
        x2 = x.reshape(*x.shape[:-n], -1)
        w2 = w.reshape(-1, *w.shape[n:])
        return einsums.einsum(f"{xs[:-n]}Z,Z{ws[n:]}->{out}", x2, w2)
    return einsums.einsum(eq, x, w)


def _few_rows_f32(eq: str, x: jax.Array, w: jax.Array) -> jax.Array | None:
    """``einsum`` of 1..16 float32 rows through the native ``f32_gemv`` (batch-1 decode, a
    verification step's k + 1 rows, decode batches up to 16), or None where XLA keeps it. XLA
    CPU packs a float32 weight for a dot of two or more rows, so 5 rows cost ~2x one, 16 rows
    ~3x; the kernel reads the weight once as stored, [I, O] or [O, I] (the tied head,
    "BTD,VD->BTV"). At one row XLA streams the weight too, but the kernel's split over the
    cores is faster, with XLA's bits for [I, O]; the head at one row stays with XLA (the
    kernel sums it in another order), so plain batch-1 decoding computes what XLA does."""
    if x.dtype != jnp.float32 or w.dtype != jnp.float32 or not cpu_kernels.f32_available():
        return None
    lhs, out = eq.split("->")
    xs, ws = lhs.split(",")
    c = "".join(ch for ch in xs if ch in ws)
    if not c or any(ch in out for ch in c) or not xs.endswith(c):
        return None
    keep, free = xs[: -len(c)], ws.replace(c, "")
    if out != keep + free or ws not in (c + free, free + c):
        return None
    M = math.prod(x.shape[: len(keep)])
    transposed = ws == free + c
    if not (1 if not transposed else 2) <= M <= cpu_kernels.F32_MAX_ROWS:
        return None
    I = math.prod(x.shape[len(keep):])
    w2 = w.reshape(-1, I) if transposed else w.reshape(I, -1)
    y = cpu_kernels.f32_gemv(x.reshape(M, I), w2, transposed=transposed)
    return y.reshape(*x.shape[: len(keep)], *(w.shape[: len(free)] if transposed else w.shape[len(c):]))


def matmul(w, x: jax.Array) -> jax.Array:
    """x [M, I] @ the bound weight w ([I, O] as stored) -> [M, O] in x.dtype: the 2-D product
    behind ``QuantArray.einsum`` and ``PackedF32.einsum``."""
    if isinstance(w, quant.PackedF32):  # made by bind for the native kernel only
        return cpu_kernels.f32_gemm_packed(x, w.values).astype(x.dtype)
    k = w.kernels or XLA
    if k.matmul == Matmul.PALLAS and not (w.scheme == quant.QuantScheme.INT4 and w.group % 64):
        # (the kernel unpacks int4 in tiles of 64 rows; XLA serves smaller groups)
        return kernels.quant_matmul(w, x, interpret=k.interpret, platform=k.platform, mesh=k.mesh)
    if w.scheme == quant.QuantScheme.W8A8:
        return w.matmul_rows(*w.quantize_input(x), x.dtype, dot=s8_dot)
    if (k.matmul == Matmul.NATIVE and w.scheme == quant.QuantScheme.INT8 and x.dtype == jnp.float32
            and cpu_kernels.available()):
        # float32 rows, any number: the native kernel widens the int8 weight in registers (or a
        # panel at a time in L1, shared by a block of rows); XLA would widen all of it to float32
        # in memory first, on every call
        _ran("wo8", f"wo8_gemm/{cpu_kernels.int8_isa(x.shape[0])}")
        return (cpu_kernels.wo8_gemm(x, w.values) * w.scale).astype(x.dtype)
    _ran("wo8" if w.scheme == quant.QuantScheme.INT8 else w.scheme.value, "xla")
    return w.matmul(x)


def s8_dot(w, xq: jax.Array) -> jax.Array:
    """The int32 sums of int8 rows xq [M, I] with w8a8 weight w's int8 values, by the fastest
    path w's choice has; every path gives the same integers."""
    native = (w.kernels or XLA).matmul == Matmul.NATIVE
    if w.layout == "amx" and native and cpu_kernels.amx_available():
        _ran("s8_dot", "int8_amx")
        return cpu_kernels.int8_amx(xq, w.values)  # the weight was packed once, by bind
    few = xq.shape[0] <= cpu_kernels.MAX_ROWS
    if native and few and cpu_kernels.available() and (
            cpu_kernels.int8_isa(xq.shape[0]) == "avx512bw" or not cpu_kernels.s8_gemm_available()):
        # a few rows (batch-1 decode): the native kernel streams the weight as stored, where
        # XLA's dot would repack all of it first. On AVX2 s8_gemm takes them instead: it ran
        # SmolLM2's projections at 1 / 2 / 4 rows in 9.3 / 9.9 / 16.5 ms of CPU against
        # int8_gemv's 29.3 / 28.1 / 37.7 (benchmarks/kernel_cpu_time.cc, Zen 3)
        _ran("s8_dot", f"int8_gemv/{cpu_kernels.int8_isa(xq.shape[0])}")
        return cpu_kernels.int8_gemv(xq, w.values_io())
    if native and cpu_kernels.s8_gemm_available() and (few or not cpu_kernels.has_vnni()):
        # more rows on a CPU without VNNI (AVX2 only: AMD Zen 2/3, older Intel): the native
        # kernel's vpmaddwd streams the weight once per block of rows; XLA's dot repacks it per call.
        # With VNNI, XLA's dot (YNNPACK's vpdpbusd) keeps them (a few rows: see above).
        _ran("s8_dot", "s8_gemm/avx2")
        return cpu_kernels.s8_gemm(xq, w.values_io())
    _ran("s8_dot", "xla")
    return quant.s8_dot(xq, w.values_io())


def einsum_many(x: jax.Array, *pairs: tuple[str, object]) -> tuple[jax.Array, ...]:
    """Several ``einsum(eq, x, w)`` of one activation (q/k/v, gate/up). w8a8 weights (smoothing
    folded away) not bound to the Pallas kernel share one quantization of x."""
    if any(isinstance(w, LoRAWeight) for _, w in pairs):  # the base products as without adapters
        base = einsum_many(x, *((eq, w.base if isinstance(w, LoRAWeight) else w) for eq, w in pairs))
        return tuple(w.add_delta(eq, x, y) if isinstance(w, LoRAWeight) else y for (eq, w), y in zip(pairs, base))
    ws = [w for _, w in pairs]
    if quant.shares_input(ws) and all((w.kernels or XLA).matmul != Matmul.PALLAS for w in ws):
        return quant.einsum_shared(x, *pairs, dot=s8_dot)
    return tuple(einsum(eq, x, w) for eq, w in pairs)


def grouped_matmul(x: jax.Array, w, group_sizes: jax.Array, *, group_offset=0) -> jax.Array:
    """x [M, I] (rows sorted by group) times each group's weight -> [M, O] in x.dtype. w: a
    float [G, I, O] (bound: ``quant.Dense``) or a ``QuantArray`` of one (contracting axis 1:
    stored [I, G*O] with a scale per group and output channel), holding groups group_offset ..
    + G - 1 of ``group_sizes``; rows of other groups give 0. Bound to Pallas: the kernel where
    its tiling fits; otherwise ``grouped_matmul_xla``, which reads only the weights of groups
    with rows (XLA CPU lowers the reference, ``ragged_dot``, to a dense dot over every group)."""
    k = getattr(w, "kernels", None) or XLA
    kw = {}
    if isinstance(w, quant.Dense):
        w = w.values
    elif isinstance(w, quant.QuantArray):
        if w.smooth is not None:
            x = (x.astype(jnp.float32) * w.smooth).astype(x.dtype)
        # w8a8 experts are multiplied as weight-only int8: the same values and scales
        kw = {"w_scale": w.scale, "out_size": w.shape[-1]}
        w = w.values_io()
    if k.matmul == Matmul.PALLAS and gm.kernel_fits(w, x.shape[1]):
        out_size = kw.get("out_size")

        def run(x, w, group_sizes, group_offset, w_scale):
            return gm.grouped_matmul_kernel(x, w, group_sizes, group_offset=group_offset, w_scale=w_scale,
                                            out_size=out_size, interpret=k.interpret, platform=k.platform)

        args = (x, w, group_sizes, group_offset, kw.get("w_scale"))
        if k.mesh is None:
            return run(*args)
        # on a mesh the experts run inside the mixture-of-experts block's shard_map, per
        # "model" shard, and this is that shard's call; a block not under one (its weights not
        # placed by ``sharding.place_experts``) runs it whole on every device
        rep = jax.sharding.PartitionSpec()
        args = (*args[:3], jnp.asarray(group_offset, jnp.int32), args[4])
        return per_model_shard(run, k.mesh, jax.tree.map(lambda _: rep, args), rep)(*args)
    return gm.grouped_matmul_xla(x, w, group_sizes, group_offset=group_offset, **kw)


# ----------------------------------------------------------------------------- LoRA
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoRAWeight:
    """A projection weight with the LoRA adapters of a packed step (``jaxinfer.lora``): the
    product of token m with it is base's plus ``(x[m] @ A[s]) @ B[s]`` for the token's adapter
    slot s = active[index[m]] (index -1: none). Made inside the step, so model code sees a
    weight like any other; the stacks hold every device slot, so loading an adapter changes
    their contents, never an executable, and the delta is computed over the n active slots only
    (n, a bucket of the adapters the step uses, is part of the executable's shapes)."""

    base: object  # the weight as bound (array, QuantArray, Dense, ...): [contracted..., free...]
    a: jax.Array  # [I, S, R] every slot's down-projection (I: the contracted axes' product)
    b: jax.Array  # [S, R, O] every slot's up-projection, scale folded in (O: the free axes' product)
    active: jax.Array  # i32[n] the device slots the step's tokens use (padded to a bucket)
    index: jax.Array  # i32[M] each token's index into active, -1: none (M: the activation's leading axes' product)
    kernels: Kernels = dataclasses.field(default=XLA, metadata={"static": True})

    def add_delta(self, eq: str, x: jax.Array, y: jax.Array) -> jax.Array:
        """y (the base product ``einsum(eq, x, base)``) plus each token's adapter term."""
        lhs, out = eq.split("->")
        xs, ws = lhs.split(",")
        c = "".join(ch for ch in xs if ch in ws and ch not in out)
        if not (c and xs.endswith(c) and ws.startswith(c) and out == xs[: -len(c)] + ws[len(c):]):
            raise ValueError(f"a LoRA weight takes contractions of x's trailing axes with the weight's "
                             f"leading ones, got {eq!r}")
        keep = x.shape[: -len(c)]
        xm = x.reshape(-1, self.a.shape[0])
        d = lora_delta(xm, self.a, self.b, self.active, self.index.reshape(xm.shape[0]), self.kernels)
        return y + d.reshape(*keep, *y.shape[len(keep):]).astype(y.dtype)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, active: jax.Array, index: jax.Array,
               k: Kernels = XLA) -> jax.Array:
    """Each row's LoRA term (``pallas_kernels.lora``): x [M, I], a [I, S, R], b [S, R, O],
    active i32[n], index i32[M] -> [M, O]; the Pallas kernel under the Pallas matmul choice,
    else XLA's."""
    if k.matmul == Matmul.PALLAS and k.mesh is None:
        return lora_kernels.lora_delta_kernel(x, a, b, active, index, interpret=k.interpret)
    return lora_kernels.lora_delta_reference(x, a, b, active, index)


# ----------------------------------------------------------------------------- attention
class PagedPath(enum.Enum):
    """How a packed step's layer reads its page pools (``models.packed.PackedKV.attend``)."""

    DECODE = "decode"  # the paged decode Pallas kernel: a step of decode rows of one query each
    RAGGED = "ragged"  # one ragged paged-attention Pallas call for every row and segment
    NATIVE = "native"  # cpu_kernels.paged_rows for the decode rows, prefill_row for the prefill row
    XLA = "xla"  # the blockwise readers of models.packed


def keys_transposed(k: Kernels, platform: str) -> bool:
    """Whether an engine's page pools store keys transposed, [P, K, H, ps] (``cache`` module
    doc), on this platform ("cpu", "gpu", "tpu") under kernel choice ``k``: only for the CPU
    readers, the native kernels and the XLA ones, which score a block of keys one head-dim row
    at a time. The Pallas kernels (interpret mode on CPU included) and every reader on TPU/GPU
    take keys [P, K, ps, H], as the values: a TPU tiles the two minor dimensions (8, 128), and
    a page of 16 positions as the minor one made XLA copy the whole key pool after each write."""
    return platform == "cpu" and k.attention != Attention.PALLAS


def whole_page_writes(k: Kernels, keys_transposed: bool) -> bool:
    """Whether the engine writes its page pools a whole page at a time (``cache.write_pages``'s
    ``whole_pages``) rather than a token at a time: on TPU, where a scatter over a pool's page
    and slot dims makes XLA relay out the whole pool (a prompt chunk's write, or any write
    inside a chain's loop)."""
    return not keys_transposed and _common.resolve_platform(k.platform) == "tpu"


def pool_lanes(k: Kernels) -> int:
    """The multiple an engine's page pools pad their minor dimension to (``cache.init_paged_cache``'s
    ``lanes``): 128 on TPU, whose (8, 128) tiles a 64-wide head or a 576-wide latent fills only
    in part, so that XLA lays such a pool out with the pages minor and copies it whole around
    each layer's write and read; 1 (the model's head dim) elsewhere, where the native CPU
    kernels read the pools as the model shapes them."""
    return 128 if _common.resolve_platform(k.platform) == "tpu" else 1


def paged_path(k: Kernels, kpool, vpool, *, defer_writes: bool, sinks: bool = False,
               decode_only: bool = False, keys_transposed: bool = True) -> PagedPath:
    """The path of a packed step's layer over pools kpool [P, K, H, ps] (keys_transposed) or
    [P, K, ps, H] / vpool (float, or ``cache.QuantKV``; kpool None: a latent pool, whose keys
    are its values). decode_only: the step's batch has decode rows of one query each and no
    prefill row (``PackedBatch.decode_only``, a static property of its shapes).

    The Pallas kernels read this step's keys from the pages, so not with deferred writes, and
    take float pools of the page sizes they tile, with or without attention sinks. A decode-only
    step goes to the paged decode kernel (one [G, H] tile per row and kv head, no query blocks
    of one real query: ``benchmarks/RESULTS.md``, "GPU kernels"); every other step
    (verification rows of q > 1, a prefill row) to the ragged kernel. The native kernels
    take float32 or int8 pools of pages up to ``cpu_kernels.ROWS_MAX_PAGE`` positions with the
    keys transposed, and no sinks. None reads a latent pool."""
    from jaxinfer.cache import QuantKV

    if kpool is None:
        return PagedPath.XLA
    ps = vpool.shape[2]
    quantized = isinstance(kpool, QuantKV)
    if k.attention == Attention.PALLAS:
        if defer_writes or quantized:
            return PagedPath.XLA
        if decode_only and kernels.paged_attention_fits(ps, kpool.dtype, platform=k.platform):
            return PagedPath.DECODE
        if kernels.ragged_paged_attention_fits(ps, kpool.dtype, platform=k.platform):
            return PagedPath.RAGGED
        return PagedPath.XLA
    if (k.attention == Attention.NATIVE and keys_transposed and not sinks and ps <= cpu_kernels.ROWS_MAX_PAGE
            and cpu_kernels.attention_available()):
        if quantized:
            return PagedPath.NATIVE if kpool.axis == -2 and vpool.axis == -1 else PagedPath.XLA
        if kpool.dtype == jnp.float32 and vpool.dtype == jnp.float32:
            return PagedPath.NATIVE
    return PagedPath.XLA
