"""GGUF loader tests: our header parse and our dequantizers against the ``gguf`` package.

The independent side is llama.cpp's own Python package: ``gguf.GGUFReader`` for the container
and ``gguf.quants.dequantize`` for the block formats. Real files cover the quant types they
hold; synthetic blocks and small files written with ``gguf.GGUFWriter`` cover the rest.
"""

import re

import gguf
import gguf.quants as gq
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from jaxinfer.errors import CheckpointError
from jaxinfer.loaders.gguf import (
    SUPPORTED_QTYPES,
    GGUFCheckpoint,
    _block_layout,
    dequantize,
    read_metadata,
    unpermute_llama_qk,
)

# Byte offsets of the float16 scale fields in each block: random bytes there could be inf/NaN,
# which would test float edge cases rather than the block layout.
F16_FIELDS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def reference(raw: np.ndarray, qtype: str) -> np.ndarray:
    """gguf's dequantizer (F32 handled here: gguf.quants passes it through unchanged)."""
    return np.asarray(gq.dequantize(raw, GGMLQuantizationType[qtype]), np.float32)


def assert_matches_reference(ours: np.ndarray, ref: np.ndarray):
    assert ours.dtype == np.float32
    assert ours.shape == ref.shape
    # Same formulas in the same float order as ggml, so the match is exact.
    np.testing.assert_array_equal(ours, ref)


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    return GGUFCheckpoint(smollm2_gguf)


@pytest.fixture(scope="session")
def gemma3(gemma3_gguf):
    return GGUFCheckpoint(gemma3_gguf)


@pytest.fixture(scope="session")
def smollm2_reader(smollm2_gguf):
    # ~3 s: GGUFReader builds an object per vocabulary entry. Gemma's 262144 entries would
    # take several times longer, so the full reader comparison runs on SmolLM2 only.
    return gguf.GGUFReader(smollm2_gguf)


# --- The container ---------------------------------------------------------------------------


def test_tensor_table_matches_gguf_reader(smollm2, smollm2_reader):
    ref = {t.name: t for t in smollm2_reader.tensors}
    assert list(smollm2.tensors) == [t.name for t in smollm2_reader.tensors]
    for name, info in smollm2.tensors.items():
        t = ref[name]
        assert info.shape == tuple(reversed(t.shape.tolist()))
        assert info.qtype == t.tensor_type.name
        assert info.offset == t.data_offset
        assert info.nbytes == t.n_bytes
        assert smollm2.raw(name).tobytes() == t.data.tobytes()


def test_metadata_matches_gguf_reader(smollm2, smollm2_reader):
    ref = {k: f.contents() for k, f in smollm2_reader.fields.items() if not k.startswith("GGUF.")}
    assert smollm2.metadata == ref


def test_metadata_smollm2(smollm2, smollm2_gguf):
    m = smollm2.metadata
    assert smollm2.architecture == "llama" == m["general.architecture"]
    assert m["llama.block_count"] == 30
    assert m["llama.attention.head_count"] == 9
    assert m["llama.attention.head_count_kv"] == 3
    assert m["llama.rope.freq_base"] == 100000.0
    tokens = m["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and all(type(t) is str for t in tokens[:100])
    assert tokens[1] == "<|im_start|>"
    assert len(m["tokenizer.ggml.token_type"]) == 49152
    assert all(type(t) is int for t in m["tokenizer.ggml.token_type"][:100])
    assert m["tokenizer.ggml.merges"][0] == "Ġ t"
    assert type(m["tokenizer.ggml.add_bos_token"]) is bool
    assert "<|im_start|>" in m["tokenizer.chat_template"]
    assert read_metadata(smollm2_gguf) == m


def test_metadata_gemma3(gemma3):
    m = gemma3.metadata
    assert gemma3.architecture == "gemma3"
    assert m["gemma3.block_count"] == 18
    assert m["gemma3.attention.key_length"] == 256
    assert len(m["tokenizer.ggml.tokens"]) == 262144
    scores = m["tokenizer.ggml.scores"]
    assert len(scores) == 262144 and type(scores[0]) is float
    assert m["tokenizer.ggml.tokens"][m["tokenizer.ggml.bos_token_id"]] == "<bos>"
    embed = gemma3.tensors["token_embd.weight"]
    assert (embed.name, embed.shape, embed.qtype) == ("token_embd.weight", (262144, 640), "Q8_0")
    assert gemma3.tensors["blk.0.attn_q.weight"].shape == (4 * 256, 640)


# --- Dequantization of the real files --------------------------------------------------------


def _pick(ckpt: GGUFCheckpoint, per_type: int = 3) -> list[str]:
    """A few tensors of every type in the file, smallest first to keep the test quick."""
    chosen: dict[str, list[str]] = {}
    for name, info in sorted(ckpt.tensors.items(), key=lambda kv: kv[1].size):
        if len(chosen.setdefault(info.qtype, [])) < per_type:
            chosen[info.qtype].append(name)
    return [name for names in chosen.values() for name in names]


def test_types_in_real_files(smollm2, gemma3):
    assert {i.qtype for i in smollm2.tensors.values()} == {"F32", "Q4_1", "Q8_0"}
    assert {i.qtype for i in gemma3.tensors.values()} == {"F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K"}


def test_load_smollm2_matches_gguf(smollm2, smollm2_reader):
    # Reference data comes from GGUFReader, so offsets and shapes are checked independently.
    ref = {t.name: t for t in smollm2_reader.tensors}
    for name in _pick(smollm2) + ["blk.0.attn_q.weight"]:
        t = ref[name]
        assert_matches_reference(smollm2.load(name), reference(t.data, t.tensor_type.name))


@pytest.mark.slow
def test_gemma3_all_tensors_match_gguf_reader(gemma3, gemma3_gguf):
    # GGUFReader takes ~15 s to open this file, hence slow; the fast test below uses our raw().
    for t in gguf.GGUFReader(gemma3_gguf).tensors:
        info = gemma3.tensors[t.name]
        assert (info.offset, info.nbytes) == (t.data_offset, t.n_bytes)
        assert_matches_reference(gemma3.load(t.name), reference(t.data, t.tensor_type.name))


def test_load_gemma3_matches_gguf(gemma3):
    for name in _pick(gemma3):
        qtype = gemma3.tensors[name].qtype
        assert_matches_reference(gemma3.load(name), reference(gemma3.raw(name), qtype))


def test_load_dtype_and_independence(smollm2):
    w = smollm2.load("blk.0.attn_norm.weight", dtype=np.float16)
    assert w.dtype == np.float16 and w.shape == (576,)
    w32 = smollm2.load("blk.0.attn_norm.weight")
    w32[:] = 0  # a private, writeable copy: the mapped file is untouched
    assert np.any(smollm2.load("blk.0.attn_norm.weight") != 0)


def test_raw_shapes(smollm2):
    assert smollm2.raw("blk.0.attn_norm.weight").dtype == np.float32
    q = smollm2.raw("blk.0.ffn_down.weight")  # Q4_1, (576, 1536): 48 blocks of 20 bytes a row
    assert q.dtype == np.uint8 and q.shape == (576, 1536 // 32 * 20)


# --- Dequantization of synthetic blocks ------------------------------------------------------


def test_block_sizes_agree_with_gguf():
    for qtype in SUPPORTED_QTYPES:
        assert _block_layout(qtype) == GGML_QUANT_SIZES[GGMLQuantizationType[qtype]], qtype


@pytest.mark.parametrize("qtype", sorted(F16_FIELDS))
def test_random_blocks_match_gguf(qtype):
    # Random bytes exercise every bit of every field, which weights from a quantizer do not.
    rng = np.random.default_rng(sum(map(ord, qtype)))
    block_size, type_size = _block_layout(qtype)
    n_rows, blocks_per_row = 6, 3
    raw = rng.integers(0, 256, (n_rows * blocks_per_row, type_size), dtype=np.uint8)
    for start in F16_FIELDS[qtype]:
        scale = rng.uniform(-2, 2, raw.shape[0]).astype(np.float16)
        raw[:, start : start + 2] = scale.view(np.uint8).reshape(-1, 2)
    raw = raw.reshape(n_rows, blocks_per_row * type_size)
    ours = dequantize(raw, qtype, (n_rows, blocks_per_row * block_size))
    assert_matches_reference(ours, reference(raw, qtype))


def test_q8_k_by_hand():
    # Q8_K (gguf has no dequantizer for it): f32 d, 256 int8, 16 int16 block sums (unused).
    qs = np.arange(-128, 128, dtype=np.int8)
    block = np.concatenate(
        [np.float32(0.5).reshape(1).view(np.uint8), qs.view(np.uint8), np.zeros(32, np.uint8)]
    )
    np.testing.assert_array_equal(dequantize(block, "Q8_K", (256,)), qs.astype(np.float32) * 0.5)


def test_q4_0_by_hand():
    # d = 2: byte j holds element j (low nibble) and element j + 16 (high nibble), less 8.
    d = np.float16(2).reshape(1).view(np.uint8)
    qs = (np.arange(16, dtype=np.uint8) | (np.uint8(15) << 4)).astype(np.uint8)
    out = dequantize(np.concatenate([d, qs]), "Q4_0", (32,))
    np.testing.assert_array_equal(out[:16], (np.arange(16) - 8) * 2.0)
    np.testing.assert_array_equal(out[16:], np.full(16, 14.0))


def _write_gguf(path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]]):
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("test.u32", 7)
    w.add_int32("test.i32", -7)
    w.add_uint64("test.u64", 2**40)
    w.add_float32("test.f32", 0.25)
    w.add_bool("test.bool", True)
    w.add_string("test.str", "héllo")
    w.add_array("test.strs", ["a", "", "ü"])
    w.add_array("test.ints", [1, 2, 3])
    w.add_array("test.floats", [0.5, 1.5])
    for name, (data, raw_dtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_written_file_round_trip(tmp_path):
    # Types absent from the real files, quantized by gguf and read back by both sides.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    T = GGMLQuantizationType
    tensors = {
        "f32": (x, None),
        "f16": (x.astype(np.float16), None),
        "bf16": (gq.quantize(x, T.BF16), T.BF16),
        "q4_0": (gq.quantize(x, T.Q4_0), T.Q4_0),
        "q5_1": (gq.quantize(x, T.Q5_1), T.Q5_1),
        "q8_0": (gq.quantize(x, T.Q8_0), T.Q8_0),
        "bias": (x[0], None),
    }
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, tensors)
    ckpt, reader = GGUFCheckpoint(path), gguf.GGUFReader(path)

    assert ckpt.architecture == "llama"
    m = ckpt.metadata
    assert (m["test.u32"], m["test.i32"], m["test.u64"]) == (7, -7, 2**40)
    assert (m["test.f32"], m["test.bool"], m["test.str"]) == (0.25, True, "héllo")
    assert (m["test.strs"], m["test.ints"]) == (["a", "", "ü"], [1, 2, 3])
    assert m["test.floats"] == [0.5, 1.5]
    assert m == {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}

    # Sanity against the original values: about half a quantization step for |x| < 5.
    tolerance = {"f32": 0, "f16": 3e-3, "bf16": 3e-2, "q4_0": 0.5, "q5_1": 0.2, "q8_0": 0.05}
    for t in reader.tensors:
        info = ckpt.tensors[t.name]
        assert info.qtype == t.tensor_type.name
        ours = ckpt.load(t.name)
        assert_matches_reference(ours, reference(t.data, info.qtype).reshape(info.shape))
        want = x[0] if t.name == "bias" else x
        np.testing.assert_allclose(ours, want, atol=tolerance.get(t.name, 0))
    assert ckpt.raw("bf16").dtype.name == "bfloat16"


# --- Rotary permutation ----------------------------------------------------------------------


def permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute, verbatim.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def test_unpermute_by_hand():
    # One head of 4 rows: Hugging Face [x0, x1, y0, y1] is stored as [x0, y0, x1, y1].
    stored = np.array([10, 20, 11, 21])
    np.testing.assert_array_equal(unpermute_llama_qk(stored, 1), [10, 11, 20, 21])


@pytest.mark.parametrize("n_heads,head_dim", [(9, 64), (3, 64), (2, 8)])
def test_unpermute_inverts_llama_cpp(n_heads, head_dim):
    rng = np.random.default_rng(n_heads)
    w = rng.standard_normal((n_heads * head_dim, 5)).astype(np.float32)
    b = w[:, 0].copy()  # a bias
    for x in (w, b):
        stored = permute_like_llama_cpp(x, n_heads)
        assert not np.array_equal(stored, x)
        np.testing.assert_array_equal(unpermute_llama_qk(stored, n_heads), x)


def test_unpermute_rejects_bad_rows():
    with pytest.raises(ValueError, match="rows=10"):
        unpermute_llama_qk(np.zeros((10, 2)), 3)


# --- Bad input -------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(CheckpointError, match="nope.gguf.*no such"):
        GGUFCheckpoint(path)


def test_not_gguf(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b'{"__metadata__": {}}' + bytes(100))
    with pytest.raises(CheckpointError, match="model.safetensors.*not a GGUF file"):
        GGUFCheckpoint(path)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty.gguf.*empty"):
        GGUFCheckpoint(empty)


@pytest.mark.parametrize("keep", ["1MB", "90%"])
def test_truncated(tmp_path, smollm2_gguf, keep):
    # 1 MB ends inside SmolLM2's 1.8 MB header; 90% ends inside the tensor data.
    size = smollm2_gguf.stat().st_size
    n = 1 << 20 if keep == "1MB" else size * 9 // 10
    path = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(n))
    with pytest.raises(CheckpointError, match="cut.gguf.*truncated"):
        GGUFCheckpoint(path)


def test_every_cut_inside_the_header_says_truncated_header(tmp_path):
    """A file cut anywhere in its header (inside a string's length, a string, an array, a
    tensor record) names the problem and the offset, never a struct error."""
    whole = tmp_path / "whole.gguf"
    _write_gguf(whole, {"w": (np.ones((2, 32), np.float32), None)})
    data = whole.read_bytes()
    header_end = data.index(np.ones(1, np.float32).tobytes() * 64)  # the tensor data starts
    cut = tmp_path / "cut.gguf"
    for n in range(5, header_end - 31):  # (the last 31 bytes before the data are alignment padding)
        cut.write_bytes(data[:n])
        with pytest.raises(CheckpointError) as e:
            GGUFCheckpoint(cut)
        msg = str(e.value)
        assert re.search(rf"cut\.gguf: truncated GGUF header: the value at offset \d+ runs past the end of the file "
                         rf"\({n} bytes\)", msg), (n, msg)
        assert int(re.search(r"offset (\d+)", msg).group(1)) <= n


def test_unsupported_type(tmp_path):
    T = GGMLQuantizationType
    raw = np.random.default_rng(0).integers(0, 256, (4, 2 * 18), dtype=np.uint8)  # 2 blocks a row
    path = tmp_path / "iq.gguf"
    _write_gguf(path, {"blk.0.ffn_up.weight": (raw, T.IQ4_NL)})
    ckpt = GGUFCheckpoint(path)
    assert ckpt.tensors["blk.0.ffn_up.weight"].shape == (4, 64)
    assert ckpt.raw("blk.0.ffn_up.weight").tobytes() == raw.tobytes()
    with pytest.raises(CheckpointError, match=r"iq.gguf.*blk\.0\.ffn_up\.weight.*IQ4_NL.*Q4_K"):
        ckpt.load("blk.0.ffn_up.weight")
    with pytest.raises(CheckpointError, match="IQ4_NL"):
        dequantize(raw, "IQ4_NL", (4, 64))


def test_missing_tensor(smollm2):
    with pytest.raises(CheckpointError, match="no tensor named 'output.weight'"):
        smollm2.load("output.weight")
