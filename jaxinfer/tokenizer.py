"""Tokenizers built from a checkpoint's own metadata: GGUF vocabularies and Hugging Face dirs.

One ``Tokenizer`` class serves every model. The goal is the exact ids transformers produces for
the same checkpoint (the ids the model was trained on), and the tests hold us to it.

Text goes in through one of two backends:

* byte-level BPE (GGUF ``tokenizer.ggml.model == "gpt2"``, and any ``tokenizer.json``) runs on
  the ``tokenizers`` library. A GGUF stores the vocabulary and merges but names its
  pre-tokenizer only (``tokenizer.ggml.pre``), so the split is looked up in a table here.
* SentencePiece vocabularies (GGUF ``"llama"``, ``tokenizer.model``) run on ``sentencepiece``,
  from a ModelProto rebuilt out of the GGUF's tokens, scores and types. Control and
  user-defined tokens are cut out of the text first, as transformers does with its added
  tokens, and runs of spaces follow transformers' BPE rather than SentencePiece's longest match
  (see ``_bpe_space_run``).

Ids come back out through one table holding the bytes of every token, so ``decode`` and the
streaming ``IncrementalDetokenizer`` share one definition and cannot drift apart: a token's
bytes are its byte-level spelling undone, or its SentencePiece piece with ``▁`` as a space and
``<0xNN>`` as the byte NN. Invalid UTF-8 becomes one U+FFFD per maximal invalid subsequence (the
rule of Python's ``errors="replace"`` and Rust's ``from_utf8_lossy``, hence of byte-level
decoding in transformers). transformers' SentencePiece decoder instead turns a whole run of
byte tokens into one U+FFFD per byte once any of it is invalid; we keep the per-subsequence rule
there too, so a stream never has to wait for a run of byte tokens to end.
"""

from __future__ import annotations

import codecs
import functools
import heapq
import json
import re
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

from jaxinfer.errors import CheckpointError, InvalidRequest

# Token types, numbered alike by llama.cpp (GGUF tokenizer.ggml.token_type) and SentencePiece.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_SPM_SPACE = "\u2581"  # SentencePiece's visible space, "▁"

# Control tokens that close a chat turn. Generation stops on them as on EOS: transformers'
# generation_config lists them beside EOS (Gemma 3: <eos> and <end_of_turn>), and llama.cpp
# counts them as end-of-generation. <|endoftext|> is deliberately absent: in ChatML models
# such as SmolLM2 it separates documents and HF generation does not stop on it.
_END_OF_TURN = frozenset({"<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>"})


# ---------------------------------------------------------------------------------------------
# Byte-level BPE: GPT-2's printable alphabet and the pre-tokenizers a GGUF can name.


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


# Regexes of the tokenizer.json files these vocabularies come from (the Split pre-tokenizer).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PRE = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
# GPT-2's own regex, which ByteLevel(use_regex=True) applies by itself.
_GPT2_PRE = frozenset({"gpt2", "gpt-2"})
# The StarCoder family (SmolLM included): every digit on its own, then GPT-2's regex. Their
# tokenizer.json reads Sequence[Digits(individual_digits=True), ByteLevel], and llama.cpp runs
# "\p{N}" before the GPT-2 regex for these names. transformers' GGUF converter (5.x) leaves the
# Digits step out, which changes ids wherever whitespace precedes a digit ("\n\n1", "a  1").
_DIGITS_PRE = frozenset({"smollm", "starcoder", "refact", "codeshell"})


def _byte_level_pre_tokenizer(pre: str):
    from tokenizers import Regex
    from tokenizers import pre_tokenizers as pt

    if pre in _GPT2_PRE:
        return pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_PRE:
        return pt.Sequence(
            [
                pt.Digits(individual_digits=True),
                pt.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _SPLIT_PRE:
        return pt.Sequence(
            [
                pt.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated", invert=False),
                pt.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    known = sorted(_GPT2_PRE | _DIGITS_PRE | _SPLIT_PRE.keys())
    # llama.cpp refuses unknown names too: a wrong split gives plausible but wrong ids.
    raise CheckpointError(f"GGUF tokenizer.ggml.pre={pre!r} is not supported (known: {known})")


def _byte_level_bytes(token: str) -> bytes:
    """A byte-level token's bytes, undoing GPT-2's alphabet as tokenizers' ByteLevel decoder does.

    A token with any character outside the alphabet (an added token spelled in plain text) is
    taken as its own UTF-8, again like the ByteLevel decoder.
    """
    inverse = _inverse_byte_alphabet()
    try:
        return bytes(inverse[c] for c in token)
    except KeyError:
        return token.encode()


@functools.cache
def _inverse_byte_alphabet() -> dict[str, int]:
    return {c: b for b, c in _byte_alphabet().items()}


def _byte_level_backend(tokens: list[str], types: list[int], merges: list[str], pre: str):
    """A ``tokenizers.Tokenizer`` for a GGUF byte-level vocabulary, and its bytes table."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers.models import BPE

    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    vocab = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        # A normal token outside the alphabet is stored in plain text; BPE works on the
        # alphabet's spelling of its bytes. Control and user-defined tokens are matched whole
        # in the raw text, so they keep their own spelling.
        if kind not in (CONTROL, USER_DEFINED) and not set(token) <= letters:
            token = "".join(alphabet[b] for b in token.encode())
        vocab[token] = i
    pairs = [tuple(m.split(" ")) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise CheckpointError("GGUF tokenizer.ggml.merges has an entry that is not 'left right'")
    backend = BackendTokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    _add_atomic_tokens(backend, tokens, types)
    table = [_byte_level_bytes(t) for t in tokens]
    return (lambda text: backend.encode(text, add_special_tokens=False).ids), table


def _add_atomic_tokens(backend, tokens: list[str], types: list[int]) -> None:
    """Control tokens become special added tokens and user-defined ones plain added tokens,
    both matched whole in the raw text, as transformers' GGUF converter and llama.cpp do."""
    from tokenizers import AddedToken

    control = [t for t, k in zip(tokens, types) if k == CONTROL and t]
    user = [t for t, k in zip(tokens, types) if k == USER_DEFINED and t]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


# ---------------------------------------------------------------------------------------------
# SentencePiece.


def _literal_pattern(strings: Iterable[str]) -> re.Pattern:
    """A regex matching any of ``strings``, longest first at each position.

    Built as a trie so a search costs the length of the match, not the number of strings
    (Gemma has 6 k control tokens); with ``search`` this is leftmost-longest, the matching
    transformers' added tokens use.
    """
    trie: dict = {}
    for s in strings:
        node = trie
        for ch in s:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict) -> str:
        branches = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        # A string may end here; the greedy "?" still prefers the longer strings below.
        return f"(?:{body})?" if "" in node else body

    return re.compile(build(trie) or r"(?!)", re.DOTALL)


def _is_space_run(token: str) -> bool:
    return bool(token) and set(token) <= {" ", _SPM_SPACE}


def _bpe_space_run(n: int, run_ids: dict[int, int]) -> list[int]:
    """Lengths of the tokens transformers' BPE cuts a run of ``n`` spaces into.

    Gemma's vocabulary has one user-defined token for each run of 2..31 spaces. SentencePiece
    (and llama.cpp) take the longest that fits, but transformers' Gemma tokenizer gives them BPE
    merges, ranked by token id and then by longer left part, so 32 spaces come out as 16 + 16
    instead of 31 + 1. This replays those merges over the run: a priority queue of adjacent
    pairs, lowest rank first, leftmost on ties, like tokenizers' BPE.
    """
    length = [1] * n
    nxt = list(range(1, n + 1))
    prev = list(range(-1, n - 1))
    alive = [True] * n

    def rank(a: int, b: int):
        merged = run_ids.get(length[a] + length[b])
        return None if merged is None else (merged, -length[a])

    heap = [(r, i) for i in range(n - 1) if (r := rank(i, i + 1)) is not None]
    heapq.heapify(heap)
    while heap:
        r, i = heapq.heappop(heap)
        j = nxt[i] if alive[i] else n
        if j >= n or rank(i, j) != r:
            continue  # stale: one side was merged since this pair was queued
        length[i] += length[j]
        alive[j] = False
        nxt[i] = nxt[j]
        if nxt[i] < n:
            prev[nxt[i]] = i
        for a in (prev[i], i):
            if a >= 0 and nxt[a] < n and (r2 := rank(a, nxt[a])) is not None:
                heapq.heappush(heap, (r2, a))
    out, i = [], 0
    while i < n:
        out.append(length[i])
        i = nxt[i]
    return out


def _sentencepiece_backend(
    tokens: list[str],
    scores: list[float] | None,
    types: list[int],
    *,
    unk_id: int | None,
    add_space_prefix: bool,
):
    """An encoder for a SentencePiece vocabulary, and its bytes table."""
    from sentencepiece import SentencePieceProcessor
    from sentencepiece import sentencepiece_model_pb2 as spm_pb2

    proto = spm_pb2.ModelProto()
    # GGUF SentencePiece vocabularies are all run as BPE over piece scores (llama.cpp's "SPM").
    proto.trainer_spec.model_type = spm_pb2.TrainerSpec.BPE
    proto.trainer_spec.vocab_size = len(tokens)
    proto.trainer_spec.byte_fallback = BYTE in types
    proto.trainer_spec.unk_id = -1 if unk_id is None else unk_id
    proto.trainer_spec.bos_id = proto.trainer_spec.eos_id = proto.trainer_spec.pad_id = -1
    norm = proto.normalizer_spec
    norm.name = "identity"  # no NFKC: the GGUF carries no charsmap and Gemma uses none
    norm.add_dummy_prefix = False  # added per text segment below, as llama.cpp does
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    for i, (token, kind) in enumerate(zip(tokens, types)):
        piece = proto.pieces.add()
        # SentencePiece wants exactly one UNKNOWN piece, the unk id (Gemma's GGUF marks it
        # CONTROL).
        if i == unk_id:
            kind = UNKNOWN
        elif kind == UNKNOWN:
            kind = CONTROL
        elif kind not in (NORMAL, CONTROL, USER_DEFINED, UNUSED, BYTE):
            kind = NORMAL  # UNDEFINED (0) in older files
        # llama.cpp's converter writes user-defined pieces with real spaces; SentencePiece
        # matches against text whose spaces are already "▁".
        piece.piece = token.replace(" ", _SPM_SPACE) if kind == USER_DEFINED else token
        piece.score = scores[i] if scores is not None else 0.0
        piece.type = kind
    try:
        sp = SentencePieceProcessor(model_proto=proto.SerializeToString())
    except Exception as e:  # sentencepiece raises bare RuntimeError on a malformed vocabulary
        raise CheckpointError(
            f"cannot build a SentencePiece model from this vocabulary: {e}"
        ) from e

    # Like transformers' added tokens: control tokens and user-defined ones (except space runs,
    # handled below) are cut out of the raw text first and never merged with their neighbours.
    atomic = {
        t: i
        for i, (t, k) in enumerate(zip(tokens, types))
        if t and (k == CONTROL or (k == USER_DEFINED and not _is_space_run(t)))
    }
    splitter = _literal_pattern(atomic)
    run_ids = {
        len(t): i
        for i, (t, k) in enumerate(zip(tokens, types))
        if k == USER_DEFINED and _is_space_run(t)
    }
    if run_ids:
        run_ids[1] = sp.piece_to_id(_SPM_SPACE)
    # A literal "▁" in the text normalizes to the same symbol as a space.
    space_runs = re.compile(f"[ {_SPM_SPACE}]{{2,}}")

    @functools.lru_cache(maxsize=256)
    def run_tokens(n: int) -> tuple[int, ...]:
        return tuple(run_ids[k] for k in _bpe_space_run(n, run_ids))

    def encode_plain(text: str, out: list[int]) -> None:
        if not run_ids:
            out.extend(sp.encode(text))
            return
        # Space runs are merged before anything else in transformers' BPE (their merges rank
        # first) and never join a neighbour, so they can be cut out and tokenized on their own.
        pos = 0
        for m in space_runs.finditer(text):
            if m.start() > pos:
                out.extend(sp.encode(text[pos : m.start()]))
            out.extend(run_tokens(m.end() - m.start()))
            pos = m.end()
        if pos < len(text):
            out.extend(sp.encode(text[pos:]))

    def encode_text(text: str) -> list[int]:
        out: list[int] = []
        after_token = True  # llama.cpp adds the space prefix at the start and after a token
        for chunk, token_id in _split_atomic(text, splitter, atomic):
            if token_id is not None:
                out.append(token_id)
                after_token = True
                continue
            if add_space_prefix and after_token:
                chunk = " " + chunk
            after_token = False
            encode_plain(chunk, out)
        return out

    table = [_piece_bytes(t, byte_fallback=k == BYTE) for t, k in zip(tokens, types)]
    return encode_text, table


def _piece_bytes(piece: str, *, byte_fallback: bool) -> bytes:
    """A SentencePiece piece's bytes: ``<0xNN>`` is the byte NN, ``▁`` a space."""
    if byte_fallback and len(piece) == 6 and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
        return bytes([int(piece[3:5], 16)])
    return piece.replace(_SPM_SPACE, " ").encode()


def _split_atomic(
    text: str, pattern: re.Pattern, ids: dict[str, int]
) -> Iterator[tuple[str, int | None]]:
    """(text, None) for plain stretches and (token, id) for each atomic token, in order."""
    pos = 0
    for m in pattern.finditer(text):
        if m.end() == m.start():
            continue
        if m.start() > pos:
            yield text[pos : m.start()], None
        yield m.group(), ids[m.group()]
        pos = m.end()
    if pos < len(text):
        yield text[pos:], None


# ---------------------------------------------------------------------------------------------
# Chat templates, rendered the way transformers renders them.


@functools.lru_cache(maxsize=8)
def _compile_chat_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        # HF's {% generation %} marks assistant text for training masks; rendering keeps it as is.
        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(
                lineno
            )

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise CheckpointError(f"the checkpoint's chat template does not parse: {e}") from e


# ---------------------------------------------------------------------------------------------
# The public classes.


# a chat template's loop over a message's content parts: {% for item in message['content'] %}
_CONTENT_LOOP = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+\w+(?:\[\s*['\"]content['\"]\s*\]|\.content\b)")


class Tokenizer:
    """Text to token ids and back, for one checkpoint.

    Build one with ``tokenizer_from_gguf`` or ``tokenizer_from_hf_dir``.
    """

    def __init__(
        self,
        *,
        encode_text: Callable[[str], list[int]],
        pieces: list[str],
        piece_bytes: list[bytes],
        special_ids: Iterable[int],
        bos_id: int | None,
        eos_ids: Iterable[int],
        pad_id: int,
        add_bos: bool,
        chat_template: str | None,
        template_tokens: dict[str, str],
        strip_leading_space: bool = False,
    ):
        self.vocab_size = len(pieces)
        self.bos_id = bos_id
        self.eos_ids = frozenset(eos_ids)
        self.pad_id = pad_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._encode_text = encode_text
        self._pieces = pieces
        self._special = frozenset(special_ids)
        self._bytes = piece_bytes
        # The same table with special tokens emptied, so skipping them costs nothing per call.
        self._visible_bytes = [b"" if i in self._special else b for i, b in enumerate(piece_bytes)]
        self._template_tokens = template_tokens
        # SentencePiece models with a dummy prefix drop the space it put before the first word.
        self._strip_leading_space = strip_leading_space

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special-token text (``"<|im_start|>"``) becomes its single id
        either way; ``add_special_tokens`` only decides whether BOS is prepended (``add_bos``)."""
        ids = self._encode_text(text)
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        table = self._table(skip_special_tokens)
        ids = self._checked(ids)
        text = b"".join([table[i] for i in ids]).decode("utf-8", errors="replace")
        if self._strip_leading_space and text.startswith(" "):
            text = text[1:]
        return text

    def id_to_piece(self, id: int) -> str:
        """The token as the vocabulary spells it (``"Ġthe"``, ``"▁the"``, ``"<0x0A>"``)."""
        return self._pieces[self._checked([id])[0]]

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes as the vocabulary holds them, special tokens included (their text):
        what a grammar engine needs to walk the vocabulary."""
        return list(self._bytes)

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special

    def is_special(self, id: int) -> bool:
        """Whether ``decode(..., skip_special_tokens=True)`` drops this id (control tokens)."""
        return int(id) in self._special

    def detokenizer(self, *, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A streaming decoder: feed ids one by one, get text as soon as it is complete."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    @property
    def renders_content_parts(self) -> bool:
        """Whether the chat template loops over a message's content, a list of typed parts (as
        multimodal templates do): it is then given the parts themselves rather than one string,
        as vLLM gives its "openai" content format to the templates it finds such a loop in."""
        return self.chat_template is not None and _CONTENT_LOOP.search(self.chat_template) is not None

    def apply_chat_template(
        self, messages: list[dict], *, add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """The prompt text for a conversation, rendered like transformers'
        ``apply_chat_template(..., tokenize=False)``: a sandboxed jinja2 environment with
        ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception`` and ``strftime_now``, and the
        special tokens (``bos_token``, ``eos_token``, ...) as variables. ``kwargs`` (``tools``,
        ``documents``, template switches) are passed to the template."""
        import jinja2

        if self.chat_template is None:
            raise InvalidRequest("this model has no chat template; give it plain text instead")
        template = _compile_chat_template(self.chat_template)
        variables = {"tools": None, "documents": None, **self._template_tokens, **kwargs}
        try:
            return template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.exceptions.TemplateError as e:
            raise InvalidRequest(f"the chat template rejected these messages: {e}") from e

    def _table(self, skip_special_tokens: bool) -> list[bytes]:
        return self._visible_bytes if skip_special_tokens else self._bytes

    def _checked(self, ids: Iterable[int]) -> list[int]:
        ids = [int(i) for i in ids]
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise InvalidRequest(
                f"token id {bad} is outside the vocabulary (size {self.vocab_size})"
            )
        return ids


class IncrementalDetokenizer:
    """Streams text out of token ids.

    Each ``add`` returns the text its token completes. Bytes of a character split over several
    tokens (an emoji in byte-fallback pieces) are held back until the character is whole, so no
    delta ever ends in a broken character; ``flush`` releases what is left at the end. The
    concatenation of all deltas equals ``tokenizer.decode`` of all ids, because both read the
    same bytes table and Python's incremental UTF-8 decoder replaces invalid bytes exactly as
    the one-shot decode does.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._table = tokenizer._table(skip_special_tokens)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip = tokenizer._strip_leading_space

    def add(self, token_id: int) -> str:
        token_id = int(token_id)
        if not 0 <= token_id < len(self._table):
            self._tokenizer._checked([token_id])  # raises the same error as decode
        return self._emit(self._utf8.decode(self._table[token_id]))

    def flush(self) -> str:
        """The rest of the text: incomplete trailing bytes become U+FFFD, as in ``decode``."""
        return self._emit(self._utf8.decode(b"", final=True))

    def _emit(self, text: str) -> str:
        if self._strip and text:
            self._strip = False
            if text[0] == " ":
                text = text[1:]
        return text


# ---------------------------------------------------------------------------------------------
# Builders.


def tokenizer_from_gguf(metadata: dict) -> Tokenizer:
    """The tokenizer a GGUF file describes, from its metadata (``loaders.gguf.read_metadata``:
    strings as str, arrays as lists)."""
    model = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise CheckpointError("the GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    tokens = list(tokens)
    types = list(metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise CheckpointError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")

    def token_id(key: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is None:
            return None
        if not 0 <= int(value) < len(tokens):
            raise CheckpointError(f"GGUF tokenizer.ggml.{key}={value} is outside the vocabulary")
        return int(value)

    bos_id, eos_id = token_id("bos_token_id"), token_id("eos_token_id")
    unk_id, pad_id = token_id("unknown_token_id"), token_id("padding_token_id")
    add_bos = metadata.get("tokenizer.ggml.add_bos_token")

    if model == "gpt2":
        merges = metadata.get("tokenizer.ggml.merges")
        if merges is None:
            raise CheckpointError("GGUF byte-level tokenizer has no tokenizer.ggml.merges")
        pre = metadata.get("tokenizer.ggml.pre", "gpt2")
        encode_text, table = _byte_level_backend(tokens, types, list(merges), pre)
        strip = False
        add_bos = bool(add_bos) if add_bos is not None else False
    elif model == "llama":
        scores = metadata.get("tokenizer.ggml.scores")
        add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        encode_text, table = _sentencepiece_backend(
            tokens, scores, types, unk_id=unk_id, add_space_prefix=add_prefix
        )
        strip = add_prefix
        # llama.cpp (and transformers) add BOS to a SentencePiece vocabulary unless told not to.
        add_bos = bool(add_bos) if add_bos is not None else True
    else:
        raise CheckpointError(
            f"GGUF tokenizer.ggml.model={model!r} is not supported (supported: 'gpt2', 'llama')"
        )

    named = {"bos": bos_id, "eos": eos_id, "unk": unk_id, "pad": pad_id}
    special = {i for i, k in enumerate(types) if k == CONTROL}
    special |= {i for i in named.values() if i is not None}
    eos_ids = {
        i for i in (eos_id, token_id("eot_token_id"), token_id("eom_token_id")) if i is not None
    }
    eos_ids |= {i for i in special if tokens[i] in _END_OF_TURN}
    return Tokenizer(
        encode_text=encode_text,
        pieces=tokens,
        piece_bytes=table,
        special_ids=special,
        bos_id=bos_id,
        eos_ids=eos_ids,
        pad_id=_first(pad_id, eos_id, 0),
        add_bos=add_bos,
        chat_template=metadata.get("tokenizer.chat_template"),
        template_tokens={f"{k}_token": tokens[i] for k, i in named.items() if i is not None},
        strip_leading_space=strip,
    )


def tokenizer_from_hf_dir(path) -> Tokenizer:
    """The tokenizer of a Hugging Face checkpoint directory: ``tokenizer.json`` (run by
    ``tokenizers``) or else ``tokenizer.model`` (SentencePiece), with ``tokenizer_config.json``
    for the special tokens, ``add_bos_token`` and the chat template, and
    ``generation_config.json`` for extra EOS ids."""
    path = Path(path)
    config = _read_json(path / "tokenizer_config.json")
    # Older checkpoints name their special tokens in a file of their own.
    for key, value in _read_json(path / "special_tokens_map.json").items():
        config.setdefault(key, value)
    if (path / "tokenizer.json").is_file():
        backend = _hf_json_backend(path / "tokenizer.json")
    elif (path / "tokenizer.model").is_file():
        backend = _hf_sentencepiece_backend(path / "tokenizer.model", config)
    else:
        raise CheckpointError(f"{path} has neither tokenizer.json nor tokenizer.model")

    def content(value) -> str | None:  # a token is written as a string or as an AddedToken dict
        return value.get("content") if isinstance(value, dict) else value

    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    template_tokens = {k: content(config[k]) for k in names if content(config.get(k))}
    ids = {k: backend.vocab.get(v) for k, v in template_tokens.items()}
    bos_id, eos_id = ids.get("bos_token"), ids.get("eos_token")
    special = backend.special | {i for i in ids.values() if i is not None}

    eos_ids = {i for i in special if backend.pieces[i] in _END_OF_TURN}
    generation_eos = _read_json(path / "generation_config.json").get("eos_token_id")
    eos_ids |= set(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    eos_ids |= {eos_id}
    eos_ids.discard(None)

    add_bos = config.get("add_bos_token")
    if add_bos is None:
        add_bos = backend.adds_bos(bos_id)
    return Tokenizer(
        encode_text=backend.encode_text,
        pieces=backend.pieces,
        piece_bytes=backend.table,
        special_ids=special,
        bos_id=bos_id,
        eos_ids=eos_ids,
        pad_id=_first(ids.get("pad_token"), eos_id, 0),
        add_bos=bool(add_bos),
        chat_template=_hf_chat_template(path, config),
        template_tokens=template_tokens,
        strip_leading_space=backend.strip_leading_space,
    )


class _Backend(NamedTuple):
    """What a Hugging Face tokenizer file gives ``tokenizer_from_hf_dir``."""

    encode_text: Callable[[str], list[int]]  # text -> ids, no BOS
    pieces: list[str]  # id -> token text
    table: list[bytes]  # id -> bytes it decodes to
    special: set[int]  # ids that skip_special_tokens drops
    vocab: dict[str, int]  # token text -> id
    strip_leading_space: bool  # the decoder drops one leading space
    adds_bos: Callable[[int | None], bool]  # default for add_bos when the config is silent


def _hf_json_backend(file: Path) -> _Backend:
    from tokenizers import Tokenizer as BackendTokenizer

    try:
        backend = BackendTokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise CheckpointError(f"cannot read {file}: {e}") from e
    pieces = [backend.id_to_token(i) or "" for i in range(backend.get_vocab_size(True))]
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else None
    kinds = _decoder_kinds(decoder)
    # Added tokens go through the same decoder in tokenizers, so one rule covers every id.
    if "ByteLevel" in kinds:
        table = [_byte_level_bytes(p) for p in pieces]
    elif kinds & {"Replace", "Metaspace", "ByteFallback"}:
        byte_fallback = "ByteFallback" in kinds
        table = [_piece_bytes(p, byte_fallback=byte_fallback) for p in pieces]
    else:
        raise CheckpointError(f"{file}: decoder {sorted(kinds) or None} is not supported")

    def adds_bos(bos_id: int | None) -> bool:
        # The file's post-processor is what transformers runs when the config says nothing.
        first = backend.encode("", add_special_tokens=True).ids[:1]
        return bos_id is not None and first == [bos_id]

    return _Backend(
        encode_text=lambda text: backend.encode(text, add_special_tokens=False).ids,
        pieces=pieces,
        table=table,
        special=special,
        vocab=backend.get_vocab(with_added_tokens=True),
        strip_leading_space=bool(kinds & {"Strip:1", "Metaspace:prepend"}),
        adds_bos=adds_bos,
    )


def _decoder_kinds(decoder: dict | None) -> set[str]:
    """The decoder step types of a tokenizer.json, flattening Sequence, with two markers for the
    steps that drop a leading space: ``Strip:1`` and ``Metaspace:prepend``."""
    if decoder is None:
        return set()
    if decoder.get("type") == "Sequence":
        return set().union(*(_decoder_kinds(d) for d in decoder.get("decoders", [])))
    kind = decoder.get("type", "")
    kinds = {kind}
    if kind == "Strip" and decoder.get("start", 0) >= 1 and decoder.get("content") == " ":
        kinds.add("Strip:1")
    if kind == "Metaspace" and (
        decoder.get("prepend_scheme") in ("always", "first") or decoder.get("add_prefix_space")
    ):
        kinds.add("Metaspace:prepend")
    return kinds


def _hf_sentencepiece_backend(file: Path, config: dict) -> _Backend:
    from sentencepiece import sentencepiece_model_pb2 as spm_pb2

    proto = spm_pb2.ModelProto()
    try:
        proto.ParseFromString(file.read_bytes())
    except Exception as e:  # protobuf's DecodeError
        raise CheckpointError(f"cannot read {file}: {e}") from e
    tokens = [p.piece for p in proto.pieces]
    types = [p.type for p in proto.pieces]
    # Tokens tokenizer_config.json declares special are matched whole, like control pieces.
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        i = int(key)
        if i < len(tokens) and entry.get("content") == tokens[i] and entry.get("special"):
            types[i] = CONTROL
    unk = next((i for i, k in enumerate(types) if k == UNKNOWN), None)
    add_prefix = proto.normalizer_spec.add_dummy_prefix
    encode_text, table = _sentencepiece_backend(
        tokens, [p.score for p in proto.pieces], types, unk_id=unk, add_space_prefix=add_prefix
    )
    return _Backend(
        encode_text=encode_text,
        pieces=tokens,
        table=table,
        special={i for i, k in enumerate(types) if k in (CONTROL, UNKNOWN)},
        vocab={t: i for i, t in enumerate(tokens)},
        strip_leading_space=add_prefix,
        # A bare SentencePiece model has no post-processor; Llama-style tokenizers add BOS.
        adds_bos=lambda bos_id: bos_id is not None,
    )


def _hf_chat_template(path: Path, config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default", next(iter(named.values()), None))
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    if template is None:
        template = _read_json(path / "chat_template.json").get("chat_template")
    return template


def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from e


def _first(*values):
    return next(v for v in values if v is not None)
