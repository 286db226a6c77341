"""The public Python API, in vLLM's shape.

    from jaxinfer import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct")
    out = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=32))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from pathlib import Path

from jaxinfer import dispatch, quant, registry
from jaxinfer.config import default_dtype
from jaxinfer.engine.config import EngineConfig, Scheduling, check_combination, start_pools
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.rows import Row
from jaxinfer.engine.speculative import SpecMethod, SpeculativeConfig
from jaxinfer.errors import CheckpointError, InvalidRequest
from jaxinfer.loaders import checkpoint
from jaxinfer.lora import LoRAConfig, LoRARequest
from jaxinfer.models.registry import model_family
from jaxinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxinfer.sampling import SamplingParams, StopChecker, default_seed_for
from jaxinfer.models.registry import num_params

_DTYPES = ("float32", "bfloat16", "float16")


class LLM:
    """A model loaded for offline generation.

    model: a ``loaders.checkpoint.Loaded`` already in memory (config, weights and tokenizer, e.g.
    ``loaders.random_weights.random_loaded``; dtype and quantize are then its own), a registry
    name (see ``jaxinfer models``), a Hugging Face Hub id (``org/name``, or
    ``org/name:FILE.gguf`` for one GGUF file of a repository; downloaded once into
    huggingface_hub's cache, see ``jaxinfer.hub``) or a path to a .gguf file, a Hugging Face
    directory or an Orbax checkpoint. revision: the Hub id's branch, tag or commit (default: its
    main branch). download_dir: the cache to download into instead of huggingface_hub's
    (``HF_HUB_CACHE``). generation_config: "auto" (vLLM's default) makes the sampling values of
    the checkpoint's ``generation_config.json`` (temperature, top_p, top_k, min_p,
    repetition_penalty, max_new_tokens) the defaults of ``get_default_sampling_params``, used
    when ``generate``/``chat``/``stream`` get no SamplingParams; "vllm" ignores them. Either way
    the file's ``eos_token_id`` (an id or a list) ends generation, as in vLLM.
    dtype: None picks float32 on CPU and bfloat16 on TPU/GPU.
    max_model_len: the longest prompt + output allowed (default: the checkpoint's context).
    quantization: "int8" (weight-only, one
    scale per output channel), "int4" (weight-only, groups of quant_group contracted rows;
    default the largest of 128/64/32 dividing each weight) or "w8a8" (int8 weights and
    per-token int8 activations, SmoothQuant-calibrated), applied weight by weight while
    loading (see ``jaxinfer.loaders.quantize``); None keeps the checkpoint's weights (a
    quantized Orbax checkpoint stays quantized). The remaining options tune the engine
    (see ``jaxinfer.engine.config.EngineConfig``, under vLLM's names: block_size,
    max_num_batched_tokens, enable_prefix_caching, scheduling_policy "fcfs" or "spf" (shortest
    prompt first), and the KV budget: num_gpu_blocks_override pages, else kv_cache_memory_bytes,
    else gpu_memory_utilization of an accelerator's memory, or 2 GiB on CPU);
    windowed_kv=False makes sliding-window
    layers keep every position (their window pages are freed by default). kv_cache_dtype:
    "auto" (the model's dtype), a float type, or "int8" (int8 keys and values with a float32
    scale per token and head; about 3.8x smaller than float32 at head_dim 64).
    enable_expert_parallel: a mixture-of-experts model's experts split whole over the
    tensor-parallel devices (tensor_parallel_size must divide their number), each device
    computing the tokens routed to its own; without it, every expert's width splits like a
    dense MLP's. Attention is tensor parallel either way.
    kernels: which kernels run attention and the matmuls (``jaxinfer.dispatch``): "auto" (the
    Pallas kernels on TPU/GPU; on one CPU device the native CPU kernels that built for this
    CPU, XLA for the rest), "pallas" (on CPU in Pallas interpret mode: slow, for tests),
    "native" (one CPU device only) or "xla" (the pure-JAX references everywhere); or a
    ``dispatch.Kernels``, to choose attention and matmuls apart.
    num_scheduler_steps: decode steps one device call may chain while no running row needs the
    host between tokens (see ``jaxinfer.engine.engine.Engine``); 1 never chains; None: the
    platform's default (``engine.config.DEFAULT_SCHEDULER_STEPS``).
    separate_sampler: plain steps sample in an executable of their own, one per row bucket, so
    the sampler is compiled once per row count instead of inside every step shape (warm-up on
    a TPU); None: the platform's default (``engine.config.DEFAULT_SEPARATE_SAMPLER``: on
    accelerators, not on CPU).
    enable_lora: serve LoRA adapters (``jaxinfer.lora``): ``generate``/``chat`` then take
    ``lora_request=LoRARequest(name, int_id, path)`` (one for every prompt, or one per prompt).
    max_loras: adapters one step may run together (a request for one more waits); max_lora_rank:
    the largest rank an adapter may have; max_cpu_loras: adapters kept read in host memory
    (default max_loras). vLLM's names and defaults.
    """

    def __init__(self, model: str | checkpoint.Loaded = registry.DEFAULT_MODEL, *, dtype: str | None = None,
                 max_model_len: int | None = None, seed: int = 0, max_num_seqs: int = 64,
                 progress: bool = True, block_size: int = 16,
                 num_gpu_blocks_override: int | None = None, gpu_memory_utilization: float = 0.9,
                 kv_cache_memory_bytes: int | None = None, max_num_batched_tokens: int = 512,
                 enable_prefix_caching: bool = True, scheduling_policy: str = "fcfs", windowed_kv: bool = True,
                 quantization: str | None = None,
                 quant_group: int | None = None, kv_cache_dtype: str = "auto",
                 speculative_config: dict | str | None = None, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, data_parallel_size: int = 1, mesh=None,
                 revision: str | None = None, download_dir: str | None = None, generation_config: str = "auto",
                 enable_expert_parallel: bool = False, kernels: str | dispatch.Kernels = "auto",
                 num_scheduler_steps: int | None = None, separate_sampler: bool | None = None,
                 enable_lora: bool = False, max_loras: int = 1,
                 max_lora_rank: int = 16, max_cpu_loras: int | None = None,
                 limit_mm_per_prompt: dict | None = None, allowed_local_media_path: str | None = None):
        dtype = dtype or default_dtype()
        if dtype == "auto":
            dtype = default_dtype()
        if dtype not in _DTYPES:
            raise InvalidRequest(f"dtype must be one of {', '.join(_DTYPES)} or 'auto', got {dtype!r}")
        if generation_config not in ("auto", "vllm"):
            raise InvalidRequest(f"generation_config must be 'auto' or 'vllm', got {generation_config!r}")
        qcfg = _quant_config(quantization, quant_group)  # bad options fail before the download
        if enable_lora and qcfg is not None and qcfg.scheme == quant.QuantScheme.W8A8:
            # an adapter's A reads each projection's input: the model's activation, not one
            # divided by a smoothing folded into the norm before it
            qcfg = dataclasses.replace(qcfg, fold_smoothing=False)
        spec = SpeculativeConfig.parse(speculative_config)  # likewise (layer count checked once loaded)
        mesh = _parallel_mesh(tensor_parallel_size, pipeline_parallel_size, data_parallel_size, mesh)
        check_combination(spec, mesh, lora=enable_lora)  # before the download, and only here
        # which kernel runs each attention and matmul: chosen once, carried by the weights, the
        # engine and its steps (for the devices it runs on: the mesh, or the default device the
        # weights are read to)
        import jax

        self.kernels = dispatch.choose(kernels, mesh=mesh, devices=None if mesh is not None else jax.local_devices()[:1])
        try:
            sched = Scheduling(scheduling_policy)
        except ValueError:
            raise InvalidRequest(f"scheduling_policy must be 'fcfs' or 'spf', got {scheduling_policy!r}") from None
        ecfg = EngineConfig(max_num_seqs=max_num_seqs, block_size=block_size,
                            num_gpu_blocks_override=num_gpu_blocks_override,
                            gpu_memory_utilization=gpu_memory_utilization,
                            kv_cache_memory_bytes=kv_cache_memory_bytes, max_num_batched_tokens=max_num_batched_tokens,
                            enable_prefix_caching=enable_prefix_caching, scheduling_policy=sched,
                            windowed_kv=windowed_kv, kv_cache_dtype=kv_cache_dtype, kernels=self.kernels,
                            num_scheduler_steps=num_scheduler_steps, separate_sampler=separate_sampler,
                            lora=LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None)
        pools = None

        def on_config(cfg):  # one device: fill the page pools while the weights are read
            nonlocal pools
            if (mesh is None and ecfg.budget_is_static()
                    and 1 < (max_model_len or cfg.max_position) <= cfg.max_position):
                pools = start_pools(cfg, ecfg, max_model_len or cfg.max_position)

        if isinstance(model, checkpoint.Loaded):  # weights already in memory (loaders.random_weights)
            self.model_path, self._sampling_defaults = model.source, {}
            on_config(model.cfg)
        else:
            self.model_path = registry.resolve(model, revision=revision, download_dir=download_dir,
                                               progress=progress, check_config=_architecture_check(model))
            # vLLM's generation_config="auto": the checkpoint's sampling values become the defaults
            self._sampling_defaults = generation_defaults(self.model_path) if generation_config == "auto" else {}
        shardings_fn = None
        if mesh is not None:
            from jaxinfer.sharding import (
                pipeline_weight_shardings,
                rules_for,
                stage_bounds,
                tensor_parallel_plan,
            )

            def shardings_fn(specs, cfg):  # each device receives only its shard while loading
                # bad sizes fail before any tensor is read
                tensor_parallel_plan(cfg, mesh.shape["model"], expert_parallel=enable_expert_parallel)
                if cfg.n_experts and mesh.shape["stage"] > 1:
                    raise InvalidRequest("pipeline_parallel_size > 1 with a mixture-of-experts model is not "
                                         "supported yet")
                # pipeline: each layer goes to its own stage's devices only
                return pipeline_weight_shardings(specs, mesh, stage_bounds(cfg.n_layers, mesh.shape["stage"]),
                                                 rules_for(enable_expert_parallel))
        loaded = model if isinstance(model, checkpoint.Loaded) else checkpoint.load(
            self.model_path, dtype=dtype, quantize=qcfg, shardings_fn=shardings_fn, on_config=on_config)
        self.cfg, self.weights, self.tokenizer = loaded.cfg, loaded.weights, loaded.tokenizer
        self.mesh = mesh
        self.parallel = None
        if mesh is not None:
            from jaxinfer.sharding import place_experts, tensor_parallel_plan

            # expert weights computed under shard_map, each device with the part it holds
            self.weights = place_experts(self.weights, model_family(self.cfg.family).weight_specs(self.cfg), mesh)
            self.parallel = dict(tensor_parallel_plan(self.cfg, mesh.shape["model"],
                                                      expert_parallel=enable_expert_parallel),
                                 data_parallel_size=mesh.shape["data"])
        self.weights = dispatch.bind(self.weights, model_family(self.cfg.family).weight_specs(self.cfg), self.kernels)
        if max_model_len is None:
            max_model_len = self.cfg.max_position
        if not 1 < max_model_len <= self.cfg.max_position:
            raise InvalidRequest(
                f"max_model_len must be in [2, {self.cfg.max_position}] (the model's context), got {max_model_len}"
            )
        self.max_model_len = max_model_len
        enable_compilation_cache()
        self.seed = seed
        self.progress = progress
        self._grammar_compiler = None  # guided.GrammarCompiler, made on the first structured-output request
        self._grammars: dict[str, str] = {}  # repr(GuidedDecoding) -> compiled grammar
        # with data parallelism, max_num_seqs and the KV budget are each replica's
        self.engine = Engine(self.cfg, self.weights, self.tokenizer, max_model_len=max_model_len, config=ecfg,
                             seed=seed, speculative=spec, mesh=mesh,
                             draft=self._load_draft(spec, dtype, progress, download_dir, self.kernels),
                             pools=pools, model_names=(str(model) if not isinstance(model, checkpoint.Loaded) else "",
                                                       str(self.model_path), self.cfg.name),
                             download_dir=download_dir)
        self.limit_mm_per_prompt = _check_mm_limit(limit_mm_per_prompt)
        from jaxinfer.media import MediaConfig

        self.media = MediaConfig(allowed_local_media_path=allowed_local_media_path)
        from jaxinfer.engine import multimodal

        self._no_images = multimodal.NO_ENCODER  # why image inputs are refused, where they are
        if not isinstance(model, checkpoint.Loaded):  # a multimodal checkpoint's image encoder
            self.engine.images, self._no_images = multimodal.load(self.model_path, self.tokenizer, dtype=dtype)
            if self.engine.images is not None:
                self.engine.images.limit = (self.limit_mm_per_prompt or {}).get("image")
        if self.engine.pipeline is not None:  # the weights now live stacked by stage
            self.weights = self.engine.weights
            self.parallel = dict(self.parallel, **self.engine.pipeline.report())
        self._request_counter = 0

    @staticmethod
    def _load_draft(spec: SpeculativeConfig | None, dtype: str, progress: bool, download_dir: str | None = None,
                    kernels: dispatch.Kernels = dispatch.XLA):
        """(ModelConfig, weights) of speculative_config's draft model, loaded like the target (in
        its dtype, quantized while loading when the config says so), or None. A Hub id is
        downloaded at the config's ``revision`` into the target's download_dir."""
        if spec is None or spec.method != SpecMethod.DRAFT_MODEL:
            return None
        path = registry.resolve(spec.model, revision=spec.revision, download_dir=download_dir, progress=progress,
                                check_config=_architecture_check(spec.model))
        loaded = checkpoint.load(path, dtype=dtype, quantize=quant.quant_config(spec.quantization))
        return loaded.cfg, dispatch.bind(loaded.weights, model_family(loaded.cfg.family).weight_specs(loaded.cfg), kernels)

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def sampling_defaults(self) -> dict:
        """The SamplingParams fields generation_config.json sets ({} under
        ``generation_config="vllm"``): the server and batch jobs apply them to requests that
        leave those fields unset, over OpenAI's defaults, as vLLM does."""
        return dict(self._sampling_defaults)

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams used when none are given: vLLM's defaults, with the sampling values
        of the checkpoint's generation_config.json over them (``generation_config="auto"``)."""
        return SamplingParams(**self._sampling_defaults)

    def _given_or_default(self, sampling_params):
        return self.get_default_sampling_params() if sampling_params is None else sampling_params

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool | None = None, lora_request=None) -> list[RequestOutput]:
        """Generate for one prompt or many. A prompt is a str, a list of token ids, or a dict
        with "prompt" or "prompt_token_ids". Outputs come back in prompt order. lora_request:
        a ``LoRARequest`` for every prompt, or a list of one (or None) per prompt."""
        items = _normalize_prompts(prompts)
        params = _normalize_params(self._given_or_default(sampling_params), len(items))
        loras = self._normalize_loras(lora_request, len(items))
        reqs = [(str(i), *self.encode_prompt(p, i), sp, lo)
                for i, (p, sp, lo) in enumerate(zip(items, params, loras))]
        self.check_guided(params)
        return self._run_all(reqs, use_tqdm)

    def chat(self, messages, sampling_params=None, *, use_tqdm: bool | None = None,
             add_generation_prompt: bool = True, lora_request=None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them;
        lora_request as for ``generate``."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params = _normalize_params(self._given_or_default(sampling_params), len(convs))
        loras = self._normalize_loras(lora_request, len(convs))
        reqs = [(str(i), *self.encode_chat(c, i, add_generation_prompt=add_generation_prompt), sp, lo)
                for i, (c, sp, lo) in enumerate(zip(convs, params, loras))]
        self.check_guided(params)
        return self._run_all(reqs, use_tqdm)

    def _normalize_loras(self, lora_request, n: int) -> list:
        """One adapter (``lora.Adapter``, read and checked now) or None per prompt."""
        if lora_request is None:
            return [None] * n
        reqs = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * n
        if len(reqs) != n:
            raise InvalidRequest(f"lora_request has {len(reqs)} entries for {n} prompts")
        return [None if r is None else self.lora_adapter(r) for r in reqs]

    def lora_adapter(self, request: LoRARequest):
        """The engine's adapter for a ``LoRARequest`` (read from its directory unless cached);
        InvalidRequest when the engine has no adapters or the directory is not a fitting one."""
        if not isinstance(request, LoRARequest):
            raise InvalidRequest(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        if self.engine.lora is None:
            raise InvalidRequest("lora_request needs an LLM started with enable_lora=True")
        return self.engine.lora.get(request)

    def encode_prompt(self, p, i: int | str = 0) -> tuple[str | None, list[int]]:
        """(text, token ids) of one prompt, validated; raises InvalidRequest naming prompt i."""
        if isinstance(p, str):
            text, toks = p, self.tokenizer.encode(p)
        elif isinstance(p, dict):
            if p.get("multi_modal_data"):
                return self._encode_with_images(p, i)
            if "prompt_token_ids" in p:
                toks, text = list(p["prompt_token_ids"]), p.get("prompt")
            elif "prompt" in p and isinstance(p["prompt"], str):
                text = p["prompt"]
                toks = self.tokenizer.encode(text)
            else:
                raise InvalidRequest(f"prompt {i}: a dict prompt needs 'prompt' (str) or 'prompt_token_ids'")
        elif isinstance(p, (list, tuple)):
            toks, text = list(p), None
        else:
            raise InvalidRequest(f"prompt {i} must be a str, a list of token ids or a dict, got {type(p).__name__}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.cfg.vocab_size for t in toks):
            raise InvalidRequest(f"prompt {i}: token ids must be ints in [0, {self.cfg.vocab_size})")
        self.check_prompt_len(toks, i)
        return text, toks

    def encode_chat(self, conv, i: int | str = 0, *, add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        """(rendered text, token ids) of one conversation through the chat template. Image
        parts ({"type": "image_url", "image_url": {"url": ...}}, or vLLM's {"type": "image_pil",
        "image_pil": PIL.Image}) become the model's image marker where they stand; the ids then
        carry the images (``multimodal.ImagePrompt``)."""
        images = self.engine.images
        conv, sources = _plain_conversation(conv, i, None if images is None else images.boi,
                                            parts=self.tokenizer.renders_content_parts, no_images=self._no_images)
        if sources:
            self._check_images(len(sources), f"conversation {i}")
        text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
        if sources:
            text = images.expand(text)
        # the template writes the special tokens itself: do not add BOS a second time
        toks = self.tokenizer.encode(text, add_special_tokens=not _starts_with_bos(self.tokenizer, text))
        self.check_prompt_len(toks, i)
        if sources:
            toks = self._image_prompt(toks, [self._read_image(s, f"conversation {i}") for s in sources],
                                      f"conversation {i}")
        return text, toks

    def _check_images(self, n: int, what: str) -> None:
        """Images are run by this model, and n of them are within limit_mm_per_prompt."""
        from jaxinfer.engine import multimodal

        if self.engine.images is None:
            raise InvalidRequest(f"{what}: this model takes no images ({self._no_images}); send text content")
        multimodal.limit_images(n, self.limit_mm_per_prompt, what)

    def _read_image(self, source, what: str):
        """A PIL image or encoded bytes from an image part's source (a URL, or an image)."""
        if not isinstance(source, str):
            return source
        from jaxinfer.media import MediaError, fetch

        try:
            return fetch(source, self.media)
        except MediaError as e:
            raise InvalidRequest(f"{what}: {e}") from None

    def _image_prompt(self, toks: list[int], images: list, what: str):
        from jaxinfer.engine import multimodal

        imgs = self.engine.images.prompt_images(toks, images, what)
        multimodal.validate(self.engine, imgs)
        return multimodal.ImagePrompt(toks, imgs)

    def _encode_with_images(self, p: dict, i) -> tuple[str | None, list[int]]:
        """vLLM's {"prompt" or "prompt_token_ids", "multi_modal_data": {"image": an image or a
        list}}: prompt text holds the model's image marker (Gemma 3: ``<start_of_image>``) once
        per image; prompt_token_ids hold each image's soft tokens already."""
        mm = p["multi_modal_data"]
        what = f"prompt {i}"
        if not isinstance(mm, dict) or set(mm) - {"image"}:
            raise InvalidRequest(f"{what}: multi_modal_data takes 'image' only, got "
                                 f"{sorted(mm) if isinstance(mm, dict) else type(mm).__name__}")
        images = mm["image"] if isinstance(mm["image"], (list, tuple)) else [mm["image"]]
        self._check_images(len(images), what)
        if "prompt_token_ids" in p:
            toks, text = list(p["prompt_token_ids"]), p.get("prompt")
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.cfg.vocab_size for t in toks):
                raise InvalidRequest(f"{what}: token ids must be ints in [0, {self.cfg.vocab_size})")
        elif isinstance(p.get("prompt"), str):
            text = p["prompt"]
            marks = text.count(self.engine.images.boi)
            if marks != len(images):
                raise InvalidRequest(f"{what}: {len(images)} image(s) need {len(images)} "
                                     f"{self.engine.images.boi!r} in the prompt, found {marks}")
            toks = self.tokenizer.encode(self.engine.images.expand(text))
        else:
            raise InvalidRequest(f"{what}: a dict prompt needs 'prompt' (str) or 'prompt_token_ids'")
        self.check_prompt_len(toks, i)
        return text, self._image_prompt(toks, images, what)

    def check_prompt_len(self, toks, i: int | str = 0) -> None:
        if not toks:
            raise InvalidRequest(f"prompt {i} is empty (0 tokens)")
        if len(toks) >= self.max_model_len:
            raise InvalidRequest(
                f"prompt {i} has {len(toks)} tokens; max_model_len is {self.max_model_len}, "
                "which must leave room for at least one generated token"
            )

    def _run_all(self, reqs, use_tqdm) -> list[RequestOutput]:
        bar = _progress(sum(r[3].n for r in reqs), self.progress if use_tqdm is None else use_tqdm)
        outs = {}
        try:
            for out in self.generate_stream(reqs, window=len(reqs), on_sequence_done=lambda: bar.update(1)):
                outs[out.request_id] = out
        finally:
            bar.close()
        return [outs[rid] for rid, *_ in reqs]

    def beam_search(self, prompts, params) -> list:
        """Beam search (``beam.BeamSearchParams``) for one prompt or many; a
        ``beam.BeamSearchOutput`` per prompt, its best beams first. See ``jaxinfer.beam``."""
        from jaxinfer.beam import beam_search

        encoded = [self.encode_prompt(p, i)[1] for i, p in enumerate(_normalize_prompts(prompts))]
        if any(getattr(toks, "images", None) is not None for toks in encoded):
            raise InvalidRequest("beam_search takes text prompts only, not multi_modal_data")
        return beam_search(self, encoded, params)

    def stream(self, prompt, sampling_params: SamplingParams | None = None, *, chat: bool = False):
        """One request's text as it is generated: yields each new piece of text (str), in
        order, until the request finishes; ``self.last_stream_output`` is then its
        RequestOutput. prompt: as for ``generate`` (``chat=True``: a conversation, a list of
        {"role", "content"} dicts). n must be 1. The engine must not be running other work."""
        sp = self._given_or_default(sampling_params)
        if sp.n != 1:
            raise InvalidRequest(f"stream takes n=1, got n={sp.n}")
        if chat:
            text, toks = self.encode_chat(prompt, 0)
        else:
            items = _normalize_prompts(prompt)
            if len(items) != 1:
                raise InvalidRequest(f"stream takes one prompt, got {len(items)}")
            text, toks = self.encode_prompt(items[0], 0)
        self.check_guided([sp])
        req = self.new_request("0", text, toks, sp, time.perf_counter())
        (row,) = req.rows
        row.stream = True  # the caller sees each token's text: no chained decode steps
        self.last_stream_output = None
        self.engine.add(row)
        sent = 0
        try:
            while True:
                done = self.engine.step()
                out = row.checker.output_text
                if len(out) > sent:
                    yield out[sent:]
                    sent = len(out)
                if any(r is row for r in done):
                    break
                if not self.engine.has_unfinished():
                    raise RuntimeError("the engine went idle before the request finished")
        except BaseException:
            if not row.checker.finished:
                self.engine.abort(row)  # the caller stopped reading: free the row's pages
                while self.engine.has_unfinished():
                    self.engine.step()
            raise
        self.last_stream_output = req.output()

    def generate_stream(self, requests, *, window: int | None = None, on_sequence_done=None):
        """Yield a RequestOutput as soon as each request finishes (completion order).

        requests: an iterable of (request_id, prompt_text_or_None, prompt_token_ids,
        SamplingParams[, LoRARequest or None]), already validated (``encode_prompt``/``encode_chat``). It is consumed
        lazily, ``window`` requests at a time (default 4 x max_num_seqs), so a stream of any
        length runs in bounded memory.
        """
        window = window or 4 * self.engine.max_num_seqs

        def rows():
            it = iter(requests)
            while chunk := list(itertools.islice(it, window)):
                arrival = time.perf_counter()
                for rid, text, toks, p, *lora in chunk:
                    yield from self.new_request(rid, text, toks, p, arrival, lora=lora[0] if lora else None).rows

        for row in self.engine.run(rows()):
            if on_sequence_done is not None:
                on_sequence_done()
            req = row.owner
            req.remaining -= 1
            if req.remaining == 0:
                yield req.output()

    def new_request(self, rid: str, text: str | None, toks: list[int], p: SamplingParams,
                    arrival: float, *, lora=None) -> Request:
        """A request's rows (one per sample, each with its own seed), ready for the engine; each
        row's ``owner`` is the returned Request, whose ``output()`` is its RequestOutput once
        every row finished. lora: the rows' adapter (``lora_adapter``), or None."""
        req = Request(rid, text, toks, p, arrival, remaining=p.n)
        index = self._request_counter
        self._request_counter += 1
        for j in range(p.n):
            row = self._make_row(toks, _sample_params(p, j, default_seed_for(self.seed, index)), index * 1024 + j)
            row.owner = req
            row.lora = lora
            row.images = getattr(toks, "images", None)  # (one object for all samples: encoded once)
            req.rows.append(row)
        if p.guided_decoding is not None:
            for row, m in zip(req.rows, self.guided_matchers(p.guided_decoding, p.n)):
                row.guided = m
        return req

    def check_guided(self, params) -> None:
        """Compile every structured-output constraint among params up front (InvalidRequest
        naming what is wrong), so a bad grammar fails before any generation."""
        for sp in params:
            if sp.guided_decoding is not None:
                self.compile_grammar(sp.guided_decoding)

    def compile_grammar(self, spec) -> str:
        """A GuidedDecoding's grammar compiled against this model's vocabulary (cached)."""
        from jaxinfer.guided import GrammarCompiler

        key = repr(spec)
        if key not in self._grammars:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.cfg.vocab_size)
            self._grammars[key] = self._grammar_compiler.check(spec)
        return self._grammars[key]

    def guided_matchers(self, spec, n: int) -> list:
        """n independent GrammarMatchers for one constraint (one per sample of a request)."""
        self.compile_grammar(spec)
        first = self._grammar_compiler.matcher(self._grammars[repr(spec)])
        return [first] + [first.copy() for _ in range(n - 1)]

    def _make_row(self, toks, sp: SamplingParams, request_index: int) -> Row:
        cap = self.max_model_len - len(toks)
        if sp.max_tokens > cap:  # generation stops at the context end with finish_reason "length"
            sp = dataclasses.replace(sp, max_tokens=cap, min_tokens=min(sp.min_tokens, cap))
        return Row(prompt_ids=toks, params=sp, request_index=request_index,
                   checker=StopChecker(sp, self.tokenizer.eos_ids),
                   detok=self.tokenizer.detokenizer(skip_special_tokens=sp.skip_special_tokens),
                   max_new=sp.max_tokens, logprobs=[] if sp.logprobs is not None else None)

    # ------------------------------------------------------------------ reports
    def memory_report(self, seq_len: int | None = None) -> dict:
        """Weights and KV cache bytes. KV bytes per token come split by layer kind: GLOBAL
        layers keep every position; LOCAL (sliding-window) layers add bytes per token only
        until their window is full when the cache keeps just the window (the engine's
        ``windowed_kv``). ``kv_bytes_seq`` is what one sequence
        of ``seq_len`` tokens (default max_model_len) needs that way, ``kv_bytes_seq_dense``
        with every position of every layer kept."""
        import jax

        from jaxinfer.config import AttentionKind

        cfg, n, kvd = self.cfg, seq_len or self.max_model_len, self.engine.kv_dtype
        windowed = self.engine.window is not None
        weights = sum(x.nbytes for x in jax.tree.leaves(self.weights))
        scheme = quant.model_scheme(self.weights)
        qas = [x for x in jax.tree.leaves(self.weights, is_leaf=lambda x: isinstance(x, quant.QuantArray))
               if isinstance(x, quant.QuantArray)]
        return {
            "weights_bytes": int(weights),
            "quantization": scheme.value if scheme is not None else None,
            # int4: the group sizes used (the largest of 128/64/32 dividing each weight)
            "quant_groups": sorted({q.group for q in qas if q.scheme == quant.QuantScheme.INT4}),
            "kv_cache_bytes": int(self.engine.last_cache_bytes),
            "kv_cache_dtype": kvd,
            "kv_bytes_per_token": cfg.kv_bytes_per_token(kvd),
            "kv_bytes_per_token_global": cfg.kv_bytes_per_token(kvd, kind=AttentionKind.GLOBAL),
            "kv_bytes_per_token_local": cfg.kv_bytes_per_token(kvd, kind=AttentionKind.LOCAL),
            "sliding_window": cfg.sliding_window,
            # multi-head latent attention: the latent's values and bytes per token against the
            # per-head keys and values it replaces (None for other attention)
            "kv_latent": cfg.latent_kv_report(kvd),
            "seq_len": n,
            "kv_bytes_seq": cfg.kv_bytes(n, kvd, windowed=windowed),
            "kv_bytes_seq_dense": cfg.kv_bytes(n, kvd, windowed=False),
            "dtype": cfg.dtype,
            "num_params": num_params(cfg),
            # tensor parallelism: devices, heads per device, and whether KV heads are split
            # (KV pools then hold kv_cache_bytes / tensor_parallel_size per device) or replicated;
            # pipeline parallelism: the stages, their layers, padding slots of uneven splits
            # (counted in weights_bytes and kv_cache_bytes), and where embedding and head live
            "parallel": self.parallel,
        }


@dataclasses.dataclass(eq=False)
class Request:
    """A request in flight: its rows (one per sample) and how many are still running."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    rows: list = dataclasses.field(default_factory=list)
    remaining: int = 0

    def output(self) -> RequestOutput:
        """The RequestOutput of this request (every row finished)."""
        rows = self.rows
        plp = rows[0].prompt_logprobs  # filled while the prompt was computed (None unless asked)
        comps = [
            CompletionOutput(
                index=j, text=r.checker.output_text, token_ids=list(r.token_ids),
                cumulative_logprob=r.cumulative_logprob if r.logprobs is not None else None,
                logprobs=r.logprobs, finish_reason=r.checker.finish_reason, stop_reason=r.checker.stop_reason,
            )
            for j, r in enumerate(rows)
        ]
        metrics = RequestMetrics(
            arrival_time=self.arrival, first_scheduled_time=min(r.scheduled_time for r in rows),
            first_token_time=min(r.first_token_time for r in rows),
            last_token_time=max(r.last_token_time for r in rows),
            finished_time=max(r.finished_time for r in rows),
            num_generated_tokens=sum(len(r.token_ids) for r in rows),
            token_times=tuple(rows[0].token_times),
            spec_drafted_tokens=sum(r.spec_drafted for r in rows),
            spec_accepted_tokens=sum(r.spec_accepted for r in rows),
        )
        lora = rows[0].lora
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, plp, comps, True, metrics,
                             None if lora is None else lora.request)


def spans_processes(tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                    data_parallel_size: int = 1) -> bool:
    """Whether ``LLM`` puts this layout on one global mesh over every ``jax.distributed``
    process (more devices than this process has), so that every process must run the same
    requests in the same order (SPMD). The batch job picks its SPMD mode by it; ``LLM``'s mesh
    (``_parallel_mesh``) makes the same choice: local when the layout fits this process."""
    import jax

    n = tensor_parallel_size * pipeline_parallel_size * data_parallel_size
    return jax.process_count() > 1 and n > jax.local_device_count()


def _parallel_mesh(tp: int, pp: int, dp: int, mesh):
    """The (data, stage, model) device mesh for the parallel sizes (None: one device, as
    without them). The product of the sizes is the number of devices used."""
    import jax

    for name, v in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp), ("data_parallel_size", dp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InvalidRequest(f"{name} must be an integer >= 1, got {v!r}")
    if mesh is not None:
        if set(mesh.axis_names) != {"data", "stage", "model"}:
            raise InvalidRequest(f"mesh must have axes ('data', 'stage', 'model'), got {dict(mesh.shape)}")
        for name, v, axis in (("tensor_parallel_size", tp, "model"), ("pipeline_parallel_size", pp, "stage"),
                              ("data_parallel_size", dp, "data")):
            if v != 1 and v != mesh.shape[axis]:
                raise InvalidRequest(f"{name}={v} does not match the mesh's {axis} axis of {mesh.shape[axis]}")
        dp, pp = mesh.shape["data"], mesh.shape["stage"]
    if dp > 1 and pp > 1:
        raise InvalidRequest("data_parallel_size > 1 together with pipeline_parallel_size > 1 is not supported yet")
    if mesh is not None:
        return mesh if mesh.devices.size > 1 else None
    n = tp * pp * dp
    if n == 1:
        return None
    from jaxinfer.sharding import make_mesh

    # Under jax.distributed: a layout that fits this process's devices stays on them (each
    # process a mesh of its own; the batch job's split of input lines is then data
    # parallelism across hosts). A bigger one is one global mesh over every process's
    # devices, tensor parallel within a host (a model group never spans two processes) and
    # data parallel across them; every process must then run the same requests (SPMD).
    local = jax.local_devices()
    if n <= len(local):  # (on one process, a bigger layout is the "needs N devices" error below)
        return make_mesh(data=dp, stage=pp, model=tp, devices=local[:n])
    devices = jax.devices()
    if n > len(devices):
        sizes = " x ".join(f"{name}={v}" for name, v in (("data_parallel_size", dp), ("tensor_parallel_size", tp),
                                                          ("pipeline_parallel_size", pp)) if v > 1)
        raise InvalidRequest(f"{sizes} needs {n} devices; {len(devices)} available")
    if len(local) % tp:
        raise InvalidRequest(f"tensor_parallel_size={tp} must divide the {len(local)} devices of each process "
                             "(a tensor-parallel group stays within one host)")
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    return make_mesh(data=dp, stage=pp, model=tp, devices=devices[:n])


# generation_config.json keys that set a SamplingParams default, as vLLM reads them
_GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(path) -> dict:
    """SamplingParams fields from a checkpoint's ``generation_config.json`` (a Hugging Face
    directory's, or the copy an Orbax checkpoint converted from one keeps beside its tokenizer);
    {} for a GGUF file or a checkpoint without one. Values the file leaves null are left out."""
    from jaxinfer.loaders.orbax_io import HF_TOKENIZER_DIR

    path = Path(path)
    file = next((f for f in (path / "generation_config.json", path / HF_TOKENIZER_DIR / "generation_config.json")
                 if path.is_dir() and f.is_file()), None)
    if file is None:
        return {}
    gen = checkpoint.read_json(file)
    if not isinstance(gen, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(gen).__name__}")
    out = {field: gen[key] for key, field in _GENERATION_KEYS.items() if gen.get(key) is not None}
    try:
        SamplingParams(**out)
    except InvalidRequest as e:
        raise CheckpointError(f"{file}: {e}") from None
    return out


def _architecture_check(model):
    """For a Hub download: refuse a config.json whose architecture no family implements, before
    any weight is fetched."""
    from jaxinfer.loaders.hf import family_for

    return lambda config: family_for(config, model)


def enable_compilation_cache() -> None:
    """JAX's persistent compilation cache, on by default under $JAXINFER_HOME/xla-cache
    (a directory the user configured for JAX is left alone). Executables that took 0.1 s or
    more to compile are kept: a step whose projections are native calls (packed float32
    weights) compiles in 0.15-0.4 s, and loading it back takes ~0.03 s."""
    import jax

    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(registry.home() / "xla-cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)


def _quant_config(quantization, group):
    """``quantization=`` / ``quant_group=`` checked under their names -> QuantConfig or None."""
    schemes = tuple(s.value for s in quant.QuantScheme)
    if quantization is not None and quantization not in schemes:
        raise InvalidRequest(f"quantization={quantization!r} is not a quantization scheme; use one of "
                             f"{', '.join(map(repr, schemes))}")
    if group is not None and quantization != "int4":
        raise InvalidRequest(f"quant_group={group} applies to quantization='int4' only, not {quantization!r}")
    return quant.quant_config(quantization, group)


def _sample_params(p: SamplingParams, j: int, request_seed: int) -> SamplingParams:
    """The j-th of n samples: a distinct, reproducible seed per sample."""
    if p.n == 1:
        return p
    seed = p.seed if p.seed is not None else request_seed
    return dataclasses.replace(p, n=1, seed=default_seed_for(seed, j) if j else seed)


def _starts_with_bos(tok, text: str) -> bool:
    if tok.bos_id is None or not tok.add_bos:
        return False
    return text.startswith(tok.id_to_piece(tok.bos_id))


_IMAGE_PARTS = {"image_url", "image_pil"}


def _check_mm_limit(limit):
    if limit is None:
        return None
    if not isinstance(limit, dict) or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                              and v >= 0 for k, v in limit.items()):
        raise InvalidRequest(f"limit_mm_per_prompt must map a modality to a count >= 0, e.g. {{'image': 2}}, "
                             f"got {limit!r}")
    if set(limit) - {"image"}:
        raise InvalidRequest(f"limit_mm_per_prompt: only 'image' inputs are run, got {sorted(limit)}")
    return dict(limit)


def _image_source(p: dict, i):
    """What an image part names: its URL (image_url) or its image (image_pil)."""
    if p["type"] == "image_pil":
        return p.get("image_pil")
    url = p.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str):
        raise InvalidRequest(f"conversation {i}: an image_url part needs {{'image_url': {{'url': str}}}}")
    return url


def _plain_conversation(conv, i, boi: str | None, *, parts: bool = False,
                        no_images: str) -> tuple[list[dict], list]:
    """The conversation as the chat template takes it, and the images its parts name (URLs or
    images), in order. parts (the template loops over content parts, as multimodal ones do): a
    list of content parts stays a list, in transformers' form ({"type": "text", "text": ...},
    {"type": "image"}), and the template places each image's marker. Otherwise each message's
    content becomes one string: text parts joined with newlines, as vLLM joins them; with image
    parts (boi: the model's image marker; None: the model takes no images, for the reason
    ``no_images``), the parts joined in order as Gemma 3's chat template joins them: each image
    as its marker, each text stripped."""
    if not isinstance(conv, list) or not conv:
        raise InvalidRequest(f"conversation {i} must be a non-empty list of messages")
    out, sources = [], []
    for m in conv:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InvalidRequest(f"conversation {i}: each message needs 'role' and 'content', got {m!r}")
        content = m["content"]
        if isinstance(content, list) and content and all(isinstance(p, dict) for p in content):
            kinds = {p.get("type") for p in content}
            texts = [p for p in content if p.get("type") == "text"]
            if kinds - {"text"} - _IMAGE_PARTS or not all(isinstance(p.get("text"), str) for p in texts):
                raise InvalidRequest(f"conversation {i}: content parts must be {{'type': 'text', 'text': str}} or "
                                     f"{{'type': 'image_url', 'image_url': {{'url': str}}}}, got types "
                                     f"{sorted(map(str, kinds))}")
            if kinds & _IMAGE_PARTS:
                if boi is None:
                    raise InvalidRequest(f"conversation {i}: this model takes no images ({no_images}); "
                                         "send text content")
                sources += [_image_source(p, i) for p in content if p["type"] in _IMAGE_PARTS]
            if parts:
                m = {**m, "content": [{"type": "text", "text": p["text"]} if p["type"] == "text" else {"type": "image"}
                                      for p in content]}
            elif kinds & _IMAGE_PARTS:
                m = {**m, "content": "".join(p["text"].strip() if p["type"] == "text" else boi for p in content)}
            else:
                m = {**m, "content": "\n".join(p["text"] for p in content)}
        elif not isinstance(content, str):
            raise InvalidRequest(f"conversation {i}: message content must be a string or a list of content parts, "
                                 f"got {type(content).__name__}")
        out.append(m)
    return out, sources


def _normalize_prompts(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single list of token ids
    for i, p in enumerate(prompts):
        if not isinstance(p, (str, dict, list, tuple)):
            raise InvalidRequest(f"prompt {i} must be a str, a list of token ids or a dict, got {type(p).__name__}")
    return prompts


def _normalize_params(sp, n: int) -> list[SamplingParams]:
    if isinstance(sp, SamplingParams):
        return [sp] * n
    sp = list(sp)
    if len(sp) != n:
        raise InvalidRequest(f"got {len(sp)} sampling_params for {n} prompts")
    return sp


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="seq", disable=not enabled or total <= 1)
