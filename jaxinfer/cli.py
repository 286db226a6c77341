"""The ``jaxinfer`` command: argument parsing and printing only.

Errors caused by input (``JaxinferError``) print one line ``jaxinfer: error: ...`` and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)


def _add_model(p: argparse.ArgumentParser) -> None:
    from jaxinfer.registry import DEFAULT_MODEL

    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help="registry name, Hugging Face Hub id (org/name, or org/name:FILE.gguf) or path to "
                        f".gguf / HF dir / Orbax dir (default {DEFAULT_MODEL})")
    p.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hub id (default: its main branch)")
    p.add_argument("--download-dir", default=None,
                   help="cache Hub downloads here instead of huggingface_hub's cache (HF_HUB_CACHE)")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="default: float32 on CPU, bfloat16 on TPU/GPU")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "int8"],
                   help="KV cache storage (auto: the model's dtype; int8: int8 with a float32 scale per token and head)")
    p.add_argument("--kernels", default="auto", choices=["auto", "pallas", "native", "xla"],
                   help="which kernels run attention and the matmuls: auto (Pallas on TPU/GPU, native CPU "
                        "kernels on one CPU device), pallas (interpret mode on CPU), native, or xla")
    _add_quantize(p)


def _add_quantize(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", "-q", default=None, choices=["int8", "int4", "w8a8"],
                   help="quantize the matmul weights while loading: int8 / int4 weight-only, or w8a8 "
                        "(int8 weights and activations, SmoothQuant-calibrated)")
    p.add_argument("--quant-group", type=int, default=None,
                   help="int4 rows per scale (default: the largest of 128/64/32 dividing each weight)")


def _add_engine(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-num-seqs", type=int, default=64, help="decode slots")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache page")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, help="exact number of KV cache pages")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of an accelerator's memory for the weights and KV cache (no effect on CPU, "
                        "where the KV cache gets 2 GiB unless --kv-cache-memory-bytes says otherwise)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="exact KV cache size in bytes (overrides --gpu-memory-utilization)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="prompt tokens per scheduler step")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV pages of shared prompt prefixes (default: on)")
    p.add_argument("--scheduling-policy", choices=["fcfs", "spf"], default="fcfs",
                   help="admission order: first come first served, or shortest prompt first")
    p.add_argument("--num-scheduler-steps", type=int, default=None,
                   help="decode steps one device call may chain when no running row needs the host between "
                        "tokens (no stop strings, grammars or streaming); 1: never chain (the default)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        "(methods: ngram with prompt_lookup_min/max, early_exit with num_layers, medusa or eagle with "
                        "model, draft_model with model and optional quantization int8/int4; "
                        "disable_by_batch_size: above this many running rows, steps run without speculation; "
                        "default never)")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT directories): a request whose model names one runs it")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters by name: name=path (a PEFT directory or Hub id) or a JSON object with "
                        '"name" and "path"; needs --enable-lora')
    p.add_argument("--max-loras", type=int, default=1, help="LoRA adapters one step may run together")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest LoRA rank an adapter may have")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="LoRA adapters kept read in host memory (default: --max-loras)")
    p.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                   help='the most images one prompt may carry, e.g. \'{"image": 2}\' (default: no limit)')
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="image_url parts may read file:// URLs under this directory (default: none)")
    _add_parallel(p)


def _mm_limit(a):
    """--limit-mm-per-prompt's JSON object (LLM checks its keys and counts)."""
    import json

    from jaxinfer.errors import InvalidRequest

    if a.limit_mm_per_prompt is None:
        return None
    try:
        return json.loads(a.limit_mm_per_prompt)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"--limit-mm-per-prompt: not JSON ({e.msg}), e.g. '{{\"image\": 2}}'") from None


def _lora_modules(a) -> dict:
    """--lora-modules as name -> LoRARequest (checked before the model loads)."""
    from jaxinfer.errors import InvalidRequest
    from jaxinfer.lora import parse_lora_modules

    modules = parse_lora_modules(getattr(a, "lora_modules", None))
    if modules and not a.enable_lora:
        raise InvalidRequest("--lora-modules needs --enable-lora")
    return modules


def _add_parallel(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="devices the weights and KV heads split over")
    p.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="pipeline stages the layers (and their KV pages) split over")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="replicas, each with its own slots and KV pages (max-num-seqs each); "
                        "data x pipeline x tensor parallel size devices in all")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="mixture-of-experts models: split whole experts over the tensor-parallel devices "
                        "instead of each expert's width (attention stays tensor parallel)")


def _model_kwargs(a) -> dict:
    return {"dtype": a.dtype, "kv_cache_dtype": a.kv_cache_dtype, "max_model_len": a.max_model_len,
            "revision": a.revision, "download_dir": a.download_dir, "kernels": a.kernels}


def _engine_kwargs(a) -> dict:
    return dict(quantization=a.quantization, quant_group=a.quant_group,
                max_num_seqs=a.max_num_seqs, block_size=a.block_size, num_gpu_blocks_override=a.num_gpu_blocks_override,
                gpu_memory_utilization=a.gpu_memory_utilization, kv_cache_memory_bytes=a.kv_cache_memory_bytes,
                max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=a.enable_prefix_caching,
                scheduling_policy=a.scheduling_policy, speculative_config=a.speculative_config,
                num_scheduler_steps=a.num_scheduler_steps, enable_lora=a.enable_lora, max_loras=a.max_loras,
                max_lora_rank=a.max_lora_rank, max_cpu_loras=a.max_cpu_loras, limit_mm_per_prompt=_mm_limit(a),
                allowed_local_media_path=a.allowed_local_media_path, **_parallel_kwargs(a))


def _parallel_kwargs(a) -> dict:
    return {"tensor_parallel_size": a.tensor_parallel_size, "pipeline_parallel_size": a.pipeline_parallel_size,
                "data_parallel_size": a.data_parallel_size, "enable_expert_parallel": a.enable_expert_parallel}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="jaxinfer", description="JAX/XLA inference for open LLMs")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    _add_model(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw text prompt")
    src.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    _add_sampling(g)
    g.add_argument("--json", action="store_true", help="print one JSON object (implies --no-stream)")
    g.add_argument("--no-stream", action="store_true", help="print the text once it is complete")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    _add_parallel(g)

    ch = sub.add_parser("chat", help="an interactive multi-turn chat in the terminal (reads stdin; /exit ends)")
    _add_model(ch)
    _add_sampling(ch)
    ch.add_argument("--system", default=None, help="a system message starting the conversation")

    b = sub.add_parser(
        "batch", help="answer every request of a file into a JSONL file, resumably",
        description="INPUT.jsonl: OpenAI Batch API request lines, answered in OpenAI's batch output format. "
                    "Any other INPUT: one prompt per line (quick mode). Results are appended as requests "
                    "finish; rerunning the same command after a crash or preemption answers only what is left.")
    b.add_argument("input", help="OpenAI batch .jsonl file, or a text file with one prompt per line (a local path, "
                                 "gs://BUCKET/KEY or s3://BUCKET/KEY)")
    b.add_argument("-o", "--output", required=True,
                   help="JSONL output file (appended to and resumed); or gs://BUCKET/KEY, s3://BUCKET/KEY: results go "
                        "to OUTPUT.parts/ in part objects, joined into OUTPUT when every request is answered")
    _add_model(b)
    _add_engine(b)
    s = b.add_argument_group("sampling defaults", "for requests that do not set them "
                             "(otherwise OpenAI's defaults; quick mode: greedy, 64 tokens)")
    s.add_argument("--max-tokens", type=int, default=None)
    s.add_argument("--temperature", type=float, default=None)
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--min-p", type=float, default=None)
    s.add_argument("--seed", type=int, default=None)
    b.add_argument("--format", choices=["auto", "openai", "prompts"], default="auto",
                   help="input format (auto: openai for .jsonl/.json files, prompts otherwise)")
    b.add_argument("--order", choices=["completion", "input"], default=None,
                   help="order of the finished file (default: completion for .jsonl, input for quick mode)")
    b.add_argument("--raw", action="store_true", help="quick mode: do not apply the chat template")
    b.add_argument("--metrics-out", default=None, help="write counts, throughput and latency percentiles as JSON")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("--grace-period", type=float, default=20.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT (default 20; to a URL output, "
                        "the last part is written within it too)")
    b.add_argument("--part-lines", type=int, default=1000,
                   help="output URL: results per part object (default 1000); a kill loses at most one unwritten part")
    b.add_argument("--part-seconds", type=float, default=30.0,
                   help="output URL: a part is also written at the first result this long after its first (default 30)")
    d = b.add_argument_group(
        "multi-host (jax.distributed)",
        "run the same command on every host. A parallel layout that fits one host's devices runs on each host "
        "separately: each process answers its share of the input and writes OUTPUT.part-I-of-N; process 0 "
        "merges them into OUTPUT. A bigger one (e.g. --tensor-parallel-size 4 --data-parallel-size 2 on hosts "
        "of 4 devices) is one mesh over all hosts, tensor parallel within a host and data or pipeline parallel "
        "across: every process then reads the whole input, which must be the same file, runs every request, "
        "and process 0 alone writes OUTPUT")
    d.add_argument("--distributed", action="store_true",
                   help="join a jax.distributed job, detected from the environment (Cloud TPU pods, SLURM, ...)")
    d.add_argument("--coordinator-address", default=None, help="HOST:PORT of process 0")
    d.add_argument("--num-processes", type=int, default=None)
    d.add_argument("--process-id", type=int, default=None)

    be = sub.add_parser("bench", help="run a reproducible synthetic workload and report serving metrics")
    _add_model(be)
    _add_engine(be)
    be.add_argument("--num-requests", type=int, default=128)
    be.add_argument("--prompt-len", type=int, nargs=2, default=(25, 250), metavar=("MIN", "MAX"))
    be.add_argument("--output-len", type=int, nargs=2, default=(64, 64), metavar=("MIN", "MAX"))
    be.add_argument("--shared-prefix-len", type=int, default=0)
    be.add_argument("--shared-prefix-share", type=float, default=0.0)
    be.add_argument("--seed", type=int, default=0)
    be.add_argument("--ttft-slo", type=float, default=None, help="seconds, for goodput")
    be.add_argument("--tpot-slo", type=float, default=None, help="seconds, for goodput")
    be.add_argument("--no-warmup", action="store_true")
    be.add_argument("--json", default=None, help="write the summary here")

    w = sub.add_parser("warmup", help="precompile the engine's buckets (kept in the persistent cache)")
    _add_model(w)
    _add_engine(w)
    w.add_argument("--max-prompt-len", type=int, default=None)
    w.add_argument("--compile-threads", type=int, default=None,
                   help="executables compiled at once (default: one per core this process may use)")

    tm = sub.add_parser("train-medusa", help="train Medusa heads for speculative decoding (self-distillation)")
    tm.add_argument("model_name", metavar="MODEL", help="registry name or path of the model the heads serve")
    tm.add_argument("--out", required=True, help="directory for the heads (Orbax checkpoint + medusa.json)")
    tm.add_argument("--heads", type=int, default=3)
    tm.add_argument("--steps", type=int, default=600)
    tm.add_argument("--batch", type=int, default=128, help="positions per step")
    tm.add_argument("--lr", type=float, default=1e-3)
    tm.add_argument("--max-tokens", type=int, default=128, help="length of the model's own answers")
    tm.add_argument("--data", default=None, help='JSONL of {"prompt", "split": "train"|"heldout"} (default: the '
                                                 "packaged medusa_prompts.jsonl)")
    tm.add_argument("--seed", type=int, default=0)

    te = sub.add_parser("train-eagle", help="train an EAGLE draft head for speculative decoding (self-distillation)")
    te.add_argument("model_name", metavar="MODEL", help="registry name or path of the model the head serves")
    te.add_argument("--out", required=True, help="directory for the head (Orbax checkpoint + eagle.json)")
    te.add_argument("--steps", type=int, default=700)
    te.add_argument("--batch", type=int, default=8, help="sequences per step")
    te.add_argument("--lr", type=float, default=1e-3)
    te.add_argument("--max-tokens", type=int, default=128, help="length of the model's own answers")
    te.add_argument("--vocab-size", type=int, default=8192, help="draft vocabulary: most frequent answer tokens")
    te.add_argument("--second-pass", type=float, default=1.0,
                    help="weight of the loss on draft 2 fed the head's own estimate (0: real features only)")
    te.add_argument("--data", default=None, help='JSONL of {"prompt", "split": "train"|"heldout"} (default: the '
                                                 "packaged draft_prompts.jsonl)")
    te.add_argument("--seed", type=int, default=0)

    sv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                        description="Endpoints: /v1/chat/completions, /v1/completions (streamed as server-sent "
                                    "events with stream=true), /v1/models, /health, /version, /tokenize, "
                                    "/detokenize, /metrics (Prometheus).")
    sv.add_argument("model_name", nargs="?", default=None, metavar="MODEL", help="same as --model")
    _add_model(sv)
    _add_engine(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1/*")
    sv.add_argument("--max-waiting", type=int, default=256,
                    help="sequences that may wait beyond the running batch; past it, 429 (default 256)")
    sv.add_argument("--rate-limit", default=None, metavar="N/min", help="requests per minute per API key")
    sv.add_argument("--allow-runtime-lora-updating", action="store_true",
                    help="enable /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora)")
    sv.add_argument("--grace-period", type=float, default=30.0,
                    help="seconds in-flight requests get to finish after SIGTERM (default 30)")

    sub.add_parser("models", help="list registered models and what is cached")
    f = sub.add_parser("fetch", help="download and verify a registered model")
    f.add_argument("name")

    c = sub.add_parser("convert", help="convert a checkpoint to an Orbax checkpoint")
    c.add_argument("src", help="registry name, Hub id, path, or gs:// / s3:// URL")
    c.add_argument("dest", help="output directory (default store: checkpoints/), or gs://BUCKET/PATH, s3://BUCKET/PATH")
    c.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    _add_quantize(c)
    return ap


def _sampling(a):
    from jaxinfer import SamplingParams

    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                          top_k=a.top_k, min_p=a.min_p, seed=a.seed)


def cmd_generate(a) -> int:
    from jaxinfer import LLM

    sp = _sampling(a)  # invalid values fail before the model loads
    # one prompt: as many decode slots as it has choices, so the page pool is sized for those
    # sequences rather than the default 64 (allocating that pool was a quarter of start-up)
    llm = LLM(a.model, **_model_kwargs(a), progress=not a.json, quantization=a.quantization, quant_group=a.quant_group,
              max_num_seqs=max(sp.n, 1), speculative_config=a.speculative_config, **_parallel_kwargs(a))
    t0 = time.perf_counter()
    if not a.json and not a.no_stream:
        prompt = [{"role": "user", "content": a.chat}] if a.chat is not None else a.prompt
        for piece in llm.stream(prompt, sp, chat=a.chat is not None):
            print(piece, end="", flush=True)
        print()
        return 0
    if a.chat is not None:
        out = llm.chat([{"role": "user", "content": a.chat}], sp, use_tqdm=False)[0]
    else:
        out = llm.generate(a.prompt, sp, use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    c = out.outputs[0]
    m = out.metrics
    decode_s = (m.last_token_time - m.first_token_time) if len(c.token_ids) > 1 else 0.0
    if a.json:
        print(json.dumps({
            "model": a.model, "prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids,
            "token_ids": c.token_ids, "text": c.text, "finish_reason": c.finish_reason,
            "ttft_s": m.ttft, "tokens_per_s": (len(c.token_ids) - 1) / decode_s if decode_s > 0 else None,
            "wall_s": wall,
            **({"spec_drafted_tokens": m.spec_drafted_tokens, "spec_accepted_tokens": m.spec_accepted_tokens}
               if a.speculative_config else {}),
        }, ensure_ascii=False))
    else:
        print(c.text)
    return 0


def cmd_chat(a) -> int:
    """Read user turns from stdin, one a line; stream each reply; keep the whole conversation."""
    from jaxinfer import LLM
    from jaxinfer.errors import JaxinferError

    sp = _sampling(a)
    llm = LLM(a.model, **_model_kwargs(a), progress=False, quantization=a.quantization, quant_group=a.quant_group,
              max_num_seqs=max(sp.n, 1))
    conv = [{"role": "system", "content": a.system}] if a.system else []
    tty = sys.stdin.isatty()
    while True:
        if tty:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        conv.append({"role": "user", "content": line.rstrip("\n")})
        reply = []
        try:
            for piece in llm.stream(conv, sp, chat=True):
                print(piece, end="", flush=True)
                reply.append(piece)
        except JaxinferError as e:  # e.g. the conversation outgrew the context: say so, keep going
            print(f"jaxinfer: error: {e}", file=sys.stderr)
            conv.pop()
            continue
        print(flush=True)
        conv.append({"role": "assistant", "content": "".join(reply)})


def cmd_batch(a) -> int:
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.batch import check_input, init_distributed, input_format, run_batch
    from jaxinfer.llm import spans_processes

    check_input(a.input)  # fail on a bad input file before loading the model
    fmt = input_format(a.input) if a.format == "auto" else a.format
    given = {k: v for k, v in (("max_tokens", a.max_tokens), ("temperature", a.temperature), ("top_p", a.top_p),
                               ("top_k", a.top_k), ("min_p", a.min_p), ("seed", a.seed)) if v is not None}
    quick = SamplingParams(**{"max_tokens": 64, "temperature": 0.0, **given}) if fmt == "prompts" else None
    if fmt == "openai":  # check the defaults as a request would be checked
        SamplingParams(**given)
    me, count = 0, 1
    if a.distributed or a.coordinator_address or a.num_processes or a.process_id is not None:
        me, count = init_distributed(a.coordinator_address, a.num_processes, a.process_id)
    sizes = {k: v for k, v in _parallel_kwargs(a).items() if k.endswith("_size")}
    lora_modules = _lora_modules(a)
    spmd = count > 1 and spans_processes(**sizes)
    s = run_batch(
        lambda: LLM(a.model, **_model_kwargs(a), **_engine_kwargs(a)),
        a.input, a.output, kind=fmt, order=a.order, defaults=given, sampling_params=quick,
        raw=a.raw, model_name=None if Path(a.model).exists() else a.model,
        metrics_out=a.metrics_out, progress=not a.no_progress, grace_period=a.grace_period,
        process_index=me, process_count=count, spmd=spmd, part_lines=a.part_lines, part_seconds=a.part_seconds,
        lora_modules=lora_modules,
    )
    who = f"process {me} of {count}: " if count > 1 else ""
    r, run, wall = s.result, s.run, max(s.wall_s, 1e-9)
    print(f"{who}{r.answered} of {s.total} requests answered ({r.ok} ok, {r.failed} failed), {r.input_tokens} input "
          f"and {r.output_tokens} output tokens -> {a.output}"
          + (f"; {r.repetitions} sequences ended by repetition detection" if r.repetitions else ""), file=sys.stderr)
    print(f"{who}this run: {run.answered} requests ({s.before} answered before), {run.output_tokens} output tokens "
          f"in {wall:.1f} s: {run.output_tokens / wall:.1f} output tok/s, {run.answered / wall:.2f} req/s",
          file=sys.stderr)
    if s.interrupted is not None:
        import signal

        print(f"jaxinfer: stopped by {signal.Signals(s.interrupted).name} with {s.total - r.answered} requests "
              "left; run the same command again to resume", file=sys.stderr)
        return 128 + s.interrupted
    return 0


def cmd_bench(a) -> int:
    from jaxinfer import LLM
    from jaxinfer.bench import WorkloadSpec, format_summary, run_bench

    spec = WorkloadSpec(a.num_requests, tuple(a.prompt_len), tuple(a.output_len), a.shared_prefix_len,
                        a.shared_prefix_share, a.seed)
    kw = _model_kwargs(a)
    kw["max_model_len"] = a.max_model_len or max(1024, a.prompt_len[1] + a.shared_prefix_len + a.output_len[1])
    llm = LLM(a.model, **kw, **_engine_kwargs(a))
    s = run_bench(llm, spec, warmup=not a.no_warmup, ttft_slo=a.ttft_slo, tpot_slo=a.tpot_slo)
    print(format_summary(s))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


def cmd_warmup(a) -> int:
    from jaxinfer import LLM
    from jaxinfer.errors import InvalidRequest

    if a.compile_threads is not None and a.compile_threads < 1:  # before the model is read
        raise InvalidRequest(f"--compile-threads must be >= 1, got {a.compile_threads}")
    llm = LLM(a.model, **_model_kwargs(a), **_engine_kwargs(a))
    t0 = time.perf_counter()
    n = llm.engine.warmup(max_prompt_len=a.max_prompt_len, compile_threads=a.compile_threads)
    print(f"compiled {n} executables in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def _rate_limit(text: str | None) -> int | None:
    from jaxinfer.errors import InvalidRequest

    if text is None:
        return None
    n, _, unit = text.partition("/")
    if unit not in ("min", "m", "minute") or not n.isdigit() or int(n) < 1:
        raise InvalidRequest(f"--rate-limit must look like 60/min, got {text!r}")
    return int(n)


def cmd_serve(a) -> int:
    from jaxinfer import LLM
    from jaxinfer.server import ServerConfig, serve

    model = a.model_name or a.model
    config = ServerConfig(model_name=model, api_key=a.api_key, max_waiting=a.max_waiting,
                          rate_limit=_rate_limit(a.rate_limit), lora_modules=_lora_modules(a),
                          allow_runtime_lora_updating=a.allow_runtime_lora_updating)  # bad flags fail before the model loads
    if a.allow_runtime_lora_updating and not a.enable_lora:
        from jaxinfer.errors import InvalidRequest

        raise InvalidRequest("--allow-runtime-lora-updating needs --enable-lora")
    llm = LLM(model, **_model_kwargs(a), progress=True, **_engine_kwargs(a))
    serve(llm, config, host=a.host, port=a.port, grace_period=a.grace_period)
    return 0


def cmd_train_medusa(a) -> int:
    from jaxinfer.train_medusa import train_medusa

    report = train_medusa(a.model_name, a.out, num_heads=a.heads, steps=a.steps, batch=a.batch, lr=a.lr,
                          max_tokens=a.max_tokens, data=a.data, seed=a.seed)
    print(json.dumps(report))
    return 0


def cmd_train_eagle(a) -> int:
    from jaxinfer.train_eagle import train_eagle

    report = train_eagle(a.model_name, a.out, steps=a.steps, batch=a.batch, lr=a.lr, max_tokens=a.max_tokens,
                         vocab_size=a.vocab_size, second_pass=a.second_pass, data=a.data, seed=a.seed)
    print(json.dumps(report))
    return 0


def cmd_models(a) -> int:
    from jaxinfer import registry

    for r in registry.list_models():
        state = f"cached at {r['path']}" if r["cached"] else "not cached (jaxinfer fetch " + r["name"] + ")"
        print(f"{r['name']:<24} {r['size'] / 1e6:7.1f} MB  {r['description']}\n{'':<24} {state}")
    return 0


def cmd_fetch(a) -> int:
    from jaxinfer import registry

    print(registry.fetch(a.name))
    return 0


def cmd_convert(a) -> int:
    from jaxinfer.loaders.convert import convert

    print(convert(a.src, a.dest, dtype=a.dtype, quantize=a.quantization, quant_group=a.quant_group))
    return 0


def main(argv=None) -> int:
    from jaxinfer.errors import JaxinferError

    a = build_parser().parse_args(argv)
    try:
        return {"generate": cmd_generate, "chat": cmd_chat, "batch": cmd_batch, "bench": cmd_bench,
                "warmup": cmd_warmup, "models": cmd_models, "serve": cmd_serve, "fetch": cmd_fetch,
                "train-medusa": cmd_train_medusa,
                "train-eagle": cmd_train_eagle,
                "convert": cmd_convert}[a.cmd](a)
    except JaxinferError as e:
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    """The ``jaxinfer`` command and ``python -m jaxinfer``: this process is the engine's, so it
    keeps freed memory in the heap (no fresh mmap per step, ``jaxinfer.hostmem``); ``main``
    called as a function leaves its caller's allocator alone."""
    from jaxinfer.hostmem import keep_freed_memory

    keep_freed_memory()
    sys.exit(main())


if __name__ == "__main__":
    entry()
