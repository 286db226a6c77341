"""Accuracy and cost of weight quantization: float32 / int8 / int4 / w8a8.

For each scheme: perplexity on benchmarks/data/english.txt (jaxinfer.evaluate.perplexity,
teacher-forced, windows of --window tokens advancing by --stride) and its ratio to float32;
greedy agreement with float32 on the golden prompts of tests/golden (the fraction of
greedy tokens equal position by position, and of prompts equal over the whole length);
weights bytes (LLM.memory_report); and the peak RSS of loading the checkpoint, measured in
a fresh subprocess per scheme (VmHWM after ``checkpoint.load``; the RSS of the process with
jax imported and the CPU backend up, before loading, is reported beside it). Not
getrusage's ru_maxrss: Linux carries it across exec, so a child spawned by this process
(vfork) reported this process's own peak, models and all.

    python benchmarks/quant_accuracy.py [--model smollm2-135m-instruct] [--json out.json]
    python benchmarks/quant_accuracy.py --schemes float32 int4:32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's jaxinfer, not an installed one
SCHEMES = ["float32", "int8", "int4", "w8a8"]  # "int4:32": int4 with quant_group 32

_RSS_SCRIPT = r"""
import json, sys, time
import jax, jax.numpy as jnp
from jaxinfer import quant, registry
from jaxinfer.loaders import checkpoint
jnp.zeros(1).block_until_ready()
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
rss = lambda: status("VmRSS")
before = rss()
path = registry.resolve(sys.argv[1], progress=False)
t = time.perf_counter()
qcfg = quant.quant_config(sys.argv[2] or None, int(sys.argv[3]) if sys.argv[3] else None)
loaded = checkpoint.load(path, dtype="float32", quantize=qcfg)
jax.block_until_ready(loaded.weights)
secs = time.perf_counter() - t
print(json.dumps({"before": before, "peak": status("VmHWM"),
                  "after": rss(), "load_s": secs}))
"""


def load_rss(model: str, scheme: str | None, group: int | None) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, model, scheme or "", str(group or "")], env=env,
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--golden", default=str(ROOT / "tests/golden/smollm2-135m-instruct.json"))
    ap.add_argument("--text", default=str(ROOT / "benchmarks/data/english.txt"))
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--stride", type=int, default=256)
    ap.add_argument("--schemes", nargs="+", default=SCHEMES,
                    help="the first is the reference (float32); int4:G sets the int4 group")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    import jax

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.evaluate import perplexity

    cases = json.loads(Path(a.golden).read_text())["prompts"]
    text = Path(a.text).read_text()
    n_new = len(cases[0]["greedy_ids"])
    sp = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True, skip_special_tokens=False)
    rows, ref = [], None
    for label in a.schemes:
        scheme, _, group = label.partition(":")
        scheme, group = (None if scheme == "float32" else scheme), (int(group) if group else None)
        rss = load_rss(a.model, scheme, group)
        llm = LLM(a.model, quantization=scheme, quant_group=group, max_model_len=256, max_num_seqs=len(cases),
                  progress=False)
        t = time.perf_counter()
        ppl = perplexity(llm, text, window=a.window, stride=a.stride)
        ppl_s = time.perf_counter() - t
        greedy = [o.outputs[0].token_ids for o in
                  llm.generate([c["prompt_ids"] for c in cases], sp, use_tqdm=False)]
        if ref is None:
            ref = {"ppl": ppl.perplexity, "greedy": greedy}
        same = sum(g == r for gs, rs in zip(greedy, ref["greedy"]) for g, r in zip(gs, rs))
        golden = sum(g == r for gs, c in zip(greedy, cases) for g, r in zip(gs, c["greedy_ids"]))
        rep = llm.memory_report()
        rows.append({
            "scheme": label, "perplexity": ppl.perplexity,
            "ppl_ratio": ppl.perplexity / ref["ppl"], "tokens_scored": ppl.tokens,
            "greedy_token_agreement": same / (len(cases) * n_new),
            "greedy_prompts_identical": sum(g == r for g, r in zip(greedy, ref["greedy"])) / len(cases),
            "golden_token_agreement": golden / (len(cases) * n_new),
            "weights_bytes": rep["weights_bytes"], "quant_groups": rep["quant_groups"],
            "load_peak_rss": rss["peak"], "rss_before_load": rss["before"], "load_s": rss["load_s"],
            "ppl_s": ppl_s,
        })
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del llm
    f32 = rows[0]["weights_bytes"]
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cpus, "
          f"{platform.processor() or platform.machine()}, load average {os.getloadavg()[0]:.1f} at end")
    print(f"{a.model}: perplexity over {rows[0]['tokens_scored']} tokens of {Path(a.text).name} "
          f"(window {a.window}, stride {a.stride}); greedy: {len(cases)} golden prompts x {n_new} tokens\n")
    print("| scheme | perplexity | ppl / f32 | greedy tokens = f32 | prompts = f32 (all 32) "
          "| tokens = golden | weights MB | / f32 | load peak RSS MB | RSS before load MB | load s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        groups = f" (groups {', '.join(map(str, r['quant_groups']))})" if r["quant_groups"] else ""
        print(f"| {r['scheme'].split(':')[0]}{groups} | {r['perplexity']:.3f} | {r['ppl_ratio']:.4f} "
              f"| {r['greedy_token_agreement']:.3f} | {r['greedy_prompts_identical']:.3f} "
              f"| {r['golden_token_agreement']:.3f} | {r['weights_bytes'] / 1e6:.1f} "
              f"| {r['weights_bytes'] / f32:.3f} | {r['load_peak_rss'] / 2**20:.0f} "
              f"| {r['rss_before_load'] / 2**20:.0f} | {r['load_s']:.1f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
