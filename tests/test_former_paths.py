"""Former module paths (``MOVED``) are aliases: they never touch the real
module's spec, the real modules reload and give their resources, and the
public names the former modules had resolve on the former paths (issue 42).

Each case runs in a fresh interpreter: which path is imported first is the
point, and reloading modules would disturb the other tests' classes.
"""

import os
import pickle
import subprocess
import sys
import textwrap

import pytest

import tpu_embed_ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 180  # seconds per interpreter; they take a few.


def _run(code: str) -> str:
  done = subprocess.run(
      [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
      timeout=LIMIT, check=False, cwd=ROOT,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  assert done.returncode == 0, done.stdout + done.stderr[-3000:]
  return done.stdout


def test_a_former_path_leaves_the_real_modules_spec_reload_and_resources():
  out = _run("""
      import importlib, importlib.resources, pkgutil
      import tpu_embed_ext.job as job
      from tpu_embed_ext.cli import text_table
      spec, table_spec = job.__spec__, text_table.__spec__
      import tpu_embed_ext.train, tpu_embed_ext.text_table
      assert job.__spec__ is spec and text_table.__spec__ is table_spec
      assert tpu_embed_ext.train.__spec__.name == "tpu_embed_ext.train"
      # importlib.resources: TypeError before the fix (the alias's loader).
      assert importlib.resources.files("tpu_embed_ext.job").joinpath("loop.py").is_file()
      assert b"def train" in pkgutil.get_data("tpu_embed_ext.job", "loop.py")
      assert "loop" in [m.name for m in pkgutil.iter_modules(job.__path__)]
      assert pkgutil.resolve_name("tpu_embed_ext.train:train") is job.train
      # reload runs the real module again, under its own name.
      text_table.lines = None
      assert importlib.reload(text_table) is text_table
      assert text_table.__name__ == "tpu_embed_ext.cli.text_table"
      assert callable(text_table.lines)
      assert importlib.reload(job).__name__ == "tpu_embed_ext.job"
      # The alias reloads too, and still reads the real module.
      again = importlib.reload(tpu_embed_ext.text_table)
      assert again.lines is text_table.lines
      print("ok")
      """)
  assert out == "ok\n"


def test_an_alias_reads_writes_and_patches_the_real_module():
  out = _run("""
      from unittest import mock
      import tpu_embed_ext as tee
      from tpu_embed_ext.spec import optimizers
      former = tee.optimizers
      assert former.SGD is optimizers.SGD and former.__file__ == optimizers.__file__
      with mock.patch("tpu_embed_ext.optimizers.SGD") as patched:
        assert optimizers.SGD is patched
      assert optimizers.SGD.__name__ == "SGD"
      former.EXTRA = 1
      assert optimizers.EXTRA == 1
      del former.EXTRA
      assert not hasattr(optimizers, "EXTRA")
      assert set(dir(optimizers)) <= set(dir(former))
      try:
        import tpu_embed_ext.train.loop
      except ModuleNotFoundError as e:
        print(e)
      try:
        former.nothing
      except AttributeError as e:
        print(e)
      """)
  assert out.splitlines() == [
      "No module named 'tpu_embed_ext.train.loop'; 'tpu_embed_ext.train' is not a package",
      "module 'tpu_embed_ext.optimizers' (now tpu_embed_ext.spec.optimizers) has no "
      "attribute 'nothing'"]


# The public names (``__all__``) of each former module before the layout move
# (git show ad6fa0e^:tpu_embed_ext/<name>.py) that are not in their new module.
LOST = {
    "learning_rates": ["RateBinder", "assign_tags", "check_tag_rules", "describe",
                       "value_at", "SCHEDULE_CLASSES"],
    "text_table": ["human_bytes"],
    "sparsecore.report": ["measure_training_data"],
    "__main__": ["where_everything_went", "main", "run",
                 "COMMANDS"],  # Documented in its docstring, not in __all__.
}


def test_the_former_modules_public_names_resolve():
  out = _run(f"""
      import importlib
      lost = {LOST!r}
      for former, names in lost.items():
        module = importlib.import_module("tpu_embed_ext." + former)
        for name in names:
          value = getattr(module, name)
          assert value is not None, (former, name)
          assert name in dir(module), (former, name)
        if former != "__main__":
          assert set(names) <= set(module.__all__), former
      rates = importlib.import_module("tpu_embed_ext.learning_rates")
      from tpu_embed_ext.tf import tags
      assert rates.assign_tags is tags.assign_tags
      assert sorted(rates.SCHEDULE_CLASSES)[0] == "CosineDecay"
      print(importlib.import_module("tpu_embed_ext.text_table").human_bytes(2048))
      """)
  assert out == "2.0 KiB\n"


def test_every_lost_name_is_in_moved_names():
  assert {f: sorted(n) for f, n in tpu_embed_ext.MOVED_NAMES.items()} == {
      f: sorted(n) for f, n in LOST.items() if f != "__main__"}


def test_a_plan_pickles():
  plan = tpu_embed_ext.plan(os.path.join(ROOT, "configs", "tiny.yaml"))
  again = pickle.loads(pickle.dumps(plan))
  assert type(again) is tpu_embed_ext.Plan
  assert again.spec == plan.spec and str(again) == str(plan)
