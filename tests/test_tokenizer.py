"""Tokenizer tests: our GGUF tokenizers against transformers' own reading of the same files.

The independent reference is transformers, which builds a tokenizer from GGUF metadata with its
own code (``integrations/gguf``): we compare ids, decoded text and rendered chat templates. One
deliberate difference, documented in ``jaxinfer.tokenizer``: for SmolLM2 transformers leaves out
the Digits pre-tokenizer that SmolLM2's tokenizer.json and llama.cpp apply, so the reference gets
that step put back before comparing, and a separate test pins the ids it changes.

Tests without transformers check round trips, the incremental detokenizer, BOS rules and the
Hugging Face directory loaders against the GGUF tokenizers.
"""

import copy
import json
import random

import pytest

from jaxinfer.errors import CheckpointError, InvalidRequest
from jaxinfer.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    tokenizer_from_gguf,
    tokenizer_from_hf_dir,
)
from tests.conftest import require

CORPUS = [
    "",
    " ",
    "Hello, world!",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "multiple    inner     spaces",
    "tab\tseparated\tvalues\t",
    "line one\nline two\r\nline three",
    "\n",
    "\n\n\n",
    "paragraph\n\n\nnext",
    "emoji 😀 and 🧪, flags 🏳️‍🌈 and skin tones 👍🏽",
    "日本語のテキスト、中文字符和한국어",
    "Café naïve résumé façade Ångström",
    "combining e\u0301 and zero\u200bwidth and nbsp\xa0here",
    "numbers 12345 and 3.14159 and 1,000,000",
    "\n\n1. first\n2. second",
    "a  1 b   22",
    "def foo(x):\n    return x ** 2  # square\n\n\tpass",
    'print("hello")  ;  {"key": [1, 2, 3]}',
    "rare unicode: 𝄞 𐍈 \U000e0041 ꙮ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after a literal bos",
    "html <table><tr><td>cell</td></tr></table> <h1>Title</h1>",
    "x" + " " * 32 + "y" + " " * 33 + "z" + " " * 100,
    "tabs" + "\t" * 40 + "newlines" + "\n" * 40,
    "literal \u2581 and \u2581\u2581 markers",
    "I'm sure they'll say it's fine, don't you think?",
    "MiXeD CaSe And ALLCAPS",
    "url https://example.com/path?q=1&r=2#frag",
]


def _gguf_metadata(path) -> dict:
    """GGUF metadata as plain Python values (str, numbers, lists), as the loader returns it.

    The loader's own parser is used when present (GGUFReader needs ~15 s for Gemma's 262144
    tokens); GGUFReader is the fallback, its string arrays decoded straight from the parts.
    """
    try:
        from jaxinfer.loaders.gguf import read_metadata
    except ImportError:
        pass
    else:
        return read_metadata(path)
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(path)
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            if field.types[1] == gguf.GGUFValueType.STRING:
                out[name] = [bytes(field.parts[i]).decode() for i in field.data]
            else:
                out[name] = np.concatenate([field.parts[i] for i in field.data]).tolist()
        elif kind == gguf.GGUFValueType.STRING:
            out[name] = bytes(field.parts[field.data[0]]).decode()
        else:
            out[name] = field.parts[field.data[0]].tolist()[0]
    return out


@pytest.fixture(scope="module")
def smollm2_meta(smollm2_gguf):
    return _gguf_metadata(smollm2_gguf)


@pytest.fixture(scope="module")
def gemma3_meta(gemma3_gguf):
    return _gguf_metadata(gemma3_gguf)


@pytest.fixture(scope="module")
def smollm2(smollm2_meta):
    return tokenizer_from_gguf(smollm2_meta)


@pytest.fixture(scope="module")
def gemma3(gemma3_meta):
    return tokenizer_from_gguf(gemma3_meta)


@pytest.fixture(scope="module")
def transformers_module():
    return require("transformers")


@pytest.fixture(scope="module")
def hf_smollm2_raw(transformers_module, smollm2_gguf):
    # The class AutoTokenizer picks for this file, called directly: AutoTokenizer would also
    # parse the whole GGUF for a config the tokenizer does not need.
    return transformers_module.TokenizersBackend.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name
    )


@pytest.fixture(scope="module")
def hf_smollm2(hf_smollm2_raw):
    """transformers' SmolLM2 tokenizer with the Digits step of SmolLM2's tokenizer.json restored."""
    from tokenizers import pre_tokenizers as pt

    ref = copy.deepcopy(hf_smollm2_raw)
    ref.backend_tokenizer.pre_tokenizer = pt.Sequence(
        [pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    return ref


@pytest.fixture(scope="module")
def hf_gemma3(transformers_module, gemma3_gguf):
    # Again AutoTokenizer's pick for this file (same backend, without the 20 s config parse).
    return transformers_module.GemmaTokenizer.from_pretrained(
        gemma3_gguf.parent, gguf_file=gemma3_gguf.name
    )


def _both(request, name):
    """Our tokenizer and transformers' for the model ``name``."""
    return request.getfixturevalue(name), request.getfixturevalue(f"hf_{name}")


def _random_texts(tok: Tokenizer, n: int, seed: int) -> list[str]:
    """Random text from vocabulary pieces, odd characters, special-token text and space runs."""
    rng = random.Random(seed)
    pieces = [tok.decode([i]) for i in rng.sample(range(tok.vocab_size), 3000)]
    odd = list("abcXYZ019 ,.;:!?'\"()[]{}<>-_=+*/\\|\n\t\r") + list(
        "éüñß日本한😀🧪\u0300\u200b\xa0▁"
    )
    specials = ["<|im_start|>", "<|im_end|>", "<bos>", "<start_of_turn>", "<h1>", "</td>", "\n\n"]
    texts = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 14)):
            r = rng.random()
            if r < 0.45:
                parts.append(rng.choice(pieces))
            elif r < 0.8:
                parts.append("".join(rng.choices(odd, k=rng.randint(1, 5))))
            elif r < 0.9:
                parts.append(rng.choice(specials))
            else:
                parts.append(" " * rng.randint(1, 70))
        texts.append("".join(parts))
    return texts


# ---------------------------------------------------------------------------------------------
# Ids against transformers.


@pytest.mark.reference
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_encode_matches_transformers(request, name):
    ours, ref = _both(request, name)
    for text in CORPUS:
        # HF's default call adds its special tokens, so this checks the BOS rule too.
        assert ours.encode(text) == ref.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False
        ), text


@pytest.mark.reference
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_random_text_matches_transformers(request, name):
    ours, ref = _both(request, name)
    texts = _random_texts(ours, 1500, seed=1)
    want = ref(texts, add_special_tokens=False)["input_ids"]
    for text, w in zip(texts, want):
        assert ours.encode(text, add_special_tokens=False) == w, text


@pytest.mark.reference
def test_gemma3_space_runs_match_transformers(gemma3, hf_gemma3):
    # SentencePiece would take the longest space token (31 spaces); transformers' BPE merges
    # prefer 16 + 16 for 32. We follow transformers at every length.
    for n in range(1, 260):
        for text in (" " * n, "a" + " " * n + "b", "<h1>" + " " * n):
            assert gemma3.encode(text) == hf_gemma3.encode(text), n


# Gemma's control tokens (<pad> <eos> <bos> <unk> <mask> <start_of_turn> <end_of_turn>,
# <unused0..6241>), user-defined ones ([multimodal], <start_of_image>, newline and space runs)
# and text that only looks like them.
GEMMA3_SPECIAL_TEXT = [
    "<pad><eos><bos><unk><mask>",
    "<bos>",
    " <bos>",
    "<bos> ",
    "<bos><bos>twice",
    "<eos>after eos",
    "<unused0> and <unused6241>, <unused99>x",
    "[multimodal] <start_of_image><end_of_image>",
    "text<end_of_turn>\n<start_of_turn>model\nanswer<end_of_turn><eos>",
    "<start_of_tur",
    "<<start_of_turn>>",
    "< start_of_turn >",
    "<START_OF_TURN>",
    "<0x41><0xF0><0x9F> byte pieces spelled out",
    "<unused>, <unused-1>, <unused62420>",
    "\n\n\n<end_of_turn>\n\n",
    "  <mask>  ",
]


@pytest.mark.reference
def test_gemma3_special_token_text_matches_transformers(gemma3, hf_gemma3):
    for text in GEMMA3_SPECIAL_TEXT:
        for add in (True, False):
            ids = gemma3.encode(text, add_special_tokens=add)
            assert ids == hf_gemma3.encode(text, add_special_tokens=add), (text, add)
        for skip in (True, False):
            assert gemma3.decode(ids, skip_special_tokens=skip) == hf_gemma3.decode(
                ids, skip_special_tokens=skip
            ), (text, skip)
        assert gemma3.decode(ids, skip_special_tokens=False) == text
    # Each marker is one id, wherever it appears; the text spelling of a byte piece is not.
    for piece, i in [("<start_of_turn>", 105), ("<end_of_turn>", 106), ("<mask>", 4),
                     ("<unused0>", 6), ("[multimodal]", 5), ("<start_of_image>", 255999)]:
        assert gemma3.encode(f"a{piece}b", add_special_tokens=False)[1:2] == [i], piece
    assert len(gemma3.encode("<0x41>", add_special_tokens=False)) > 1


def test_smollm2_digits_split_like_its_tokenizer_json(smollm2):
    # SmolLM2's tokenizer.json pre-tokenizes with Digits(individual_digits=True) before
    # ByteLevel, and llama.cpp's "smollm" pre does the same; transformers' GGUF conversion
    # (5.x) skips it and would give ["Ċ", "Ċ", "1"] and ["a", "Ġ", "Ġ1"]-style splits here.
    def pieces(text):
        return [smollm2.id_to_piece(i) for i in smollm2.encode(text)]

    assert pieces("\n\n1") == ["ĊĊ", "1"]
    assert pieces("a  1") == ["a", "ĠĠ", "1"]
    assert pieces("12345") == ["1", "2", "3", "4", "5"]
    assert pieces(" 3.14") == ["Ġ", "3", ".", "1", "4"]


# ---------------------------------------------------------------------------------------------
# Decoding.


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_decode_round_trips(request, name):
    tok = request.getfixturevalue(name)
    for text in CORPUS + _random_texts(tok, 300, seed=2):
        ids = tok.encode(text, add_special_tokens=False)
        # SentencePiece writes spaces as "▁", so a literal "▁" comes back as a space (in
        # transformers and sentencepiece alike).
        expected = text.replace("\u2581", " ") if name == "gemma3" else text
        assert tok.decode(ids, skip_special_tokens=False) == expected
    # With BOS prepended, skipping special tokens drops exactly the BOS.
    for text in ("plain text", " spaced  out ", "😀"):
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.reference
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_decode_matches_transformers(request, name):
    ours, ref = _both(request, name)
    rng = random.Random(3)
    for _ in range(300):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(0, 40))]
        for skip in (True, False):
            got = ours.decode(ids, skip_special_tokens=skip)
            want = ref.decode(ids, skip_special_tokens=skip)
            if "\ufffd" in want and name == "gemma3":
                # Invalid byte-fallback runs: transformers' ByteFallback replaces the whole run,
                # one U+FFFD per byte; we replace each maximal invalid subsequence, the rule
                # the streaming detokenizer can follow without waiting for the run to end.
                assert "\ufffd" in got
            else:
                assert got == want, ids
    for text in CORPUS:
        ids = ours.encode(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_gemma3_byte_fallback_decode(gemma3):
    # 😀 is F0 9F 98 80; Gemma spells bytes as <0xNN> pieces, all among its first 1000 ids.
    byte_token = {gemma3.id_to_piece(i): i for i in range(1000)}
    emoji = [byte_token[f"<0x{b:02X}>"] for b in "😀".encode()]
    assert gemma3.decode(emoji) == "😀"
    assert gemma3.decode(emoji[:2]) == "\ufffd"  # truncated: one maximal invalid subsequence
    detok = gemma3.detokenizer()
    assert [detok.add(i) for i in emoji] == ["", "", "", "😀"]
    assert detok.flush() == ""


def _stream(tok: Tokenizer, ids, skip: bool) -> list[str]:
    detok = tok.detokenizer(skip_special_tokens=skip)
    assert isinstance(detok, IncrementalDetokenizer)
    return [detok.add(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_incremental_detokenizer_equals_decode(request, name):
    tok = request.getfixturevalue(name)
    rng = random.Random(4)
    # Tokens of multi-byte text: their bytes split characters across tokens.
    multibyte = sorted(set(tok.encode("😀🧪👍🏽🏳️‍🌈 日本語の中文字符 한국어 𝄞𐍈ꙮ Ångström" * 3)))
    sequences = []
    for _ in range(40):
        n = rng.randint(1, 400)
        mix = rng.random()
        sequences.append(
            [
                rng.choice(multibyte) if rng.random() < mix else rng.randrange(tok.vocab_size)
                for _ in range(n)
            ]
        )
    sequences += [tok.encode(t) for t in CORPUS + _random_texts(tok, 50, seed=5)]
    for ids in sequences:
        for skip in (True, False):
            deltas = _stream(tok, ids, skip)
            full = tok.decode(ids, skip_special_tokens=skip)
            assert "".join(deltas) == full
            if "\ufffd" not in full:
                assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_holds_back_split_characters(smollm2):
    # Byte-level BPE: "日" is E6 97 A5, and SmolLM2 has no token for the whole character.
    ids = smollm2.encode("日本語")
    assert len(ids) > 3
    deltas = _stream(smollm2, ids, True)
    assert "".join(deltas) == "日本語"
    assert "" in deltas and all("\ufffd" not in d for d in deltas)
    # A stream cut inside a character ends in U+FFFD at flush, as decode does.
    lead_byte = next(i for i in range(smollm2.vocab_size) if smollm2.id_to_piece(i) == "æ")
    assert smollm2.decode([lead_byte]) == "\ufffd"
    assert _stream(smollm2, [lead_byte], True) == ["", "\ufffd"]


def test_space_prefix_sentencepiece(gemma3_meta):
    """llama.cpp's add_space_prefix (Llama 2 style): a space before the text and after each
    special token, dropped again when decoding."""
    tok = tokenizer_from_gguf({**gemma3_meta, "tokenizer.ggml.add_space_prefix": True})
    ids = tok.encode("Hello world<start_of_turn>user", add_special_tokens=False)
    assert [tok.id_to_piece(i) for i in ids] == ["▁Hello", "▁world", "<start_of_turn>", "▁user"]
    assert tok.decode(ids) == "Hello world user"
    assert tok.decode(tok.encode(" two")) == " two"
    for text in CORPUS:
        ids = tok.encode(text)
        assert "".join(_stream(tok, ids, True)) == tok.decode(ids)


# ---------------------------------------------------------------------------------------------
# Special tokens and BOS.


def test_smollm2_special_tokens(smollm2):
    assert smollm2.vocab_size == 49152
    assert smollm2.bos_id == 1 and smollm2.add_bos is False
    assert smollm2.eos_ids == {2}  # <|im_end|>: SmolLM2-Instruct's generation EOS
    assert smollm2.pad_id == 2
    assert smollm2.encode("hi") == smollm2.encode("hi", add_special_tokens=False)
    assert smollm2.encode("<|im_start|>user") == [1, smollm2.encode("user")[0]]
    assert smollm2.is_special(1) and smollm2.is_special(0) and not smollm2.is_special(28120)
    assert smollm2.decode([1, 28120, 2]) == "hello"
    assert smollm2.decode([1, 28120, 2], skip_special_tokens=False) == "<|im_start|>hello<|im_end|>"
    assert smollm2.chat_template is not None


def test_gemma3_special_tokens(gemma3):
    assert gemma3.vocab_size == 262144
    assert gemma3.bos_id == 2 and gemma3.add_bos is True
    assert gemma3.eos_ids == {1, 106}  # <eos>, <end_of_turn>
    assert gemma3.pad_id == 0
    assert gemma3.encode("") == [2]
    assert gemma3.encode("hello")[0] == 2
    assert gemma3.encode("hello", add_special_tokens=False)[0] != 2
    assert gemma3.encode("<start_of_turn>user", add_special_tokens=False)[0] == 105
    assert gemma3.is_special(105) and not gemma3.is_special(107)  # 107 is "\n", user-defined
    assert gemma3.id_to_piece(106) == "<end_of_turn>"
    assert gemma3.chat_template is None  # the base model's GGUF carries none
    with pytest.raises(InvalidRequest, match="no chat template"):
        gemma3.apply_chat_template([{"role": "user", "content": "hi"}])


def test_bad_ids_and_metadata(smollm2, smollm2_meta):
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        smollm2.decode([5, smollm2.vocab_size])
    with pytest.raises(InvalidRequest):
        smollm2.detokenizer().add(-1)
    with pytest.raises(CheckpointError, match="pre"):
        tokenizer_from_gguf({**smollm2_meta, "tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(CheckpointError, match="not supported"):
        tokenizer_from_gguf({**smollm2_meta, "tokenizer.ggml.model": "bert"})
    with pytest.raises(CheckpointError, match="no tokenizer"):
        tokenizer_from_gguf({"general.architecture": "llama"})


# ---------------------------------------------------------------------------------------------
# Chat templates.

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Tell me a joke about 日本 😀"},
    ],
]

# A Gemma-style template exercising HF's conventions: bos_token, raise_exception, trim_blocks
# and lstrip_blocks (indented non-dash tags), loop controls and tojson on non-ASCII text.
GEMMA_STYLE_TEMPLATE = """{{ bos_token }}
{% if messages[0]['role'] == 'system' %}
    {% set prefix = messages[0]['content'] + '\n\n' %}
    {% set loop_messages = messages[1:] %}
{% else %}
    {% set prefix = '' %}
    {% set loop_messages = messages %}
{% endif %}
{% for message in loop_messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant') }}
    {% endif %}
    {% if message['content'] == 'STOP' %}{% break %}{% endif %}
{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' }}
{{ (prefix if loop.first else '') + message['content'] | trim }}<end_of_turn>
{% endfor %}
{% if meta is defined %}{{ meta | tojson }}
{% endif %}
{% if add_generation_prompt %}<start_of_turn>model
{% endif %}"""


@pytest.mark.reference
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_matches_transformers(smollm2, hf_smollm2, add_generation_prompt):
    for messages in CONVERSATIONS:
        want = hf_smollm2.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        got = smollm2.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert got == want
        # The rendered prompt's markers become single special tokens.
        assert smollm2.encode(got) == hf_smollm2.encode(got, add_special_tokens=False)
    assert "You are a helpful AI assistant named SmolLM" in smollm2.apply_chat_template(
        CONVERSATIONS[0]
    )


@pytest.mark.reference
def test_chat_template_conventions_match_transformers(gemma3, hf_gemma3):
    ours = copy.copy(gemma3)
    ours.chat_template = GEMMA_STYLE_TEMPLATE
    stop = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "STOP"}]
    for messages in CONVERSATIONS + [stop]:
        for extra in ({}, {"meta": {"lang": "日本語", "n": [1, 2]}}):
            want = hf_gemma3.apply_chat_template(
                messages,
                chat_template=GEMMA_STYLE_TEMPLATE,
                tokenize=False,
                add_generation_prompt=True,
                **extra,
            )
            assert ours.apply_chat_template(messages, **extra) == want
    bad = [{"role": "assistant", "content": "I speak first"}]
    with pytest.raises(InvalidRequest, match="must alternate"):
        ours.apply_chat_template(bad)


# ---------------------------------------------------------------------------------------------
# Hugging Face directories.


@pytest.mark.reference
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_hf_dir_tokenizer_json_matches_transformers(request, tmp_path, name):
    ours_gguf = request.getfixturevalue(name)
    # The file transformers writes is its own GGUF conversion (for SmolLM2 without the Digits
    # step), and a tokenizer.json is run as written, so the unpatched tokenizer is the reference.
    ref = request.getfixturevalue({"smollm2": "hf_smollm2_raw", "gemma3": "hf_gemma3"}[name])
    ref.save_pretrained(tmp_path)
    ours = tokenizer_from_hf_dir(tmp_path)
    assert ours.vocab_size == ours_gguf.vocab_size
    assert (ours.bos_id, ours.add_bos, ours.eos_ids) == (
        ours_gguf.bos_id,
        ours_gguf.add_bos,
        ours_gguf.eos_ids,
    )
    assert ours.chat_template == ours_gguf.chat_template
    for text in CORPUS:
        ids = ref.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids)


def test_hf_dir_sentencepiece_model(tmp_path, gemma3, gemma3_meta):
    """A tokenizer.model written the way SentencePiece stores Gemma's vocabulary (spaces as
    "▁", <unk> as UNKNOWN) loads into the same tokenizer as the GGUF."""
    from sentencepiece import sentencepiece_model_pb2 as spm_pb2

    proto = spm_pb2.ModelProto()
    proto.trainer_spec.model_type = spm_pb2.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    tokens = gemma3_meta["tokenizer.ggml.tokens"]
    types = gemma3_meta["tokenizer.ggml.token_type"]
    for i, (token, score, kind) in enumerate(
        zip(tokens, gemma3_meta["tokenizer.ggml.scores"], types)
    ):
        piece = proto.pieces.add()
        piece.piece = token.replace(" ", "\u2581")
        piece.score = score
        piece.type = 2 if i == 3 else kind
    (tmp_path / "tokenizer.model").write_bytes(proto.SerializeToString())
    config = {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "add_bos_token": True,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    ours = tokenizer_from_hf_dir(tmp_path)
    assert (ours.bos_id, ours.eos_ids, ours.pad_id, ours.add_bos) == (2, {1, 106}, 0, True)
    for text in CORPUS + _random_texts(gemma3, 200, seed=6):
        ids = gemma3.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == gemma3.decode(
            ids, skip_special_tokens=False
        )


def test_hf_dir_without_tokenizer(tmp_path):
    with pytest.raises(CheckpointError, match="neither"):
        tokenizer_from_hf_dir(tmp_path)


# ---------------------------------------------------------------------------------------------
# The other byte-level pre-tokenizers a GGUF can name, on a tiny vocabulary.


def _tiny_byte_level(pre: str) -> dict:
    from jaxinfer.tokenizer import _byte_alphabet

    letters = list(_byte_alphabet().values())
    merges = ["Ġ t", "h e", "Ġt he", "1 2", "Ġ Ġ", "Ċ Ċ", "i n", "Ġ in"]
    tokens = ["<|endoftext|>", *letters, *(m.replace(" ", "") for m in merges)]
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": 0,
    }


@pytest.mark.reference
@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "llama3", "qwen2", "deepseek-r1-qwen"])
def test_byte_level_pre_tokenizers_match_transformers(transformers_module, pre):
    from transformers.integrations.gguf import convert_gguf_tokenizer

    meta = _tiny_byte_level(pre)
    ours = tokenizer_from_gguf(meta)
    tokenizer_dict = {
        "tokenizer_type": "gpt2",
        "pre_tokenizer_type": pre,
        "tokens": meta["tokenizer.ggml.tokens"],
        "token_type": meta["tokenizer.ggml.token_type"],
        "merges": meta["tokenizer.ggml.merges"],
        "eos_token_id": 0,
    }
    ref, _ = convert_gguf_tokenizer("llama", tokenizer_dict)
    texts = CORPUS + ["the 123 in  12<|endoftext|>", "I'M HERE, You'Re there's", "a\n\n b\r\n 7"]
    for text in texts:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids, (pre, text)
