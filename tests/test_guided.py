"""Structured output: llguidance grammars over SmolLM2's real vocabulary, the bitmask, and the
on-device mask.

The decode loops here run on the host over random logits masked by each step's bitmask (with
argmax, a random walk through the grammar), so any token the mask wrongly allowed would show
up as an output outside the language. The schemas and regexes are bounded, so every walk ends.
"""

import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jaxinfer.errors import InvalidRequest
from jaxinfer.guided import GrammarCompiler, GuidedDecoding, allocate_bitmask, apply_token_bitmask
from jaxinfer.openai_schema import parse_body

SEEDS = range(8)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"
CHOICES = ("red", "green", "blue, of course", 'say "hi"')
LARK = 'start: "(" num ("+" num)? ")"\nnum: /[0-9]{1,3}/'


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    from jaxinfer.loaders.gguf import read_metadata
    from jaxinfer.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(read_metadata(smollm2_gguf))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer)


def _walk(compiler, tokenizer, spec, seed, max_steps=200):
    """Greedy decode over random logits under the grammar: the text, and how the walk ended."""
    rng = np.random.default_rng(seed)
    m = compiler.matcher(spec)
    V = compiler.vocab_size
    mask = allocate_bitmask(1, V)
    ids = []
    for _ in range(max_steps):
        m.fill_bitmask(mask[0])
        logits = jnp.asarray(rng.standard_normal((1, V)).astype(np.float32))
        tok = int(jnp.argmax(apply_token_bitmask(logits, jnp.asarray(mask), jnp.array([True]))[0]))
        if tok in tokenizer.eos_ids:
            assert m.is_accepting
            return tokenizer.decode(ids), "eos"
        assert m.accept(tok), m.error
        ids.append(tok)
    raise AssertionError(f"no EOS after {max_steps} steps: {tokenizer.decode(ids)!r}")


@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_outputs_validate(compiler, tokenizer, seed):
    text, _ = _walk(compiler, tokenizer, GuidedDecoding(json=SCHEMA), seed)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("seed", SEEDS)
def test_regex_outputs_match(compiler, tokenizer, seed):
    text, _ = _walk(compiler, tokenizer, GuidedDecoding(regex=REGEX), seed)
    assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize("seed", SEEDS)
def test_choice_outputs_are_a_choice(compiler, tokenizer, seed):
    text, _ = _walk(compiler, tokenizer, GuidedDecoding(choice=CHOICES), seed)
    assert text in CHOICES


@pytest.mark.parametrize("seed", SEEDS[:4])
def test_lark_grammar_outputs_parse(compiler, tokenizer, seed):
    text, _ = _walk(compiler, tokenizer, GuidedDecoding(grammar=LARK), seed)
    assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})?\)", text), text


def test_json_object_accepts_any_compact_object(compiler, tokenizer):
    spec = _guided({"response_format": {"type": "json_object"}})
    m = compiler.matcher(spec)
    assert all(m.accept(t) for t in tokenizer.encode('{"a":[1,2],"b":{"c":null}}', add_special_tokens=False))
    assert m.is_accepting
    m = compiler.matcher(spec)
    assert not m.accept(tokenizer.encode("[", add_special_tokens=False)[0])  # an object, not an array


def test_matcher_refuses_a_token_outside_the_grammar(compiler, tokenizer):
    m = compiler.matcher(GuidedDecoding(choice=("yes", "no")))
    (maybe,) = tokenizer.encode("maybe", add_special_tokens=False)[:1]
    assert not m.accept(maybe)
    assert m.error


@pytest.mark.parametrize("spec", [GuidedDecoding(regex="(["), GuidedDecoding(grammar="start: undefined_rule"),
                                  GuidedDecoding(json='{"type": '), GuidedDecoding(json={"type": "no-such-type"})])
def test_bad_grammars_are_invalid_requests(compiler, spec):
    with pytest.raises(InvalidRequest):
        compiler.check(spec)


def test_spec_takes_exactly_one_constraint():
    with pytest.raises(InvalidRequest):
        GuidedDecoding()
    with pytest.raises(InvalidRequest):
        GuidedDecoding(regex="a", choice=("a",))
    with pytest.raises(InvalidRequest):
        GuidedDecoding(choice=())
    with pytest.raises(InvalidRequest):
        _guided({"guided_regex": "a", "guided_choice": ["a"]})
    assert _guided({"response_format": {"type": "text"}}) is None
    assert _guided({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}) \
        == GuidedDecoding(json=SCHEMA)
    assert _guided({"guided_choice": ["a", "b"]}) == GuidedDecoding(choice=("a", "b"))


def _guided(fields):
    """The constraint a chat request body with these fields asks for."""
    return parse_body("chat", {"messages": [{"role": "user", "content": "hi"}], **fields}).guided


def test_bitmask_by_hand():
    # V = 40: two words; row 0 allows tokens 0, 5 and 33, row 1 has a mask that allows nothing
    # but is switched off, row 2 allows token 39 only
    logits = jnp.arange(3 * 40, dtype=jnp.float32).reshape(3, 40)
    mask = np.zeros((3, 2), np.int32)
    mask[0, 0] = (1 << 0) | (1 << 5)
    mask[0, 1] = 1 << 1
    mask[2, 1] = 1 << 7
    out = np.asarray(apply_token_bitmask(logits, jnp.asarray(mask), jnp.array([True, False, True])))
    assert np.isfinite(out[0]).nonzero()[0].tolist() == [0, 5, 33]
    np.testing.assert_array_equal(out[1], np.asarray(logits[1]))
    assert np.isfinite(out[2]).nonzero()[0].tolist() == [39]
    assert out[0, 5] == 5.0 and out[2, 39] == 119.0


def test_bitmask_matches_llguidance_reference():
    """Against llguidance's own numpy masking, with the sign bit (word bit 31) set."""
    from llguidance.numpy import apply_token_bitmask_inplace

    rng = np.random.default_rng(0)
    B, V = 4, 100
    logits = rng.standard_normal((B, V)).astype(np.float32)
    mask = rng.integers(-(2**31), 2**31, size=(B, 4), dtype=np.int64).astype(np.int32)
    mask[:, 0] |= np.int32(-(2**31))
    want = logits.copy()
    apply_token_bitmask_inplace(want, mask)
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(mask), jnp.ones(B, bool)))
    np.testing.assert_array_equal(got, want)


def test_padded_vocabulary_never_allows_ids_past_the_tokenizer(tokenizer):
    compiler = GrammarCompiler(tokenizer, vocab_size=tokenizer.vocab_size + 64)
    m = compiler.matcher(GuidedDecoding(regex="[a-z]+"))
    mask = allocate_bitmask(1, compiler.vocab_size)
    m.fill_bitmask(mask[0])
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: compiler.vocab_size]
    assert not bits[tokenizer.vocab_size:].any()
    assert bits[: tokenizer.vocab_size].any()


def test_copies_advance_independently(compiler, tokenizer):
    a = compiler.matcher(GuidedDecoding(choice=("yes", "no")))
    b = a.copy()
    assert a.accept(tokenizer.encode("yes", add_special_tokens=False)[0])
    assert b.accept(tokenizer.encode("no", add_special_tokens=False)[0])
    assert a.is_accepting and b.is_accepting


@pytest.mark.parametrize("extra_vocab", [0, 64])
def test_batch_bitmask_equals_row_by_row(tokenizer, extra_vocab):
    from jaxinfer.guided import BatchBitmask

    compiler = GrammarCompiler(tokenizer, vocab_size=tokenizer.vocab_size + extra_vocab)
    specs = [GuidedDecoding(json=SCHEMA), None, GuidedDecoding(regex=REGEX), GuidedDecoding(choice=CHOICES), None]
    matchers = [compiler.matcher(s) if s is not None else None for s in specs]
    assert matchers[0].accept(tokenizer.encode('{"', add_special_tokens=False)[0])  # not all at the start
    batch = BatchBitmask(8, compiler.vocab_size, num_threads=2)
    batch.bitmask[:] = 12345  # stale values from an earlier step
    assert batch.fill(matchers)
    assert batch.has_mask.tolist() == [True, False, True, True, False, False, False, False]
    for b, m in enumerate(matchers):
        if m is not None:
            want = allocate_bitmask(1, compiler.vocab_size)
            m.fill_bitmask(want[0])
            np.testing.assert_array_equal(batch.bitmask[b], want[0])
    assert not batch.fill([None, None])
    assert not batch.has_mask.any()


# ------------------------------------------------------------------ in the engine, through LLM

LLM_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tag"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                             "tag": {"enum": ["a", "bb", "ccc"]}}}


def test_llm_structured_rows_share_the_batch_with_free_rows(tiny_llm):
    from jaxinfer.sampling import SamplingParams

    free = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in tiny_llm.generate(["one", "two"], free, use_tqdm=False)]
    params = [free, free]
    params += [SamplingParams(max_tokens=40, temperature=1.0, seed=s, guided_decoding={"json": LLM_SCHEMA})
               for s in range(6)]
    params += [SamplingParams(max_tokens=10, temperature=1.0, seed=s, n=2, guided_decoding={"choice": ["yes", "no"]})
               for s in range(2)]
    params += [SamplingParams(max_tokens=12, temperature=1.0, seed=s, guided_decoding={"regex": r"[a-c]{2}[0-9]"})
               for s in range(3)]
    outs = tiny_llm.generate(["one", "two"] + ["x"] * (len(params) - 2), params, use_tqdm=False)
    # the unconstrained rows are untouched by their constrained neighbours
    assert [o.outputs[0].token_ids for o in outs[:2]] == alone
    for o in outs[2:8]:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), LLM_SCHEMA)
    for o in outs[8:10]:
        assert [c.text in ("yes", "no") for c in o.outputs] == [True, True]
    for o in outs[10:]:
        assert re.fullmatch(r"[a-c]{2}[0-9]", o.outputs[0].text), o.outputs[0].text


def test_llm_bad_grammar_fails_before_generating(tiny_llm):
    from jaxinfer.sampling import SamplingParams

    with pytest.raises(InvalidRequest, match="regex"):
        tiny_llm.generate(["x"], SamplingParams(guided_decoding={"regex": "(["}), use_tqdm=False)
    with pytest.raises(InvalidRequest, match="guided_decoding"):
        SamplingParams(guided_decoding={"jsn": {}})


def test_steps_without_a_constrained_row_run_without_the_mask(tiny_llm):
    from jaxinfer.sampling import SamplingParams

    eng = tiny_llm.engine
    eng.shapes_run.clear()
    tiny_llm.generate(["one", "two"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert eng.shapes_run and not any("guided" in s for s in eng.shapes_run)
    tiny_llm.generate(["one"], SamplingParams(max_tokens=4, guided_decoding={"choice": ["ab", "cd"]}), use_tqdm=False)
    assert any("guided" in s for s in eng.shapes_run)
