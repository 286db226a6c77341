"""The CLI: bad input gets one clear line and exit code 2, never a traceback; --json fields."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from jaxinfer.cli import main
from tests.tiny_gguf import write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_gguf):
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    write_tiny_llama(path, smollm2_gguf)
    return path


def _err(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxinfer: error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_unknown_model(capsys):
    err = _err(capsys, ["generate", "--model", "no-such-model", "--prompt", "hi"])
    assert "unknown model 'no-such-model'" in err and "smollm2-135m-instruct" in err


def test_truncated_gguf(capsys, tmp_path, smollm2_gguf):
    bad = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as f:
        bad.write_bytes(f.read(3_000_000))
    assert "truncated" in _err(capsys, ["generate", "--model", str(bad), "--prompt", "hi"])


def test_not_a_gguf(capsys, tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"this is not a model" * 10)
    assert "junk.gguf" in _err(capsys, ["generate", "--model", str(bad), "--prompt", "hi"])


def test_unsupported_architecture(capsys, tmp_path, smollm2_gguf):
    path = tmp_path / "mamba.gguf"
    write_tiny_llama(path, smollm2_gguf, arch="mamba")
    err = _err(capsys, ["generate", "--model", str(path), "--prompt", "hi"])
    assert "unsupported architecture 'mamba'" in err


def test_unsupported_quant_type(capsys, tmp_path, smollm2_gguf):
    path = tmp_path / "iq.gguf"
    # IQ4_NL: blocks of 32 values in 18 bytes; ffn_up is [64, 32] -> 64 rows of one block
    raw = np.zeros((64, 18), np.uint8)
    write_tiny_llama(path, smollm2_gguf, raw_types={"blk.0.ffn_up.weight": (raw, GGMLQuantizationType.IQ4_NL)})
    err = _err(capsys, ["generate", "--model", str(path), "--prompt", "hi"])
    assert "IQ4_NL" in err and "blk.0.ffn_up.weight" in err


def test_prompt_longer_than_max_model_len(capsys, tiny):
    err = _err(capsys, ["generate", "--model", str(tiny), "--max-model-len", "8", "--prompt", "one two three four five six seven eight nine ten"])
    assert "max_model_len is 8" in err


@pytest.mark.parametrize("flag,value,field", [("--temperature", "-1", "temperature"), ("--top-p", "1.5", "top_p"),
                                              ("--top-k", "-5", "top_k"), ("--max-tokens", "0", "max_tokens"),
                                              ("--min-p", "2", "min_p")])
def test_invalid_sampling_values(capsys, flag, value, field):
    err = _err(capsys, ["generate", "--prompt", "hi", flag, value])
    assert field in err


def test_generate_json_fields(capsys, tiny):
    assert main(["generate", "--model", str(tiny), "--prompt", "Hello world", "--max-tokens", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    from jaxinfer import LLM, SamplingParams

    llm = LLM(str(tiny), progress=False)  # the API the CLI wraps: greedy, so the same tokens
    want = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert out["prompt_token_ids"] == llm.tokenizer.encode("Hello world") == want.prompt_token_ids
    assert out["token_ids"] == want.outputs[0].token_ids
    assert out["text"] == llm.tokenizer.decode(out["token_ids"]) and out["prompt"] == "Hello world"
    assert out["finish_reason"] == ("length" if len(out["token_ids"]) == 5 else "stop")
    assert 0 < out["ttft_s"] <= out["wall_s"]
    if len(out["token_ids"]) > 1:  # decode rate over the tokens after the first
        assert out["tokens_per_s"] > 0
    else:
        assert out["tokens_per_s"] is None


def test_batch_quick_mode(tmp_path, tiny):
    src = tmp_path / "prompts.txt"
    src.write_text("first prompt\n\nsecond prompt\n")
    dst = tmp_path / "out.jsonl"
    assert main(["batch", str(src), "-o", str(dst), "--model", str(tiny), "--max-tokens", "4"]) == 0
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["first prompt", "second prompt"]
    assert all(set(r) >= {"text", "finish_reason", "completion_tokens"} for r in rows)


def test_subprocess_exit_code_and_no_traceback():
    exe = shutil.which("jaxinfer") or None
    cmd = [exe] if exe else [sys.executable, "-m", "jaxinfer"]
    p = subprocess.run(cmd + ["generate", "--model", "nope", "--prompt", "x"], capture_output=True, text=True)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr and "unknown model 'nope'" in p.stderr


def test_kv_cache_dtype_flag(capsys, tiny):
    from jaxinfer.cli import build_parser

    for cmd in (["generate", "--prompt", "x"], ["batch", "in.txt", "-o", "out.jsonl"], ["bench"]):
        assert build_parser().parse_args(cmd + ["--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
        assert build_parser().parse_args(cmd).kv_cache_dtype == "auto"
    assert main(["generate", "--model", str(tiny), "--prompt", "Hello world", "--max-tokens", "5",
                 "--kv-cache-dtype", "int8", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) <= 5
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "hi", "--kv-cache-dtype", "int4"])
    assert e.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err
