"""Repetition detection: the host check against brute force, and rows ended by it in the engine,
the server's metrics and the batch summary."""

import itertools

import pytest

from jaxinfer.errors import InvalidRequest
from jaxinfer.sampling import RepetitionDetection, SamplingParams


def _brute(ids, max_period, min_repeats):
    for p in range(1, max_period + 1):
        n = p * min_repeats
        if n <= len(ids) and all(ids[-n:][i] == ids[-n:][i % p] for i in range(n)):
            return True
    return False


def test_repeating_equals_brute_force():
    for max_period, k in [(1, 2), (3, 2), (4, 3), (2, 4)]:
        rep = RepetitionDetection(max_period, k)
        for n in range(0, 9):
            for ids in itertools.product(range(3), repeat=n):
                assert rep.repeating(list(ids)) == _brute(list(ids), max_period, k), (ids, max_period, k)


def test_bad_settings_are_refused():
    for bad in [{"max_period": 0}, {"min_repeats": 1}, {"period": 3}, {"max_period": True}]:
        with pytest.raises(InvalidRequest, match="repetition_detection"):
            SamplingParams(repetition_detection=bad)


M = 30


def test_engine_ends_a_looping_row_where_brute_force_finds_the_loop(tiny_llm):
    # free rows, and rows a grammar forces into a loop (min_tokens keeps EOS away, and the
    # detector off for those tokens): run without the detector, find where
    # brute force sees a loop, then check the detector ends each row exactly there
    prompts = ["The cat", "One two three", "hello", "x"]
    kw = [dict(), dict(), dict(guided_decoding={"regex": "(ab|cd)+"}, min_tokens=M),
          dict(guided_decoding={"regex": "(xyz)+"}, min_tokens=M)]
    outs = tiny_llm.generate(prompts, [SamplingParams(max_tokens=120, temperature=0, **k) for k in kw], use_tqdm=False)
    rep = {"max_period": 8, "min_repeats": 3}
    det = tiny_llm.generate(prompts, [SamplingParams(max_tokens=120, temperature=0, repetition_detection=rep, **k)
                                      for k in kw], use_tqdm=False)
    looped = 0
    for o, d in zip(outs, det):
        ids = o.outputs[0].token_ids
        skip = M if d.prompt in prompts[2:] else 0
        end = next((i for i in range(skip + 1, len(ids) + 1) if _brute(ids[:i], 8, 3)), None)
        if end is None:
            assert d.outputs[0].finish_reason == o.outputs[0].finish_reason and d.outputs[0].token_ids == ids
        else:
            looped += 1
            assert d.outputs[0].finish_reason == "repetition" and d.outputs[0].token_ids == ids[:end]
    assert looped, "no prompt looped: pick prompts that do"
