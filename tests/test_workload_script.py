"""benchmarks/workload.py, the side-by-side batch benchmark: its command line picks and checks
engines before anything loads, and (marked slow) a dry run goes through the worker subprocess
end to end on a tiny checkpoint. Nothing here measures speed."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from tests.family_testing import write_tiny

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def workload():
    spec = importlib.util.spec_from_file_location("bench_workload", ROOT / "benchmarks" / "workload.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_help_names_every_option(workload, capsys):
    with pytest.raises(SystemExit) as e:
        workload.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--only", "--peers-python", "--peer-models", "--dry", "--list", "--repeats"):
        assert flag in out


def test_list_shows_each_engine_and_where_it_runs(workload, capsys):
    assert workload.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(workload.VARIANTS)
    by_name = {ln.split()[0]: ln for ln in lines}
    assert by_name["openvino:int8"].endswith("(--peers-python)")
    assert by_name["jaxinfer:w8a8+kv8"].endswith("(this Python)")
    assert set(workload.DEFAULT) <= set(workload.VARIANTS)


def test_selection_overrides_are_typed(workload):
    name, opts = workload.parse_selection("vllm:float32@max_num_seqs=256,max_num_batched_tokens=4096")
    assert name == "vllm:float32"
    assert opts == {"dtype": "float32", "max_num_seqs": 256, "max_num_batched_tokens": 4096}
    assert workload.VARIANTS["vllm:float32"]["max_num_seqs"] == 128  # the table is left as it was
    _, opts = workload.parse_selection("jaxinfer:float32@block_size=64")
    assert opts == {"block_size": 64}


@pytest.mark.parametrize("argv, message", [
    (["--only", "tensorrt:fp8"], "unknown engine 'tensorrt:fp8'"),
    (["--only", "vllm:float32@max_seqs=8"], "'vllm:float32' has no setting 'max_seqs'"),
    (["--only", "ctranslate2:int8@max_batch_size"], "setting 'max_batch_size' of 'ctranslate2:int8' is not key=value"),
    (["--dry", "--only", "openvino:int8"], "--dry runs jaxinfer only"),
])
def test_bad_selection_is_one_clear_error(workload, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        workload.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow  # a fresh interpreter imports jax and compiles the engine's steps
def test_dry_run_goes_through_a_worker(workload, tmp_path, monkeypatch):
    model = write_tiny(tmp_path / "tiny", "llama")
    out = tmp_path / "dry.json"
    # the worker is a fresh interpreter: it must import this checkout's jaxinfer
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    assert workload.main(["--dry", "--model", str(model), "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    r = d["results"]["jaxinfer:float32"]
    assert "error" not in r, r.get("stderr_tail")
    assert d["workload"] == {"requests": 4, "prompt_tokens": d["workload"]["prompt_tokens"],
                             "output_len": 4, "repeats": 1}
    assert 4 * 8 <= d["workload"]["prompt_tokens"] <= 4 * 16
    assert r["out_tokens"] == 16 and len(r["walls"]) == 1
    assert d["machine"]["cpus"] == os.cpu_count()
    assert d["command"].endswith("--dry --model " + str(model) + " --json " + str(out))
