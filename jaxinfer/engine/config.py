"""The engine's options (vLLM's names) and the size of its KV page pools.

``EngineConfig`` is what ``LLM`` passes down; ``pool_sizes`` turns it, the model and the
memory budget (``kv_budget``) into the number of pages each pool holds; ``start_pools`` fills
one device's pools on a second thread while the weights are still being read.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import jax

from jaxinfer import cache as kv
from jaxinfer import dispatch
from jaxinfer.config import AttentionKind, ModelConfig
from jaxinfer.engine.scheduler import Scheduling, window_pool_pages
from jaxinfer.errors import InvalidRequest

__all__ = ["CPU_KV_CACHE_BYTES", "DEFAULT_SCHEDULER_STEPS", "DEFAULT_SEPARATE_SAMPLER", "EngineConfig", "Scheduling", "kv_budget", "pool_sizes",
           "scheduler_steps", "separate_sampler", "start_pools"]

CPU_KV_CACHE_BYTES = 2 << 30  # the page pools' budget on CPU when kv_cache_memory_bytes is not given
# decode steps chained on device when num_scheduler_steps is not given, by platform
# (benchmarks/RESULTS.md, "Chained decode steps"): on a CPU a real model's step is bound by the
# device, and building the chains' executables costs a short job more than they save; an
# accelerator keeps 1 until the engine has been measured there with chains
DEFAULT_SCHEDULER_STEPS = {"cpu": 1, "accelerator": 1}
# whether a plain step's sampler runs as an executable of its own when separate_sampler is not
# given, by platform (benchmarks/RESULTS.md, "TPU (compiled, not run)"): on an accelerator every
# step executable compiled its own copy of the sampler, most of its compile time; on a CPU the
# compiles are cheap and the second dispatch a step is not worth it
DEFAULT_SEPARATE_SAMPLER = {"cpu": False, "accelerator": True}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's options, under vLLM's names.

    The page pools' size: ``num_gpu_blocks_override`` pages when given; else
    ``kv_cache_memory_bytes`` bytes when given; else, on an accelerator,
    ``gpu_memory_utilization`` of the device's memory minus what is in use once the weights
    are placed (as vLLM); on CPU, ``CPU_KV_CACHE_BYTES`` (2 GiB: a fraction of host memory
    would take most of a shared machine). Pools never hold more than every slot needs at
    full length, with as much again for cached prefixes."""

    max_num_seqs: int = 64  # decode slots
    block_size: int = 16  # tokens per KV page
    num_gpu_blocks_override: int | None = None  # exact number of KV pages
    gpu_memory_utilization: float = 0.9  # accelerators: share of device memory for weights + KV pages
    kv_cache_memory_bytes: int | None = None  # exact KV page budget (over gpu_memory_utilization)
    max_num_batched_tokens: int = 512  # prompt tokens per scheduler iteration (the prefill row's budget)
    enable_prefix_caching: bool = True
    scheduling_policy: Scheduling = Scheduling.FCFS
    windowed_kv: bool = True  # LOCAL layers keep only their window (False: every position)
    kv_cache_dtype: str = "auto"  # page pools' dtype: auto (the model's), a float type, or int8
    # the attention's kernels: dispatch.choose's option, or its choice (made once: ``engine_kernels``)
    kernels: str | dispatch.Kernels = "auto"
    # decode steps one device call may chain when no running row needs the host between tokens
    # (``engine.chaining.chained_decode``); None: the platform's default (DEFAULT_SCHEDULER_STEPS)
    num_scheduler_steps: int | None = None
    # a plain step's sampling as an executable of its own, one per row bucket, that every step
    # shape of that many rows shares (``step.sample_rows``); None: the platform's default
    # (DEFAULT_SEPARATE_SAMPLER). Engines with replicas or an EAGLE head always sample in the step
    separate_sampler: bool | None = None
    # LoRA adapters (``lora.LoRAConfig``: max_loras, max_lora_rank, max_cpu_loras); None: none
    lora: object = None

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidRequest(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 16 or self.max_num_batched_tokens & (self.max_num_batched_tokens - 1):
            raise InvalidRequest(f"max_num_batched_tokens must be a power of two >= 16, "
                                 f"got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise InvalidRequest(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidRequest(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise InvalidRequest(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise InvalidRequest(f"num_gpu_blocks_override must be >= 2 (one is the scratch page), "
                                 f"got {self.num_gpu_blocks_override}")
        if self.num_scheduler_steps is not None and not 1 <= self.num_scheduler_steps <= 256:
            raise InvalidRequest(f"num_scheduler_steps must be in [1, 256], got {self.num_scheduler_steps}")
        if self.kv_cache_dtype not in kv.KV_CACHE_DTYPES:
            raise InvalidRequest(f"kv_cache_dtype must be one of {', '.join(kv.KV_CACHE_DTYPES)}, "
                                 f"got {self.kv_cache_dtype!r}")

    def budget_is_static(self) -> bool:
        """Whether the pools' size is known before the weights are placed (no device memory
        to measure): then the pools can be filled while the weights load."""
        return (self.num_gpu_blocks_override is not None or self.kv_cache_memory_bytes is not None
                or jax.default_backend() == "cpu")


def scheduler_steps(config: EngineConfig) -> int:
    """Decode steps a chain may run: ``num_scheduler_steps``, else the platform's default."""
    if config.num_scheduler_steps is not None:
        return config.num_scheduler_steps
    return DEFAULT_SCHEDULER_STEPS["cpu" if jax.default_backend() == "cpu" else "accelerator"]


def separate_sampler(config: EngineConfig, platform: str) -> bool:
    """Whether plain steps sample in an executable of their own: ``separate_sampler``, else the
    default of ``platform`` (the engine's devices')."""
    if config.separate_sampler is not None:
        return config.separate_sampler
    return DEFAULT_SEPARATE_SAMPLER["cpu" if platform == "cpu" else "accelerator"]


def kv_budget(config: EngineConfig, devices=None) -> int:
    """The page pools' byte budget (see ``EngineConfig``): on an accelerator, the free share of
    ``gpu_memory_utilization`` of each device's memory, summed over ``devices`` (one model
    replica's; default the first device)."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    devices = list(devices) if devices is not None else jax.local_devices()[:1]
    total = 0
    for d in devices:
        st = d.memory_stats() if d.platform != "cpu" else None
        if not st or "bytes_limit" not in st:
            return CPU_KV_CACHE_BYTES
        total += max(0, int(config.gpu_memory_utilization * st["bytes_limit"]) - st.get("bytes_in_use", 0))
    return total


def pool_sizes(cfg: ModelConfig, config: EngineConfig, kv_dtype, pages_per_seq: int, budget: int, *,
               lanes: int = 1):
    """(window, full-length pages, window pages) of one engine's page pools: the window None
    when no layer is windowed (or windowed_kv is off); enough full-length pages for every slot
    at full length (plus room for cached prefixes), within ``budget`` bytes (``kv_budget``), the
    head dims padded to ``lanes`` (``dispatch.pool_lanes``)."""
    ps = config.block_size
    W = cfg.sliding_window if config.windowed_kv else None
    window = W if W and any(cfg.layer_window(i) for i in range(cfg.n_layers)) else None
    window_bytes, num_window_pages = 0, None
    if window:
        # a chain's rows hold window pages up to their last chained position too
        num_window_pages = window_pool_pages(window + scheduler_steps(config) - 1, ps, config.max_num_seqs,
                                             config.max_num_batched_tokens, pages_per_seq)
        window_bytes = num_window_pages * ps * cfg.kv_bytes_per_token(kv_dtype, kind=AttentionKind.LOCAL,
                                                                      lanes=lanes)
    full_bytes_per_token = cfg.kv_bytes_per_token(kv_dtype, kind=AttentionKind.GLOBAL if window else None,
                                                  lanes=lanes)
    num_pages = config.num_gpu_blocks_override or max(2, min(
        max(budget - window_bytes, 0) // (max(full_bytes_per_token, 1) * ps),
        2 * config.max_num_seqs * pages_per_seq + 1))
    return window, num_pages, num_window_pages


def _make_pools(cfg: ModelConfig, config: EngineConfig, max_model_len: int) -> kv.PagedKVCache:
    """The zeroed page pools of an engine on one device (the default one), in the keys layout
    that engine chooses there (``dispatch.keys_transposed``)."""
    pages_per_seq = -(-max_model_len // config.block_size)
    kv_dtype = kv.kv_storage_dtype(config.kv_cache_dtype, cfg)
    device = jax.local_devices()[0]
    kernels = engine_kernels(config, devices=device)
    lanes = dispatch.pool_lanes(kernels)
    _, num_pages, num_window_pages = pool_sizes(cfg, config, kv_dtype, pages_per_seq, kv_budget(config),
                                                lanes=lanes)
    transposed = dispatch.keys_transposed(kernels, dispatch.device_platform(device))
    return kv.init_paged_cache(cfg, num_pages, config.block_size, kv_dtype, num_window_pages=num_window_pages,
                               keys_transposed=transposed, lanes=lanes)


def start_pools(cfg: ModelConfig, config: EngineConfig, max_model_len: int) -> concurrent.futures.Future:
    """Zero-fill an engine's page pools on a second thread (for ``Engine(pools=...)``).
    Filling the default 2 GB of pools takes ~0.5 s of memory writes; begun as soon as the
    checkpoint's config is known, it runs beside the weights being read and dequantized."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxinfer-pools")
    future = pool.submit(_make_pools, cfg, config, max_model_len)
    future.made_for = (cfg, config, max_model_len)
    pool.shutdown(wait=False)
    return future


def engine_kernels(config: EngineConfig, *, mesh=None, devices=None) -> dispatch.Kernels:
    """The engine's kernels: ``config.kernels`` where it is a choice ``dispatch.choose`` made
    already (``LLM`` chooses once, where the option enters, and passes the choice down), else
    ``dispatch.choose``'s choice of that option for the mesh or devices (an engine made alone)."""
    if isinstance(config.kernels, dispatch.Kernels) and config.kernels.platform is not None:
        return config.kernels
    return dispatch.choose(config.kernels, mesh=mesh, devices=devices)


def check_combination(spec, mesh, *, lora: bool) -> None:
    """Refuse, in one place and with the reason, the options that do not run together: the
    engine step composes them otherwise. Called where the options enter (``LLM``, before the
    download). spec: the parsed ``SpeculativeConfig`` or None; mesh:
    the (data, stage, model) mesh or None; lora: whether LoRA adapters are enabled."""
    from jaxinfer.engine.speculative import SpecMethod

    data = mesh.shape["data"] if mesh is not None else 1
    stages = mesh.shape.get("stage", 1) if mesh is not None else 1
    if spec is not None:
        if data > 1:  # the drafter proposes, plans and reads one scheduler's rows
            raise InvalidRequest("speculative decoding is not supported with data_parallel_size > 1")
        if stages > 1 and spec.method == SpecMethod.EARLY_EXIT:  # its draft layers are one stage's alone
            raise InvalidRequest("speculative_config method early_exit is not supported with "
                                 "pipeline_parallel_size > 1: the drafting layers sit on the first stage only")
        if stages > 1 and spec.branches > 1:  # the branches' deferred writes are one pass's, not a stage's
            raise InvalidRequest("speculative_config branches > 1 is not supported with pipeline_parallel_size > 1")
        if mesh is not None and spec.method in (SpecMethod.DRAFT_MODEL, SpecMethod.EAGLE):
            # their weights and pools live on one device
            raise InvalidRequest(f"speculative_config method {spec.method.value} does not run with "
                                 "tensor parallelism yet")
    if lora:
        if spec is not None:
            # drafts and their verification run the base weights (and a draft model or head
            # trained on them): an adapter's rows would be verified against the wrong model
            raise InvalidRequest("speculative decoding with LoRA adapters (enable_lora) is not supported: "
                                 "drafting and verification run the base model's weights only")
        if data > 1:
            raise InvalidRequest("LoRA adapters (enable_lora) are not supported with data_parallel_size > 1")
        if stages > 1:
            raise InvalidRequest("LoRA adapters (enable_lora) are not supported with pipeline_parallel_size > 1")
