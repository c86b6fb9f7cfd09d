"""Both Colab notebooks run to completion on CPU (small sizes), show the
learning curve and a prediction from the exported model; the install cell
works on a fresh runtime and after a restart."""

import importlib.util
import os
import re
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Lines no reader of the notebooks needs: log and warning lines of other
# libraries (the package's own lines never look like these).
_LIBRARY_LINE = re.compile(
    r"^.*(?:\bWARNING\b|Warning\b|deprecated|^INFO:|^I\d{4} |absl|oneDNN|"
    r"examples/s\]).*$", re.M)


def _notebook(name):
  return nbformat.read(os.path.join(ROOT, "colab", name), as_version=4)


@pytest.mark.parametrize("name", ["quickstart.ipynb", "tpu_training.ipynb"])
def test_notebook_runs(name, tmp_path, monkeypatch):
  monkeypatch.setenv("TEE_NOTEBOOK_STEPS", "20")
  monkeypatch.setenv("TEE_NOTEBOOK_CONFIG", os.path.join(ROOT, "configs/tiny.yaml"))
  monkeypatch.setenv("TEE_NOTEBOOK_WORKDIR", str(tmp_path / "work"))
  monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
  notebook = _notebook(name)
  NotebookClient(notebook, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": ROOT}}).execute()
  outputs = [o for c in notebook.cells if c.cell_type == "code"
             for o in c.get("outputs", [])]
  text = "".join(o.get("text", "") for o in outputs)
  # Only what a reader needs: other libraries' lines (TensorFlow's C++
  # start-up, absl, tfds' warnings and bars, TensorFlow's INFO) are in the
  # library log, not under a cell.
  assert not [o["text"] for o in outputs if o.get("name") == "stderr"]
  shown = text + "".join(o.get("data", {}).get("text/plain", "") for o in outputs)
  assert not _LIBRARY_LINE.findall(shown), _LIBRARY_LINE.findall(shown)
  assert os.path.exists(str(tmp_path / "work") + "-libraries.log")
  # The learning curve has a point per block: 20 steps in blocks of 4.
  with open(tmp_path / "work" / "history.csv") as f:
    assert [int(float(r.split(",")[0])) for r in f.read().splitlines()[1:]] == [
        4, 8, 12, 16, 20]
  assert f"tpu_embed_ext from {ROOT}" in text
  if name == "tpu_training.ipynb":
    assert "falling back to CPU emulation" in text
    assert "trained on: CPU emulation (CPUEmbedding)" in text
  else:
    assert "held-out AUC" in text
  # The learning curve is shown, and five predictions of the exported model.
  assert any("image/png" in o.get("data", {}) for o in outputs)
  predictions = [l for l in text.splitlines() if l.startswith("predicted click probability")]
  assert len(predictions) == 5
  for line in predictions:
    probability = float(line.split()[3])
    assert 0.0 < probability < 1.0


def test_quickstart_requests_no_tpu_and_the_tpu_notebook_does():
  assert "accelerator" not in _notebook("quickstart.ipynb").metadata
  assert _notebook("tpu_training.ipynb").metadata["accelerator"] == "TPU"


def _setup_cell():
  return _notebook("quickstart.ipynb").cells[1].source


def test_install_cell_on_a_fresh_runtime_clones_and_installs(tmp_path, monkeypatch):
  # A fresh runtime: the package is not importable. The cell clones the
  # repository (here: this checkout, by path) and installs it; pip is only
  # recorded, since installing would change this test's environment.
  calls = []
  real_call = subprocess.check_call

  def check_call(command, *args, **kwargs):
    calls.append(list(command))
    return real_call(command, *args, **kwargs) if command[0] == "git" else 0

  real_find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None
                      if name == "tpu_embed_ext" else real_find_spec(name, *a))
  monkeypatch.setattr(subprocess, "check_call", check_call)
  monkeypatch.setattr(sys, "path", list(sys.path))
  monkeypatch.chdir(tmp_path)
  repo = tmp_path / "content" / "tpu_embed_ext"
  monkeypatch.setenv("TEE_REPO_URL", ROOT)
  monkeypatch.setenv("TEE_NOTEBOOK_REPO_DIR", str(repo))
  namespace = {}
  exec(_setup_cell(), namespace)  # pylint: disable=exec-used
  assert calls == [["git", "clone", "--depth", "1", ROOT, str(repo)],
                   [sys.executable, "-m", "pip", "install", "-q", "-e", f"{repo}[data]"]]
  assert sys.path[0] == str(repo) and os.getcwd() == str(repo)
  assert os.path.exists(namespace["CONFIG"])  # configs/ranking.yaml of the clone.
  # Run again (a restart before the install finished): no second clone.
  calls.clear()
  exec(_setup_cell(), {})  # pylint: disable=exec-used
  assert [c[0] for c in calls] == [sys.executable]


def test_install_cell_after_a_restart_installs_nothing(tmp_path):
  # After a restart the package is installed; the kernel starts elsewhere.
  env = {**os.environ, "TEE_NOTEBOOK_REPO_DIR": str(tmp_path / "nothing_here")}
  code = _setup_cell() + "\nprint(os.getcwd()); print(os.path.exists(CONFIG))"
  out = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env={
      **env, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=600, check=True)
  assert out.stdout.splitlines() == [f"tpu_embed_ext from {ROOT}", ROOT, "True"]
  assert not (tmp_path / "nothing_here").exists()
