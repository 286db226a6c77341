"""Reproducible synthetic workloads and the serving metrics computed over them.

A workload is a list of requests drawn from a seed: prompt lengths and output lengths from
uniform ranges, prompts made of real text (a fixed English passage, cycled and cut at a
random offset) so tokenizers see natural input, and an optional shared prefix (a long
"system prompt") on a given share of the requests.
"""

from __future__ import annotations

import dataclasses
import random
from jaxinfer.models.registry import num_params

PASSAGE = (
    "The history of the printing press is closely tied to the spread of literacy in Europe. "
    "Before Johannes Gutenberg built his press in Mainz around 1440, books were copied by hand, "
    "usually by monks working in scriptoria, and a single volume could take months to finish. "
    "Movable metal type, oil-based ink and a screw press adapted from wine making allowed a small "
    "workshop to produce hundreds of identical pages in a day. Within fifty years, presses were "
    "operating in more than two hundred cities, and millions of books had been printed. Pamphlets, "
    "newspapers and scientific journals followed, and ideas could now travel faster than ever. "
    "Rivers carved the valleys where the first towns grew; merchants followed the water, and "
    "with them came scribes, accountants and teachers. A ledger kept in one city could be copied "
    "and read in another within weeks, and prices, recipes, maps and songs moved with it. "
)


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 128
    prompt_len: tuple[int, int] = (25, 250)  # tokens, inclusive range
    output_len: tuple[int, int] = (64, 64)
    shared_prefix_len: int = 0  # tokens of a common prefix
    shared_prefix_share: float = 0.0  # fraction of requests that carry it
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int


def make_workload(spec: WorkloadSpec, tokenizer) -> list[BenchRequest]:
    """Token-exact prompts: lengths are counted in the model's own tokens."""
    rng = random.Random(spec.seed)
    text_ids = tokenizer.encode(PASSAGE * 40, add_special_tokens=False)
    prefix = text_ids[-spec.shared_prefix_len:] if spec.shared_prefix_len else []
    out = []
    for _ in range(spec.num_requests):
        n = rng.randint(*spec.prompt_len)
        start = rng.randrange(0, len(text_ids) - n)
        body = text_ids[start : start + n]
        if prefix and rng.random() < spec.shared_prefix_share:
            body = prefix + body
        out.append(BenchRequest(body, rng.randint(*spec.output_len)))
    return out


def run_bench(llm, spec: WorkloadSpec, *, warmup: bool = True, ttft_slo: float | None = None,
              tpot_slo: float | None = None, peaks: dict | None = None) -> dict:
    """Run a workload through an LLM (every request arrives at once, greedy, EOS ignored) and
    summarize latencies, throughput, goodput, MFU and MBU, and compilations."""
    import time

    import jax

    from jaxinfer import metrics
    from jaxinfer.registry import home
    from jaxinfer.sampling import SamplingParams

    reqs = make_workload(spec, llm.tokenizer)
    eng = llm.engine
    compiled_warmup = 0
    if warmup:
        compiled_warmup = eng.warmup(max_prompt_len=max(len(r.prompt_ids) for r in reqs),
                                     max_len=max(len(r.prompt_ids) + r.max_tokens for r in reqs))
    before = eng.num_compilations()
    prompts = [{"prompt_token_ids": r.prompt_ids} for r in reqs]
    sps = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    stats = eng.spec_stats
    if stats is not None:
        stats.__init__(stats.k)  # count the timed run only
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    wall = time.perf_counter() - t0
    timings = [metrics.RequestTiming(o.metrics.arrival_time, o.metrics.first_scheduled_time,
                                     o.metrics.token_times, len(o.prompt_token_ids),
                                     len(o.outputs[0].token_ids)) for o in outs]
    cfg = llm.cfg
    weights_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.weights))
    kv_tok = cfg.kv_bytes_per_token(eng.kv_dtype)  # as the engine stores it (int8 KV)
    # decode steps read the weights once and each running sequence's context
    steps = eng.stats.get("decode_steps") or max(t.output_tokens for t in timings)
    kv_read = sum(kv_tok * (t.prompt_tokens * t.output_tokens + t.output_tokens * (t.output_tokens - 1) / 2)
                  for t in timings)
    mean_ctx = sum(t.prompt_tokens + t.output_tokens / 2 for t in timings) / len(timings)
    peaks = peaks or metrics.measure_peaks(home() / f"peaks-{cfg.dtype}.json", cfg.dtype)
    fpt = metrics.model_flops_per_token(num_params(cfg), cfg.n_layers, cfg.n_heads * cfg.head_dim, mean_ctx)
    out = metrics.summarize(timings, wall, ttft_slo=ttft_slo, tpot_slo=tpot_slo, model_flops_per_token=fpt,
                            decode_bytes=steps * weights_bytes + kv_read, peaks=peaks)
    out["model_flops_per_token"] = fpt
    after = eng.num_compilations()
    out["compilations"] = {"warmup": compiled_warmup, "during_run": after - before, "total": after}
    out["weights_bytes"], out["kv_bytes_per_token"] = int(weights_bytes), kv_tok
    out["engine"] = dict(eng.stats)
    if stats is not None:
        out["speculative"] = stats.summary()
    out["workload"] = dataclasses.asdict(spec)
    out["peaks"] = peaks
    return out


def format_summary(s: dict) -> str:
    lines = [(f"requests {s['requests']}  wall {s['wall_s']:.2f} s  input {s['input_tok_s']:.1f} tok/s  "
              f"output {s['output_tok_s']:.1f} tok/s  goodput {s['goodput_output_tok_s']:.1f} tok/s "
              f"({s['slo']['met']}/{s['requests']} met SLO)")]
    for k in ("queue_s", "ttft_s", "tpot_s", "itl_s", "e2e_s"):
        v = s[k]
        fmt = lambda x: "   n/a" if x is None else f"{x * 1e3:8.1f}"
        lines.append(f"  {k[:-2]:<6} ms  p50 {fmt(v['p50'])}  p90 {fmt(v['p90'])}  p99 {fmt(v['p99'])}")
    if "mfu" in s:
        lines.append(f"  MFU {100 * s['mfu']:.1f}%  MBU {100 * s.get('mbu', 0):.1f}%  "
                     f"(peaks {s['peaks']['flops'] / 1e9:.0f} GFLOP/s, {s['peaks']['bytes_s'] / 1e9:.1f} GB/s)")
    if "speculative" in s:
        sp = s["speculative"]
        lines.append(f"  speculative: {sp['spec_accepted_tokens']}/{sp['spec_drafted_tokens']} drafts accepted "
                     f"({100 * sp['spec_acceptance_rate']:.1f}%), {sp['spec_mean_accepted_length']:.2f} tokens per "
                     f"verified block, by position {sp['spec_acceptance_by_position']}, "
                     f"{sp['spec_disabled_steps']} steps without speculation")
    c = s["compilations"]
    lines.append(f"  compilations: {c['warmup']} in warm-up, {c['during_run']} during the run, {c['total']} total")
    return "\n".join(lines)
