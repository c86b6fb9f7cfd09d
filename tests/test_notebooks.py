"""Both Colab notebooks run to completion on CPU (small sizes)."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", ["quickstart.ipynb", "tpu_training.ipynb"])
def test_notebook_runs(name, tmp_path, monkeypatch):
  monkeypatch.setenv("TEE_NOTEBOOK_STEPS", "20")
  monkeypatch.setenv("TEE_NOTEBOOK_CONFIG", os.path.join(ROOT, "configs/tiny.yaml"))
  monkeypatch.setenv("TEE_NOTEBOOK_WORKDIR", str(tmp_path / "work"))
  monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
  notebook = nbformat.read(os.path.join(ROOT, "colab", name), as_version=4)
  NotebookClient(notebook, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": ROOT}}).execute()
  outputs = "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code"
                    for o in c.get("outputs", []))
  if name == "tpu_training.ipynb":
    assert "falling back to CPU emulation" in outputs
    assert "trained on: CPU emulation (CPUEmbedding)" in outputs
  else:
    assert "held-out AUC" in outputs
