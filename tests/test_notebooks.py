"""Both Colab notebooks, as a Colab user gets them: in a fresh virtualenv that
holds Jupyter and nothing of this package, with the wheel uploaded to the
working directory and an empty HOME. The first cell installs the wheel (with
TensorFlow and the data tools, from the package index, as on a runtime
without them); the notebook then runs top to bottom on CPU (small sizes),
shows the learning curve and five predictions of the exported model. Run
again after a simulated restart (installed already, another working
directory without the wheel), it installs nothing and changes no directory.

The TPU notebook's TPU branch runs under the emulated TPU: the same notebook
file, executed by nbclient in a kernel whose process is started by
``python -m tpu_embed_ext emulate --replicas 2 -m ipykernel_launcher -f
{connection_file}`` (a kernelspec in the run's JUPYTER_DATA_DIR). Nothing in
the notebook is set or patched for the test: its own
``TPUClusterResolver()``, ``initialize_tpu_system`` and ``TPUStrategy`` find
the emulated TPU, as on a Colab TPU runtime they find the real one (whose
kernel has a TPU; ours has the emulation), and ``train(CONFIG, tpu="auto")``
takes the job's TPU path. Chosen over an environment variable the notebook
would read: that would be a branch of the notebook no Colab user runs.

No ``--system-site-packages``: a dependency the wheel does not declare fails
here. One virtualenv for the module; pip's cache makes the second install of
TensorFlow fast. The install cell's other routes (a git URL, the index by
name, none: one line naming them all) are checked with pip recorded.
"""

import glob
import json
import os
import re
import subprocess
import sys
import textwrap

import nbformat
import pytest

from tests import wheel_build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMULATED_KERNEL = "tee-emulated-tpu"
# Lines no reader of the notebooks needs: log and warning lines of other
# libraries (the package's own lines never look like these).
_LIBRARY_LINE = re.compile(
    r"^.*(?:\bWARNING\b|Warning\b|deprecated|^INFO:|^I\d{4} |absl|oneDNN|"
    r"examples/s\]).*$", re.M)
# Runs a notebook with the virtualenv's Python and its own ipykernel.
_EXECUTE = textwrap.dedent("""
    import sys, nbformat
    from nbclient import NotebookClient
    notebook = nbformat.read(sys.argv[1], as_version=4)
    # A last cell: where the kernel's working directory is at the end.
    notebook.cells.append(nbformat.v4.new_code_cell('print("cwd at the end:", os.getcwd())'))
    try:
      NotebookClient(notebook, timeout=900, kernel_name=sys.argv[4],
                     resources={"metadata": {"path": sys.argv[3]}}).execute()
    finally:
      nbformat.write(notebook, sys.argv[2])
""")


def _notebook(name):
  return nbformat.read(os.path.join(ROOT, "colab", name), as_version=4)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
  """A fresh virtualenv with Jupyter (nbclient, ipykernel) only, the wheel,
  and a run() that executes a notebook in it from a given directory."""
  root = tmp_path_factory.mktemp("colab")
  wheel = wheel_build.build_wheel(root)
  subprocess.run([sys.executable, "-m", "venv", str(root / "env")], check=True,
                 timeout=300)
  python = root / "env" / "bin" / "python"
  wheel_build.pip("install", "nbclient", "nbformat", "ipykernel", python=python)
  home = root / "home"
  home.mkdir()
  # The emulated TPU's kernel: ipykernel run by the emulate command (the
  # package must be installed in the virtualenv before it starts).
  spec = root / "jupyter" / "kernels" / EMULATED_KERNEL
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(json.dumps({
      "argv": [str(python), "-m", "tpu_embed_ext", "emulate", "--replicas", "2",
               "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "Python 3 (emulated TPU, 2 cores)", "language": "python"}))

  def run(name, cwd, workdir, kernel="python3"):
    out = root / f"executed-{len(os.listdir(root))}.ipynb"
    env = wheel_build.clean_env(
        root / "env", home, TEE_NOTEBOOK_STEPS="20", TEE_NOTEBOOK_CONFIG="tiny",
        TEE_NOTEBOOK_WORKDIR=str(workdir), TF_CPP_MIN_LOG_LEVEL="3",
        JUPYTER_DATA_DIR=str(root / "jupyter"),
        # The compile (about 40 s, announced: test_native_kernels) is not
        # what this test is about; the TensorFlow-op path gives the same.
        TPU_EMBED_EXT_KERNELS="tf")
    done = subprocess.run(
        [str(python), "-c", _EXECUTE, os.path.join(ROOT, "colab", name), str(out),
         str(cwd), kernel], cwd=str(cwd), env=env, capture_output=True, text=True,
        timeout=1200, check=False)
    executed = nbformat.read(str(out), as_version=4) if out.exists() else None
    assert done.returncode == 0, (done.stderr[-4000:], _text(executed)[-4000:])
    return executed

  content = root / "content"  # Colab's working directory.
  content.mkdir()
  return {"run": run, "wheel": wheel, "content": content, "root": root,
          "site": str(root / "env" / "lib"), "python": python}


def _outputs(notebook):
  return [o for c in notebook.cells if c.cell_type == "code"
          for o in c.get("outputs", [])]


def _text(notebook):
  if notebook is None:
    return ""
  return "".join(o.get("text", "") + o.get("evalue", "") + "".join(o.get("traceback", []))
                 for o in _outputs(notebook))


def _check_run(notebook, name, workdir, cwd, tpu=False):
  outputs = _outputs(notebook)
  text = _text(notebook)
  # Only what a reader needs: other libraries' lines (TensorFlow's C++
  # start-up, absl, tfds' warnings and bars, TensorFlow's INFO) are in the
  # library log, not under a cell.
  assert not [o["text"] for o in outputs if o.get("name") == "stderr"]
  shown = text + "".join(o.get("data", {}).get("text/plain", "") for o in outputs)
  assert not _LIBRARY_LINE.findall(shown), _LIBRARY_LINE.findall(shown)
  assert os.path.exists(str(workdir) + "-libraries.log")
  # The learning curve has a point per block: 20 steps in blocks of 4.
  with open(workdir / "history.csv") as f:
    assert [int(float(r.split(",")[0])) for r in f.read().splitlines()[1:]] == [
        4, 8, 12, 16, 20]
  if tpu:
    # The notebook's own resolver found the emulated TPU; the job took its
    # TPU path (TPUStrategy, TPUEmbedding) and says so, never "a TPU".
    assert ("Found an emulated TPU (tpu_embed_ext.emulate_tpu, not a real TPU), "
            "2 cores, embedding_feature V1: training with TPUEmbedding.\n") in text
    assert "Training on emulated TPU, 2 replicas (TPUEmbedding)." in text
    assert "trained on: emulated TPU, 2 replicas (TPUEmbedding)\n" in text
    assert "No TPU attached" not in text and "CPUEmbedding" not in text
    assert re.search(r"^exported to \S+serving$", text, re.M), text[-2000:]
  elif name == "tpu_training.ipynb":
    assert "No TPU attached to this runtime: falling back to CPU emulation." in text
    assert "trained on: CPU emulation (CPUEmbedding)" in text
  else:
    assert "held-out AUC" in text
  assert any("image/png" in o.get("data", {}) for o in outputs)
  predictions = [l for l in text.splitlines()
                 if l.startswith("predicted click probability")]
  assert len(predictions) == 5
  for line in predictions:
    assert 0.0 < float(line.split()[3]) < 1.0
  # The package from the virtualenv's site-packages, and no chdir into it.
  found = re.search(r"^tpu_embed_ext 0\.1\.0 from (\S+)$", text, re.M)
  assert found, text[-2000:]
  assert f"cwd at the end: {cwd}\n" in text
  return text, found.group(1)


@pytest.mark.parametrize("name", ["quickstart.ipynb", "tpu_training.ipynb"])
def test_notebook_on_a_fresh_runtime_and_after_a_restart(runtime, name):
  site = runtime["site"]
  content = runtime["content"]
  for leftover in glob.glob(str(content / "*.whl")):
    os.remove(leftover)
  # A fresh runtime: uninstalled (the first notebook's install, if any, gone;
  # its dependencies stay, as pip's cache would make them quick).
  wheel_build.pip("uninstall", "-y", "tpu_embed_ext", python=runtime["python"])
  upload = content / runtime["wheel"].name
  upload.write_bytes(runtime["wheel"].read_bytes())
  workdir = runtime["root"] / f"work-{name}"
  text, where = _check_run(runtime["run"](name, content, workdir), name, workdir,
                           content)
  install = [l for l in text.splitlines() if l.startswith("installing ")]
  assert len(install) == 1 and install[0].startswith(f"installing {upload}["), install
  assert where.startswith(site), where  # The wheel's install, not the clone.
  # A restart: installed already. Run from elsewhere (a local Jupyter, no
  # wheel there): nothing installed, the finished model_dir trains nothing.
  elsewhere = runtime["root"] / f"elsewhere-{name}"
  elsewhere.mkdir()
  text, again = _check_run(runtime["run"](name, elsewhere, workdir), name, workdir,
                           elsewhere)
  assert "installing " not in text and again == where
  assert "Already trained to step 20 (asked for 20): nothing to do" in text


def test_quickstart_requests_no_tpu_and_the_tpu_notebook_does():
  assert "accelerator" not in _notebook("quickstart.ipynb").metadata
  assert _notebook("tpu_training.ipynb").metadata["accelerator"] == "TPU"


@pytest.mark.parametrize("name", ["quickstart.ipynb", "tpu_training.ipynb"])
def test_notebooks_say_how_to_open_them_and_name_shipped_configs(name):
  notebook = _notebook(name)
  first = notebook.cells[0]
  assert first.cell_type == "markdown"
  assert "**Open it in Colab:** File > Upload notebook" in first.source
  assert "make dist" in first.source and "REPO_URL" in first.source
  code = "\n".join(c.source for c in notebook.cells if c.cell_type == "code")
  assert "configs/" not in code and "chdir" not in code
  assert 'os.environ.get("TEE_NOTEBOOK_CONFIG", "ranking")' in code


# --- the install cell's routes, pip recorded ------------------------------------

def _setup_cell():
  return _notebook("quickstart.ipynb").cells[1].source


def _run_setup(monkeypatch, tmp_path, returncode=0, url=""):
  """Runs the install cell as on a runtime without the package; returns the
  pip command it ran (recorded, not run) and the cell's namespace."""
  import importlib.util
  calls = []

  def run(command, **kwargs):
    calls.append(list(command))
    return subprocess.CompletedProcess(command, returncode, "",
                                       "ERROR: No matching distribution found")
  real_find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None
                      if n == "tpu_embed_ext" else real_find_spec(n, *a))
  monkeypatch.setattr(subprocess, "run", run)
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("TEE_REPO_URL", url)
  namespace = {}
  exec(_setup_cell(), namespace)  # pylint: disable=exec-used
  return calls, namespace


def test_install_cell_routes_in_order(monkeypatch, tmp_path, capsys):
  # TensorFlow is importable here, as on Colab: only [data] is added.
  calls, namespace = _run_setup(monkeypatch, tmp_path, url="https://example.org/t.git")
  assert calls == [[sys.executable, "-m", "pip", "install", "-q",
                    "tpu_embed_ext[data] @ git+https://example.org/t.git"]]
  assert namespace["CONFIG"] == "ranking"
  (tmp_path / "tpu_embed_ext-0.1.0-py3-none-any.whl").write_text("")
  calls, _ = _run_setup(monkeypatch, tmp_path, url="https://example.org/t.git")
  assert calls[0][-1] == f"{tmp_path}/tpu_embed_ext-0.1.0-py3-none-any.whl[data]"
  os.remove(tmp_path / "tpu_embed_ext-0.1.0-py3-none-any.whl")
  calls, _ = _run_setup(monkeypatch, tmp_path)
  assert calls[0][-1] == "tpu_embed_ext[data]"  # The index, by name.
  assert os.getcwd() == str(tmp_path)
  out = capsys.readouterr().out
  assert "installing tpu_embed_ext[data] (about 1 minute; 3 with TensorFlow)..." in out


def test_install_cell_without_a_route_says_every_one_in_one_line(monkeypatch, tmp_path):
  with pytest.raises(RuntimeError) as info:
    _run_setup(monkeypatch, tmp_path, returncode=1)
  assert str(info.value) == (
      "tpu_embed_ext is not installed and could not be installed from "
      "tpu_embed_ext[data] (ERROR: No matching distribution found). Fix, one of: "
      "upload its wheel (tpu_embed_ext-*.whl, from `make dist`) to "
      f"{tmp_path}; set REPO_URL at the top of this cell (or TEE_REPO_URL) to its "
      "git URL; or, once it is published, pip install tpu_embed_ext.")


def test_tpu_notebook_trains_on_the_emulated_tpu(runtime):
  """The TPU branch: the notebook, unchanged, in the emulated TPU's kernel
  (module docstring). Installed already, as after a restart (the kernel's
  process imports the package before the first cell runs); a new model_dir,
  so it trains: 20 steps of tiny on 2 replicas, the learning curve, export and
  five predictions."""
  wheel_build.pip("install", f"{runtime['wheel']}[cpu,data]", python=runtime["python"])
  workdir = runtime["root"] / "work-emulated-tpu"
  content = runtime["content"]
  notebook = runtime["run"]("tpu_training.ipynb", content, workdir,
                            kernel=EMULATED_KERNEL)
  text, where = _check_run(notebook, "tpu_training.ipynb", workdir, content, tpu=True)
  assert where.startswith(runtime["site"]), where
  assert "installing " not in text
  # The learning curve was drawn from this run and displayed under its cell.
  assert os.path.getsize(workdir / "learning_curve.png") > 0


# --- the TPU notebook's detection cell, per embedding feature -------------------

def _detection_cell():
  cell, = [c.source for c in _notebook("tpu_training.ipynb").cells
           if c.cell_type == "code" and "TPUClusterResolver()" in c.source]
  return cell


_UNSUPPORTED = ("Found an emulated TPU (tpu_embed_ext.emulate_tpu, not a real TPU), 2 "
                "cores, whose embedding_feature is UNSUPPORTED (no embedding "
                "accelerator), so TPUEmbedding cannot run on it (TensorFlow: "
                "https://www.tensorflow.org/api_docs/python/tf/tpu/experimental/"
                "HardwareFeature/EmbeddingFeature): training on CPU emulation instead.\n")


@pytest.mark.parametrize("feature, tpu, printed", [
    pytest.param(None, "auto", "Found an emulated TPU (tpu_embed_ext.emulate_tpu, not a "
                 "real TPU), 2 cores, embedding_feature V1: training with "
                 "TPUEmbedding.\n", marks=pytest.mark.emulate_tpu(replicas=2), id="V1"),
    pytest.param(None, "auto", "Found an emulated TPU (tpu_embed_ext.emulate_tpu, not a "
                 "real TPU), 2 cores, embedding_feature V2: training with "
                 "TPUEmbeddingV2 (SparseCore).\n",
                 marks=pytest.mark.emulate_tpu(replicas=2, sparsecore=True,
                                                  topology="v5p:2"), id="V2"),
    pytest.param("UNSUPPORTED", "none", _UNSUPPORTED,
                 marks=pytest.mark.emulate_tpu(replicas=2), id="UNSUPPORTED"),
])
def test_tpu_notebook_detection_cell_reads_the_embedding_feature(
    emulated_tpu, monkeypatch, capsys, feature, tpu, printed):
  """The notebook's own detection cell (its source, run here under the
  emulated TPU): V1 and V2 take the TPU path (``tpu="auto"``); a TPU that
  reports no embedding accelerator (as the emulation never does: its reported
  feature is replaced) gets one line, with TensorFlow's source, before
  anything is built, and the CPU emulation."""
  del emulated_tpu
  if feature is not None:
    from tensorflow.core.protobuf.tpu import topology_pb2
    from tensorflow.python.tpu import tpu_hardware_feature
    from tpu_embed_ext.emulated_tpu import strategy as emulated_strategy
    proto = topology_pb2.TPUHardwareFeature(
        embedding_feature=getattr(topology_pb2.TPUHardwareFeature.EmbeddingFeature,
                                  feature))
    monkeypatch.setattr(emulated_strategy, "hardware_feature",
                        lambda _: tpu_hardware_feature.HardwareFeature(proto))
  namespace = {}
  exec(_detection_cell(), namespace)  # pylint: disable=exec-used
  assert namespace["TPU"] == tpu
  assert capsys.readouterr().out == printed


@pytest.mark.parametrize("printed", [
    pytest.param("emulated TPU, 2 replicas (TPUEmbedding)",
                 marks=pytest.mark.emulate_tpu(replicas=2), id="V1"),
    pytest.param("emulated TPU v5p:2 (2 chips x 4 SparseCores), 2 replicas "
                 "(TPUEmbeddingV2, SparseCore)",
                 marks=pytest.mark.emulate_tpu(replicas=2, sparsecore=True,
                                               topology="v5p:2"), id="V2"),
])
def test_tpu_auto_under_the_emulation_names_it(emulated_tpu, printed):
  """What the notebook's ``train(CONFIG, tpu="auto")`` prints after "Training
  on": the emulated TPU's resolver, named as the emulation, never as a TPU, and
  the embedding API its hardware takes."""
  del emulated_tpu
  from tpu_embed_ext.job import strategy as strategy_lib
  strategy, where = strategy_lib.resolve_strategy("auto")
  assert strategy is not None and where == printed
