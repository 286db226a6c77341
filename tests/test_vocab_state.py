"""The paged engine carries [S, V] penalty statistics only while a running row has penalties,
with the same tokens either way; random in-memory weights go through ``LLM``; a warm second
generate of the same shapes builds no executable."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import ModelConfig
from jaxinfer.errors import InvalidRequest
from jaxinfer.loaders.random_weights import random_loaded, random_weights
from jaxinfer.quant import quant_config

V = 300
CFG = ModelConfig("llama", vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  d_ff=64, max_position=128, tie_embeddings=False, name="tiny-random")


@pytest.fixture(scope="module")
def llm():
    # scale 1: logits far apart, so greedy and sampled tokens are not near-ties
    return LLM(random_loaded(CFG, scale=1.0, seed=3), max_model_len=128, max_num_seqs=4, progress=False,
               enable_prefix_caching=False)


def _prompts(n, seed=0, length=12):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, V, length)] for _ in range(n)]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_plain_batch_has_no_vocab_state(llm):
    outs = llm.generate(_prompts(3), SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=6,
                                                    ignore_eos=True), use_tqdm=False)
    assert all(len(t) == 6 for t in _tokens(outs))
    assert llm.engine.slots.sampling.prompt_mask is None and llm.engine.slots.sampling.output_counts is None


def test_penalty_row_joining_plain_rows_matches_it_alone(llm):
    """A penalty row admitted beside plain rows (the [S, V] state is added for it, zeroed for
    the others) samples what it samples alone, and the plain rows what they sample without it;
    a later plain batch drops the state again."""
    prompts = _prompts(4, seed=1)
    plain = SamplingParams(temperature=0.7, seed=5, max_tokens=10, ignore_eos=True)
    pen = SamplingParams(temperature=0.0, repetition_penalty=1.8, presence_penalty=0.5, frequency_penalty=0.3,
                         max_tokens=10, ignore_eos=True)
    alone_plain = _tokens(llm.generate(prompts[:3], plain, use_tqdm=False))
    alone_pen = _tokens(llm.generate(prompts[3:], pen, use_tqdm=False))
    assert llm.engine.slots.sampling.output_counts is not None
    mixed = _tokens(llm.generate(prompts, [plain] * 3 + [pen], use_tqdm=False))
    assert mixed == alone_plain + alone_pen
    # the penalties changed something, so the state was read
    assert alone_pen != _tokens(llm.generate(prompts[3:], SamplingParams(temperature=0.0, max_tokens=10,
                                                                          ignore_eos=True), use_tqdm=False))
    assert llm.engine.slots.sampling.output_counts is None


def test_warm_second_generate_builds_nothing(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    llm.generate(_prompts(3, seed=7), sp, use_tqdm=False)
    before = llm.engine.num_compilations()
    llm.generate(_prompts(3, seed=8), sp, use_tqdm=False)  # other prompts, the same shapes
    assert llm.engine.num_compilations() == before


def test_random_weights_follow_the_declarations():
    w = random_weights(CFG, quantize=quant_config("int8"))
    assert w["layers"][0]["wq"].values.dtype == np.int8
    assert w["embed"].shape == (V, CFG.d_model)
    assert float(np.asarray(w["layers"][1]["attn_norm"]).min()) == 1.0  # declared "ones"
    with pytest.raises(InvalidRequest, match="w8a8"):
        random_weights(CFG, quantize=quant_config("w8a8"))
