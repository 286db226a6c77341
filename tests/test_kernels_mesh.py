"""The Pallas kernels on a mesh: each call runs inside ``shard_map``, each device on its shard.

* On 8 virtual CPU devices (a subprocess, so XLA_FLAGS apply), ``kernels="pallas"`` (interpret
  mode) under tensor parallelism 2 and 4 (and 2 replicas of TP 2) gives the greedy tokens and
  log-probs of ``kernels="xla"`` on one device, for a tiny Llama in float32 and int8 (the
  quantized matmul kernel on column- and row-split weights) and a tiny Mixtral (the experts'
  grouped matmul), and the traced step really holds the Pallas calls, inside ``shard_map``.
  The one-device XLA path is itself held to transformers (``test_families``,
  ``test_mixtral_model``); the Mixtral here is also compared with transformers directly.
* For a TPU (libtpu, ``jax.experimental.topologies``), from this CPU host and without patching
  anything: the packed step of toy models lowered on abstract weights and pools carrying the
  engine's shardings compiles for v5e:2x2 with tensor parallelism 4 and for v5e:1x1, its HLO
  holds the Mosaic calls (``tpu_custom_call``), and no page pool is all-gathered.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests import family_testing as ft
from tests.conftest import on_ci

ROOT = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------------------- virtual CPU devices
_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    import pallas_kernels.grouped_matmul as gm
    import pallas_kernels.spec_verify as sv
    from jaxinfer import LLM, SamplingParams, kernels
    assert len(jax.devices()) == 8
    path, opt = sys.argv[1], json.loads(sys.argv[2])
    calls = {}

    def spy(module, name):  # counts the kernel adapters' calls as the steps are traced
        real = getattr(module, name)
        setattr(module, name, lambda *a, **k: calls.__setitem__(name, calls.get(name, 0) + 1) or real(*a, **k))

    for name in ("paged_attention", "ragged_paged_attention", "quant_matmul"):
        spy(kernels, name)
    spy(gm, "grouped_matmul_kernel")
    spy(sv, "spec_verify")
    prompts = opt["prompts"]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1, logprobs=0)
    ref = None
    for run in opt["runs"]:
        dp, tp = run["dp"], run["tp"]
        calls.clear()
        llm = LLM(path, progress=False, max_model_len=128, max_num_seqs=4, block_size=8, tensor_parallel_size=tp,
                  data_parallel_size=dp, kernels=run["kernels"], **opt["llm"], **run["llm"])
        outs = llm.generate(prompts, sp, use_tqdm=False)
        got = {"tokens": [o.outputs[0].token_ids for o in outs],
               "lp": [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs],
               "plp": [[next(lp.logprob for tok, lp in pos.items() if tok == o.prompt_token_ids[t + 1])
                        for t, pos in enumerate(o.prompt_logprobs[1:])] for o in outs]}
        e = llm.engine
        info = {"calls": dict(calls), "kernels_mesh": e.kernels.mesh is not None,
                "kv_spec": [str(a) for a in getattr(jax.tree.leaves(e.k_pages[0])[0].sharding, "spec", ())]}
        if dp == 1:  # the traced decode step: its Pallas calls, and the shard_maps they sit in
            from jaxinfer.engine.step import StepInputs
            jaxpr = str(e._step.trace(e.weights, StepInputs(e.idle_batch(4, 8, 0)), e.state, cfg=e.cfg,
                                      num_logprobs=-1, prompt_logprobs=-1, kernels=e.kernels).jaxpr)
            info |= {"pallas_calls": jaxpr.count("pallas_call"), "shard_maps": jaxpr.count("shard_map")}
        print("RUN " + json.dumps({"run": run, "out": got, "info": info}), flush=True)
""")


def _runs(path, runs: list[dict], *, prompts, llm=None, timeout=1200) -> list[dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    opt = {"runs": runs, "prompts": prompts, "llm": llm or {}}
    p = subprocess.run([sys.executable, "-c", _SCRIPT, str(path), json.dumps(opt)], env=env, capture_output=True,
                       text=True, timeout=timeout, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return [json.loads(ln[len("RUN "):]) for ln in p.stdout.splitlines() if ln.startswith("RUN ")]


def _run(kernels: str, tp: int, dp: int = 1, **llm) -> dict:
    return {"kernels": kernels, "tp": tp, "dp": dp, "llm": llm}


def _assert_same(got: dict, ref: dict, atol: float):
    assert got["tokens"] == ref["tokens"]
    for a, b in zip(got["lp"] + got["plp"], ref["lp"] + ref["plp"]):
        np.testing.assert_allclose(a, b, atol=atol)


TEXT = ["The capital of France is", "def fib(n):", "Once upon a time there was"]


# int8: 1.5 minutes more (its TPU compile below runs by default)
@pytest.mark.parametrize("quantization", [None, pytest.param("int8", marks=pytest.mark.slow)])
def test_pallas_on_tensor_parallel_meshes_equals_one_device(tiny_gguf, quantization):
    """4 query heads over 2 KV heads: TP 2 splits the pools over KV heads (each device's
    kernel reads its own), TP 4 keeps every KV head on every device (each reads them all);
    int8 runs every projection through the quantized matmul kernel, per weight shard (wq/wk/wv
    and w_gate/w_up by columns, wo and w_down by rows, summed over "model")."""
    float_model = quantization is None
    runs = [_run("xla", 1), _run("pallas", 2)]
    runs += [_run("xla", 2), _run("pallas", 4), _run("pallas", 2, dp=2)] if float_model else []
    out = _runs(tiny_gguf, runs, prompts=TEXT, llm={"quantization": quantization})
    ref = out[0]["out"]
    for r in out[1:]:
        _assert_same(r["out"], ref, atol=2e-4 if float_model else 2e-3)
        info, run = r["info"], r["run"]
        assert info["kernels_mesh"]
        assert ("model" in info["kv_spec"]) == (run["tp"] == 2), info  # split over 2 devices, kept whole on 4
        if run["kernels"] == "xla":
            assert not info["calls"] and info.get("pallas_calls", 0) == 0
            continue
        assert info["calls"]["ragged_paged_attention"] >= 2 and info["calls"]["paged_attention"] >= 2, info
        if not float_model:
            assert info["calls"]["quant_matmul"] >= 2 * 7, info
        if run["dp"] == 1:
            # 2 layers' decode attention, and 7 projections each plus the LM head in int8
            assert info["pallas_calls"] == (2 if float_model else 2 + 2 * 7 + 1), info
            assert info["shard_maps"] >= info["pallas_calls"], info


@pytest.mark.slow  # 4 minutes of interpret-mode compiles
def test_pallas_under_pipeline_stages_and_speculation(tiny_gguf):
    """Nested shard_maps: in a pipeline (manual over "stage") the int8 matmul kernels run per
    "model" shard of each stage; verification rows of n-gram drafts run the ragged kernel per
    KV-head shard and the verifier kernel with the logits whole on every device."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 16}
    runs = [_run("xla", 1), _run("pallas", 2, pipeline_parallel_size=2), _run("pallas", 2, speculative_config=ngram)]
    prompts = ["a b c a b c a b c a b c a b", "1 2 3 4 1 2 3 4 1 2 3 4 1 2"]
    out = _runs(tiny_gguf, runs, prompts=prompts, llm={"quantization": "int8"})
    for r in out[1:]:
        _assert_same(r["out"], out[0]["out"], atol=2e-3)
        assert r["info"]["calls"]["quant_matmul"] >= 2 * 7, r["info"]
    assert out[2]["info"]["calls"]["spec_verify"] >= 1 and out[2]["info"]["calls"]["ragged_paged_attention"] >= 2


@pytest.mark.reference
@pytest.mark.slow  # about 5 minutes: the grouped matmul interpreted, on three meshes
def test_pallas_experts_on_tensor_parallel_meshes_equal_one_device(tmp_path):
    """A tiny Mixtral (8 experts, 4 query heads over 2 KV heads): its experts' grouped matmul
    runs per "model" shard inside the block's shard_map (each device its columns of every
    expert), attention per KV-head shard; tokens and log-probs as on one device, which holds
    transformers' own prompt log-probs and greedy tokens."""
    path = ft.write_tiny(tmp_path / "mixtral", "mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2})
    prompts = [list(p) for p in ft.PROMPTS[::2]]
    out = _runs(path, [_run("xla", 1), _run("pallas", 2), _run("pallas", 4)], prompts=prompts)
    ref = out[0]["out"]
    got = [{"prompt_logprobs": plp, "tokens": toks} for plp, toks in zip(ref["plp"], ref["tokens"])]
    ft.assert_matches(got, ft.reference(path, prompts, max_tokens=8), what="one device")
    for r in out[1:]:
        _assert_same(r["out"], ref, atol=2e-4)
        assert r["info"]["calls"]["grouped_matmul_kernel"] >= 3 * 3, r["info"]  # gate, up, down per layer
        assert r["info"]["pallas_calls"] == 3 * (1 + 3), r["info"]  # attention and 3 expert matmuls per layer


# ----------------------------------------------------------------------------- TPU compile
def tpu_devices(name: str, bounds: tuple):
    """The devices of a TPU topology (no TPU needed: libtpu compiles for it); skipped where
    libtpu is missing, except under CI=true, where the tpu extra is installed."""
    try:
        from jax.experimental import topologies

        # (several test processes may each load libtpu, to compile only)
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        return topologies.get_topology_desc(platform="tpu", topology_name=name, chips_per_host_bounds=bounds).devices
    except Exception as e:  # no libtpu: jax raises its own errors, which vary by version
        if on_ci():
            pytest.fail(f"CI=true and no TPU topology {name} ({e}); install the tpu extra", pytrace=False)
        pytest.skip(f"no libtpu to compile for a TPU here ({e})")


def _toy(kind: str):
    from jaxinfer.config import ModelConfig

    common = dict(vocab_size=512, d_model=256, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=128, d_ff=512)
    if kind == "moe":
        return ModelConfig(family="mixtral", n_experts=4, n_experts_per_tok=2, moe_d_ff=512, **common)
    return ModelConfig(family="llama", **common)


def _lower_step(devices, kind: str, *, decode_only: bool, quantization: str | None = None):
    """The engine's packed step of a toy model, lowered (``jaxinfer.aot``) on abstract weights,
    pools and slots carrying the engine's shardings on a (1, 1, len(devices)) mesh of
    ``devices`` with ``choose("pallas", mesh=...)`` -> (compiled HLO text, the pools' shape)."""
    from jaxinfer import aot
    from jaxinfer.sharding import make_mesh

    cfg = _toy(kind)
    mesh = make_mesh(model=len(devices), devices=devices)
    k = aot.target_kernels(mesh)
    assert (k.platform, k.interpret) == ("tpu", False)
    weights, _ = aot.abstract_weights(cfg, mesh, k, quantization=quantization)
    kind_ = aot.StepKind("decode" if decode_only else "prefill", rows=8, prefill=0 if decode_only else 32)
    lowered, info = aot.lower_step(cfg, weights, mesh, k, kind_, aot.Workload(context=128))
    return lowered.compile().as_text(), info["pools"][0][0][0]


# the sampler's two threshold kernels (wide top-k, wide top-p), beside a step's layers' calls
SAMPLER_CALLS = 2


def _gathered_pools(hlo: str, pool_shape) -> list[str]:
    """The all-gathers whose result holds a whole pool's pages (a pool moving between devices)."""
    lead = f"[{pool_shape[0]},"
    return [ln for ln in hlo.splitlines() if re.search(r" all-gather(-start)?\(", ln) and lead in ln.split("=")[1]]


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "prefill"])
def test_llama_step_compiles_for_a_v5e_2x2_mesh_with_tensor_parallel_4(decode_only):
    """The decode step (paged decode kernel) and a step with a prefill row (ragged kernel):
    Mosaic calls, one per layer, each device on its KV head of the four; no pool gathered."""
    hlo, pool = _lower_step(tpu_devices("v5e:2x2", (2, 2, 1)), "llama", decode_only=decode_only)
    assert hlo.count("custom_call_target=\"tpu_custom_call\"") == 2 + SAMPLER_CALLS
    decode = bool(re.search(r"(?<!ragged_)paged_attention_tpu", hlo))
    assert decode == decode_only and ("ragged_paged_attention_tpu" in hlo) != decode_only
    assert not _gathered_pools(hlo, pool)


def test_llama_step_compiles_for_one_v5e_chip():
    hlo, _ = _lower_step(tpu_devices("v5e:1x1", (1, 1, 1)), "llama", decode_only=True)
    assert hlo.count("custom_call_target=\"tpu_custom_call\"") == 2 + SAMPLER_CALLS
    assert not re.search(r" (all-gather|all-reduce)(-start)?\(", hlo)


def test_int8_step_compiles_for_a_v5e_2x2_mesh():
    """Every projection and the LM head through the quantized matmul kernel, per weight shard."""
    hlo, pool = _lower_step(tpu_devices("v5e:2x2", (2, 2, 1)), "llama", decode_only=True, quantization="int8")
    assert hlo.count("custom_call_target=\"tpu_custom_call\"") == 2 + 2 * 7 + 1 + SAMPLER_CALLS
    assert not _gathered_pools(hlo, pool)


def test_moe_step_compiles_for_a_v5e_2x2_mesh():
    """The experts' three grouped matmuls per layer as Mosaic calls inside the block's shard_map."""
    hlo, pool = _lower_step(tpu_devices("v5e:2x2", (2, 2, 1)), "moe", decode_only=True)
    assert hlo.count("custom_call_target=\"tpu_custom_call\"") == 2 * (1 + 3) + SAMPLER_CALLS
    assert "grouped_matmul_tpu" in hlo
    assert not _gathered_pools(hlo, pool)
