"""Tensor parallelism through LLM on 8 virtual CPU devices (each check in a subprocess, so
XLA_FLAGS apply): greedy tokens and prompt logprobs equal one device's, the KV pools split over
KV heads where they divide and replicated where they do not, and the compiled decode step
holds one all-reduce after attention and one after the MLP per layer and gathers no weights.
Bad sizes get one clear error."""

import os
import subprocess
import sys
import textwrap

import pytest

from jaxinfer import LLM
from jaxinfer.errors import InvalidRequest

_COMMON = textwrap.dedent("""
    import re, sys
    from collections import Counter
    import jax, numpy as np
    from jaxinfer import LLM, SamplingParams, kernels
    assert len(jax.devices()) == 8
    path, sizes = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time there was"]
    ref = None
    for tp in sizes:
        llm = LLM(path, progress=False, max_model_len=256, max_num_seqs=4, tensor_parallel_size=tp)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        toks = [o.outputs[0].token_ids for o in outs]
        plp = np.array([[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs[:1]])
        if ref is None:
            ref = (toks, plp)
            continue
        assert toks == ref[0], (tp, toks, ref[0])
        np.testing.assert_allclose(plp, ref[1], atol=2e-4)  # float32, summation order differs across shards
        rep = llm.memory_report()["parallel"]
        e = llm.engine
        spec = e.k_pages[0].sharding.spec
        k_heads = spec[1] if len(spec) > 1 else None
        assert (k_heads == "model") == (rep["kv_heads"] == "split"), (rep, e.k_pages[0].sharding.spec)
        txt = e._step.lower(e.weights, e.idle_batch(4, 8, 0), e.k_pages, e.v_pages, e.slots, cfg=e.cfg,
                            num_logprobs=-1, prompt_logprobs=-1, kernel_mode=kernels.current_mode()).compile().as_text()
        per = Counter()
        for line in txt.splitlines():
            m = re.search(r"= (\\S+) (all-reduce|all-gather)(?:-start)?\\(", line)
            if m:
                scope = re.search(r"layer(\\d+)/(attention|mlp)", line)
                if scope:
                    per[(m.group(2), scope.group(2))] += 1
                if m.group(2) == "all-gather":  # activations only: no weight is ever gathered
                    shape = [int(x) for x in re.findall(r"\\d+", m.group(1).split("[")[1].split("]")[0])]
                    assert np.prod(shape) < 4 * e.cfg.d_model * 64, line
        L = e.cfg.n_layers
        assert per[("all-reduce", "attention")] == L and per[("all-reduce", "mlp")] == L, per
        assert per[("all-gather", "mlp")] == 0, per
        print("tp", tp, rep, dict(per))
    print("ok")
""")


def _run(path, sizes: str, timeout=900):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    p = subprocess.run([sys.executable, "-c", _COMMON, str(path), sizes], env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert p.stdout.strip().endswith("ok")
    return p.stdout


def test_tiny_tensor_parallel_2_and_4_equal_one_device(tiny_gguf):
    """4 query heads, 2 KV heads: TP 2 splits the KV heads, TP 4 replicates them."""
    out = _run(tiny_gguf, "1,2,4")
    assert "'kv_heads': 'split'" in out and "'kv_heads': 'replicated'" in out


def test_smollm2_tensor_parallel_3_equals_one_device(smollm2_gguf):
    """9 query heads and 3 KV heads over 3 devices: one KV head each."""
    _run(smollm2_gguf, "1,3")


@pytest.mark.parametrize("kw,msg", [
    (dict(tensor_parallel_size=3), "must divide the model's 4 query heads"),
    (dict(tensor_parallel_size=0), "must be an integer >= 1"),
    (dict(data_parallel_size=2), "not supported yet"),
])
def test_bad_sizes_are_one_clear_error(tiny_gguf, kw, msg):
    if kw.get("tensor_parallel_size", 1) > 1 and len(__import__("jax").devices()) < kw["tensor_parallel_size"]:
        msg = "needs 3 devices"
    with pytest.raises(InvalidRequest, match=msg):
        LLM(str(tiny_gguf), progress=False, **kw)


def test_cli_bad_parallel_size_exits_2(capsys):
    from jaxinfer.cli import main

    assert main(["generate", "--prompt", "x", "--data-parallel-size", "2"]) == 2
    assert "not supported yet" in capsys.readouterr().err
