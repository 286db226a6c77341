"""Beam search: width 1 is greedy; width 4 equals a reference that scores every token of the
vocabulary for every beam, from the model's plain forward (no cache, no engine)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.beam import BeamSearchParams
from jaxinfer.errors import InvalidRequest
from jaxinfer.models.registry import model_family
from jaxinfer.sampling import SamplingParams

PROMPTS = ["Hello world", "a b c"]


def test_width_one_is_greedy(tiny_llm):
    out = tiny_llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
    greedy = tiny_llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    for b, g in zip(out, greedy):
        (seq,) = b.sequences
        assert seq.token_ids == g.outputs[0].token_ids and seq.text == g.outputs[0].text


def _reference(llm, prompt_ids, width, steps, length_penalty):
    """Beam search over the whole vocabulary: every beam times every token, the best `width` kept."""
    mod = model_family(llm.cfg.family)
    fwd = jax.jit(lambda w, t: mod.unembed(w, mod.forward(w, t, jnp.zeros(1, jnp.int32), None, cfg=llm.cfg)[0],
                                           llm.cfg))
    beams = [([], 0.0)]
    for _ in range(steps):
        cum = []  # f64[beams, V]: every continuation's cumulative logprob
        for toks, c in beams:
            logits = np.asarray(fwd(llm.weights, jnp.asarray([prompt_ids + toks], jnp.int32)), np.float64)[0, -1]
            cum.append(c + logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum())))
        cum = np.stack(cum)
        n = len(beams[0][0]) + 1
        score = cum / (len(prompt_ids) + n) ** length_penalty  # vLLM's score: the prompt counts in the length
        best = np.argsort(-score, axis=None, kind="stable")[:width]
        beams = [(beams[k // cum.shape[1]][0] + [int(k % cum.shape[1])], float(cum.flat[k])) for k in best]
    return beams


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_width_four_equals_the_whole_vocabulary_reference(tiny_llm, length_penalty):
    out = tiny_llm.beam_search(PROMPTS, BeamSearchParams(beam_width=4, max_tokens=4, ignore_eos=True,
                                                         length_penalty=length_penalty))
    for prompt, got in zip(PROMPTS, out):
        want = _reference(tiny_llm, tiny_llm.tokenizer.encode(prompt), 4, 4, length_penalty)
        assert [s.token_ids for s in got.sequences] == [t for t, _ in want]
        np.testing.assert_allclose([s.cum_logprob for s in got.sequences], [c for _, c in want], rtol=1e-4)
        assert all(s.finish_reason == "length" for s in got.sequences)


def test_eos_ends_a_beam_and_pages_come_back(tiny_llm):
    eos = tiny_llm.tokenizer.eos_ids
    out = tiny_llm.beam_search(["x"], BeamSearchParams(beam_width=3, max_tokens=3))
    for s in out[0].sequences:
        assert (s.finish_reason == "stop") == (s.token_ids[-1] in eos) and len(s.token_ids) <= 3
    assert [s.score for s in out[0].sequences] == sorted((s.score for s in out[0].sequences), reverse=True)
    assert not tiny_llm.engine.has_unfinished() and tiny_llm.engine.num_running() == 0


@pytest.mark.parametrize("kw", [dict(beam_width=0, max_tokens=3), dict(beam_width=11, max_tokens=3),
                                dict(beam_width=2, max_tokens=0), dict(beam_width=2, max_tokens=3, length_penalty=float("nan"))])
def test_bad_params(kw):
    with pytest.raises(InvalidRequest):
        BeamSearchParams(**kw)
