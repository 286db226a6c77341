"""The quickstart notebook runs top to bottom on the real default model (nbclient, CPU), from a
copy outside the repository, its %pip cell pointed at this checkout.

The %pip cell installs into a throwaway --target directory that the kernel's PYTHONPATH puts
first, so the kernel imports what that cell just installed, and the shared environment's own
jaxinfer is left alone.
"""

import os
import shutil
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow  # 2 min: a fresh kernel installs the package and compiles the model
def test_quickstart_notebook_executes(smollm2_gguf, tmp_path):  # the fixture fetches the model once
    work = tmp_path / "colab"
    work.mkdir()
    shutil.copy(NOTEBOOK, work / NOTEBOOK.name)
    nb = nbformat.read(work / NOTEBOOK.name, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert first.source.startswith("%pip install") and "git+https://" in first.source
    assert "../" not in "".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "colab.research.google.com" in nb.cells[0].source
    site = tmp_path / "site"
    site.mkdir()
    first.source = f"%pip install -q --no-deps --no-build-isolation --target {site} {ROOT}"
    env = dict(os.environ, PYTHONPATH=str(site))
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(work)}}).execute(env=env)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"], [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    assert "JAX backend: CPU" in text
    assert f"{site}/jaxinfer" in text  # the kernel ran the copy the %pip cell installed
    assert "'The capital of France is' ->" in text
    assert "10 ok, 0 failed" in text and "rerun: 10 already answered, 0 run" in text
    assert text.count("output tokens/s") == 4
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the throughput plot
    assert sys.executable  # (the kernel is python3 of this environment)
