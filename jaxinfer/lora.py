"""LoRA adapters, in vLLM's API: PEFT directories read and checked against the model, a host
cache of them, and the device slots a packed step reads.

    llm = LLM(model, enable_lora=True, max_loras=4, max_lora_rank=16)
    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))

An adapter is a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``, local or
a Hub id) whose LoRA pairs target the q, k, v, o, gate, up and down projections (any subset, any
layers), or the fused modules of families whose checkpoints fuse them (Phi-3's ``qkv_proj`` and
``gate_up_proj``, GLM-4's ``gate_up_proj``): as in vLLM, a fused module's adapter applies to each
of its slices, the A shared and B's rows split as the base weight's rows are. Each projection of a token computes ``base(x) + scale * (x A) B``, with PEFT's scale:
``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` under rsLoRA.

On device every target projection of every layer holds a stack of ``max_loras`` slots, A as
[I, S, R] and B (the scale folded in) as [S, R, O], R = ``max_lora_rank`` (a smaller rank is
zero-padded, which changes nothing). A packed step takes the distinct slots its tokens use,
padded to a bucket n of 1, 2, 4, ..., max_loras (``PackedBatch.lora_active``), and each
token's index into them (``PackedBatch.lora_index``, -1: no adapter; ``engine.batch.lora_arrays``), and
wraps each target weight in a ``dispatch.LoRAWeight``, so every family's projections
(``layers.dot``) add the term without knowing of adapters. The delta is computed over the n
active slots' n*R columns, so a step costs what its adapters need, not what max_loras allows;
a step with no adapter rows carries none and does no adapter work. Loading an adapter into a
slot writes the stacks' contents through one jitted, donated update: no new executable beyond
the bucket variants (at most log2(max_loras) + 1 per step shape, compiled by warm-up).

Rows of up to ``max_loras`` distinct adapters run together; a request for one more waits in the
queue until a slot's last row finishes (``LoRAManager.acquire``, called at admission), while
requests behind it that can run (the base model's, or an adapter's already in a slot) go ahead. Adapters
read from disk stay in a host cache of ``max_cpu_loras`` (least recently used out first).
Prefix-cache pages of a row with an adapter are named under that adapter
(``Adapter.prefix_salt``, ``engine.pages.root_hash``), so two adapters never share a prefix's pages.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import struct
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.dispatch import XLA, Kernels, LoRAWeight
from jaxinfer.errors import InvalidRequest

# the projections an adapter may target: PEFT's module name (unfused) -> our layer weight;
# a family's own checkpoint names say which modules its adapters name (``_module_map``)
TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w_gate",
           "up_proj": "w_up", "down_proj": "w_down"}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest: an adapter by name, a positive integer id unique to it, and its PEFT
    directory (a local path or a Hugging Face Hub id)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise InvalidRequest(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise InvalidRequest("lora_name must not be empty")
        if not self.lora_path:
            raise InvalidRequest(f"LoRA adapter {self.lora_name!r}: lora_path is empty")

    # vLLM's accessors
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """The engine's adapter limits, under vLLM's names and defaults."""

    max_loras: int = 1  # adapters one step may run (device slots)
    max_lora_rank: int = 16  # the largest rank an adapter may have (the slots' R)
    max_cpu_loras: int | None = None  # adapters kept read in host memory (None: max_loras)

    def __post_init__(self):
        if self.max_loras < 1:
            raise InvalidRequest(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise InvalidRequest(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise InvalidRequest(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def host_capacity(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclasses.dataclass(eq=False)
class Adapter:
    """One adapter read from its directory: per (layer, target weight) its A [I, r] and its
    B [r, O] times the scale, in the model's dtype, zero-padded to the engine's rank."""

    request: LoRARequest
    rank: int
    scale: float
    pairs: dict  # (layer, weight name) -> (a np[I, R], b np[R, O])
    # its slot contents already on their way to the device (``LoRAManager.stage``), until written
    staged: object = None

    @property
    def key(self) -> int:
        return self.request.lora_int_id

    @property
    def prefix_salt(self) -> str:
        """What names its rows' prefix-cache pages apart (``engine.pages.root_hash``)."""
        return f"lora:{self.key}:{self.request.lora_path}"


def target_shapes(cfg, family) -> dict[str, tuple[int, int]]:
    """Our target weight -> (I, O): its contracted and free sizes (every layer alike)."""
    from jaxinfer.specs import is_spec

    layer = family.weight_specs(cfg)["layers"][0]
    out = {}
    for ours in TARGETS.values():
        spec = layer.get(ours)
        if spec is None or not is_spec(spec) or "expert" in spec.axes or not spec.contract_axes:
            continue
        n = len(spec.contract_axes)
        out[ours] = (math.prod(spec.shape[:n]), math.prod(spec.shape[n:]))
    return out


def _module_map(family, cfg) -> dict[str, tuple[int, tuple[str, ...]]]:
    """PEFT module path (``model.layers.3.self_attn.q_proj``) -> (layer, our weights), from the
    family's own checkpoint names. A fused module (Phi-3's ``qkv_proj``, ``gate_up_proj``) maps
    to the weights of its row blocks, in block order (``loaders.common.fused_block``): its
    adapter's A is theirs alike and its B's rows split between them, as the base weight's are."""
    from jaxinfer.loaders.common import fused_block

    shapes = target_shapes(cfg, family)
    blocks: dict[str, dict[int, str]] = collections.defaultdict(dict)
    for path, (hf, _, transpose) in family.checkpoint_names.items():
        if len(path) != 2 or path[0] != "layers" or path[1] not in shapes or not transpose:
            continue
        tensor, block = fused_block(hf)
        if not tensor.endswith(".weight") or tensor.count("{") != 1:
            continue
        blocks[tensor[: -len(".weight")]][0 if block is None else block] = path[1]
    out = {}
    for module, by_block in blocks.items():
        if sorted(by_block) != list(range(len(by_block))):
            continue  # a fused tensor whose blocks are not all projections an adapter may target
        for i in range(cfg.n_layers):
            out[module.format(i=i)] = (i, tuple(by_block[j] for j in range(len(by_block))))
    return out


def check_base(weights: dict) -> None:
    """Refuse base weights no adapter can be added to: w8a8 projections whose SmoothQuant
    smoothing was folded into the norm or matmul before them (a w8a8 checkpoint saved
    quantized) read x / s, while an adapter's A was trained on x."""
    from jaxinfer import quant

    for i, layer in enumerate(weights["layers"]):
        for name in TARGETS.values():
            w = layer.get(name)
            if isinstance(w, quant.QuantArray) and w.scheme == quant.QuantScheme.W8A8 and w.smooth is None:
                raise InvalidRequest(
                    f"LoRA adapters (enable_lora) cannot run over these w8a8 weights: layer {i} {name} reads an "
                    "activation its smoothing was folded into (a checkpoint saved quantized), not the one an "
                    "adapter was trained on; load the float checkpoint with quantization='w8a8', which keeps the "
                    "smoothing at run time under enable_lora")


def resolve_path(request: LoRARequest, download_dir=None) -> Path:
    """The adapter's local directory: its path, or a Hub id downloaded through huggingface_hub."""
    p = Path(request.lora_path).expanduser()
    if p.exists():
        return p
    from jaxinfer import hub

    if hub.parse_hub_id(request.lora_path) is None:
        raise InvalidRequest(f"LoRA adapter {request.lora_name!r}: {request.lora_path!r} is neither a directory "
                             "nor a Hugging Face Hub id")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(request.lora_path, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE],
                                      cache_dir=download_dir))
    except Exception as e:  # noqa: BLE001 (any download failure is the request's bad path)
        raise InvalidRequest(f"LoRA adapter {request.lora_name!r}: cannot fetch {request.lora_path!r} from the "
                             f"Hub ({type(e).__name__}: {e})") from None


def _same_model(named: str, model_names) -> bool:
    """Whether the adapter's base_model_name_or_path names the served model: equal, or the same
    last path component (a Hub id and a local copy of it)."""
    tail = lambda s: str(s).rstrip("/").split("/")[-1].lower()  # noqa: E731
    return any(n and (str(n) == named or tail(n) == tail(named)) for n in model_names)


def read_adapter(request: LoRARequest, *, cfg, family, config: LoRAConfig, model_names=(),
                 download_dir=None) -> Adapter:
    """Read and check a PEFT LoRA directory against the model (InvalidRequest naming what is
    wrong: the directory, its config, a module the engine cannot apply, a rank over
    max_lora_rank, another base model, a shape that does not fit)."""
    name = request.lora_name
    where = resolve_path(request, download_dir)
    what = f"LoRA adapter {name!r} ({where})"
    if not where.is_dir():
        raise InvalidRequest(f"{what}: not a directory")
    if not (where / CONFIG_FILE).is_file():
        raise InvalidRequest(f"{what}: no {CONFIG_FILE} (a PEFT adapter directory holds {CONFIG_FILE} and "
                             f"{WEIGHTS_FILE})")
    if not (where / WEIGHTS_FILE).is_file():
        raise InvalidRequest(f"{what}: no {WEIGHTS_FILE}" + (" (adapter_model.bin is not supported: save with "
                             "safe_serialization=True)" if (where / "adapter_model.bin").is_file() else ""))
    try:
        conf = json.loads((where / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise InvalidRequest(f"{what}: {CONFIG_FILE} is not readable JSON ({e})") from None
    if not isinstance(conf, dict) or conf.get("peft_type", "LORA") != "LORA":
        raise InvalidRequest(f"{what}: peft_type {conf.get('peft_type') if isinstance(conf, dict) else conf!r} "
                             "is not LORA")
    for key, ok, why in (("use_dora", not conf.get("use_dora"), "DoRA adapters are not supported"),
                         ("bias", conf.get("bias", "none") == "none", "trained biases are not supported"),
                         ("modules_to_save", not conf.get("modules_to_save"),
                          "fully trained modules (modules_to_save) are not supported"),
                         ("rank_pattern", not conf.get("rank_pattern"), "per-module ranks are not supported"),
                         ("alpha_pattern", not conf.get("alpha_pattern"), "per-module alphas are not supported"),
                         ("fan_in_fan_out", not conf.get("fan_in_fan_out"), "fan_in_fan_out layers are not "
                          "supported")):
        if not ok:
            raise InvalidRequest(f"{what}: {key}={conf.get(key)!r}: {why}")
    base = conf.get("base_model_name_or_path")
    if base and model_names and not _same_model(base, model_names):
        raise InvalidRequest(f"{what}: trained for base model {base!r}, but this engine serves "
                             f"{next(n for n in model_names if n)!r}")
    try:
        r, alpha = int(conf["r"]), float(conf.get("lora_alpha", conf["r"]))
    except (KeyError, TypeError, ValueError):
        raise InvalidRequest(f"{what}: {CONFIG_FILE} needs an integer r (and a numeric lora_alpha)") from None
    if r < 1:
        raise InvalidRequest(f"{what}: r={r} must be >= 1")
    if r > config.max_lora_rank:
        raise InvalidRequest(f"{what}: rank r={r} exceeds max_lora_rank={config.max_lora_rank}")
    scale = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    modules = _module_map(family, cfg)
    shapes = target_shapes(cfg, family)
    dtype = np.dtype(cfg.jnp_dtype)
    R = config.max_lora_rank
    supported = ", ".join(dict.fromkeys(m.split(".")[-1] for m in modules))
    found: dict[tuple[int, tuple[str, ...]], dict[str, np.ndarray]] = collections.defaultdict(dict)
    for key, value in _read_safetensors(where / WEIGHTS_FILE, what).items():
        module, part = _split_key(key)
        if any(f".{m}." in f".{key}" for m in ("embed_tokens", "lm_head")):
            raise InvalidRequest(f"{what}: tensor {key!r}: the embedding and the LM head are not supported as "
                                 f"LoRA targets (supported: {supported} of each decoder layer)")
        if part is None:
            raise InvalidRequest(f"{what}: tensor {key!r} is not a LoRA A/B weight (only LoRA pairs of "
                                 f"the {supported} projections are supported)")
        if module not in modules:
            leaf = module.split(".")[-1]
            why = ("the embedding and the LM head are not supported as LoRA targets"
                   if leaf in ("embed_tokens", "lm_head") else
                   f"supported targets: {supported} of each decoder layer")
            raise InvalidRequest(f"{what}: module {module!r} cannot take a LoRA adapter here ({why})")
        found[modules[module]][part] = value.astype(np.float32)
    if not found:
        raise InvalidRequest(f"{what}: {WEIGHTS_FILE} holds no LoRA weights")
    pairs = {}
    for (i, ours), got in sorted(found.items()):
        what_w = f"layer {i} {'+'.join(ours)}"
        if set(got) != {"A", "B"}:
            raise InvalidRequest(f"{what}: {what_w} has lora_{''.join(got)} without its pair")
        a, b = got["A"], got["B"]  # torch Linear layouts: A [r, I], B [O, r]
        I, O = shapes[ours[0]][0], sum(shapes[w][1] for w in ours)
        if a.ndim != 2 or b.ndim != 2 or a.shape != (r, I) or b.shape != (O, r):
            raise InvalidRequest(f"{what}: {what_w}: lora_A {a.shape} and lora_B {b.shape} do not fit "
                                 f"the base model's projection (rank {r}: want A ({r}, {I}) and B ({O}, {r}))")
        pa = np.zeros((I, R), dtype)
        pa[:, :r] = a.T
        start = 0
        for w in ours:  # a fused projection: each block's weight takes its rows of B, and all of A
            rows = shapes[w][1]
            pb = np.zeros((R, rows), dtype)
            pb[:r] = b[start : start + rows].T * np.float32(scale)
            pairs[(i, w)] = (pa, pb)
            start += rows
    return Adapter(request, r, scale, pairs)


def _read_safetensors(path: Path, what: str) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file (adapters are small: read whole)."""
    from jaxinfer.loaders.hf import _DTYPES

    data = path.read_bytes()
    try:
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        out = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
            dt = _DTYPES[info["dtype"]]
            if end - begin != math.prod(shape) * dt.itemsize or 8 + n + end > len(data):
                raise ValueError(f"tensor {name!r} has {end - begin} bytes for shape {shape}")
            out[name] = np.frombuffer(data, dt, math.prod(shape), 8 + n + begin).reshape(shape)
        return out
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise InvalidRequest(f"{what}: {WEIGHTS_FILE} is not a readable safetensors file ({e})") from None


def _split_key(key: str) -> tuple[str, str | None]:
    """``base_model.model.<module>.lora_A.weight`` -> (module, "A"); (key, None) otherwise."""
    k = key.removeprefix("base_model.model.")
    for part in ("A", "B"):
        for suffix in (f".lora_{part}.weight", f".lora_{part}.default.weight"):
            if k.endswith(suffix):
                return k[: -len(suffix)], part
    return k, None


def parse_lora_modules(specs) -> dict[str, LoRARequest]:
    """``--lora-modules`` as vLLM takes them: ``name=path`` or a JSON object with "name", "path"
    (and "base_model_name") -> name -> LoRARequest, ids 1, 2, ... in the order given."""
    out: dict[str, LoRARequest] = {}
    for spec in specs or ():
        spec = spec.strip()
        if spec.startswith("{"):
            try:
                obj = json.loads(spec)
                name, path, base = obj["name"], obj["path"], obj.get("base_model_name")
            except (ValueError, KeyError, TypeError):
                raise InvalidRequest(f"--lora-modules {spec!r}: a JSON module needs \"name\" and \"path\"") from None
        else:
            name, eq, path = spec.partition("=")
            base = None
            if not eq or not name or not path:
                raise InvalidRequest(f"--lora-modules {spec!r}: expected name=path")
        if name in out:
            raise InvalidRequest(f"--lora-modules names {name!r} twice")
        out[name] = LoRARequest(name, len(out) + 1, path, base)
    return out


# ----------------------------------------------------------------------------- on device
def empty_stacks(cfg, family, config: LoRAConfig) -> dict:
    """Zero stacks of every slot: {"layers": [{weight: (a [I, S, R], b [S, R, O])}]}."""
    S, R, dt = config.max_loras, config.max_lora_rank, cfg.jnp_dtype
    shapes = target_shapes(cfg, family)
    return {"layers": [{w: (jnp.zeros((I, S, R), dt), jnp.zeros((S, R, O), dt)) for w, (I, O) in shapes.items()}
                       for _ in range(cfg.n_layers)]}


def _write_slot(stacks: dict, slot: jax.Array, new: dict) -> dict:
    """stacks with slot ``slot`` (traced: one executable for every slot) set to ``new``
    ({"layers": [{weight: (a [I, R], b [R, O])}]})."""
    def one(pair, n):
        a, b = pair
        return (jax.lax.dynamic_update_slice_in_dim(a, n[0][:, None].astype(a.dtype), slot, axis=1),
                jax.lax.dynamic_update_slice_in_dim(b, n[1][None].astype(b.dtype), slot, axis=0))

    return {"layers": [{w: one(p, n[w]) for w, p in layer.items()} for layer, n in zip(stacks["layers"], new["layers"])]}


def attach(weights: dict, stacks: dict, active: jax.Array, index: jax.Array, kernels: Kernels = XLA) -> dict:
    """weights with every target projection a ``dispatch.LoRAWeight`` over the stacks, for
    tokens whose adapters are ``active[index]`` (active i32[n] device slots, index i32[N], -1:
    none; inside a jitted step)."""
    layers = []
    for w, st in zip(weights["layers"], stacks["layers"]):
        layers.append(w | {name: LoRAWeight(w[name], a, b, active, index, kernels) for name, (a, b) in st.items()})
    return weights | {"layers": layers}


class LoRAManager:
    """The engine's adapters: the host cache of those read (LRU, ``max_cpu_loras``), the
    device slots (``max_loras``) with the number of running rows using each, and the stacks a
    step reads. ``acquire`` at admission pins an adapter to a slot (loading it into the
    least recently used free one when it has none) or says the row must wait; ``release``
    when the row leaves its decode slot."""

    def __init__(self, cfg, family, config: LoRAConfig, *, place=lambda t: t, model_names=(), download_dir=None):
        self.cfg, self.family, self.config = cfg, family, config
        self.model_names, self.download_dir = tuple(model_names), download_dir
        self.place = place  # puts a pytree where the step's weights are (device or mesh)
        self.stacks = place(empty_stacks(cfg, family, config))
        self._write = jax.jit(_write_slot, donate_argnums=0)
        self.host: collections.OrderedDict[int, Adapter] = collections.OrderedDict()
        self.slot_of: dict[int, int] = {}  # adapter id -> device slot
        self.users = [0] * config.max_loras  # running rows per slot
        self.held: list[int | None] = [None] * config.max_loras  # adapter id in each slot
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict((s, None) for s in range(config.max_loras))
        self.names: dict[str, LoRARequest] = {}  # name -> request, of every adapter read
        self.swaps = 0  # adapters written into a device slot
        self.swap_seconds = 0.0  # host time dispatching those writes (the copies run asynchronously)
        # requests are read on a server's handler threads while the engine thread admits rows
        self._lock = threading.RLock()

    def get(self, request: LoRARequest) -> Adapter:
        """The adapter, read (and checked) unless the host cache holds it. Unless it holds a
        device slot already, its copy to the device starts now, when its request arrives, so
        the step that first runs it does not wait for the copy."""
        with self._lock:
            known = self.names.get(request.lora_name)
            if known is not None and known.lora_int_id != request.lora_int_id:
                raise InvalidRequest(f"LoRA adapter {request.lora_name!r} is already loaded with lora_int_id "
                                     f"{known.lora_int_id}, not {request.lora_int_id}")
            a = self.host.get(request.lora_int_id)
            if a is not None and a.request.lora_path != request.lora_path:
                raise InvalidRequest(f"lora_int_id {request.lora_int_id} is already adapter {a.request.lora_name!r} "
                                     f"({a.request.lora_path}); each adapter needs its own id")
        if a is None:  # read outside the lock: the engine thread admits rows meanwhile
            a = read_adapter(request, cfg=self.cfg, family=self.family, config=self.config,
                             model_names=self.model_names, download_dir=self.download_dir)
        with self._lock:
            a = self.host.setdefault(request.lora_int_id, a)
            while len(self.host) > self.config.host_capacity:
                self.host.popitem(last=False)
            self.host.move_to_end(request.lora_int_id)
            self.names[request.lora_name] = request
            if a.key not in self.slot_of and a.staged is None:
                a.staged = self.place(self._contents(a))  # asynchronous: returns before the copy ends
            return a

    def _contents(self, adapter: Adapter) -> dict:
        """The adapter as one slot's contents: every target of every layer, zeros where it has none."""
        R = self.config.max_lora_rank
        layers = []
        for i, layer in enumerate(self.stacks["layers"]):
            zeros = lambda a, b: (np.zeros((a.shape[0], R), a.dtype), np.zeros((R, b.shape[2]), b.dtype))  # noqa: E731
            layers.append({w: adapter.pairs.get((i, w)) or zeros(a, b) for w, (a, b) in layer.items()})
        return {"layers": layers}

    def can_acquire(self, adapter: Adapter) -> bool:
        """Whether ``acquire`` would give the adapter a slot now."""
        with self._lock:
            return adapter.key in self.slot_of or any(u == 0 for u in self.users)

    def acquire(self, adapter: Adapter) -> int | None:
        """The device slot of ``adapter``, pinned for one more row; None when every slot is
        pinned by other adapters (the row waits)."""
        with self._lock:
            key = adapter.key
            slot = self.slot_of.get(key)
            if slot is None:
                slot = next((s for s in self.lru if self.users[s] == 0), None)
                if slot is None:
                    return None
                self._load(slot, adapter)
            self.users[slot] += 1
            self.lru.move_to_end(slot)
            return slot

    def release(self, slot: int) -> None:
        with self._lock:
            self.users[slot] -= 1

    def _load(self, slot: int, adapter: Adapter) -> None:
        import time

        t0 = time.perf_counter()
        old = self.held[slot]
        if old is not None:
            del self.slot_of[old]
        new, adapter.staged = adapter.staged, None  # (the slot holds it now: no second device copy)
        if new is None:  # evicted from its slot since its request arrived
            new = self.place(self._contents(adapter))
        self.stacks = self._write(self.stacks, jnp.int32(slot), new)
        self.held[slot], self.slot_of[adapter.key] = adapter.key, slot
        self.swaps += 1
        self.swap_seconds += time.perf_counter() - t0

    def unload(self, name: str) -> None:
        """Forget a named adapter (its slot is reused once no running row holds it)."""
        with self._lock:
            req = self.names.pop(name, None)
            if req is None:
                raise InvalidRequest(f"LoRA adapter {name!r} is not loaded")
            self.host.pop(req.lora_int_id, None)
            slot = self.slot_of.get(req.lora_int_id)
            if slot is not None and self.users[slot] == 0:  # a later adapter under this id is read afresh
                del self.slot_of[req.lora_int_id]
                self.held[slot] = None
