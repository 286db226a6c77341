"""A mixture of experts against a dense model with the same active parameters: one decode step
(the engine's bare jitted packed step, no scheduler) of ``--rows`` rows, each attending to
``--context`` positions, on this CPU.

Both models are Mixtral-shaped, written by transformers (random weights): the MoE has
``--experts`` experts of width ``--expert-ff``, ``--top-k`` per token; the dense one (Mistral,
same attention) one MLP of width top_k * expert_ff, so a token meets the same number of
weights in both. At 64 rows over 64 experts nearly every expert has a row (a decode step
reads about 55 of them), so the MoE step reads ~27x the MLP bytes of the dense one and is
bound by that; the ratio is the cost of those reads, not of the routing.

    python benchmarks/moe_step.py                        # one device, then 8 virtual devices
    python benchmarks/moe_step.py --rows 1 --no-parallel

With 8 virtual devices (a subprocess with XLA_FLAGS), the MoE runs expert parallel
(``enable_expert_parallel``, 8 experts per device) and tensor parallel (each expert's width
split), and the dense model tensor parallel; the devices share this machine's cores, so the
point is what each layout costs relative to the others, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from timing import step_seconds


def write_model(path: Path, a, moe: bool) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    common = dict(vocab_size=a.vocab, hidden_size=a.d_model, num_hidden_layers=a.layers,
                  num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.d_model // a.heads,
                  max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if moe:
        cfg = transformers.MixtralConfig(**common, intermediate_size=a.expert_ff, num_local_experts=a.experts,
                                         num_experts_per_tok=a.top_k, sliding_window=None)
    else:
        cfg = transformers.MistralConfig(**common, intermediate_size=a.top_k * a.expert_ff, sliding_window=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # spread the routing: transformers starts the router near zero
        for name, p in model.named_parameters():
            if "gate.weight" in name:
                p.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(a.vocab)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t1", "eos_token": "t2", "unk_token": "t3"}))
    return path


def decode_batch(eng, rows: int, ctx: int, rng):
    """A decode step of ``rows`` rows at position ``ctx``, their pages scattered in the pool."""
    from jaxinfer.engine import buckets, replicas

    ps = eng.allocator.page_size
    n = -(-(ctx + 1) // ps)
    b = replicas.only(eng.idle_batch(rows, buckets.width_bucket(n, eng.pages_per_seq), 0))  # one replica's
    pages = 1 + rng.permutation(eng.allocator.num_pages - 1)[: rows * n].reshape(rows, n)
    b.table[:rows, :n] = pages
    b.positions[:] = ctx
    b.tokens[:] = rng.integers(4, eng.cfg.vocab_size, b.tokens.shape)
    b.write_page[:] = pages[:, ctx // ps]
    b.active[:] = True
    return replicas.stack([b])


def measure(layouts: dict, paths: dict, a) -> dict:
    """layout name -> (model, LLM kwargs); returns name -> median ms, all interleaved."""
    from jaxinfer import LLM

    rng = np.random.default_rng(0)
    cases = {}
    for name, (model, kw) in layouts.items():
        llm = LLM(str(paths[model]), max_model_len=512, max_num_seqs=a.rows, progress=False,
                  enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20, **kw)
        batch = decode_batch(llm.engine, a.rows, a.context, rng)
        step_seconds(llm.engine, batch, 2)  # compiles
        cases[name] = (llm, batch)
    times: dict[str, list[float]] = {n: [] for n in cases}
    for _ in range(a.rounds):
        for name, (llm, batch) in cases.items():
            times[name] += step_seconds(llm.engine, batch, 3)
    return {n: statistics.median(t) * 1e3 for n, t in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--expert-ff", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-parallel", action="store_true", help="skip the 8-virtual-device layouts")
    ap.add_argument("--models", help=argparse.SUPPRESS)  # the child process: reuse the parent's checkpoints
    ap.add_argument("--parallel-child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if a.models:
            paths = {k: Path(v) for k, v in json.loads(a.models).items()}
        else:
            paths = {"moe": write_model(Path(tmp) / "moe", a, True), "dense": write_model(Path(tmp) / "dense", a, False)}
        if a.parallel_child:
            d = 8
            res = measure({f"MoE, EP {d}": ("moe", dict(tensor_parallel_size=d, enable_expert_parallel=True)),
                           f"MoE, TP {d}": ("moe", dict(tensor_parallel_size=d)),
                           f"dense, TP {d}": ("dense", dict(tensor_parallel_size=d))}, paths, a)
            print("RESULT " + json.dumps(res))
            return
        import jax

        print(f"{a.experts} experts of [{a.d_model}, {a.expert_ff}], top {a.top_k}, vs dense width "
              f"{a.top_k * a.expert_ff}; {a.layers} layers, D {a.d_model}; decode step of {a.rows} rows at "
              f"context {a.context}; {jax.devices()[0].device_kind}, {os.cpu_count()} cores; median ms of "
              f"{3 * a.rounds} steps", flush=True)
        res = measure({"MoE": ("moe", {}), "dense": ("dense", {})}, paths, a)
        print(f"  one device:  MoE {res['MoE']:8.2f} ms   dense {res['dense']:8.2f} ms   "
              f"MoE / dense {res['MoE'] / res['dense']:.2f}", flush=True)
        if a.no_parallel:
            return
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
        argv = [sys.executable, __file__, *sys.argv[1:], "--parallel-child",
                "--models", json.dumps({k: str(v) for k, v in paths.items()})]
        p = subprocess.run(argv, env=env, capture_output=True, text=True)
        if p.returncode:
            sys.exit(p.stderr[-4000:])
        par = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[7:])
        base = par["dense, TP 8"]
        for name, ms in par.items():
            print(f"  8 virtual devices: {name:14s} {ms:8.2f} ms   / dense TP 8 {ms / base:.2f}")


if __name__ == "__main__":
    main()
