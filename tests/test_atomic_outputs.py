"""Outputs appear whole or not at all, never overwrite inputs, and I/O faults
are one-line errors (tpu_embed_ext/host/atomic.py, checkpoint conversion).

Kills are real: a child process SIGKILLs itself right after its N-th
``rename`` of the swap, for every N, and the output found afterwards (after
``atomic.recover``, which every reader of the package calls) is the old
complete one or the new complete one. Full and read-only disks are real
tmpfs mounts where the test may mount (root in a container); elsewhere those
cases are skipped, and the monkeypatched ENOSPC test still runs.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tests import mounts
from tpu_embed_ext.host import atomic
from tpu_embed_ext.host import model_dir as model_dir_lib
from tpu_embed_ext.sparsecore import convert_checkpoint

TINY = "configs/tiny.yaml"


def _checkpoint(path, value):
  v = tf.Variable(tf.fill([64, 8], float(value)))
  w = tf.Variable(tf.fill([5], float(value)))
  return tf.train.Checkpoint(v=v, w=w).write(str(path))


def _value(prefix):
  reader = tf.train.load_checkpoint(prefix)
  v = reader.get_tensor("v/.ATTRIBUTES/VARIABLE_VALUE")
  w = reader.get_tensor("w/.ATTRIBUTES/VARIABLE_VALUE")
  assert (v == v.flat[0]).all() and (w == v.flat[0]).all()  # a consistent pair
  return float(v.flat[0])


# The child imports atomic.py without the package's __init__ (no TensorFlow:
# it starts in a fraction of a second) and stages a copy of a ready-made
# checkpoint.
_KILL_AFTER_RENAMES = textwrap.dedent("""
  import os, shutil, signal, sys, types
  package = types.ModuleType("tpu_embed_ext")
  package.__path__ = [sys.argv[5]]
  sys.modules["tpu_embed_ext"] = package
  from tpu_embed_ext.host import atomic
  mode, target, n, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
  count = [0]
  real = os.rename
  def rename(a, b):
    real(a, b)
    count[0] += 1
    if count[0] == n:
      os.kill(os.getpid(), signal.SIGKILL)
  if mode == "prefix":
    with atomic.write_prefix(target) as staging:
      for name in atomic.prefix_files(new):
        shutil.copy(name, staging + name[len(new):])
      if n == 0:
        os.kill(os.getpid(), signal.SIGKILL)
      os.rename = rename
  else:
    if mode == "dir_no_exchange":
      atomic._exchange = lambda a, b: False
    with atomic.write_dir(target) as tmp:
      for name in ("a", "b"):
        with open(os.path.join(tmp, name), "w") as f:
          f.write("new")
      if n == 0:
        os.kill(os.getpid(), signal.SIGKILL)
      os.rename = rename
""")


def _kill_after(mode, target, n, new=""):
  package = os.path.dirname(os.path.dirname(atomic.__file__))  # tpu_embed_ext/
  return subprocess.run([sys.executable, "-c", _KILL_AFTER_RENAMES, mode, str(target),
                         str(n), str(new), package], capture_output=True, text=True,
                        timeout=600)


def test_checkpoint_prefix_killed_after_every_rename_is_old_or_new(tmp_path):
  # Old: one data file + index. The swap renames 2 old files away, 2 new in.
  new = _checkpoint(tmp_path / "new" / "ckpt", 2.0)
  seen = set()
  for n in range(0, 6):
    target = tmp_path / f"n{n}" / "out"
    _checkpoint(target, 1.0)
    out = _kill_after("prefix", target, n, new)
    assert out.returncode == (0 if n == 5 else -9), out.stderr
    atomic.recover(str(target))
    seen.add(_value(str(target)))
    assert sorted(os.listdir(target.parent)) == [
        "out.data-00000-of-00001", "out.index"], n  # leftovers cleaned
  assert seen == {1.0, 2.0}


@pytest.mark.parametrize("mode", ["dir", "dir_no_exchange"])
def test_directory_killed_after_every_rename_is_old_or_new(tmp_path, mode):
  seen = set()
  for n in range(0, 4):
    target = tmp_path / f"n{n}" / "serving"
    target.mkdir(parents=True)
    for name in ("a", "b"):
      (target / name).write_text("old")
    out = _kill_after(mode, target, n)
    assert out.returncode in (0, -9), out.stderr
    atomic.recover(str(target))
    contents = {(target / name).read_text() for name in ("a", "b")}
    assert len(contents) == 1, contents  # never a mix
    seen |= contents
    assert os.listdir(target.parent) == ["serving"], n
  assert seen == {"old", "new"}


def test_write_file_error_keeps_the_old_file_and_leaves_nothing(tmp_path):
  path = tmp_path / "metrics.json"
  atomic.write_text(str(path), "old")
  with pytest.raises(RuntimeError):
    with atomic.write_file(str(path)) as f:
      f.write("half")
      raise RuntimeError("killed")
  assert path.read_text() == "old" and os.listdir(tmp_path) == ["metrics.json"]


def test_leftovers_of_dead_processes_are_cleaned_and_not_of_live_ones(tmp_path):
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True).stdout.strip()
  (tmp_path / f".x.tmp-{dead}-0").write_text("partial")
  (tmp_path / f".x.tmp-{os.getpid()}-99").write_text("mine")
  atomic.clean(str(tmp_path / "x"))
  assert os.listdir(tmp_path) == [f".x.tmp-{os.getpid()}-99"]


# --- convert-checkpoint -----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
  spec = tee.EmbeddingSpec.from_file(TINY)
  emb = tee.CPUEmbedding(spec)
  emb.build()
  for slots in emb.variables.values():
    for var in slots.values():
      var.assign(tf.random.stateless_uniform(var.shape, seed=[1, 2]))
  directory = tmp_path_factory.mktemp("ckpt")
  return spec, tf.train.Checkpoint(embedding=emb).write(str(directory / "ckpt-10"))


def _files(directory):
  return {name: open(os.path.join(directory, name), "rb").read()
          for name in sorted(os.listdir(directory))}


@pytest.mark.parametrize("spelling", ["same", "dot_slash", "symlink"])
def test_convert_onto_its_input_is_refused_before_writing(tmp_path, tiny_checkpoint,
                                                          spelling):
  spec, src = tiny_checkpoint
  work = tmp_path / "w"
  work.mkdir()
  for name in os.listdir(os.path.dirname(src)):
    os.link(os.path.join(os.path.dirname(src), name), work / name)
  src = str(work / "ckpt-10")
  out = {"same": src, "dot_slash": str(work / "." / "ckpt-10"),
         "symlink": str(tmp_path / "link" / "ckpt-10")}[spelling]
  (tmp_path / "link").symlink_to(work)
  before = _files(work)
  with pytest.raises(atomic.OutputError, match=(
      r"^--out .* would overwrite the input checkpoint .*ckpt-10 \(the output equals, "
      r"contains or lies inside it\); nothing was written. Fix: pass another --out, "
      r"outside the input.$")):
    convert_checkpoint(src, out, spec, "v5p:1")
  assert _files(work) == before


def test_convert_errors_name_the_checkpoint(tmp_path, tiny_checkpoint):
  spec, src = tiny_checkpoint
  with pytest.raises(model_dir_lib.CheckpointError, match=(
      r"^--checkpoint .*/nope: no such checkpoint \(.*/nope.index does not exist\). "
      r"Fix: pass a checkpoint prefix")):
    convert_checkpoint(str(tmp_path / "nope"), str(tmp_path / "o"), spec, "v5p:1")
  (tmp_path / "empty").mkdir()
  with pytest.raises(model_dir_lib.CheckpointError, match=(
      r"^--checkpoint .*/empty is a directory without checkpoints")):
    convert_checkpoint(str(tmp_path / "empty"), str(tmp_path / "o"), spec, "v5p:1")
  with pytest.raises(atomic.OutputError, match=(
      r"^--out .* is a directory; the output is a checkpoint prefix")):
    convert_checkpoint(src, str(tmp_path), spec, "v5p:1")
  assert sorted(os.listdir(tmp_path)) == ["empty"]


def _copy_checkpoint(src, directory, name):
  directory.mkdir(parents=True, exist_ok=True)
  for path in atomic.prefix_files(src):
    data = open(path, "rb").read()
    (directory / (name + path[len(src):])).write_bytes(data)
  return str(directory / name)


def test_convert_from_a_directory_falls_back_past_a_truncated_data_file(
    tmp_path, tiny_checkpoint):
  spec, src = tiny_checkpoint
  checkpoints = tmp_path / "run" / "checkpoints"
  good = _copy_checkpoint(src, checkpoints, "ckpt-10")
  newest = _copy_checkpoint(src, checkpoints, "ckpt-20")
  data = newest + ".data-00000-of-00001"
  os.truncate(data, os.path.getsize(data) // 2)
  lines = []
  # A truncated prefix given by name: a one-line CheckpointError, nothing written.
  with pytest.raises(model_dir_lib.CheckpointError, match=(
      r"^checkpoint .*ckpt-20 cannot be read: Read less bytes than requested. Nothing "
      r"was written to .*/o. Fix: convert an undamaged checkpoint")):
    convert_checkpoint(newest, str(tmp_path / "o"), spec, "v5p:1", log=lines.append)
  assert not (tmp_path / "o.index").exists() and sorted(os.listdir(tmp_path)) == ["run"]
  # The model_dir: the newest readable checkpoint, saying which.
  convert_checkpoint(str(tmp_path / "run"), str(tmp_path / "o"), spec, "v5p:1",
                     log=lines.append)
  assert any("ckpt-20.index is damaged" in l for l in lines), lines
  assert lines[-1] == (f"Converting {good} (step 10), the newest readable checkpoint "
                       f"in {checkpoints}.")
  back = str(tmp_path / "back")
  convert_checkpoint(str(tmp_path / "o"), back, spec, None)
  ref = tf.train.load_checkpoint(good)
  got = tf.train.load_checkpoint(back)
  key = "embedding/t_c5/.ATTRIBUTES/VARIABLE_VALUE"
  np.testing.assert_array_equal(got.get_tensor(key), ref.get_tensor(key))


def test_convert_with_a_missing_slot_tensor_is_a_checkpoint_error(tmp_path,
                                                                 tiny_checkpoint):
  spec, src = tiny_checkpoint
  reader = tf.train.load_checkpoint(src)
  names = [k for k in reader.get_variable_to_shape_map()
           if k != "embedding/t_c0.Saccumulators/.ATTRIBUTES/VARIABLE_VALUE"]
  assert len(names) == len(reader.get_variable_to_shape_map()) - 1
  damaged = str(tmp_path / "damaged")
  tf.raw_ops.SaveV2(prefix=damaged, tensor_names=names, shape_and_slices=[""] * len(names),
                    tensors=[reader.get_tensor(n) for n in names])
  with pytest.raises(model_dir_lib.CheckpointError, match=(
      r"^checkpoint .*damaged is damaged: its object graph lists the slot 'accumulators'"
      r" of 't_c0' but it holds no tensor embedding/t_c0.Saccumulators/.ATTRIBUTES/"
      r"VARIABLE_VALUE. Fix: convert an undamaged checkpoint")):
    convert_checkpoint(damaged, str(tmp_path / "o"), spec, "v5p:1")
  assert not os.path.exists(tmp_path / "o.index")


def test_convert_enospc_in_process_keeps_the_previous_output(tmp_path, tiny_checkpoint,
                                                             monkeypatch):
  """Simulated: SaveV2 raises what TensorFlow raises for a full disk."""
  spec, src = tiny_checkpoint
  out = str(tmp_path / "o")
  convert_checkpoint(src, out, spec, "v5p:1")
  before = _files(tmp_path)
  from tpu_embed_ext.sparsecore import checkpoint as sc_checkpoint
  real = tf.raw_ops.SaveV2
  calls = [0]

  def full_disk(**kwargs):
    calls[0] += 1
    if calls[0] == 3:
      raise tf.errors.ResourceExhaustedError(None, None, "No space left on device")
    return real(**kwargs)
  monkeypatch.setattr(sc_checkpoint.tf.raw_ops, "SaveV2", full_disk)
  with pytest.raises(atomic.OutputError, match=(
      r"^--out cannot be written .*|^cannot write --out .*/o: No space left on device. "
      r"Nothing was replaced; the previous output, if any, is intact. Fix: free space "
      r"on that disk, or write elsewhere.$")):
    convert_checkpoint(src, out, spec, "v6e:8")
  assert _files(tmp_path) == before


def test_convert_to_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, tiny_checkpoint):
  spec, src = tiny_checkpoint
  with mounts.tmpfs(tmp_path / "small", size="48k") as small:
    with pytest.raises(atomic.OutputError, match=(
        r"^cannot write --out .*/small/o: .*No space left on device.*Fix: free space on "
        r"that disk, or write elsewhere.$")):
      convert_checkpoint(src, str(small / "o"), spec, "v5p:1")
    assert os.listdir(small) == []


def test_convert_to_a_read_only_disk_is_refused_before_converting(tmp_path,
                                                                  tiny_checkpoint):
  spec, src = tiny_checkpoint
  with mounts.tmpfs(tmp_path / "ro", read_only=True) as ro:
    with pytest.raises(atomic.OutputError, match=(
        r"^cannot write --out .*/ro/o: Read-only file system. Nothing was replaced; "
        r"the previous output, if any, is intact. Fix: make it writable, or write "
        r"elsewhere.$")):
      convert_checkpoint(src, str(ro / "o"), spec, "v5p:1")


def test_convert_command_errors_are_one_line(tmp_path, tiny_checkpoint):
  _, src = tiny_checkpoint
  env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
  out = subprocess.run(
      [sys.executable, "-m", "tpu_embed_ext", "convert-checkpoint", "--config", TINY,
       "--checkpoint", src, "--out", src, "--topology", "1x4"],  # No v5p slice has 1 chip.
      capture_output=True, text=True, timeout=600, env=env)
  assert out.returncode == 2, out.stderr
  lines = [l for l in out.stderr.splitlines() if l.startswith("error:") or "Traceback" in l]
  assert lines == [f"error: --out {src} would overwrite the input checkpoint {src} (the "
                   "output equals, contains or lies inside it); nothing was written. Fix: "
                   "pass another --out, outside the input. (--verbose shows the "
                   "traceback)"]
