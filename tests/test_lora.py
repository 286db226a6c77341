"""LoRA adapters (``jaxinfer.lora``) against transformers + PEFT float32 on tiny checkpoints:
each adapter alone, several adapters and base rows in one batch, the errors, and the prefix
cache keeping adapters apart."""

from __future__ import annotations


import json

import numpy as np
import pytest

from tests import family_testing as ft
from tests.lora_testing import peft_reference, write_adapter
from tests.test_families import FAMILIES

pytestmark = pytest.mark.reference

KW = dict(max_model_len=128, progress=False, kv_cache_memory_bytes=16 << 20, max_num_seqs=8)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama 3, two adapters over every projection (ranks 4 and 8, the second rsLoRA),
    and PEFT's outputs for each and for the base model."""
    root = tmp_path_factory.mktemp("lora_llama")
    base = ft.write_tiny(root / "base", "llama")
    a = write_adapter(base, root / "a", r=4, alpha=8, seed=1)
    b = write_adapter(base, root / "b", r=8, alpha=4, rslora=True, seed=2, targets=["q_proj", "v_proj", "down_proj"])
    return {"base": base, "a": a, "b": b,
            "ref": {k: peft_reference(base, None if k == "base" else p) for k, p in
                    (("base", None), ("a", a), ("b", b))}}


def lora(name, i, path):
    from jaxinfer import LoRARequest

    return LoRARequest(name, i, str(path))


def test_one_adapter_equals_peft(llama):
    from jaxinfer import LLM

    llm = LLM(str(llama["base"]), enable_lora=True, max_loras=2, max_lora_rank=8, **KW)
    for name, i in (("a", 1), ("b", 2)):
        got = ft.outputs_of(llm.generate([list(p) for p in ft.PROMPTS], _greedy(), use_tqdm=False,
                                         lora_request=lora(name, i, llama[name])))
        ft.assert_matches(got, llama["ref"][name], what=f"adapter {name}")
        # the adapter changes the outputs: the comparison above is not the base model's
        assert np.abs(np.subtract(got[0]["prompt_logprobs"], llama["ref"]["base"][0]["prompt_logprobs"])).max() > 0.05
    ft.assert_matches(ft.generate(llm), llama["ref"]["base"], what="base rows of a LoRA engine")


def _greedy():
    from jaxinfer import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=ft.MAX_TOKENS, ignore_eos=True, prompt_logprobs=0)


def _adapters(root, base):
    """Three adapters of two ranks: every projection (r 4), rsLoRA on three (r 8), and the
    MLP of the first and last layers only (r 8)."""
    return {"a": write_adapter(base, root / "a", r=4, alpha=8, seed=1),
            "b": write_adapter(base, root / "b", r=8, alpha=4, rslora=True, seed=2,
                               targets=["q_proj", "v_proj", "down_proj"]),
            "c": write_adapter(base, root / "c", r=8, alpha=16, seed=3, targets=["gate_proj", "up_proj", "o_proj"],
                               layers=[0, 2])}


def check_mixed(base, adapters, refs, **kw):
    """Every prompt under each adapter and under none, all in one ``generate`` (one batch of
    rows of three adapters and base rows), each equal to transformers + PEFT."""
    from jaxinfer import LLM

    llm = LLM(str(base), enable_lora=True, max_loras=3, max_lora_rank=8, **(KW | {"max_num_seqs": 16} | kw))
    names = [None, *adapters]
    prompts = [list(p) for _ in names for p in ft.PROMPTS]
    reqs = [None if n is None else lora(n, list(adapters).index(n) + 1, adapters[n]) for n in names for _ in ft.PROMPTS]
    got = ft.outputs_of(llm.generate(prompts, _greedy(), use_tqdm=False, lora_request=reqs))
    P = len(ft.PROMPTS)
    for j, n in enumerate(names):
        ft.assert_matches(got[j * P : (j + 1) * P], refs["base" if n is None else n], what=f"adapter {n} in a mixed batch")
    assert llm.engine.lora.swaps == len(adapters)
    # the steps ran over active sets of the buckets only (1, 2, 3 for max_loras=3)
    assert set(lora_sizes(llm.engine)) <= {1, 2, 3}, llm.engine.shapes_run
    return llm


def lora_sizes_of(shape: tuple) -> list[int]:
    """The active-set size of one ``Engine.shapes_run`` entry ([]: a step without adapters)."""
    return [t[1] for t in shape if isinstance(t, tuple) and t[:1] == ("lora",)]


def lora_sizes(eng) -> list[int]:
    """The active-set sizes of the steps an engine ran (``Engine.shapes_run``)."""
    return [n for s in eng.shapes_run for n in lora_sizes_of(s)]


def test_mixed_batch_equals_peft(llama, tmp_path):
    adapters = {"a": llama["a"], "b": llama["b"],
                "c": write_adapter(llama["base"], tmp_path / "c", r=8, alpha=16, seed=3,
                                   targets=["gate_proj", "up_proj", "o_proj"], layers=[0, 2])}
    refs = dict(llama["ref"], c=peft_reference(llama["base"], adapters["c"]))
    check_mixed(llama["base"], adapters, refs)


@pytest.mark.slow  # three references and an engine per family: a minute or two each
@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text"])
def test_mixed_batch_equals_peft_other_families(model_type, tmp_path):
    base = ft.write_tiny(tmp_path / "base", model_type, FAMILIES.get(model_type, {}))
    adapters = _adapters(tmp_path, base)
    refs = {"base": peft_reference(base, None)} | {n: peft_reference(base, p) for n, p in adapters.items()}
    check_mixed(base, adapters, refs)


# families whose checkpoints fuse projections, PEFT's target modules on them, and the fused ones
FUSED = {"phi3": ({"partial_rotary_factor": 0.5},
                  ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], ["qkv_proj", "gate_up_proj"]),
         "glm4": (FAMILIES["glm4"],
                  ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"], ["gate_up_proj", "v_proj"])}


@pytest.mark.parametrize("model_type", ["phi3", pytest.param("glm4", marks=pytest.mark.slow)])  # ~40 s each
def test_fused_projections_equal_peft(model_type, tmp_path):
    """PEFT adapters on the fused modules of Phi-3 (qkv_proj, gate_up_proj) and GLM-4
    (gate_up_proj), applied to our separate weights as slices of the fused output: each
    adapter and base rows in one batch equal transformers + PEFT."""
    overrides, every, fused = FUSED[model_type]
    base = ft.write_tiny(tmp_path / "base", model_type, overrides)
    adapters = {"a": write_adapter(base, tmp_path / "a", r=4, alpha=8, seed=1, targets=every),
                "b": write_adapter(base, tmp_path / "b", r=8, alpha=4, rslora=True, seed=2, targets=fused)}
    refs = {"base": peft_reference(base, None)} | {n: peft_reference(base, p) for n, p in adapters.items()}
    for n in adapters:  # each adapter changes the outputs
        assert np.abs(np.subtract(refs[n][0]["prompt_logprobs"], refs["base"][0]["prompt_logprobs"])).max() > 0.05
    llm = check_mixed(base, adapters, refs)
    # the fused module's A is every slice's, its B split by the slices' rows
    from safetensors.numpy import load_file

    lo = llm.engine.lora.host[2]
    b = next(v for k, v in load_file(adapters["b"] / "adapter_model.safetensors").items()
             if "layers.1." in k and "gate_up_proj.lora_B" in k)
    F = b.shape[0] // 2
    scale = 4 / np.sqrt(8)
    np.testing.assert_allclose(lo.pairs[(1, "w_gate")][1].T, b[:F] * scale, rtol=1e-6)
    np.testing.assert_allclose(lo.pairs[(1, "w_up")][1].T, b[F:] * scale, rtol=1e-6)
    assert lo.pairs[(1, "w_gate")][0] is lo.pairs[(1, "w_up")][0]


def _sp(**kw):
    from jaxinfer import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=ft.MAX_TOKENS, ignore_eos=True, **kw)


def test_more_adapters_than_slots_wait_for_one(llama):
    """max_loras=1: rows of a second adapter wait in the queue until the first's rows finish,
    then its adapter takes the slot, while base rows queued behind them go ahead; each still
    equals PEFT."""
    from jaxinfer import LLM

    llm = LLM(str(llama["base"]), enable_lora=True, max_loras=1, max_lora_rank=8, **KW)
    P = len(ft.PROMPTS)
    reqs = [lora("a", 1, llama["a"])] * P + [lora("b", 2, llama["b"])] * P + [None] * P
    outs = llm.generate([list(p) for p in ft.PROMPTS] * 3, _greedy(), use_tqdm=False, lora_request=reqs)
    got = ft.outputs_of(outs)
    ft.assert_matches(got[:P], llama["ref"]["a"], what="adapter a")
    ft.assert_matches(got[P : 2 * P], llama["ref"]["b"], what="adapter b, queued behind a")
    ft.assert_matches(got[2 * P :], llama["ref"]["base"], what="base rows, passing b's")
    started = [o.metrics.first_scheduled_time for o in outs]
    assert max(started[2 * P :]) < min(started[P : 2 * P]), "the base rows should not wait for adapter b's slot"
    assert [o.lora_request.lora_name if o.lora_request else None for o in outs] == ["a"] * P + ["b"] * P + [None] * P
    assert llm.engine.lora.swaps == 2
    # max_loras=1: one active-set bucket, so each step shape has one variant with adapters
    assert set(lora_sizes(llm.engine)) == {1}, llm.engine.shapes_run
    shapes = set(llm.engine.shapes_run)
    n, writes = llm.engine.num_compilations(), llm.engine.lora._write._cache_size()
    # the same again: each adapter swapped into the one slot anew, new contents and no new
    # executable (neither the step's nor the slot write's), and no new step variant
    again = ft.outputs_of(llm.generate([list(p) for p in ft.PROMPTS] * 3, _greedy(), use_tqdm=False,
                                       lora_request=reqs))
    assert again == got
    assert llm.engine.lora.swaps == 4 and llm.engine.num_compilations() == n
    assert set(llm.engine.shapes_run) == shapes
    assert llm.engine.lora._write._cache_size() == writes


def test_prefix_cache_keeps_adapters_apart(llama):
    """The second prompt shares the first's 40-token prefix: under the same adapter it reuses
    the cached pages, under another adapter or none it does not (and equals PEFT)."""
    from jaxinfer import LLM

    llm = LLM(str(llama["base"]), enable_lora=True, max_loras=2, max_lora_rank=8, **KW)
    stats = llm.engine.allocator.stats
    a, b = lora("a", 1, llama["a"]), lora("b", 2, llama["b"])
    llm.generate([list(ft.PROMPTS[0])], _sp(), use_tqdm=False, lora_request=a)
    for req, name in ((b, "b"), (None, "base")):
        hits = stats.prefix_hits
        got = ft.outputs_of(llm.generate([list(ft.PROMPTS[1])], _sp(), use_tqdm=False, lora_request=req))
        assert stats.prefix_hits == hits, f"{name} reused adapter a's pages"
        ft.assert_matches(got, llama["ref"][name][1:2], what=f"{name} after a")
    hits = stats.prefix_hits
    got = ft.outputs_of(llm.generate([list(ft.PROMPTS[1])], _sp(), use_tqdm=False, lora_request=a))
    assert stats.prefix_hits > hits, "adapter a should reuse its own cached prefix"
    ft.assert_matches(got, llama["ref"]["a"][1:2], what="a after a (prefix-cache hit)")


def test_errors_name_what_is_wrong(llama, tmp_path):
    import shutil

    from jaxinfer import LLM
    from jaxinfer.errors import InvalidRequest

    llm = LLM(str(llama["base"]), enable_lora=True, max_loras=2, max_lora_rank=4, **KW)
    p = [list(ft.PROMPTS[0])]

    def refused(req, match):
        with pytest.raises(InvalidRequest, match=match) as e:
            llm.generate(p, _sp(), use_tqdm=False, lora_request=req)
        assert "\n" not in str(e.value)

    refused(lora("missing", 3, tmp_path / "missing"), "neither a directory nor a Hugging Face Hub id")
    (tmp_path / "empty").mkdir()
    refused(lora("empty", 3, tmp_path / "empty"), "no adapter_config.json")
    refused(lora("b", 2, llama["b"]), r"rank r=8 exceeds max_lora_rank=4")
    other = shutil.copytree(llama["a"], tmp_path / "other")
    conf = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps(conf | {"base_model_name_or_path": "org/another-model"}))
    refused(lora("other", 4, other), "trained for base model 'org/another-model'")
    # another model of the same name (a base directory too): its shapes do not fit
    wide = ft.write_tiny(tmp_path / "wide" / "base", "llama", {"hidden_size": 32, "head_dim": 8})
    refused(lora("wide", 5, write_adapter(wide, tmp_path / "wide_a", r=4, alpha=8)), "do not fit the base model")
    refused(lora("emb", 6, write_adapter(llama["base"], tmp_path / "emb", r=4, alpha=8,
                                         targets=["embed_tokens", "q_proj"])),
            "the embedding and the LM head are not supported")
    with pytest.raises(InvalidRequest, match="enable_lora=True"):
        LLM(str(llama["base"]), **KW).generate(p, _sp(), use_tqdm=False, lora_request=lora("a", 1, llama["a"]))
    with pytest.raises(InvalidRequest, match="speculative decoding with LoRA adapters"):
        LLM(str(llama["base"]), enable_lora=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2},
            **KW)
    # the engine still serves after every refusal
    ft.assert_matches(ft.generate(llm, ft.PROMPTS[:1]), llama["ref"]["base"][:1], what="base after refusals")


def _texts(llm, adapters):
    """Greedy text of the first and last prompt under each adapter (None: the base model)."""
    out = {}
    for name, path in adapters.items():
        req = None if name is None else lora(name, list(adapters).index(name), path)
        outs = llm.generate([list(ft.PROMPTS[0]), list(ft.PROMPTS[2])], _sp(), use_tqdm=False, lora_request=req)
        out[name] = [o.outputs[0].text for o in outs]
    return out


def test_server_runs_two_adapters_side_by_side(llama):
    import concurrent.futures

    import httpx2 as httpx

    from jaxinfer import LLM
    from jaxinfer.lora import parse_lora_modules
    from jaxinfer.server import ServerConfig
    from jaxinfer.server.app import HTTPError, Server
    from tests.server_testing import live_server

    llm = LLM(str(llama["base"]), enable_lora=True, max_loras=2, max_lora_rank=8, **KW)
    want = _texts(llm, {None: None, "a": llama["a"], "b": llama["b"]})
    assert want["a"] != want["b"] != want[None]
    config = ServerConfig(model_name="base", lora_modules=parse_lora_modules([f"a={llama['a']}", f"b={llama['b']}"]),
                          allow_runtime_lora_updating=True)
    with pytest.raises(HTTPError, match="allow-runtime-lora-updating"):
        Server(llm, ServerConfig(model_name="base")).load_lora({"lora_name": "x", "lora_path": str(llama["a"])})
    with live_server(llm, config) as (url, _):
        cards = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [("base", None), ("a", "base"), ("b", "base")]

        def complete(model, prompt):
            body = {"model": model, "prompt": list(prompt), "max_tokens": ft.MAX_TOKENS, "temperature": 0.0,
                    "ignore_eos": True}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
            return r.status_code, r.json()

        jobs = [(m, p) for m in ("a", "b", "base") for p in (ft.PROMPTS[0], ft.PROMPTS[2])]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:  # side by side in the running batch
            got = list(pool.map(lambda j: complete(*j), jobs))
        for (m, _), (status, body) in zip(jobs, got):
            assert status == 200 and body["model"] == m, body
        texts = [body["choices"][0]["text"] for _, body in got]
        assert texts == want["a"] + want["b"] + want[None]
        status, body = complete("nope", ft.PROMPTS[0])
        assert status == 404 and "neither the served model nor a LoRA adapter" in body["error"]["message"]
        # an adapter loaded and unloaded at run time (adapter a's weights under another name)
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(llama["a"])},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert complete("a2", ft.PROMPTS[0])[1]["choices"][0]["text"] == want["a"][0]
        bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent/x"},
                         timeout=60)
        assert bad.status_code == 400 and "lora_path" in bad.text
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a2"}, timeout=60).status_code == 200
        assert complete("a2", ft.PROMPTS[0])[0] == 404


def test_batch_job_runs_two_adapters_side_by_side(llama, tmp_path):
    from jaxinfer import LLM
    from jaxinfer.batch import run_batch
    from jaxinfer.lora import parse_lora_modules
    from tests.batch_testing import completion, read_jsonl, write_jsonl

    llm = LLM(str(llama["base"]), enable_lora=True, max_loras=2, max_lora_rank=8, **KW)
    want = _texts(llm, {None: None, "a": llama["a"], "b": llama["b"]})
    body = dict(max_tokens=ft.MAX_TOKENS, temperature=0.0, ignore_eos=True)
    lines = [completion(f"{m}-{k}", list(p), **body) | {"body": completion("", list(p), **body)["body"] | {"model": m}}
             for m in ("a", "b", "base") for k, p in enumerate((ft.PROMPTS[0], ft.PROMPTS[2]))]
    lines.append(completion("unknown", list(ft.PROMPTS[0]), **body))  # model "m": no such adapter
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    run_batch(llm, inp, tmp_path / "out.jsonl", progress=False, model_name="base",
              lora_modules=parse_lora_modules([f"a={llama['a']}", f"b={llama['b']}"]))
    recs = {r["custom_id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    for m, key in (("a", "a"), ("b", "b"), ("base", None)):
        for k in range(2):
            resp = recs[f"{m}-{k}"]["response"]
            assert resp["status_code"] == 200 and resp["body"]["model"] == m, resp
            assert resp["body"]["choices"][0]["text"] == want[key][k]
    err = recs["unknown"]["response"]
    assert err["status_code"] == 400 and err["body"]["error"]["code"] == "model_not_found"
    assert "line 7: model 'm' is neither the served model nor a LoRA adapter" in err["body"]["error"]["message"]


def test_chained_decode_and_int8_base_compose(llama):
    """Adapters' rows in chains of decode steps (num_scheduler_steps=4) equal PEFT; over int8
    weight-only base weights (the adapter stays float) they equal PEFT over the same weights
    rounded to int8."""
    from jaxinfer import LLM

    adapters = {"a": llama["a"], "b": llama["b"]}
    names = [None, *adapters]
    reqs = [None if n is None else lora(n, names.index(n), adapters[n]) for n in names for _ in ft.PROMPTS]
    prompts = [list(p) for _ in names for p in ft.PROMPTS]
    P = len(ft.PROMPTS)
    int8 = {n: peft_reference(llama["base"], None if n is None else adapters[n], int8=True) for n in names}
    for kw, refs in (({"num_scheduler_steps": 4}, {n: llama["ref"]["base" if n is None else n] for n in names}),
                     ({"quantization": "int8"}, int8)):
        llm = LLM(str(llama["base"]), enable_lora=True, max_loras=2, max_lora_rank=8, **(KW | kw))
        got = ft.outputs_of(llm.generate(prompts, _greedy(), use_tqdm=False, lora_request=reqs))
        for j, n in enumerate(names):
            ft.assert_matches(got[j * P : (j + 1) * P], refs[n], what=f"{kw} {n}")
        if "num_scheduler_steps" in kw:
            assert llm.engine.stats["chains"] > 0


@pytest.mark.parametrize("scheme", ["int4", "w8a8"])
def test_quantized_base_equals_peft_over_it(llama, scheme):
    """Adapters over int4 and w8a8 base weights (the adapter stays float) equal PEFT over the
    same weights dequantized, w8a8's activations rounded to int8 per token as its matmuls round
    them. Under enable_lora w8a8 keeps its smoothing at run time: each projection reads the
    model's own activation, as the adapter's A expects."""
    from jaxinfer import LLM, quant
    from jaxinfer.lora import TARGETS
    from tests.lora_testing import quantized_base

    adapters = {"a": llama["a"], "b": llama["b"]}
    names = [None, *adapters]
    reqs = [None if n is None else lora(n, names.index(n), adapters[n]) for n in names for _ in ft.PROMPTS]
    llm = LLM(str(llama["base"]), enable_lora=True, max_loras=2, max_lora_rank=8, quantization=scheme, **KW)
    layer = llm.engine.weights["layers"][1]
    assert all(isinstance(layer[w], quant.QuantArray) for w in TARGETS.values())
    if scheme == "w8a8":
        assert all(layer[w].smooth is not None for w in TARGETS.values())
    got = ft.outputs_of(llm.generate([list(p) for _ in names for p in ft.PROMPTS], _greedy(), use_tqdm=False,
                                     lora_request=reqs))
    deq = quantized_base(llm)
    P = len(ft.PROMPTS)
    refs = {n: peft_reference(llama["base"], None if n is None else adapters[n], quantized=deq) for n in names}
    for j, n in enumerate(names):
        if scheme == "int4":
            ft.assert_matches(got[j * P : (j + 1) * P], refs[n], what=f"{scheme} {n}")
        else:
            _assert_matches_rounded(got[j * P : (j + 1) * P], refs[n], [refs[m] for m in names if m != n],
                                    what=f"{scheme} {n}")


def _assert_matches_rounded(got, ref, others, *, what):
    """Prompt log-probs of a model that rounds its activations to int8: a value on a rounding
    boundary may round either way under float noise, and one flip moves that position's keys
    and values and so the log-probs after it by up to ~0.1 here (measured: the reference
    itself, its smoothing perturbed by 1e-6, moves that much; so does a change in the order of
    the attention's float sums), and every position after a flip moves a little. So: every
    position within 0.2, and the median ten times nearer the right reference than the
    references of the other adapters (an adapter applied wrongly, or not at all, is as far as
    they are: about 1 here, against about 0.01 after an early flip); greedy tokens to the int8
    near-tie."""
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        d = np.abs(np.subtract(g["prompt_logprobs"], r["prompt_logprobs"]))
        wrong = min(np.median(np.abs(np.subtract(g["prompt_logprobs"], o[i]["prompt_logprobs"]))) for o in others)
        assert d.max() < 0.2 and np.median(d) < wrong / 10, (what, i, d, wrong)
    ft.assert_matches([dict(g, prompt_logprobs=None) for g in got], ref, near_tie=ft.INT8_NEAR_TIE, what=what)


def test_w8a8_with_folded_smoothing_refuses_adapters(llama):
    """A w8a8 model whose smoothing is folded into its norms (as a checkpoint saved quantized
    holds it) cannot take adapters: one error, at start-up."""
    from jaxinfer import LLM, quant
    from jaxinfer.errors import InvalidRequest
    from jaxinfer.loaders import checkpoint

    folded = checkpoint.load(str(llama["base"]), dtype="float32", quantize=quant.quant_config("w8a8"))
    with pytest.raises(InvalidRequest, match="smoothing was folded") as e:
        LLM(folded, enable_lora=True, **KW)
    assert "\n" not in str(e.value)


_TP_SCRIPT = r"""
import json, sys
from tests import family_testing as ft
from jaxinfer import LLM, LoRARequest, SamplingParams
base, a, b = sys.argv[1:4]
llm = LLM(base, tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=128,
          progress=False, kv_cache_memory_bytes=16 << 20, max_num_seqs=8)
reqs = [None, LoRARequest("a", 1, a), LoRARequest("b", 2, b)]
sp = SamplingParams(temperature=0.0, max_tokens=ft.MAX_TOKENS, ignore_eos=True, prompt_logprobs=0)
outs = llm.generate([list(p) for _ in reqs for p in ft.PROMPTS], sp, use_tqdm=False,
                    lora_request=[r for r in reqs for _ in ft.PROMPTS])
st = llm.engine.lora.stacks["layers"][0]
split = {w: [tuple(x.sharding.spec) for x in st[w]] for w in ("wq", "wo", "w_down")}
print("RESULT " + json.dumps({"outs": ft.outputs_of(outs), "split": split}))
"""


@pytest.mark.slow  # a subprocess on 8 virtual CPU devices: a minute or two
def test_tensor_parallel_2_equals_peft(llama):
    """Weights split over 2 devices, each adapter's A split like its base weight's input and B
    like its output: base rows and both adapters' rows in one batch equal PEFT."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", _TP_SCRIPT, str(llama["base"]), str(llama["a"]), str(llama["b"])],
                       env=env, capture_output=True, text=True, timeout=900, cwd=root)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    res = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    got = res["outs"]
    # A split like its base's input, B like its output: q's output heads, o's and down's inputs
    assert res["split"] == {"wq": [[], [None, None, "model"]], "wo": [["model", None, None], []],
                            "w_down": [["model", None, None], []]}, res["split"]  # ([]: replicated)
    P = len(ft.PROMPTS)
    for j, n in enumerate(("base", "a", "b")):
        ft.assert_matches(got[j * P : (j + 1) * P], llama["ref"][n], what=f"tensor parallel 2, {n}")


def test_cli_lora_flags_are_checked_before_the_model_loads(capsys, tmp_path):
    """Bad LoRA flags exit 2 with one line, before any model is read (the model here does not exist)."""
    from jaxinfer.cli import main

    for args, message in (
            (["serve", "--model", "nope", "--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
            (["serve", "--model", "nope", "--enable-lora", "--lora-modules", "a"], "expected name=path"),
            (["serve", "--model", "nope", "--enable-lora", "--lora-modules", "a=/x", "a=/y"], "names 'a' twice"),
            (["serve", "--model", "nope", "--allow-runtime-lora-updating"], "needs --enable-lora"),
            (["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o.jsonl"), "--model", "nope",
              "--lora-modules", "a=/x"], "--lora-modules needs --enable-lora")):
        if args[0] == "batch":
            (tmp_path / "in.jsonl").write_text("")
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


@pytest.mark.slow  # warm-up compiles every step shape three times: a minute or more
def test_warmup_compiles_each_adapter_bucket(llama):
    """With max_loras=2, warm-up compiles each step shape without adapters and with active
    sets of 1 and 2, so rows of two adapters and base rows together compile nothing more."""
    from jaxinfer import LLM
    from jaxinfer.engine.warmup import warmup_shapes

    # the prompts below arrive together and pack one prefill row of up to max_num_batched_tokens,
    # so warm-up covers the whole model length (a prefill row of 128 tokens)
    llm = LLM(str(llama["base"]), enable_lora=True, max_loras=2, max_lora_rank=8,
              **(KW | {"max_num_batched_tokens": 128}))
    eng = llm.engine
    eng.warmup()
    shapes = set(warmup_shapes(eng))
    by_size = {n: {s[:3] for s in eng.shapes_run if lora_sizes_of(s) == ([n] if n else [])} for n in (0, 1, 2)}
    assert by_size == {0: shapes, 1: shapes, 2: shapes}, by_size
    compiled = eng.num_compilations()
    reqs = [lora("a", 1, llama["a"]), lora("b", 2, llama["b"]), None]
    llm.generate([list(p) for _ in reqs for p in ft.PROMPTS], _sp(), use_tqdm=False,
                 lora_request=[r for r in reqs for _ in ft.PROMPTS])
    assert eng.num_compilations() == compiled, sorted(map(str, eng.shapes_run))
    assert set(lora_sizes(eng)) == {1, 2}
