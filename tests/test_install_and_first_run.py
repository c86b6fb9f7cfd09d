"""A new user's first hour: what the install and the first run
say while they work, what they build, and what the docs point to.

The notebooks (test_notebooks.py), the printed commands (test_wheel.py) and
the CLI's own lines (test_cli.py) are tested beside their code.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent


# --- make install, make dist -------------------------------------------------------

def test_make_install_says_each_stage_and_its_cost_before_it_runs():
  plan = subprocess.run(["make", "-n", "-B", "install"], cwd=ROOT, capture_output=True,
                        text=True, timeout=60, check=True).stdout
  stages = re.findall(r'echo "make install: (\d)/3 ([^"]*)"', plan)
  assert [n for n, _ in stages] == ["1", "2", "3"], plan
  for _, text in stages:  # Each says what it costs.
    assert re.search(r"\(a few seconds\)|about \d+ (minutes?|seconds)", text), text
  assert "installing TensorFlow (cpu) and tpu_embed_ext, about 2 minutes" in plan
  # Each stage's line comes before its command; the kernels' compile is
  # announced by the loader itself (the test below), not twice.
  assert plan.index("2/3") < plan.index("install -e '.[cpu]'")
  assert plan.index("3/3") < plan.index("install -e '.[cpu,test]'")
  assert "compiling" not in plan.lower()


def test_make_dist_builds_the_wheel_and_the_sdist_with_the_configs(tmp_path):
  for name in ("Makefile", "setup.py"):
    shutil.copy(ROOT / name, tmp_path)
  ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
  for name in ("tpu_embed_ext", "configs"):
    shutil.copytree(ROOT / name, tmp_path / name, ignore=ignore)
  venv = os.path.dirname(os.path.dirname(sys.executable))
  done = subprocess.run(["make", "dist", f"VENV={venv}"], cwd=tmp_path,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout + done.stderr
  wheel, = (tmp_path / "dist").glob("tpu_embed_ext-0.1.0-*.whl")
  sdist, = (tmp_path / "dist").glob("tpu_embed_ext-0.1.0.tar.gz")
  names = zipfile.ZipFile(wheel).namelist()
  for config in ("tiny", "ranking", "criteo", "movielens"):
    assert f"tpu_embed_ext/configs/{config}.yaml" in names
  assert "tpu_embed_ext/emulation/native/lookup_op.cc" in names
  members = tarfile.open(sdist).getnames()
  assert "tpu_embed_ext-0.1.0/configs/tiny.yaml" in members
  assert "tpu_embed_ext-0.1.0/tpu_embed_ext/emulation/native/update_op.cc" in members
  assert not (tmp_path / "build").exists() and not list(tmp_path.glob("*.egg-info"))


# --- the native kernels' compile: said once, with its duration ----------------------

def test_the_kernel_compile_is_announced_once_with_its_duration(
    tmp_path, monkeypatch, capsys):
  """A first run compiles (here a one-line source, not the kernels: the
  announcement is the loader's, whatever it compiles); a second finds the
  library and says nothing."""
  from tpu_embed_ext.emulation.native import loader
  source = tmp_path / "tiny_op.cc"
  source.write_text("extern \"C\" int tpu_embed_ext_test() { return 1; }\n")
  monkeypatch.setenv("TPU_EMBED_EXT_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setattr(loader, "_sources", lambda: [str(source)])
  directory = loader.build()
  assert os.path.exists(os.path.join(directory, loader.LIBRARY))
  out = capsys.readouterr().out
  assert re.fullmatch(re.escape(loader.COMPILING) + r" done in \d+ s\.\n", out), out
  assert loader.build() == directory
  assert capsys.readouterr().out == ""


# --- the learning curve's ceiling ----------------------------------------------------

def test_the_learning_curve_draws_the_planted_model_ceiling(tmp_path, monkeypatch):
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib.axes import Axes
  from tpu_embed_ext.job import outputs
  for step, auc in ((10, 0.61), (20, 0.66)):
    outputs.append_history(str(tmp_path), {"step": step, "loss": 0.6, "auc": auc,
                                           "eval_loss": 0.62, "eval_auc": auc - 0.01})
  lines = []
  real = Axes.axhline

  def axhline(self, y=0, *args, **kwargs):
    lines.append((self.get_title(), y, kwargs.get("label")))
    return real(self, y, *args, **kwargs)
  monkeypatch.setattr(Axes, "axhline", axhline)
  outputs.plot_learning_curve(str(tmp_path))  # No metrics.json yet: no line.
  assert lines == []
  (tmp_path / "metrics.json").write_text('{"planted_auc": 0.7312}')
  outputs.plot_learning_curve(str(tmp_path))
  assert [(y, label) for _, y, label in lines] == [
      (0.7312, "planted model 0.7312 (the ceiling)")]
  assert (tmp_path / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"


# --- docs ------------------------------------------------------------------------------

def _nav_pages(node):
  if isinstance(node, str):
    return [node]
  if isinstance(node, dict):
    return [p for v in node.values() for p in _nav_pages(v)]
  return [p for v in node for p in _nav_pages(v)]


def test_the_docs_home_page_links_every_page_of_the_site():
  with open(ROOT / "mkdocs.yml") as f:
    text = f.read()
  nav = yaml.safe_load(text[text.index("\nnav:"):])["nav"]
  home = ("index", "api", "cli")  # The home page; two linked in its table already.
  pages = [p for p in _nav_pages(nav) if p[:-len(".md")] not in home]
  guides = {f"guides/{p.name}" for p in (ROOT / "docs" / "guides").glob("*.md")}
  assert guides <= set(pages)
  index = (ROOT / "docs/index.md").read_text()
  missing = [p for p in pages if f"]({p})" not in index]
  assert not missing, missing


def test_the_readme_says_how_long_make_test_takes_and_how_to_open_a_notebook():
  readme = (ROOT / "README.md").read_text()
  assert "make test   # run the whole test suite: about 30 minutes on a 2-core machine" in readme
  assert "**To open one in Colab**: File > Upload notebook" in readme
  assert "<!-- docs-test: fragment (my_job.py is yours;" in readme
