"""Mixtral against transformers' own tiny checkpoint (8 experts, top 2): prompt log-probs and
greedy tokens through the paged engine, with a prefix-cache hit, n-gram speculation, the int8
KV cache and tensor parallelism 2 (``tests/family_testing.py``); a sliding window; int8
experts (one scale per expert and output channel); the GGUF llama.cpp's converter writes;
expert parallelism on 8 virtual CPU devices, whose compiled step gathers no expert weight."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from tests import family_testing as ft

pytestmark = pytest.mark.reference

TINY = {"num_local_experts": 8, "num_experts_per_tok": 2}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ft.write_tiny(tmp_path_factory.mktemp("mixtral") / "m", "mixtral", TINY)


@pytest.fixture(scope="module")
def tiny_ref(tiny):
    return ft.reference(tiny)


def test_mixtral_equals_transformers(tiny):
    ft.check_family(tiny)


def test_mixtral_sliding_window_equals_transformers(tmp_path):
    """sliding_window 8: every layer attends to its last 8 positions (windowed page pools)."""
    path = ft.write_tiny(tmp_path / "m", "mixtral", TINY | {"sliding_window": 8})
    ft.check_family(path, tp=False, int8_kv=False, ngram=False)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_experts(tiny, scheme):
    """quantization="int8" / "int4": each expert weight is one QuantArray [D, E*F] with scales per
    (expert, output channel), equal to quantizing every expert on its own; the router stays
    float. The quantized model (grouped matmuls over int8 / int4 experts) computes what the
    float model does with the dequantized weights (itself held to transformers above)."""
    from jaxinfer import LLM
    from jaxinfer.models import mixtral
    from jaxinfer.quant import QuantArray, quantize_int4, quantize_int8

    kw = dict(max_model_len=128, progress=False, kv_cache_memory_bytes=16 << 20, max_num_seqs=4)
    llm = LLM(str(tiny), quantization=scheme, **kw)
    w = llm.weights["layers"][1]["moe"]
    assert not isinstance(w["router"], QuantArray), "the router stays float"
    gate = w["w_gate"]
    assert isinstance(gate, QuantArray) and gate.shape == (8, 64, 128) and gate.values.shape[1] == 8 * 128
    f = LLM(str(tiny), **kw).weights["layers"][1]["moe"]["w_gate"]  # [E, D, F]
    for e in (0, 5):
        one = quantize_int8(f[e], (0,)) if scheme == "int8" else quantize_int4(f[e], (0,), gate.group)
        np.testing.assert_array_equal(np.asarray(gate.values).reshape(-1, 8, 128)[:, e], np.asarray(one.values))
        np.testing.assert_array_equal(np.asarray(gate.scale).reshape(-1, 8, 128)[:, e],
                                      np.asarray(one.scale).reshape(-1, 128))
    deq = jax.tree.map(lambda a: a.dequantize() if isinstance(a, QuantArray) else a, llm.weights,
                       is_leaf=lambda a: isinstance(a, QuantArray))
    tokens = jnp.asarray([ft.PROMPTS[0]], jnp.int32)

    @jax.jit
    def logits(weights):
        h, _ = mixtral.forward(weights, tokens, jnp.zeros(1, jnp.int32), None, cfg=llm.cfg)
        return mixtral.unembed(weights, h, llm.cfg)

    np.testing.assert_allclose(logits(llm.weights), logits(deq), atol=2e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- GGUF
def write_gguf(path: Path, hf_dir: Path) -> Path:
    """The tiny checkpoint as llama.cpp's converter writes Mixtral: architecture "llama" with
    expert_count / expert_used_count, Q/K rows permuted for its rotary layout, each layer's
    experts stacked into one tensor per projection ([E, F, D] as numpy reads it)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    t = load_file(str(hf_dir / "model.safetensors"))
    H, K, E = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_local_experts"]

    def permute(w, n):  # convert_hf_to_gguf.LlamaModel.permute
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", cfg["num_hidden_layers"])
    w.add_uint32("llama.context_length", cfg["max_position_embeddings"])
    w.add_uint32("llama.embedding_length", cfg["hidden_size"])
    w.add_uint32("llama.feed_forward_length", cfg["intermediate_size"])
    w.add_uint32("llama.attention.head_count", H)
    w.add_uint32("llama.attention.head_count_kv", K)
    w.add_uint32("llama.attention.key_length", cfg["head_dim"])
    w.add_uint32("llama.attention.value_length", cfg["head_dim"])
    w.add_float32("llama.rope.freq_base", cfg["rope_parameters"]["rope_theta"])
    w.add_float32("llama.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_uint32("llama.expert_count", E)
    w.add_uint32("llama.expert_used_count", cfg["num_experts_per_tok"])
    w.add_string("tokenizer.ggml.model", "llama")  # Mixtral's SentencePiece vocabulary, as t0 .. t95
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(cfg["vocab_size"])])
    w.add_array("tokenizer.ggml.scores", [0.0] * cfg["vocab_size"])
    w.add_array("tokenizer.ggml.token_type", [2 if i == 3 else 1 for i in range(cfg["vocab_size"])])  # t3: unk
    w.add_uint32("tokenizer.ggml.unknown_token_id", 3)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    tensors = {"token_embd.weight": t["model.embed_tokens.weight"], "output_norm.weight": t["model.norm.weight"],
               "output.weight": t["lm_head.weight"]}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            f"blk.{i}.attn_norm.weight": t[p + "input_layernorm.weight"],
            f"blk.{i}.ffn_norm.weight": t[p + "post_attention_layernorm.weight"],
            f"blk.{i}.attn_q.weight": permute(t[p + "self_attn.q_proj.weight"], H),
            f"blk.{i}.attn_k.weight": permute(t[p + "self_attn.k_proj.weight"], K),
            f"blk.{i}.attn_v.weight": t[p + "self_attn.v_proj.weight"],
            f"blk.{i}.attn_output.weight": t[p + "self_attn.o_proj.weight"],
            f"blk.{i}.ffn_gate_inp.weight": t[p + "block_sparse_moe.gate.weight"],
        }
        for ours, theirs in (("gate", "w1"), ("down", "w2"), ("up", "w3")):
            tensors[f"blk.{i}.ffn_{ours}_exps.weight"] = np.stack(
                [t[f"{p}block_sparse_moe.experts.{e}.{theirs}.weight"] for e in range(E)])
    for name, a in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(a, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_mixtral_gguf_equals_transformers(tiny, tiny_ref, tmp_path):
    """The GGUF of the same weights loads as Mixtral and gives transformers' log-probs."""
    from jaxinfer import LLM

    path = write_gguf(tmp_path / "mixtral.gguf", tiny)
    llm = LLM(str(path), max_model_len=128, progress=False, kv_cache_memory_bytes=16 << 20, max_num_seqs=4)
    assert llm.cfg.family == "mixtral" and llm.cfg.n_experts == 8 and llm.cfg.n_experts_per_tok == 2
    ft.assert_matches(ft.generate(llm), tiny_ref, what="gguf")


# ----------------------------------------------------------------------------- expert parallel
_EP_SCRIPT = textwrap.dedent(r"""
    import json, re, sys
    import jax, numpy as np
    from jaxinfer import LLM
    from jaxinfer.sharding import Placed
    from tests.family_testing import generate
    from tests.hlo_collectives import collectives
    path = sys.argv[1]
    out = {}
    for name, kw in json.loads(sys.argv[2]).items():
        llm = LLM(path, max_model_len=128, progress=False, kv_cache_memory_bytes=16 << 20, max_num_seqs=4, **kw)
        res = {"outputs": generate(llm), "parallel": llm.parallel}
        e = llm.engine
        gate = e.weights["layers"][0]["moe"]["w_gate"]
        res["gate_spec"] = [str(s) for s in gate.specs] if isinstance(gate, Placed) else None
        n = len(jax.devices())
        from jaxinfer.engine.step import StepInputs
        txt = e._step.lower(e.weights, StepInputs(e.idle_batch(4, 8, 0)), e.state, cfg=e.cfg,
                            num_logprobs=-1, prompt_logprobs=-1, kernels=e.kernels).compile().as_text()
        res["collectives"] = []
        for op, shape, groups, line in collectives(txt, n):
            scope = re.search(r"layer(\d+)/(attention|mlp)", line)
            res["collectives"].append((op, shape, len(groups[0]), scope.group(0) if scope else ""))
        out[name] = res
        del llm, e
    print("RESULT " + json.dumps(out))
""")


def _parallel_runs(path, runs: dict) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", _EP_SCRIPT, str(path), json.dumps(runs)], env=env,
                       capture_output=True, text=True, timeout=900, cwd=root)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_expert_parallel_equals_transformers_and_gathers_no_expert_weight(tiny, tiny_ref):
    """EP 4 (tensor_parallel_size 4 with enable_expert_parallel: 2 experts per device) and
    EP 2 x TP 2 (two data-parallel replicas, each tensor parallel 2 with its experts split 2
    ways) give transformers' tokens and log-probs, as TP 4 (each expert's width split) does.
    Each compiled step sums the expert parts with one all-reduce of [tokens, D] per layer,
    beside attention's, and gathers nothing the size of an expert weight (nor anything but
    small activations)."""
    runs = _parallel_runs(tiny, {
        "ep4": dict(tensor_parallel_size=4, enable_expert_parallel=True),
        "ep2xtp2": dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True),
        "tp4": dict(tensor_parallel_size=4),
    })
    D, E, F, L = 64, 8, 128, 3
    for name, res in runs.items():
        ft.assert_matches(res["outputs"], tiny_ref, what=name)
        ops = res["collectives"]
        big = [o for o in ops if o[0] != "all-reduce" and np.prod(o[1]) >= D * F]  # one expert is D x F
        assert not big, (name, big)
        for i in range(L):
            mlp = [(op, shape) for op, shape, _, scope in ops if scope == f"layer{i}/mlp"]
            # the tokens' expert outputs [T, D] summed once over the devices, nothing else
            assert mlp == [("all-reduce", [4, D])], (name, i, mlp)
    assert runs["ep4"]["parallel"]["experts"] == "expert parallel"
    assert runs["ep4"]["parallel"]["experts_per_device"] == E // 4
    assert "'model'" in runs["ep4"]["gate_spec"][0].split(",")[0], runs["ep4"]["gate_spec"]
    assert runs["tp4"]["parallel"]["experts"] == "split"
    assert runs["ep2xtp2"]["parallel"]["experts_per_device"] == E // 2


def test_expert_parallel_needs_experts_to_divide(tiny):
    from jaxinfer import LLM
    from jaxinfer.errors import InvalidRequest
    from jaxinfer.sharding import tensor_parallel_plan

    cfg = LLM(str(tiny), max_model_len=128, progress=False, kv_cache_memory_bytes=16 << 20, max_num_seqs=4).cfg
    with pytest.raises(InvalidRequest, match="tensor_parallel_size=3 must divide the model's 8 experts"):
        tensor_parallel_plan(dataclasses.replace(cfg, n_heads=6, n_kv_heads=3), 3, expert_parallel=True)
    with pytest.raises(InvalidRequest, match="needs a mixture-of-experts model"):
        tensor_parallel_plan(dataclasses.replace(cfg, n_experts=0), 2, expert_parallel=True)


def test_cli_enable_expert_parallel_reaches_llm():
    from jaxinfer import cli

    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--enable-expert-parallel",
                                          "--tensor-parallel-size", "2"])
    assert cli._parallel_kwargs(args) == dict(tensor_parallel_size=2, pipeline_parallel_size=1,
                                              data_parallel_size=1, enable_expert_parallel=True)


# ----------------------------------------------------------------------------- the block
def _block_numpy(x, w, k, renormalize, glu):
    """The MoE block token by token, expert by expert, in float64."""
    x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    f = {n: np.asarray(v, np.float64) for n, v in w.items()}
    logits = x @ f["router"] + f.get("router_bias", 0.0)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-p[t], kind="stable")[:k]
        wts = p[t, top] / (p[t, top].sum() if renormalize else 1.0)
        for e, wt in zip(top, wts):
            g = x[t] @ f["w_gate"][e] + (f["b_gate"][e] if "b_gate" in f else 0)
            u = x[t] @ f["w_up"][e] + (f["b_up"][e] if "b_up" in f else 0)
            out[t] += wt * (glu(g, u) @ f["w_down"][e] + (f["b_down"][e] if "b_down" in f else 0))
    return out


@pytest.mark.parametrize("renormalize,bias", [(True, False), (False, True)])
def test_moe_block_equals_token_by_token(renormalize, bias):
    """The block (sorted rows, grouped matmuls, combine) equals routing each token through its
    k experts one by one, with and without renormalised weights and expert biases."""
    from jaxinfer.models import moe
    from jaxinfer.specs import init_weights
    from jaxinfer.config import ModelConfig

    cfg = ModelConfig("mixtral", 16, 32, 1, 2, 2, 16, 48)
    specs = moe.weight_specs(32, 6, 48, expert_bias=bias, router_bias=bias)
    w = init_weights(specs, cfg, jax.random.key(0), scale=0.3)
    w = {n: v + 0.1 * jax.random.normal(jax.random.key(i), v.shape) if n.startswith("b") or n == "router_bias"
         else v for i, (n, v) in enumerate(w.items())}
    x = jax.random.normal(jax.random.key(9), (2, 7, 32))
    out = jax.jit(lambda x, w: moe.moe_mlp(x, w, route=moe.softmax_topk(2, renormalize=renormalize)))(x, w)
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    want = _block_numpy(x, w, 2, renormalize, lambda g, u: silu(g) * u)
    np.testing.assert_allclose(np.asarray(out).reshape(-1, 32), want, atol=2e-5, rtol=1e-5)


def test_moe_block_reads_experts_through_grouped_matmuls_only():
    """No dot in the block's program has the whole expert stack as an operand: every expert
    weight is read a group at a time (inside the grouped matmul's loop)."""
    from jaxinfer.models import moe
    from jaxinfer.specs import init_weights
    from jaxinfer.config import ModelConfig

    cfg = ModelConfig("mixtral", 16, 32, 1, 2, 2, 16, 48)
    w = init_weights(moe.weight_specs(32, 6, 48), cfg, jax.random.key(0))
    x = jnp.ones((1, 5, 32))
    jaxpr = jax.make_jaxpr(lambda x, w: moe.moe_mlp(x, w, route=moe.softmax_topk(2, renormalize=True)))(x, w)

    def dots(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name in ("dot_general", "ragged_dot_general"):
                yield eqn
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from dots(sub)

    shapes = [[tuple(v.aval.shape) for v in e.invars] for e in dots(jaxpr.jaxpr)]
    assert shapes and not any(len(s) == 3 and s[0] == 6 for op in shapes for s in op), shapes


def test_moe_block_kernel_path_equals_cpu_path():
    """Traced for TPU/GPU (the Pallas grouped matmul, in interpret mode here) the block computes
    what the CPU path (the XLA loop) does, float and int8 experts."""
    from jaxinfer import dispatch
    from jaxinfer.config import ModelConfig
    from jaxinfer.models import moe
    from jaxinfer.quant import quantize_int8
    from jaxinfer.specs import init_weights

    cfg = ModelConfig("mixtral", 16, 128, 1, 2, 2, 16, 128)
    w = init_weights(moe.weight_specs(128, 8, 128), cfg, jax.random.key(1), scale=0.1)
    x = jax.random.normal(jax.random.key(2), (3, 11, 128))
    route = moe.softmax_topk(2, renormalize=True)
    specs = moe.weight_specs(128, 8, 128)
    for weights in (w, w | {n: quantize_int8(w[n], (1,)) for n in ("w_gate", "w_up", "w_down")}):
        cpu = jax.jit(lambda x, w: moe.moe_mlp(x, w, route=route))(x, weights)
        bound = dispatch.bind(weights, specs, dispatch.INTERPRET)  # as LLM(kernels="pallas") leaves them
        kern = jax.jit(lambda x, w: moe.moe_mlp(x, w, route=route))(x, bound)
        np.testing.assert_allclose(kern, cpu, atol=1e-5, rtol=1e-5)


def test_w8a8_refuses_experts_before_reading(tiny):
    from jaxinfer import LLM
    from jaxinfer.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="w8a8' does not cover mixture-of-experts"):
        LLM(str(tiny), quantization="w8a8", max_model_len=128, progress=False, kv_cache_memory_bytes=16 << 20)


_SHARDED_BLOCK = textwrap.dedent(r"""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding
    from jaxinfer.config import ModelConfig
    from jaxinfer.models import moe
    from jaxinfer.quant import QuantArray, quantize_int8
    from jaxinfer.sharding import make_mesh, place_experts, quant_shardings, rules_for, weight_shardings
    from jaxinfer.specs import init_weights
    cfg = ModelConfig("mixtral", 16, 64, 1, 2, 2, 16, 64)
    specs = moe.weight_specs(64, 8, 64, expert_bias=True, router_bias=True)
    w = init_weights(specs, cfg, jax.random.key(0), scale=0.2)
    w = {n: v + 0.1 * jax.random.normal(jax.random.key(i), v.shape) if "b" in n.split("_")[0] else v
         for i, (n, v) in enumerate(w.items())}
    x = jax.random.normal(jax.random.key(5), (2, 9, 64))
    route = moe.softmax_topk(2, renormalize=False)
    block = jax.jit(lambda x, w: moe.moe_mlp(x, w, route=route))
    for quantized in (False, True):
        ws = dict(w, **{n: quantize_int8(w[n], (1,)) for n in ("w_gate", "w_up", "w_down")}) if quantized else w
        one = block(x, ws)
        for ep in (True, False):
            mesh = make_mesh(1, 4, jax.devices()[:4])
            sh = weight_shardings(specs, mesh, rules_for(ep))
            placed = {n: jax.device_put(v, quant_shardings(v, sh[n]) if isinstance(v, QuantArray) else sh[n])
                      for n, v in ws.items()}
            out = block(x, place_experts(placed, specs, mesh))
            np.testing.assert_allclose(out, one, atol=2e-5, rtol=2e-5, err_msg=f"{quantized=} {ep=}")
    print("ok")
""")


def test_moe_block_sharded_equals_one_device():
    """The block under shard_map on 4 virtual devices, experts split whole (expert parallel)
    or by width (tensor parallel), float and int8, with router and expert biases, equals the
    block on one device."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", _SHARDED_BLOCK], env=env, capture_output=True, text=True,
                       timeout=600, cwd=root)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-2000:] + p.stderr[-4000:]
