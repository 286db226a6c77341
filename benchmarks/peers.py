"""Peers, side by side in one run: jaxinfer vs transformers (PyTorch CPU) vs llama.cpp.

    python benchmarks/peers.py --json benchmarks/peers.json --plot benchmarks/peers.png
    python benchmarks/peers.py --quick                     # smoke run, a few minutes

One synthetic workload (``jaxinfer.bench``: 128 requests, prompts of 25-250 tokens, 64 output
tokens each, seed 0) is tokenized once with the model's own tokenizer, and exactly the same
prompt token ids go to the three engines, all on the same SmolLM2-135M GGUF:

* **transformers** (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``, the Q4_1
  weights dequantized to bfloat16 and to float32): padded batch ``generate``, greedy, left
  padding, EOS ignored; the requests are taken in workload order, ``batch`` at a time. Its best
  batch size is reported too.
* **llama.cpp** through ``llama-cpp-python``'s low-level API, on the Q4_1 weights as they are:
  ``concurrency`` sequences in flight (one KV stream each), one ``llama_decode`` per step for
  every sequence (each running sequence's next token, plus prompt chunks of newly admitted
  sequences under an ``n_batch`` token budget, as llama-server does), greedy argmax of each
  sequence's logits; a finished sequence's slot is refilled at once.
* **jaxinfer** through its public API: ``LLM(path, max_model_len=1024, max_num_seqs=concurrency)``
  and ``llm.generate`` with ``SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)``;
  one warm-up pass (compilation), then the timed runs.

Throughput is output tokens / wall time of the whole workload (prefill included). Concurrency 1
runs a subset of the requests (``--subset``, 8 by default) to keep it short. Each engine runs in
its own subprocess, one after another, on 2 threads (``torch.set_num_threads(2)``,
``n_threads=2``; XLA CPU uses the machine's 2 cores). Medians over ``--repeats`` runs.

The llama.cpp and plotting parts need the ``bench`` extra (``pip install -e .[bench]``; build
llama-cpp-python for this CPU with ``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON"``,
``-DGGML_AVX512=OFF`` where the CPU has no AVX-512; with ``--no-deps``, install ``diskcache`` too).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "smollm2-135m-instruct"
THREADS = 2


# ---------------------------------------------------------------------------------- helpers
def _loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def _median_row(runs):
    walls = [r["wall_s"] for r in runs]
    tps = [r["out_tok_s"] for r in runs]
    return {"out_tok_s": statistics.median(tps), "wall_s": statistics.median(walls),
            "runs_out_tok_s": [round(t, 2) for t in tps],
            "out_tokens": runs[0]["out_tokens"], "requests": runs[0]["requests"]}


def _check_counts(reqs, outs, who):
    for i, (r, o) in enumerate(zip(reqs, outs)):
        if len(o) != r["max_tokens"]:
            raise RuntimeError(f"{who}: request {i} produced {len(o)} tokens, expected {r['max_tokens']}")


def _requests_for(workload, conc, subset):
    return workload[:subset] if conc == 1 else workload


# ---------------------------------------------------------------------------------- engines
# Each engine lives in its own worker process for the whole run and is driven level by level:
# setup(c) loads/compiles for concurrency c, run(c) times one pass over the requests,
# teardown(c) frees what setup made.
class TransformersEngine:
    def __init__(self, work, args):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(THREADS)
        self.torch = torch
        path = Path(work["model_path"])
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        self.model.eval()
        self.load_s = time.perf_counter() - t0
        self.pad = work["pad_id"]
        self.args = args

    def setup(self, c, reqs):
        self._run(reqs[: min(len(reqs), c, 2)], c)  # warm-up: allocator, kernels
        return {}

    def run(self, c, reqs):
        return self._run(reqs, c)

    def teardown(self, c):
        pass

    def _run(self, reqs, batch):
        from transformers import GenerationConfig

        torch = self.torch
        outs, n_tok = [], 0
        t0 = time.perf_counter()
        for i in range(0, len(reqs), batch):
            chunk = reqs[i : i + batch]
            L = max(len(r["prompt_ids"]) for r in chunk)
            m = max(r["max_tokens"] for r in chunk)
            ids = torch.full((len(chunk), L), self.pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), L), dtype=torch.long)
            for j, r in enumerate(chunk):  # left padding
                n = len(r["prompt_ids"])
                ids[j, L - n :] = torch.tensor(r["prompt_ids"])
                mask[j, L - n :] = 1
            # eos_token_id=None: EOS ignored, every row makes max_new_tokens tokens
            gcfg = GenerationConfig(max_new_tokens=m, do_sample=False, eos_token_id=None,
                                    pad_token_id=self.pad, bos_token_id=None)
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gcfg)
            new = out[:, L:].tolist()
            for j, r in enumerate(chunk):
                toks = new[j][: r["max_tokens"]]
                outs.append(toks)
                n_tok += len(toks)
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "out_tokens": n_tok, "out_tok_s": n_tok / wall, "requests": len(reqs)}, outs

    def info(self):
        import transformers

        cfg = self.model.config
        lin = self.model.get_decoder().layers[0].mlp.down_proj  # dense nn.Linear = dequantized
        return {"load_s": self.load_s,
                "versions": {"torch": self.torch.__version__, "transformers": transformers.__version__},
                "config": {"dtype": self.args.dtype, "threads": self.torch.get_num_threads(),
                           "attn_implementation": getattr(cfg, "_attn_implementation", None),
                           "weights": f"{type(lin).__name__} weight {lin.weight.dtype}, {tuple(lin.weight.shape)}",
                           "batching": "padded batches in workload order, left padding"}}


class LlamaCppEngine:
    def __init__(self, work, args):
        import ctypes

        import llama_cpp
        from llama_cpp import llama_cpp as ll

        self.ll, self.version = ll, llama_cpp.__version__

        def _log(level, text, user_data):  # keep errors only (level 4 = GGML_LOG_LEVEL_ERROR)
            if level == 4:
                sys.stderr.write((text or b"").decode(errors="replace"))

        self._log_cb = ll.llama_log_callback(_log)  # keep a reference: ctypes callbacks must stay alive
        ll.llama_log_set(self._log_cb, ctypes.c_void_p())
        ll.llama_backend_init()
        t0 = time.perf_counter()
        self.model = ll.llama_model_load_from_file(work["model_path"].encode(), ll.llama_model_default_params())
        if not self.model:
            raise RuntimeError("llama.cpp could not load the model")
        self.load_s = time.perf_counter() - t0
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        per_seq = max(len(r["prompt_ids"]) + r["max_tokens"] for r in work["requests"])
        self.per_seq = -(-per_seq // 256) * 256
        self.args = args
        self.unified = bool(args.llama_kv_unified)
        self.ctx = None
        self.ctx_cfg = {}

    def setup(self, c, reqs):
        ll = self.ll
        cp = ll.llama_context_default_params()
        cp.n_ctx = self.per_seq * c
        cp.n_batch = max(self.args.n_batch, c)
        cp.n_ubatch = min(cp.n_batch, self.args.n_ubatch)
        cp.n_seq_max = c
        cp.n_threads = THREADS
        cp.n_threads_batch = THREADS
        # False: one KV stream per sequence, attention reads only its own cells. True: one shared
        # cache (llama-server's layout), prompts and decodes mixed in the same batch.
        cp.kv_unified = self.unified
        cp.no_perf = True
        self.ctx = ll.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {c} sequences")
        self.cap = cp.n_batch
        self.ctx_cfg = {"n_ctx": cp.n_ctx, "n_ctx_per_seq": self.per_seq, "n_batch": cp.n_batch,
                        "n_ubatch": cp.n_ubatch, "threads": cp.n_threads, "kv_unified": bool(cp.kv_unified),
                        "flash_attn_type": cp.flash_attn_type}
        self._run(reqs[: min(len(reqs), c, 4)], c)  # warm-up
        return {"decode_calls_note": "one llama_decode per step for all sequences"}

    def teardown(self, c):
        self.ll.llama_free(self.ctx)
        self.ctx = None

    def run(self, c, reqs):
        return self._run(reqs, c)

    def _run(self, reqs, conc):
        import numpy as np

        ll, ctx, cap = self.ll, self.ctx, self.cap
        mem = ll.llama_get_memory(ctx)
        ll.llama_memory_clear(mem, True)
        batch = ll.llama_batch_init(cap, 0, 1)
        tok_a = np.ctypeslib.as_array(batch.token, shape=(cap,))
        pos_a = np.ctypeslib.as_array(batch.pos, shape=(cap,))
        nsq_a = np.ctypeslib.as_array(batch.n_seq_id, shape=(cap,))
        lg_a = np.ctypeslib.as_array(batch.logits, shape=(cap,))
        seq_ptrs = [batch.seq_id[i] for i in range(cap)]
        nsq_a[:] = 1
        outs = [None] * len(reqs)
        pending = list(range(len(reqs)))[::-1]
        slots = [None] * conc  # each: [request, prompt_cursor, next_pos, next_token, outputs]
        n_tok, steps, prefill_calls = 0, 0, 0
        t0 = time.perf_counter()
        while pending or any(s is not None for s in slots):
            for s in range(conc):  # a free slot takes the next request at once
                if slots[s] is None and pending:
                    slots[s] = [pending.pop(), 0, 0, None, []]
            n, owners = 0, []  # owners: the slot of each logits row, in batch order
            if not self.unified:
                # Separate KV streams: llama.cpp splits a batch into ubatches holding equally many
                # tokens of every sequence, so a prompt mixed with 1-token decodes would run in
                # hundreds of tiny ubatches. New prompts are prefilled on their own instead (one
                # sequence per call, n_batch tokens at a time); the decode step below stays one
                # call for all running sequences.
                for s, st in enumerate(slots):
                    if st is None or st[3] is not None:
                        continue
                    ids = reqs[st[0]]["prompt_ids"]
                    while st[1] < len(ids):
                        k = min(len(ids) - st[1], cap)
                        tok_a[:k] = ids[st[1] : st[1] + k]
                        pos_a[:k] = np.arange(st[1], st[1] + k)
                        lg_a[:k] = 0
                        for j in range(k):
                            seq_ptrs[j][0] = s
                        st[1] += k
                        last = st[1] == len(ids)
                        if last:
                            lg_a[k - 1] = 1
                        batch.n_tokens = k
                        rc = ll.llama_decode(ctx, batch)
                        if rc != 0:
                            raise RuntimeError(f"llama_decode returned {rc}")
                        prefill_calls += 1
                    st[2] = st[1]
                    t = int(np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, -1), shape=(self.n_vocab,)).argmax())
                    st[4].append(t)
                    n_tok += 1
                    if len(st[4]) >= reqs[st[0]]["max_tokens"]:
                        outs[st[0]] = st[4]
                        ll.llama_memory_seq_rm(mem, s, -1, -1)
                        slots[s] = None
                    else:
                        st[3] = t
            for s, st in enumerate(slots):  # every running sequence: its next token
                if st is not None and st[3] is not None:
                    tok_a[n], pos_a[n], lg_a[n] = st[3], st[2], 1
                    seq_ptrs[n][0] = s
                    st[2] += 1
                    owners.append(s)
                    n += 1
            for s, st in enumerate(slots):  # then prompt chunks, within the n_batch budget
                if st is None or st[3] is not None or n >= cap:
                    continue
                ids = reqs[st[0]]["prompt_ids"]
                k = min(len(ids) - st[1], cap - n)
                tok_a[n : n + k] = ids[st[1] : st[1] + k]
                pos_a[n : n + k] = np.arange(st[1], st[1] + k)
                lg_a[n : n + k] = 0
                for j in range(n, n + k):
                    seq_ptrs[j][0] = s
                st[1] += k
                st[2] = st[1]
                n += k
                if st[1] == len(ids):  # logits of the last prompt token give the first output
                    lg_a[n - 1] = 1
                    owners.append(s)
            if n == 0:
                continue
            batch.n_tokens = n
            rc = ll.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            steps += 1
            if owners:
                logits = np.ctypeslib.as_array(ll.llama_get_logits(ctx), shape=(len(owners), self.n_vocab))
                for s, t in zip(owners, logits.argmax(axis=1).tolist()):  # greedy
                    st = slots[s]
                    st[4].append(t)
                    n_tok += 1
                    if len(st[4]) >= reqs[st[0]]["max_tokens"]:
                        outs[st[0]] = st[4]
                        ll.llama_memory_seq_rm(mem, s, -1, -1)
                        slots[s] = None
                    else:
                        st[3] = t
        wall = time.perf_counter() - t0
        ll.llama_batch_free(batch)
        return {"wall_s": wall, "out_tokens": n_tok, "out_tok_s": n_tok / wall, "requests": len(reqs),
                "decode_calls": steps, "prefill_calls": prefill_calls}, outs

    def info(self):
        return {"load_s": self.load_s, "versions": {"llama_cpp_python": self.version},
                "config": {"weights": "Q4_1 as stored in the GGUF", **self.ctx_cfg,
                           "batching": "continuous: a finished sequence's slot is refilled at once; "
                                       + ("prompts chunked into the decode batch (n_batch budget)" if self.unified
                                          else "a new prompt prefilled in its own calls, then one "
                                               "llama_decode per step for all running sequences")}}


class JaxinferEngine:
    def __init__(self, work, args):
        import jax

        self.jax, self.args, self.llm = jax, args, None
        self.path = work["model_path"]

    def setup(self, c, reqs):
        from jaxinfer import LLM

        t0 = time.perf_counter()
        self.llm = LLM(self.path, max_model_len=1024, max_num_seqs=c, progress=False,
                       enable_prefix_caching=self.args.jaxinfer_prefix_caching, **self._variant())
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.run(c, reqs)  # warm-up: compiles this configuration's buckets
        warm_s = time.perf_counter() - t0
        self.comp_warm = self._ncomp()
        return {"load_s": load_s, "warmup_s": warm_s, "compilations_after_warmup": self.comp_warm}

    def _variant(self) -> dict:
        """LLM options of this worker's variant: "float" or e.g. "w8a8", "int8+kv8"."""
        kw = {}
        for part in (self.args.dtype or "float").split("+"):
            if part == "kv8":
                kw["kv_cache_dtype"] = "int8"
            elif part != "float":
                kw["quantization"] = part
        return kw

    def _ncomp(self):
        f = getattr(self.llm.engine, "num_compilations", None)
        return f() if f else None

    def run(self, c, reqs):
        from jaxinfer import SamplingParams

        prompts = [{"prompt_token_ids": r["prompt_ids"]} for r in reqs]
        sps = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
        t0 = time.perf_counter()
        res = self.llm.generate(prompts, sps, use_tqdm=False)
        wall = time.perf_counter() - t0
        outs = [list(o.outputs[0].token_ids) for o in res]
        n_tok = sum(len(o) for o in outs)
        return {"wall_s": wall, "out_tokens": n_tok, "out_tok_s": n_tok / wall, "requests": len(reqs)}, outs

    def teardown(self, c):
        end = self._ncomp()
        stats = dict(getattr(self.llm.engine, "stats", {}) or {})
        self.llm = None
        gc.collect()
        self.jax.clear_caches()
        return {"compilations_during_timed": None if end is None or self.comp_warm is None else end - self.comp_warm,
                "engine_stats": stats}

    def info(self):
        import jaxinfer
        from jaxinfer.config import default_dtype

        jax = self.jax
        return {"versions": {"jaxinfer": jaxinfer.__version__, "jax": jax.__version__,
                             "backend": jax.default_backend(), "devices": len(jax.devices())},
                "config": {"max_model_len": 1024, "dtype": default_dtype(), **self._variant(),
                           "enable_prefix_caching": self.args.jaxinfer_prefix_caching,
                           "weights": "Q4_1 dequantized at load (default dtype)"}}


ENGINES = {"transformers": TransformersEngine, "llamacpp": LlamaCppEngine, "jaxinfer": JaxinferEngine}
MARK = "@@peers@@ "


def worker_main(a):
    """Serve setup/run/teardown/info requests, one JSON line each, from the driver."""
    work = json.load(open(a.workfile))
    reqs_all = work["requests"]
    eng = None
    out = sys.stdout
    sys.stdout = sys.stderr  # anything the libraries print goes to stderr, the protocol stays clean

    def reply(obj):
        out.write(MARK + json.dumps(obj) + "\n")
        out.flush()

    for line in sys.stdin:
        msg = json.loads(line)
        op, c = msg["op"], msg.get("c")
        try:
            if eng is None:
                eng = ENGINES[a.worker](work, a)
            reqs = _requests_for(reqs_all, c, a.subset) if c else None
            if op == "setup":
                reply({"ok": True, "setup": eng.setup(c, reqs) or {}})
            elif op == "run":
                r, outs = eng.run(c, reqs)
                _check_counts(reqs, outs, f"{a.worker} at concurrency {c}")
                reply({"ok": True, "run": r, "outs": outs if msg.get("want_outs") else None})
            elif op == "teardown":
                reply({"ok": True, "teardown": eng.teardown(c) or {}})
            elif op == "info":
                reply({"ok": True, "info": eng.info()})
            elif op == "quit":
                reply({"ok": True})
                return
        except Exception as e:  # report and keep serving: the driver decides
            import traceback

            traceback.print_exc()
            reply({"ok": False, "error": f"{type(e).__name__}: {e}"})


# ---------------------------------------------------------------------------------- driver
def _git_state():
    here = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "jaxinfer"], cwd=here,
                               capture_output=True, text=True).stdout.strip()
        return {"commit": rev, "jaxinfer_dir_dirty": bool(dirty)}
    except OSError:
        return None


def _lscpu():
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()[:20]
    except OSError:
        return [platform.processor()]


class Worker:
    """One engine in its own process, driven over stdin/stdout."""

    def __init__(self, kind, label, workfile, args, dtype=None):
        self.kind, self.label, self.error = kind, label, None
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--workfile", workfile,
               "--subset", str(args.subset), "--threads", str(args.threads), "--n-batch", str(args.n_batch), "--n-ubatch", str(args.n_ubatch)]
        if dtype:
            cmd += ["--dtype", dtype]
        if args.jaxinfer_prefix_caching:
            cmd += ["--jaxinfer-prefix-caching"]
        if args.llama_kv_unified:
            cmd += ["--llama-kv-unified"]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
                   TOKENIZERS_PARALLELISM="false")
        if args.omp_wait_policy:
            env["OMP_WAIT_POLICY"] = args.omp_wait_policy
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def call(self, op, c=None, **kw):
        if self.error:
            return None
        try:
            self.p.stdin.write(json.dumps({"op": op, "c": c, **kw}) + "\n")
            self.p.stdin.flush()
            for line in self.p.stdout:
                if line.startswith(MARK):
                    msg = json.loads(line[len(MARK):])
                    break
            else:
                raise RuntimeError(f"worker exited (code {self.p.wait()})")
        except (OSError, RuntimeError) as e:
            msg = {"ok": False, "error": str(e)}
        if not msg.get("ok"):
            self.error = f"{op} at concurrency {c}: {msg.get('error')}"
            print(f"   {self.label} FAILED: {self.error}", flush=True)
            return None
        return msg

    def close(self):
        if not self.error:
            self.call("quit")
        try:
            self.p.stdin.close()
        except OSError:
            pass
        self.p.wait(timeout=120)


def _agreement(a, b):
    """Mean length of the common prefix of two engines' greedy outputs (same requests), / output length."""
    if not a or not b:
        return None
    fr = []
    for x, y in zip(a, b):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        fr.append(k / max(len(x), 1))
    return round(sum(fr) / len(fr), 3)


def _table(results, levels):
    names = [n for n in results if results[n].get("ok")]
    lines = ["output tok/s (median)  " + "".join(f"{'c=' + str(c):>10}" for c in levels) + "      best"]
    for n in names:
        by = {r["concurrency"]: r["out_tok_s"] for r in results[n]["rows"]}
        best = max(by, key=by.get)
        lines.append(f"{n:22s} " + "".join(f"{by[c]:10.1f}" if c in by else f"{'-':>10}" for c in levels)
                     + f"   {by[best]:7.1f} @ {best}")
    return "\n".join(lines)


def _plot(results: dict, levels, title: str, path: str) -> None:
    """Throughput against concurrency, one line per engine: each jaxinfer variant gets a
    colour of its own (from C3 on), so no variant shares a peer's colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    style = {"jaxinfer": ("C0", "o", "-"), "llama.cpp": ("C1", "s", "-"),
             "transformers-bfloat16": ("C2", "^", "-"), "transformers-float32": ("C2", "v", "--")}
    variants = iter(f"C{i}" for i in range(3, 10))
    for n, res in results.items():
        if not res.get("ok"):
            continue
        xs = [r["concurrency"] for r in res["rows"]]
        ys = [r["out_tok_s"] for r in res["rows"]]
        col, mk, ls = style[n] if n in style else (next(variants), "x", "-.")
        ax.plot(xs, ys, marker=mk, linestyle=ls, color=col, label=n)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels)
    ax.set_xticklabels([str(c) for c in levels])
    ax.set_xlabel("concurrency (jaxinfer max_num_seqs / transformers batch / llama.cpp sequences)")
    ax.set_ylabel("output tokens / s (whole workload)")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def _title(header: dict) -> str:
    """The plot title, from a run's header (as written at the top of its JSON)."""
    w, started = header["workload"], datetime.datetime.fromisoformat(header["date"])
    return (f"{header['model']} on {header['machine']['cpu_count']} CPU cores, {w['num_requests']} requests, "
            f"prompts {w['prompt_len'][0]}-{w['prompt_len'][1]}, {w['output_len'][0]} out\n"
            f"{started:%Y-%m-%d %H:%M}, 1-min load average {header['loadavg_start'][0]:.1f} at start, "
            f"{header['loadavg_end'][0]:.1f} at end")


def replot(json_path: str, path: str) -> None:
    """Redraw the plot of an earlier run from its JSON."""
    d = json.loads(Path(json_path).read_text())
    levels = sorted({r["concurrency"] for e in d["engines"].values() if e.get("ok") for r in e["rows"]})
    _plot(d["engines"], levels, _title(d), path)


def main():
    global THREADS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--engines", nargs="+", default=["transformers", "llamacpp", "jaxinfer"],
                    choices=list(ENGINES))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32, 64])
    ap.add_argument("--hf-batches", type=int, nargs="+", default=None,
                    help="transformers batch sizes (default: --concurrency)")
    ap.add_argument("--hf-dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=3, help="timed runs at cheap levels (<= --cheap-concurrency)")
    ap.add_argument("--big-repeats", type=int, default=3, help="timed runs at the other levels")
    ap.add_argument("--top-repeats", type=int, default=None,
                    help="timed runs at the highest --concurrency level (default: --big-repeats)")
    ap.add_argument("--cheap-concurrency", type=int, default=1)
    ap.add_argument("--threads", type=int, default=THREADS, help="CPU threads per engine (torch, llama.cpp)")
    ap.add_argument("--jaxinfer-prefix-caching", action="store_true",
                    help="leave jaxinfer's prefix cache on (off by default: every timed run repeats the "
                         "warm-up's prompts, which the cache would serve without prefill)")
    ap.add_argument("--jaxinfer-variants", nargs="+", default=["float"],
                    help="jaxinfer configurations, each its own engine in the table: 'float' (the "
                         "default dtype), a quantize scheme ('int8', 'int4', 'w8a8'), '+kv8' for the "
                         "int8 KV cache, e.g. float w8a8 w8a8+kv8")
    ap.add_argument("--subset", type=int, default=8, help="requests run at concurrency 1")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--n-batch", type=int, default=2048, help="llama.cpp tokens per decode call")
    ap.add_argument("--n-ubatch", type=int, default=512)
    ap.add_argument("--llama-kv-unified", action="store_true",
                    help="llama.cpp: one shared KV cache with prompts mixed into the decode batch "
                         "(default: a KV stream per sequence, prompts prefilled in their own calls)")
    ap.add_argument("--omp-wait-policy", default="PASSIVE",
                    help="OMP_WAIT_POLICY for the workers (torch and llama.cpp use OpenMP). PASSIVE by "
                         "default: on a shared, loaded machine spinning OpenMP threads collapse (a 2-thread "
                         "SmolLM2 decode step measured 10x slower with ACTIVE); '' leaves it unset")
    ap.add_argument("--quick", action="store_true", help="smoke run: 16 requests, 16 tokens, c in {1, 4}")
    ap.add_argument("--json", default=None)
    ap.add_argument("--merge-with", default=None,
                    help="a JSON from an earlier run of the same workload: its engines that are not "
                         "re-run here (or failed there) join this run's table, JSON and plot")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help="only redraw --plot from the JSON of an earlier run, running nothing")
    # internal: one engine in a subprocess
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workfile", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()

    THREADS = a.threads
    if a.worker:
        return worker_main(a)
    if a.replot:
        return replot(a.replot, a.plot or str(Path(a.replot).with_suffix(".png")))

    if a.quick:
        a.num_requests, a.output_len, a.subset, a.repeats, a.big_repeats = 16, 16, 4, 1, 1
        a.concurrency = [1, 4]
        a.hf_batches = a.hf_batches or [1, 4]
    hf_batches = a.hf_batches or a.concurrency

    from jaxinfer import registry
    from jaxinfer.bench import WorkloadSpec, make_workload
    from jaxinfer.loaders.gguf import read_metadata
    from jaxinfer.tokenizer import tokenizer_from_gguf

    path = registry.fetch(a.model, progress=False)
    meta = read_metadata(path)
    tok = tokenizer_from_gguf(meta)
    spec = WorkloadSpec(num_requests=a.num_requests, prompt_len=(25, 250),
                        output_len=(a.output_len, a.output_len), seed=0)
    wl = make_workload(spec, tok)
    pad = meta.get("tokenizer.ggml.padding_token_id", meta.get("tokenizer.ggml.eos_token_id", 0))
    work = {"model_path": str(path), "pad_id": int(pad),
            "requests": [{"prompt_ids": list(r.prompt_ids), "max_tokens": r.max_tokens} for r in wl]}
    started = datetime.datetime.now().astimezone()
    header = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "date": started.isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "lscpu": _lscpu(), "cpu_count": os.cpu_count()},
        "git": _git_state(),
        "model": a.model, "model_file": path.name,
        "workload": {"num_requests": spec.num_requests, "prompt_len": spec.prompt_len,
                     "output_len": spec.output_len, "seed": spec.seed,
                     "prompt_tokens": sum(len(r.prompt_ids) for r in wl),
                     "subset_at_concurrency_1": a.subset},
        "repeats": {f"concurrency<={a.cheap_concurrency}": a.repeats, "other": a.big_repeats,
                    f"concurrency={max(a.concurrency)}": a.top_repeats or a.big_repeats},
        "threads": a.threads, "omp_wait_policy": a.omp_wait_policy or None,
        "order": "level by level, timed runs interleaved across engines",
        "loadavg_start": _loadavg(),
    }
    print(f"{a.model}: {len(wl)} requests, {header['workload']['prompt_tokens']} prompt tokens, "
          f"{a.output_len} output tokens each; load {header['loadavg_start']}", flush=True)

    # Every engine runs at a concurrency level before any moves on to the next, and the timed
    # repeats are interleaved (engine order rotated each round), so a change in the machine's
    # background load hits all engines alike rather than one of them.
    plan = {}  # label -> (kind, dtype, levels)
    for eng in a.engines:
        if eng == "transformers":
            for dt in a.hf_dtypes:
                plan[f"transformers-{dt}"] = (eng, dt, hf_batches)
        elif eng == "jaxinfer":
            for v in a.jaxinfer_variants:
                plan["jaxinfer" if v == "float" else f"jaxinfer-{v}"] = (eng, v, a.concurrency)
        else:
            plan[{"llamacpp": "llama.cpp"}.get(eng, eng)] = (eng, None, a.concurrency)
    results = {lb: {"ok": True, "rows": [], "levels": {}} for lb in plan}
    samples = {}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(work, f)
        workfile = f.name
    workers = {lb: Worker(kind, lb, workfile, a, dt) for lb, (kind, dt, _) in plan.items()}
    try:
        for c in sorted({c for *_, lv in plan.values() for c in lv}):
            here = [lb for lb, (*_, lv) in plan.items() if c in lv and not workers[lb].error]
            reps = (a.repeats if c <= a.cheap_concurrency
                    else a.top_repeats if c == max(a.concurrency) and a.top_repeats else a.big_repeats)
            for lb in here:
                t0 = time.perf_counter()
                m = workers[lb].call("setup", c)
                if m:
                    results[lb]["levels"][c] = {"setup": m["setup"], "setup_s": time.perf_counter() - t0, "runs": []}
                    print(f"== {lb} @ {c}: ready in {time.perf_counter() - t0:.0f} s (load {_loadavg()})", flush=True)
            for k in range(reps):
                order = here[k % len(here):] + here[: k % len(here)] if here else []
                for lb in order:
                    want = c == min(plan[lb][2]) and k == 0
                    la = _loadavg()
                    m = workers[lb].call("run", c, want_outs=want)
                    if not m:
                        continue
                    r = {**m["run"], "loadavg_before": la, "loadavg_after": _loadavg()}
                    results[lb]["levels"][c]["runs"].append(r)
                    if want:
                        samples[lb] = m["outs"]
                    print(f"   {lb:22s} c={c:<4d} run {k + 1}/{reps}: {r['out_tok_s']:8.1f} tok/s "
                          f"({r['wall_s']:.1f} s, load {la[0]:.1f})", flush=True)
            for lb in here:
                m = workers[lb].call("teardown", c)
                lv = results[lb]["levels"].get(c)
                if m and lv:
                    lv["teardown"] = m["teardown"]
                if lv and lv["runs"]:
                    extra = {k: v for d in (lv["setup"], lv.get("teardown", {})) for k, v in d.items()}
                    row = {"concurrency": c, **_median_row(lv["runs"]), **extra, "setup_s": lv["setup_s"],
                           "loadavg_runs": [r["loadavg_before"][0] for r in lv["runs"]]}
                    if "decode_calls" in lv["runs"][0]:
                        row["decode_calls"] = lv["runs"][0]["decode_calls"]
                    results[lb]["rows"].append(row)
        for lb, w in workers.items():
            m = w.call("info")
            if m:
                results[lb].update(m["info"])
            if w.error:
                results[lb]["error"] = w.error
                results[lb]["ok"] = bool(results[lb]["rows"])
    finally:
        for w in workers.values():
            try:
                w.close()
            except Exception:
                w.p.kill()
        os.unlink(workfile)
    for r in results.values():
        r.pop("levels", None)
    for lb, outs in samples.items():
        results[lb]["sample_outputs_c1"] = outs
    header["loadavg_end"] = _loadavg()
    header["elapsed_s"] = (datetime.datetime.now().astimezone() - started).total_seconds()
    if a.merge_with:  # engines measured by an earlier invocation, kept unless re-run here
        prev = json.load(open(a.merge_with))
        if prev["workload"]["prompt_tokens"] != header["workload"]["prompt_tokens"]:
            raise SystemExit(f"{a.merge_with} ran another workload")
        merged = {}
        for lb, res in prev["engines"].items():
            if lb in results and results[lb].get("ok"):
                continue
            res.setdefault("from_run", {k: prev.get(k) for k in ("command", "date", "loadavg_start", "loadavg_end")})
            merged[lb] = res
            if res.get("sample_outputs_c1"):
                samples[lb] = res["sample_outputs_c1"]
        results = {**merged, **{lb: r for lb, r in results.items() if r.get("ok") or lb not in merged}}
        header["merged_from"] = {"file": a.merge_with, "engines": list(merged),
                                 "runs": [prev.get("merged_from", {}).get("runs", []), prev.get("command")]}

    levels = sorted({r["concurrency"] for res in results.values() if res.get("ok") for r in res["rows"]})
    table = _table(results, levels)
    summary = {}

    def at(name, c):
        res = results.get(name)
        if not res or not res.get("ok"):
            return None
        return next((r["out_tok_s"] for r in res["rows"] if r["concurrency"] == c), None)

    def best(name):
        res = results.get(name)
        if not res or not res.get("ok"):
            return None, None
        r = max(res["rows"], key=lambda r: r["out_tok_s"])
        return r["out_tok_s"], r["concurrency"]

    top = max(a.concurrency)
    jx_labels = [lb for lb in results if lb.startswith("jaxinfer")]
    for name in ("transformers-bfloat16", "transformers-float32"):
        v, b = best(name)
        if v:
            summary[f"{name}_best"] = {"out_tok_s": v, "batch": b}
            for jl in jx_labels:
                jx = at(jl, top)
                if jx:
                    summary[f"{jl}@{top} / {name}_best"] = round(jx / v, 3)
    for jl in jx_labels:
        for c in a.concurrency:
            j, l = at(jl, c), at("llama.cpp", c)
            if j and l:
                summary[f"{jl}/llama.cpp@{c}"] = round(j / l, 3)
    names = list(samples)
    agree = {f"{x} vs {y}": _agreement(samples[x], samples[y])
             for i, x in enumerate(names) for y in names[i + 1:]}
    summary["greedy_prefix_agreement_c1"] = agree

    print("\n" + table)
    for k, v in summary.items():
        print(f"{k}: {v}")
    print(f"load average: start {header['loadavg_start']}, end {header['loadavg_end']}")

    if a.json:
        with open(a.json, "w") as f:
            json.dump({**header, "table": table.splitlines(), "summary": summary, "engines": results}, f, indent=1)
    if a.plot:
        _plot(results, levels, _title(header), a.plot)


if __name__ == "__main__":
    main()
