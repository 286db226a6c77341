"""The engine end to end on a tiny random model with a real tokenizer: batching never changes
a row's tokens, seeds do not depend on batch position, stops and lengths end each row on its
own, logprobs are consistent, and plain and verification steps donate the page pools and
slots."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.slots import slots_with_vocab_state
from jaxinfer.engine.step import StepInputs
from jaxinfer.engine.verify import DraftBlock
from jaxinfer.errors import InvalidRequest

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog and keeps running", "1 2 3",
           "A longer prompt about the history of printing presses in Europe during the fifteenth century", "x"]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_batched_greedy_equals_each_alone(tiny_llm):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    together = _ids(tiny_llm.generate(PROMPTS, sp, use_tqdm=False))
    alone = [_ids(tiny_llm.generate([p], sp, use_tqdm=False))[0] for p in PROMPTS]
    assert together == alone


def test_rows_stop_on_their_own(tiny_llm):
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 3, 7, 12, 5)]
    outs = tiny_llm.generate(PROMPTS, sps, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 3, 7, 12, 5]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    full = _ids(tiny_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False))
    assert [f[: len(o.outputs[0].token_ids)] for f, o in zip(full, outs)] == _ids(outs)


def test_seed_independent_of_batch_position(tiny_llm):
    target = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=10, seed=5, ignore_eos=True)
    alone = _ids(tiny_llm.generate([PROMPTS[1]], target, use_tqdm=False))[0]
    mixed = tiny_llm.generate(PROMPTS[:4] + [PROMPTS[1]], [other] * 4 + [target], use_tqdm=False)
    assert _ids(mixed)[4] == alone
    again = _ids(tiny_llm.generate([PROMPTS[1]], target, use_tqdm=False))[0]
    assert again == alone


def test_n_samples_distinct_and_reproducible(tiny_llm):
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True)
    a = tiny_llm.generate(PROMPTS[0], sp, use_tqdm=False)[0]
    b = tiny_llm.generate(PROMPTS[0], sp, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3


def test_stop_string_spanning_tokens(tiny_llm):
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, skip_special_tokens=False)
    base = tiny_llm.generate(PROMPTS[1], sp, use_tqdm=False)[0].outputs[0]
    text = base.text
    pieces = [tiny_llm.tokenizer.decode(base.token_ids[: k + 1], skip_special_tokens=False) for k in range(len(base.token_ids))]
    # a stop string made of the end of token 3's text and the start of token 4's
    cut = len(pieces[3])
    stop = text[cut - 2 : cut + 2]
    assert len(stop) == 4 and stop in text
    out = tiny_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop], skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    inc = tiny_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True, skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert inc.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids(tiny_llm):
    base = tiny_llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop_tok = base.token_ids[4]
    k = base.token_ids.index(stop_tok)
    out = tiny_llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[: k + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


def test_logprobs_consistent(tiny_llm):
    out = tiny_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6
    total = 0.0
    for tok, pos in zip(out.token_ids, out.logprobs):
        assert tok in pos and pos[tok].rank == 1  # greedy picks the most likely token
        ranks = sorted(lp.rank for lp in pos.values())
        assert ranks == [1, 2, 3]
        lps = [lp.logprob for lp in sorted(pos.values(), key=lambda lp: lp.rank)]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        total += pos[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-5)


def test_bad_requests(tiny_llm):
    with pytest.raises(InvalidRequest, match="empty"):
        tiny_llm.generate([[]], use_tqdm=False)
    with pytest.raises(InvalidRequest, match="max_model_len"):
        tiny_llm.generate([[5] * 600], use_tqdm=False)
    with pytest.raises(InvalidRequest, match="sampling_params"):
        tiny_llm.generate(["a", "b"], [SamplingParams()] * 3, use_tqdm=False)
    with pytest.raises(InvalidRequest, match="n"):
        SamplingParams(n=0)


def test_max_tokens_capped_by_max_model_len(tiny_llm):
    out = tiny_llm.generate([[5] * 500], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 512 - 500 and out.outputs[0].finish_reason == "length"


def test_packed_step_donates_pools_and_slots(tiny_llm):
    eng = tiny_llm.engine  # page pools and per-slot device state donated
    # with the [S, V] penalty statistics, the largest per-slot buffers
    slots_old = slots_with_vocab_state(eng.slots, tiny_llm.cfg.vocab_size, True)
    k_old, v_old = eng.k_pages, eng.v_pages
    old = dataclasses.replace(eng.state, slots=slots_old)
    out = eng._step(tiny_llm.weights, StepInputs(eng.idle_batch(8, 8, 32)), old, cfg=tiny_llm.cfg,
                    num_logprobs=-1, prompt_logprobs=-1, kernels=eng.kernels)
    jax.block_until_ready(out)
    assert all(a.is_deleted() for a in k_old + v_old)  # the page pools were donated
    assert all(a.is_deleted() for a in jax.tree.leaves(slots_old))
    _, state = out
    eng.state = dataclasses.replace(state, slots=slots_with_vocab_state(state.slots, tiny_llm.cfg.vocab_size, False))
    assert not any(a.is_deleted() for a in eng.k_pages + eng.v_pages)


def test_verification_step_donates_pools_slots_and_draft_pools(tiny_gguf):
    from jaxinfer import LLM

    llm = LLM(str(tiny_gguf), progress=False, max_num_seqs=2, kv_cache_memory_bytes=8 << 20,
              speculative_config={"method": "early_exit", "num_speculative_tokens": 2, "num_layers": 1})
    eng = llm.engine  # with the [S, V] penalty statistics, the largest per-slot buffers
    eng.state = dataclasses.replace(eng.state, slots=slots_with_vocab_state(eng.slots, llm.cfg.vocab_size, True))
    k_old, v_old, slots_old = eng.k_pages, eng.v_pages, eng.slots
    out = eng.run_step(eng.idle_batch(2, 8, 0, q=3), drafts=DraftBlock())
    jax.block_until_ready(out)
    assert all(a.is_deleted() for a in k_old + v_old)
    assert slots_old.sampling.output_counts.is_deleted() and slots_old.last_tokens.is_deleted()
    assert not any(a.is_deleted() for a in eng.k_pages + eng.v_pages)


def test_memory_report(tiny_llm):
    r = tiny_llm.memory_report()
    n = sum(np.prod(x.shape) for x in jax.tree.leaves(tiny_llm.weights))
    assert r["weights_bytes"] == 4 * n and r["num_params"] == n
    cfg, alloc = tiny_llm.cfg, tiny_llm.engine.allocator
    # float32 K and V for every layer and kv head, in every page of the pool
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
    assert r["kv_bytes_per_token"] == per_token
    assert r["kv_cache_bytes"] == alloc.num_pages * alloc.page_size * per_token
