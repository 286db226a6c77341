"""The real Gemma 3 270M checkpoint (GGUF Q4_K_M) against transformers (PyTorch CPU, float32).

Goldens come from tests/golden/make_gemma3_goldens.py (committed beside them); transformers
reads the GGUF with its own dequantizer and its own handling of Gemma's norm weights (llama.cpp
stores 1 + w, transformers subtracts the 1 again, we subtract it in ``gemma3.gguf_tensor``), so
it shares no code with us. One prompt is longer than the 512-token sliding window.
"""

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer.config import AttentionKind
from jaxinfer.models import gemma3

GOLDEN = json.loads((Path(__file__).parent / "golden" / "gemma-3-270m.json").read_text())
CASES = GOLDEN["prompts"]
NEAR_TIE = 0.05  # top-2 logit margin below which float32 rounding may flip the argmax
LOGIT_ATOL = 5e-4  # float32, 18 layers, logits up to ~40: observed max |diff| 6.4e-5 (logprobs 3.9e-5)


@pytest.fixture(scope="module")
def llm(gemma3_llm):
    return gemma3_llm


def test_config_matches_transformers_reading(llm):
    cfg, hf = llm.cfg, GOLDEN["metadata"]["hf_config"]
    want = ["full_attention" if k == AttentionKind.GLOBAL else "sliding_attention"
            for k in map(cfg.layer_kind, range(cfg.n_layers))]
    assert want == hf["layer_types"]
    assert cfg.sliding_window == hf["sliding_window"] and cfg.head_dim == hf["head_dim"]
    assert cfg.rope.theta == hf["rope_parameters"]["full_attention"]["rope_theta"]
    assert cfg.rope_local.theta == hf["rope_parameters"]["sliding_attention"]["rope_theta"]
    assert cfg.query_pre_attn_scalar == hf["query_pre_attn_scalar"]
    assert cfg.final_logit_softcap == hf["final_logit_softcapping"] and cfg.tie_embeddings
    assert cfg.norm_eps == pytest.approx(hf["rms_norm_eps"])
    # the GGUF stores eps as float32 (9.99999997e-07), which transformers reads as is too
    assert dataclasses.replace(cfg, name="", norm_eps=1e-6) == dataclasses.replace(gemma3.PRESETS["gemma-3-270m"], name="")
    assert llm.memory_report()["num_params"] == 268_098_176


def test_prompt_token_ids_equal_transformers(llm):
    tok = llm.tokenizer
    for case in CASES:
        ids = tok.encode(case["prompt_text"])
        assert ids == case["prompt_ids"], case["name"]
        assert ids[0] == tok.bos_id == GOLDEN["metadata"]["bos_token_id"]
        assert tok.decode(ids[1:], skip_special_tokens=False) == case["prompt_text"], case["name"]


def test_greedy_tokens_equal_transformers_up_to_near_ties(llm):
    """Through LLM.generate end to end. The prompt past the window runs on its own: with it the
    eight short rows would decode in a batch bucket of 16, each step unembedding twice the rows."""
    sp = SamplingParams(temperature=0.0, max_tokens=len(CASES[0]["greedy_ids"]), ignore_eos=True,
                        skip_special_tokens=False)
    short = [c for c in CASES if c["name"] != "past_window"]
    outs = llm.generate([c["prompt_ids"] for c in short], sp, use_tqdm=False)
    outs += llm.generate([c["prompt_ids"] for c in CASES if c["name"] == "past_window"], sp, use_tqdm=False)
    exact = 0
    for case, out in zip(short + [c for c in CASES if c["name"] == "past_window"], outs):
        got, want = out.outputs[0].token_ids, case["greedy_ids"]
        assert len(got) == len(want), case["name"]
        exact += got == want
        for k, (g, w) in enumerate(zip(got, want)):
            if g != w:  # allowed only at a near-tie; after it the continuations differ
                assert case["margins"][k] < NEAR_TIE, (case["name"], k, g, w, case["margins"][k])
                break
    assert exact >= len(CASES) - 1  # a near-tie may excuse one prompt, not the whole set


@functools.partial(jax.jit, static_argnames=("cfg",))
def _logits_at(w, tokens, rows, cols, *, cfg):
    """Uncached forward over right-padded tokens [B, T]; logits only at (rows, cols) [R, V]
    (the 262144-wide unembedding of every position would dominate the test's time)."""
    h, _ = gemma3.forward(w, tokens, jnp.zeros(tokens.shape[0], jnp.int32), None, cfg=cfg)
    return gemma3.unembed(w, h[rows, cols][None], cfg)[0]


def test_logits_and_prompt_logprobs_match_transformers(llm):
    """Three right-padded batches (the short prompts, the paragraph, the prompt past the
    window): padding cannot change causal logits, and three shapes compile three times, not
    nine. The prompt logprobs come from the same forward pass (extra rows of the gather)."""
    plp = {ref["name"]: ref for ref in GOLDEN["prompt_logprobs"]}
    groups: dict[int, list] = {}
    for case in CASES:
        n = len(case["prompt_ids"]) + len(case["greedy_ids"]) - 1
        groups.setdefault(max(64, n), []).append(case)
    worst, worst_lp, checked = 0.0, 0.0, 0
    for T, cases in groups.items():
        tokens = np.zeros((len(cases), T), np.int32)
        rows, cols, refs = [], [], []
        for b, case in enumerate(cases):
            ids = case["prompt_ids"] + case["greedy_ids"][:-1]
            tokens[b, : len(ids)] = ids
            for ref in case["logits"]:
                rows.append(b)
                cols.append(ref["position"])
                refs.append((case["name"], ref))
            if case["name"] in plp:
                for i in range(len(case["prompt_ids"]) - 1):
                    rows.append(b)
                    cols.append(i)
                    refs.append((case["name"], i))
        logits = _logits_at(llm.weights, jnp.asarray(tokens), jnp.asarray(rows), jnp.asarray(cols), cfg=llm.cfg)
        for row, (name, ref) in zip(np.asarray(logits).astype(np.float64), refs):
            lse = np.log(np.sum(np.exp(row - row.max()))) + row.max()
            if isinstance(ref, int):  # prompt position ref predicting prompt token ref + 1
                want = plp[name]["logprobs"][ref]
                lp = row[plp[name]["prompt_ids"][ref + 1]] - lse
                worst_lp = max(worst_lp, abs(lp - want))
                assert abs(lp - want) < LOGIT_ATOL, (name, ref, lp, want)
                continue
            diff = np.abs(row[ref["top_ids"]] - np.asarray(ref["top_logits"]))
            worst = max(worst, float(diff.max()))
            checked += 1
            assert diff.max() < LOGIT_ATOL, (name, ref["position"], diff.max())
            assert abs(lse - ref["logsumexp"]) < LOGIT_ATOL, (name, ref["position"])
            assert abs(row.mean() - ref["mean"]) < LOGIT_ATOL and abs(row.std() - ref["std"]) < LOGIT_ATOL
    assert checked == 4 * len(CASES) and worst_lp > 0
    print(f"max |logit diff| vs transformers: {worst:.2e}; max |prompt logprob diff|: {worst_lp:.2e}")
