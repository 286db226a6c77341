"""benchmarks/gpu_engine.py --dry: the GPU script's every section at toy sizes on CPU, so it
cannot break unseen between the runs on a lent GPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_engine.py"


def test_gpu_engine_dry(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # as when run as a script: its sibling modules
    spec = importlib.util.spec_from_file_location("gpu_engine", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_engine", mod)  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    res = mod.main(["--dry", "--out", str(tmp_path)])
    assert (tmp_path / "gpu_engine.json").is_file()
    secs = res["sections"]
    assert set(secs) == {"ceilings", "llama8b", "llama8b-int8", "smollm2"}
    assert not [name for name, s in secs.items() if "error" in s], secs
    assert secs["ceilings"]["copy_gbps"] > 0
    for name in ("llama8b", "llama8b-int8", "smollm2"):
        for r in secs[name]["decode"]:
            assert r["step_ms"] > 0 and r["mbu"] > 0
            assert r["built_second"] == 0  # the timed generate reuses the first one's executables
    assert secs["llama8b-int8"]["weight_bytes"] < secs["llama8b"]["weight_bytes"] / 2
    assert secs["llama8b"]["prefill"]["tflops"] > 0
