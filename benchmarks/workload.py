"""The batch workload, side by side in one run: jaxinfer's schemes against transformers'
dtypes, each at its best settings (benchmarks/RESULTS.md, "Batch workload against
transformers").

    python benchmarks/workload.py --json benchmarks/workload.json
    python benchmarks/workload.py --only jaxinfer:float32 transformers:bfloat16 --repeats 1

Workload (``jaxinfer.bench.make_workload``): 128 requests, prompts of 25-250 tokens, 64 new
tokens each, greedy, EOS ignored, the same prompt token ids for every engine. Each engine runs
in its own subprocess on the machine's 2 cores, makes one whole untimed pass first (jaxinfer
compiles every shape the workload hits; oneDNN builds its kernels for every batch shape
transformers meets), then ``--repeats`` timed passes; the median is reported.

* jaxinfer: ``LLM(model, max_model_len=1024, max_num_seqs=64, quantization=..., kv_cache_dtype=...,
  enable_prefix_caching=False)`` and ``llm.generate`` (prefix caching off: the timed passes
  repeat the warm pass's prompts, and reusing their pages would flatter us).
* transformers: the GGUF dequantized to the dtype, padded ``generate`` on batches of 64 with
  left padding, ``torch.set_num_threads(2)``, ``inference_mode``; the requests in workload
  order and sorted by prompt length (less padding: its best), the better one reported.

Every worker process keeps freed memory in glibc's heap (``jaxinfer.hostmem``, as the
``jaxinfer`` command does), transformers' as well as ours; ``--malloc default`` leaves glibc's
own settings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = {
    "jaxinfer:float32": {},
    "jaxinfer:float32+kv8": {"kv_cache_dtype": "int8"},
    "jaxinfer:float32+ps64": {"block_size": 64},  # KV pages of 64 positions (default 16)
    "jaxinfer:float32+ps128": {"block_size": 128},
    # float32 with XLA's own dots (the weights left unpacked: JAXINFER_NATIVE_F32_PACK=0)
    "jaxinfer:float32+xla-dots": {"env": {"JAXINFER_NATIVE_F32_PACK": "0"}},
    "jaxinfer:w8a8": {"quantization": "w8a8"},
    "jaxinfer:w8a8+kv8": {"quantization": "w8a8", "kv_cache_dtype": "int8"},
    "transformers:bfloat16": {},
    "transformers:float32": {},
}


def _workload(model: str):
    from jaxinfer import registry
    from jaxinfer.bench import WorkloadSpec, make_workload
    from jaxinfer.loaders import checkpoint

    path = registry.resolve(model, progress=False)
    tok = checkpoint.load(path, dtype="float32").tokenizer
    reqs = make_workload(WorkloadSpec(num_requests=128, prompt_len=(25, 250), output_len=(64, 64), seed=0), tok)
    return path, [(r.prompt_ids, r.max_tokens) for r in reqs], tok.pad_id


def run_jaxinfer(model, opts, repeats):
    from jaxinfer import LLM, SamplingParams

    _, reqs, _ = _workload(model)
    # prefix caching off: the timed passes repeat the warm pass's prompts, whose pages it would reuse
    llm = LLM(model, max_model_len=1024, max_num_seqs=64, progress=False, enable_prefix_caching=False, **opts)
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    t0 = time.perf_counter()
    llm.generate(prompts, sps, use_tqdm=False)
    warm = time.perf_counter() - t0
    compiled = llm.engine.num_compilations()
    walls, outs = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = llm.generate(prompts, sps, use_tqdm=False)
        walls.append(time.perf_counter() - t0)
        outs = [o.outputs[0].token_ids for o in res]
    n = sum(len(o) for o in outs)
    return {"out_tok_s": n / statistics.median(walls), "walls": walls, "first_pass_s": warm,
            "compilations": compiled, "compiled_in_timed": llm.engine.num_compilations() - compiled,
            "tokens": outs}


def run_transformers(model, dtype, repeats):
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(2)
    path, reqs, pad = _workload(model)
    m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                             dtype={"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype])
    m.eval()

    def one_pass(order):
        outs = {}
        for i in range(0, len(order), 64):
            chunk = order[i : i + 64]
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
        return [outs[k] for k in range(len(reqs))]

    best = None
    for name, order in (("workload order", list(range(len(reqs)))),
                        ("sorted by prompt length", sorted(range(len(reqs)), key=lambda k: len(reqs[k][0])))):
        one_pass(order)  # warm: oneDNN kernels for this order's batch shapes
        walls = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            outs = one_pass(order)
            walls.append(time.perf_counter() - t0)
        n = sum(len(o) for o in outs)
        res = {"out_tok_s": n / statistics.median(walls), "walls": walls, "order": name, "tokens": outs}
        if best is None or res["out_tok_s"] > best["out_tok_s"]:
            best = res
    return best


def worker(name, model, repeats, malloc):
    engine, variant = name.split(":")
    if malloc == "keep":  # for either engine: a process-wide setting, each peer gets it
        from jaxinfer.hostmem import keep_freed_memory

        keep_freed_memory()
    if engine == "jaxinfer":
        opts = dict(VARIANTS[name])
        os.environ.update(opts.pop("env", {}))  # read when the kernels are first asked for
        return run_jaxinfer(model, opts, repeats)
    return run_transformers(model, variant, repeats)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--only", nargs="*", default=list(VARIANTS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--worker")
    ap.add_argument("--malloc", choices=["keep", "default"], default="keep",
                    help="keep: every worker keeps freed memory in glibc's heap (jaxinfer.hostmem), as the "
                         "jaxinfer command does; default: glibc's own settings")
    a = ap.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(a.worker, a.model, a.repeats, a.malloc)))
        return
    results = {}
    for name in a.only:
        load = os.getloadavg()[0]
        p = subprocess.run([sys.executable, __file__, "--worker", name, "--model", a.model,
                            "--repeats", str(a.repeats), "--malloc", a.malloc], capture_output=True, text=True)
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(name, "failed:", p.stderr[-2000:])
            continue
        results[name] = json.loads(line[7:]) | {"load_before": load}
        r = results[name]
        extra = f" ({r['order']})" if "order" in r else f" (compiled {r['compilations']}, {r['compiled_in_timed']} in timed)"
        print(f"{name:24s} {r['out_tok_s']:7.1f} tok/s  walls {[round(w, 1) for w in r['walls']]}{extra}", flush=True)
    ref = results.get("transformers:float32", {}).get("tokens")
    for name, r in results.items():
        if ref and name != "transformers:float32":
            same = sum(x == y for x, y in zip(r["tokens"], ref))
            print(f"{name:24s} greedy outputs equal to transformers float32: {same}/{len(ref)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "results": {k: {x: y for x, y in v.items() if x != "tokens"} for k, v in results.items()}},
                      f, indent=1)


if __name__ == "__main__":
    main()
