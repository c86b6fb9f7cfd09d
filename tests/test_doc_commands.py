"""Every command the README and the docs show runs as written, quietly.

Extracted: each line of a ```sh block in README.md and docs/**/*.md that
starts with ``python -m tpu_embed_ext``, ``tpu-embed`` or ``make`` (a trailing
``\\`` joins the next line, a ``#`` comment is dropped). They run in page
order (README first) in one scratch working directory holding a copy of
``configs/``, so that ``export`` finds what ``train`` wrote. One substitution,
the only one: in that copy ``configs/ranking.yaml`` is ``configs/tiny.yaml``
(the same commands: 60 steps on the tiny dataset instead of 1,500 steps on
500k examples). The tiny dataset is built in the session's private tfds
data_dir (tests/conftest.py), like a fresh machine would.

``make run`` is checked to run ``train --config configs/ranking.yaml``
(``make -n``); that train command runs here. ``make test`` is this suite and
``make docs`` the build of tests/test_docs.py: neither runs again.

A command with a placeholder (``FILE``, ``N``, ``DIR``, ``[--optional]``,
``a|b``) fails: the docs write commands as they run, and describe the flags
in tables. A command that succeeds prints nothing to stderr: other libraries'
log lines go to a log file (``tpu_embed_ext/host/library_log.py``), whatever
``TF_CPP_MIN_LOG_LEVEL`` says: every command runs with it at 0, where
TensorFlow logs at start-up on any CPU.

Also here: ``plan --data`` on every shipped config, and the help of the
installed ``tpu-embed`` equal to that of ``python -m tpu_embed_ext``.
"""

import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_COMMAND = re.compile(r"^(python -m tpu_embed_ext|tpu-embed|make)\b")
_PLACEHOLDER = re.compile(r"\[|\]|\||\b(FILE|N|DIR|PREFIX|PATH|T|NAME)\b|\.\.\.")
_NOT_RUN = {"make test": "this suite", "make docs": "tests/test_docs.py builds the site",
            "make bench": "benchmarks/ (minutes; benchmarks are not tests)"}
TIMEOUT = 900


def doc_commands():
  """``(page:line, command)`` of every command in a ```sh block, in page order."""
  out = []
  for page in PAGES:
    lines, i, in_sh = page.read_text().splitlines(), 0, False
    while i < len(lines):
      line = lines[i].strip()
      if line.startswith("```"):
        in_sh = line in ("```sh", "```bash", "```shell") and not in_sh
        i += 1
        continue
      start = i
      while in_sh and line.endswith("\\") and i + 1 < len(lines):
        i += 1
        line = line[:-1] + " " + lines[i].strip()
      command = line.split(" #", 1)[0].strip()
      if in_sh and _COMMAND.match(command):
        out.append((f"{page.relative_to(ROOT)}:{start + 1}", command))
      i += 1
  return out


COMMANDS = doc_commands()


def _run_with_tf_logging_on(argv, cwd, **kwargs):
  """Runs with TensorFlow's C++ logging on (TF_CPP_MIN_LOG_LEVEL=0): it logs at
  start-up on any CPU, and a command's stderr must still be its own lines."""
  env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "0"}
  return subprocess.run(argv, cwd=cwd, capture_output=True, text=True,
                        timeout=TIMEOUT, env=env, **kwargs)


def _argv(command: str):
  words = shlex.split(command)
  if words[0] == "python":
    return [sys.executable] + words[1:]
  if words[0] == "tpu-embed":
    return [str(pathlib.Path(sys.executable).parent / "tpu-embed")] + words[1:]
  return words


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """The scratch directory: configs/ copied, ranking.yaml swapped for tiny.yaml."""
  path = tmp_path_factory.mktemp("docs_commands")
  shutil.copytree(ROOT / "configs", path / "configs")
  shutil.copy(ROOT / "configs" / "tiny.yaml", path / "configs" / "ranking.yaml")
  return path


def test_the_docs_show_commands():
  pages = {where.split(":")[0] for where, _ in COMMANDS}
  assert {"README.md", "docs/cli.md"} <= pages
  assert any(" train " in c for _, c in COMMANDS)
  assert any("convert-checkpoint" in c and "--prefix" not in c for _, c in COMMANDS)


@pytest.mark.parametrize("where,command", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_command_runs_as_written(where, command, workdir):
  assert not _PLACEHOLDER.search(command.replace("--topology v5p:4", "")), (
      f"{where}: a placeholder in {command!r}: write the command as it runs")
  if command.startswith("make"):
    target = command.split()[1]
    if command in _NOT_RUN:
      pytest.skip(f"{command}: {_NOT_RUN[command]}")
    assert target == "run", f"{where}: no rule for {command!r} in this test"
    plan = _run_with_tf_logging_on(["make", "-n", "run"], ROOT)
    assert "-m tpu_embed_ext train --config configs/ranking.yaml" in plan.stdout
    command = "python -m tpu_embed_ext train --config configs/ranking.yaml"
  out = _run_with_tf_logging_on(_argv(command), workdir)
  assert out.returncode == 0, f"{where}: {command}\n{out.stdout}\n{out.stderr}"
  assert not out.stderr.strip(), f"{where}: {command} wrote to stderr:\n{out.stderr}"


def test_help_is_the_same_for_both_entry_points(tmp_path):
  module = _run_with_tf_logging_on([sys.executable, "-m", "tpu_embed_ext", "--help"], tmp_path)
  script = _run_with_tf_logging_on(_argv("tpu-embed --help"), tmp_path)
  assert module.returncode == script.returncode == 0
  assert module.stdout == script.stdout
  for command in ("plan", "train", "export", "convert-checkpoint", "emulate"):
    assert f"\n  {command}: " in module.stdout
  for command, flags in (("plan", ("--config", "--data")),
                         ("train", ("--config", "--steps", "--model_dir")),
                         ("export", ("--out",)),
                         ("convert-checkpoint", ("--prefix", "--checkpoint"))):
    module = _run_with_tf_logging_on([sys.executable, "-m", "tpu_embed_ext", command, "--help"], tmp_path)
    script = _run_with_tf_logging_on(_argv(f"tpu-embed {command} --help"), tmp_path)
    assert module.returncode == script.returncode == 0
    assert module.stdout == script.stdout
    for flag in flags:
      assert f"\n  {flag}\n" in module.stdout
    assert f"examples:\n  tpu-embed {command} --config" in module.stdout


CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS)
def test_plan_data_works_for_every_shipped_config(config, tmp_path):
  """``plan --data`` on each config as shipped (movielens: tfds's mock data,
  as it downloads otherwise; ranking builds synthetic_clicks/default)."""
  if config == "movielens.yaml":
    import tensorflow_datasets as tfds
    from tests import test_train
    from tpu_embed_ext.cli import main as cli
    argv = ["tpu_embed_ext", "plan", "--config", f"configs/{config}",
            "--engine", "v2", "--topology", "v5p:4", "--data", "2"]
    with tfds.testing.mock_data(as_dataset_fn=test_train._movielens_examples):  # pylint: disable=protected-access
      assert cli.main(argv) == 0
    return
  path = ROOT / "configs" / config
  if config == "criteo.yaml":
    # Its tables without its train: section: a spec that names no dataset,
    # measured on ids drawn from the spec (Criteo's own vocabularies).
    import yaml
    spec_only = yaml.safe_load((ROOT / "configs" / config).read_text())
    del spec_only["train"]
    path = tmp_path / config
    path.write_text(yaml.safe_dump(spec_only))
  if config == "ranking.yaml":
    # The substitution of test_command_runs_as_written: the same config on
    # the tiny dataset (building the default one, 500k examples, takes two
    # minutes, and the code that reads either is the same).
    path = tmp_path / config
    path.write_text((ROOT / "configs" / config).read_text().replace(
        "synthetic_clicks/default", "synthetic_clicks/tiny"))
  out = _run_with_tf_logging_on([sys.executable, "-m", "tpu_embed_ext", "plan", "--config",
              str(path), "--engine", "v2", "--topology", "v5p:4",
              "--data", "2"], tmp_path)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "SparseCore input per step on" in out.stdout
  if config == "criteo.yaml":  # No train: section: ids drawn from the spec.
    assert ("measured on 2 batches of 512 examples drawn from the spec (zipf ids "
            "over each table's vocabulary; the config names no dataset).") in out.stdout
  else:
    assert "measured on 2 training batches of synthetic_clicks/" in out.stdout
