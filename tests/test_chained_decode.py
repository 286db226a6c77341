"""Chained decode steps (``num_scheduler_steps``) give exactly what single steps give.

The oracle is the same requests run with num_scheduler_steps=1: one host round trip per token,
every stop decided by the host's own checker. Against it, chains of up to 8 steps must give the
same tokens, finish reasons and logprobs (within float tolerance), greedy and seeded, with rows
finishing mid-chain by EOS, stop_token_ids and max_tokens, min_tokens and ignore_eos, more
requests than slots, prefix-cache hits, int8 KV pages, a sliding-window family, a short page
pool and tensor parallelism. Rows the host must watch token by token (stop strings, grammars,
streaming) chain nothing, and ``Engine.stats`` says why.

n-gram speculation chains its verification steps instead (drafts looked up on device): the
same tokens and acceptance as blocks the host drafts, greedy (and plain decoding's tokens) and
seeded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import AttentionKind, ModelConfig, RopeConfig
from jaxinfer.loaders.random_weights import random_loaded, word_tokenizer

V = 300
CFG = ModelConfig("llama", vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  d_ff=64, max_position=256, tie_embeddings=False, name="tiny-random")
N = 8  # chained steps
LP_ATOL = 1e-4


def _pair(loaded, **kw):
    """(single steps, chains of N) over the same weights and options."""
    kw = {"max_model_len": 128, "max_num_seqs": 4, "progress": False, **kw}
    return LLM(loaded, num_scheduler_steps=1, **kw), LLM(loaded, num_scheduler_steps=N, **kw)


@pytest.fixture(scope="module")
def loaded():
    # scale 1: logits far apart, so greedy and sampled tokens are not near-ties
    return random_loaded(CFG, scale=1.0, seed=3)


@pytest.fixture(scope="module")
def pair(loaded):
    return _pair(loaded)


def _prompts(n, seed=0, length=12, vocab=V):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab, length)] for _ in range(n)]


def _same(single, chained, prompts, params, **kw):
    """Run both; assert equal tokens, finish reasons and logprobs. Returns the chained outputs
    and the chained engine's counters added by this run."""
    before = dict(chained.engine.stats)
    want = single.generate(prompts, params, use_tqdm=False, **kw)
    got = chained.generate(prompts, params, use_tqdm=False, **kw)
    delta = {k: v - before.get(k, 0) for k, v in chained.engine.stats.items()}
    for i, (a, b) in enumerate(zip(want, got)):
        for ca, cb in zip(a.outputs, b.outputs):
            assert cb.token_ids == ca.token_ids, (i, ca.token_ids, cb.token_ids)
            assert (cb.finish_reason, cb.stop_reason) == (ca.finish_reason, ca.stop_reason), i
            assert (ca.logprobs is None) == (cb.logprobs is None)
            for pa, pb in zip(ca.logprobs or [], cb.logprobs or []):
                assert pa.keys() == pb.keys(), i
                for t in pa:
                    assert abs(pa[t].logprob - pb[t].logprob) <= LP_ATOL and pa[t].rank == pb[t].rank
            if ca.logprobs is not None:
                assert abs(ca.cumulative_logprob - cb.cumulative_logprob) <= LP_ATOL * max(len(ca.token_ids), 1)
    return got, delta


def test_greedy_and_seeded_rows_finishing_mid_chain_equal_single_steps(pair):
    """Ten rows over four slots (arrivals wait for rows that finish mid-chain), greedy and
    seeded, logprobs, penalties, max_tokens that end inside a chain, min_tokens and ignore_eos."""
    prompts = _prompts(10, seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=3) for m in (3, 11, 17)]
    params += [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=13 + s, ignore_eos=True)
               for s in range(3)]
    params += [SamplingParams(temperature=1.0, top_k=20, seed=9, max_tokens=21, logprobs=0),
               SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.4, max_tokens=19),
               SamplingParams(temperature=0.7, seed=4, min_tokens=6, max_tokens=15),
               SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)]
    _, st = _same(*pair, prompts, params)
    assert st["chains"] > 0 and st["chained_steps"] > 2 * st["chains"], st
    assert st["chain_refused_prefill"] > 0  # arrivals' prompts ran as plain steps
    assert st["chain_cut_arrivals"] > 0  # rows waited for a slot: chains ended at a finish


def test_eos_stop_ids_and_min_tokens_mid_chain(loaded):
    """EOS and stop_token_ids end rows inside a chain on device, on the same token as the
    host's checker; before min_tokens they are masked, and ignore_eos samples past EOS."""
    prompts = _prompts(4, seed=2)
    tok = word_tokenizer(V)
    probe = LLM(dataclasses.replace(loaded, tokenizer=tok), max_model_len=128, max_num_seqs=4, progress=False,
                num_scheduler_steps=1)
    free = [o.outputs[0].token_ids for o in probe.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)]
    eos, stop = free[0][6], free[1][4]
    tok.eos_ids = frozenset(tok.eos_ids | {eos})  # an EOS the random model does sample
    single, chained = _pair(dataclasses.replace(loaded, tokenizer=tok))
    params = [SamplingParams(temperature=0.0, max_tokens=24),
              SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop], ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, min_tokens=10),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    got, st = _same(single, chained, prompts, params)
    reasons = [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in got]
    assert reasons[0] == ("stop", None) and len(got[0].outputs[0].token_ids) <= 7, reasons
    assert reasons[1] == ("stop", stop) and len(got[1].outputs[0].token_ids) <= 5, reasons
    assert len(got[2].outputs[0].token_ids) >= 10 and reasons[3] == ("length", None), reasons
    assert st["chains"] > 0, st


@pytest.mark.slow
def test_prefix_cache_hits_and_a_short_page_pool(loaded):
    """Prompts sharing two full pages hit the prefix cache; a pool of few pages makes chains
    shorter (chain_cut_pages) and rows wait or get preempted, with the same tokens."""
    rng = np.random.default_rng(5)
    shared = [int(t) for t in rng.integers(3, V, 32)]
    prompts = [shared + [int(t) for t in rng.integers(3, V, 5)] for _ in range(6)]
    sp = SamplingParams(temperature=0.6, seed=11, max_tokens=30, ignore_eos=True, logprobs=1)
    single, chained = _pair(loaded, block_size=8)
    _same(single, chained, prompts[:1], sp)
    _, st = _same(single, chained, prompts, sp)
    assert st["cached_prompt_tokens"] > 0 and st["chains"] > 0, st
    single, chained = _pair(loaded, block_size=8, num_gpu_blocks_override=24)
    _, st = _same(single, chained, prompts, sp)
    assert st["chain_cut_pages"] > 0 and st["chains"] > 0, st


@pytest.mark.slow
def test_int8_kv_cache(loaded):
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=2) for m in (7, 20)]
    params += [SamplingParams(temperature=0.9, seed=3, max_tokens=18, ignore_eos=True)]
    _, st = _same(*_pair(loaded, kv_cache_dtype="int8"), _prompts(3, seed=6), params)
    assert st["chains"] > 0, st


@pytest.mark.slow
def test_sliding_window_family():
    """Gemma 3 with a 4-token window over 4-token pages: a chain's rows hold window pages
    ahead, and trimming after the chain frees them."""
    L, G = AttentionKind.LOCAL, AttentionKind.GLOBAL
    cfg = ModelConfig(family="gemma3", vocab_size=97, d_model=48, n_layers=4, n_heads=4, n_kv_heads=2,
                      head_dim=8, d_ff=64, norm_eps=1e-6, rope=RopeConfig(theta=1e6),
                      rope_local=RopeConfig(theta=1e4), layer_kinds=(L, G, L, G), sliding_window=4,
                      query_pre_attn_scalar=12.0, max_position=256)
    single, chained = _pair(random_loaded(cfg, scale=1.0, seed=1), block_size=4)
    assert chained.engine.window == 4
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (9, 25)]
    params += [SamplingParams(temperature=0.8, seed=2, max_tokens=22, ignore_eos=True, logprobs=1)] * 3
    _, st = _same(single, chained, _prompts(5, seed=7, length=10, vocab=97), params)
    assert st["chains"] > 0 and st["peak_window_pages"] > 0, st


def test_rows_the_host_must_watch_chain_nothing_and_say_why(pair):
    single, chained = pair
    prompts = _prompts(2, seed=8)
    text = chained.tokenizer.decode(single.generate(prompts[:1], SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids[3:5])
    _, st = _same(single, chained, prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                            stop=[text.strip()]))
    assert st["chains"] == 0 and st["chain_refused_stop_strings"] > 0, st

    before = dict(chained.engine.stats)
    pieces = list(chained.stream({"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)))
    st = {k: v - before[k] for k, v in chained.engine.stats.items()}
    assert pieces and chained.last_stream_output.outputs[0].token_ids == single.generate(
        prompts[:1], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].token_ids
    assert st["chains"] == 0 and st["chain_refused_streaming"] > 0, st

    # one plain row beside one the host watches: no chain for either
    _, st = _same(single, chained, prompts, [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                                             SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                            repetition_detection={"max_period": 2,
                                                                                  "min_repeats": 50})])
    assert st["chains"] == 0 and st["chain_refused_repetition_detection"] > 0, st


def test_grammar_rows_chain_nothing(pair):
    single, chained = pair
    sp = SamplingParams(temperature=0.0, max_tokens=6, guided_decoding={"choice": ["t5 t6 t7", "t8 t9"]})
    _, st = _same(single, chained, _prompts(1, seed=9), sp)
    assert st["chains"] == 0 and st["chain_refused_guided"] > 0, st


@pytest.mark.slow
def test_speculation_switches_chaining_off_and_says_so(loaded):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    single, chained = _pair(loaded, speculative_config=spec)
    prompts = [p * 3 for p in _prompts(2, seed=10, length=5)]  # repeats for the n-gram drafts
    _, st = _same(single, chained, prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert st["chains"] == 0 and st["chain_refused_speculative"] > 0, st


def test_warm_second_generate_builds_nothing(pair):
    _, chained = pair
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    chained.generate(_prompts(3, seed=11), sp, use_tqdm=False)
    before = chained.engine.num_compilations()
    chained.generate(_prompts(3, seed=12), sp, use_tqdm=False)
    assert chained.engine.num_compilations() == before
    assert sum(1 for s in chained.engine.shapes_run if s[-1] == ("chain", N)) >= 1


def test_bad_num_scheduler_steps_is_refused(loaded):
    from jaxinfer.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="num_scheduler_steps"):
        LLM(loaded, max_model_len=64, num_scheduler_steps=0, progress=False)


_TP = r"""
import json, sys
import numpy as np
from jaxinfer import LLM, SamplingParams
from jaxinfer.config import ModelConfig
from jaxinfer.loaders.random_weights import random_loaded
cfg = ModelConfig("llama", vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  d_ff=64, max_position=256, tie_embeddings=False, name="tiny-random")
loaded = random_loaded(cfg, scale=1.0, seed=3)
rng = np.random.default_rng(0)
prompts = [[int(t) for t in rng.integers(3, 300, 12)] for _ in range(5)]
params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=1) for m in (5, 14, 23)]
params += [SamplingParams(temperature=0.8, seed=s, max_tokens=17, ignore_eos=True) for s in (1, 2)]
out = {}
for name, kw in (("one", dict(num_scheduler_steps=1)), ("tp2", dict(num_scheduler_steps=8, tensor_parallel_size=2))):
    llm = LLM(loaded, max_model_len=128, max_num_seqs=4, progress=False, **kw)
    res = llm.generate(prompts, params, use_tqdm=False)
    out[name] = {"tokens": [r.outputs[0].token_ids for r in res],
                 "lp": [r.outputs[0].cumulative_logprob for r in res], "chains": llm.engine.stats["chains"]}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_tensor_parallel_2_chains_equal_one_device():
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    p = subprocess.run([sys.executable, "-c", _TP], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["tp2"]["tokens"] == out["one"]["tokens"]
    assert np.allclose(out["tp2"]["lp"][:3], out["one"]["lp"][:3], atol=1e-3)
    assert out["tp2"]["chains"] > 0


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def ngram_pair(loaded):
    """(plain single steps, n-gram speculation) over the same weights; the random model's
    greedy answers fall into loops, which n-gram drafts then predict."""
    kw = {"max_model_len": 128, "max_num_seqs": 4, "progress": False}
    return LLM(loaded, **kw), LLM(loaded, speculative_config=NGRAM, **kw)


def _ngram_runs(llm, monkeypatch, prompts, params):
    """The speculative engine's outputs and acceptance counters with its verification steps
    chained (n-gram drafts looked up on device) and with every block built by the host."""
    from jaxinfer.engine import drafting

    dispatched = []
    orig = drafting.Drafter.chained_block
    monkeypatch.setattr(drafting.Drafter, "chained_block", lambda self, *a: dispatched.append(1) or orig(self, *a))

    def run(chain: bool):
        monkeypatch.setattr(drafting.Drafter, "chains", lambda self: chain)
        st = llm.engine.spec_stats
        st.__init__(NGRAM["num_speculative_tokens"])
        dispatched.clear()
        outs = llm.generate(prompts, params, use_tqdm=False)
        got = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason,
                o.metrics.spec_drafted_tokens, o.metrics.spec_accepted_tokens) for o in outs]
        return got, (st.drafted, st.accepted, st.by_position, st.drafted_by_position), st.chained_steps, len(dispatched)

    chained, unchained = run(True), run(False)
    assert unchained[2:] == (0, 0)
    assert chained[2] == chained[3] > 0  # the counter says the steps chained
    assert chained[:2] == unchained[:2]  # same tokens, finishes and acceptance, chained or not
    assert chained[1][1] > 0 and chained[1][0] > chained[1][1]  # drafts accepted and rejected
    return chained[0]


def test_ngram_chained_verification_equals_host_built_blocks_and_plain(ngram_pair, monkeypatch):
    """Greedy rows (six over four slots) chain their n-gram verification steps: the same
    tokens as blocks the host drafts and as plain decoding, with max_tokens cutting drafts and
    ending rows inside a block, and a stop token ending one."""
    plain, spec = ngram_pair
    prompts = [p * 3 for p in _prompts(6, seed=10, length=5)]  # repeats for the n-gram drafts
    free = plain.generate(prompts[5:], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (30, 5, 17, 2, 23)]
    params.append(SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[free[13]]))
    want = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in plain.generate(prompts, params, use_tqdm=False)]
    got = _ngram_runs(spec, monkeypatch, prompts, params)
    assert [g[:3] for g in got] == want
    assert want[5][1:] == ("stop", free[13]) and [len(w[0]) for w in want[:5]] == [30, 5, 17, 2, 23]


def test_ngram_chained_verification_seeded_rows(ngram_pair, monkeypatch):
    """Seeded rows (top-p, top-k, min_tokens) draw the same tokens with chained verification
    steps as with host-built ones."""
    _, spec = ngram_pair
    prompts = [p * 3 for p in _prompts(4, seed=12, length=4)]
    params = [SamplingParams(temperature=0.5, top_p=0.9, seed=1, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.2, top_k=5, seed=2, max_tokens=33, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=37, min_tokens=8),
              SamplingParams(temperature=0.5, seed=4, max_tokens=29, ignore_eos=True)]
    _ngram_runs(spec, monkeypatch, prompts, params)


@pytest.mark.slow  # 50 s on 2 cores: the steps with logprobs and with penalties compiled
def test_ngram_chained_verification_logprobs_and_penalties(ngram_pair, monkeypatch):
    _, spec = ngram_pair
    prompts = [p * 3 for p in _prompts(4, seed=10, length=5)]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.2, top_k=5, seed=2, max_tokens=33, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0.4, presence_penalty=0.3, repetition_penalty=1.2, seed=3, max_tokens=30),
              SamplingParams(temperature=0.0, max_tokens=27, ignore_eos=True)]
    _ngram_runs(spec, monkeypatch, prompts, params)
