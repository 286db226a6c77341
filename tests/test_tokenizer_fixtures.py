"""Tokenizer correctness from committed fixtures: no model fetch, no network, no torch.

``tests/fixtures/tokenizer/`` holds a small byte-level BPE (Llama 3's split regex) in its
Hugging Face form and as GGUF metadata, and the ids transformers gives a set of texts
(digits, contractions, whitespace runs, CRLF, non-Latin scripts, unseen emoji, a special
token inside text). ``tests/fixtures/make_tokenizer_fixtures.py`` made them.
"""

import json
from pathlib import Path

import pytest

from jaxinfer.tokenizer import tokenizer_from_gguf, tokenizer_from_hf_dir

FIXTURES = Path(__file__).parent / "fixtures" / "tokenizer"
EXPECTED = json.loads((FIXTURES / "bpe.expected.json").read_text())["cases"]
SPECIAL_CASES = [c for c in EXPECTED if "<|" in c["text"]]


@pytest.fixture(scope="module", params=["hf_dir", "gguf"])
def tok(request):
    if request.param == "hf_dir":
        return tokenizer_from_hf_dir(FIXTURES / "bpe")
    return tokenizer_from_gguf(json.loads((FIXTURES / "bpe.gguf.json").read_text()))


def test_fixture_covers_what_it_claims():
    assert len(EXPECTED) >= 12 and SPECIAL_CASES
    assert any(len(c["ids"]) < len(c["text"].encode()) // 2 for c in EXPECTED)  # merges are used


@pytest.mark.parametrize("case", EXPECTED, ids=lambda c: repr(c["text"][:24]))
def test_ids_equal_transformers(tok, case):
    assert tok.encode(case["text"], add_special_tokens=False) == case["ids"]


@pytest.mark.parametrize("case", EXPECTED, ids=lambda c: repr(c["text"][:24]))
def test_decode_gives_the_text_back(tok, case):
    assert tok.decode(case["ids"], skip_special_tokens=False) == case["text"]


def test_bos_and_specials(tok):
    bos, eos = 0, 1  # <|begin_of_text|>, <|end_of_text|> were the first special tokens trained
    assert tok.encode("hi", add_special_tokens=True)[0] == bos
    assert eos in tok.eos_ids
    (case,) = SPECIAL_CASES
    assert 2 in case["ids"]  # <|eot_id|> is matched whole inside the text
    assert "<|eot_id|>" not in tok.decode(case["ids"], skip_special_tokens=True)
