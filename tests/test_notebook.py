"""The quickstart notebook runs top to bottom on the real default model (nbclient, CPU)."""

from pathlib import Path

import nbclient
import nbformat

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_executes(smollm2_gguf):  # the fixture fetches the model once
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    assert "'The capital of France is' ->" in text
    assert "10 ok, 0 failed" in text and "rerun: 10 already answered, 0 run" in text
    assert text.count("output tokens/s") == 4
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the throughput plot
