"""Fault injection: SIGKILL ``train``, ``export`` and ``convert-checkpoint`` at
random moments and compare with uninterrupted runs.

  .venv/bin/python tests/fault_injection.py --rounds 5 --seed 1 --work /tmp/fi

For each command it first runs it uninterrupted (the reference), then runs it
again ``--rounds`` times, each killed with SIGKILL at a moment chosen from
what the run shows on disk, not from the clock: the harness picks one of the
command's stages at random (``STAGES``: a new checkpoint, a temporary sibling
being filled, the output being swapped...) and kills the process as soon as
that stage is seen. A stage the run passes unseen (it finished first) counts
as "finished"; no verdict depends on when the kill lands, so a loaded machine
changes which moments are hit, never the result. Then it checks what the
README promises:

- ``train``: after the kills, one more run finishes the job; every variable
  of its final checkpoint is bit-identical to the reference's, history.csv
  has one row per block, metrics.json and learning_curve.png exist, at most
  ``max_to_keep`` (3) checkpoints are kept, and no temporary file is left.
- ``export`` and ``convert-checkpoint``: the uninterrupted run writes --out
  (the reference); each killed run writes the same --out again. After every
  kill the --out loads and equals the reference (it is the old complete
  output or the new complete one, and both equal it): a partial output, or
  none, fails the check. A killed run may leave its temporary siblings
  (``.<out>.tmp-<pid>-<n>``...); the next run deletes them: after one more
  uninterrupted run none is left and --out still equals the reference.

Sizes are small (configs/tiny.yaml, 10 steps in blocks of 5, one evaluation
batch). tests/test_fault_injection.py runs it with one round per command in
``make test``. Exit status 0 when every check passed.
"""

import argparse
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Per command: stage name -> glob patterns ({out} is the command's output:
# the model_dir, --out; {out_sibling} its hidden siblings' stem). A stage is reached when a file or
# directory matching one of them appears that was not there, with the same
# inode, when the run started: a fresh checkpoint, a temporary sibling, an
# output replaced by a rename.
STAGES = {
    "train": {
        "a new checkpoint": ["{out}/checkpoints/ckpt-*.index"],
        "a checkpoint being written": ["{out}/checkpoints/ckpt-*_temp*",
                                       "{out}/checkpoints/checkpoint.tmp*"],
        "a row of history.csv": ["{out}/.history.csv.tmp-*", "{out}/history.csv"],
        "the TensorBoard file": ["{out}/logs/events.out.tfevents.*"],
    },
    "export": {
        "the new SavedModel being filled": ["{out_sibling}.tmp-*/variables/*"],
        "the new SavedModel complete beside --out": ["{out_sibling}.tmp-*/saved_model.pb"],
        "--out swapped": ["{out}/saved_model.pb"],
    },
    "convert-checkpoint": {
        "the new checkpoint being staged": ["{out_sibling}.tmp-*/*"],
        "the old checkpoint moved aside": ["{out_sibling}.bak-*"],
        "--out replaced": ["{out}.index"],
    },
}


class Harness:

  def __init__(self, work: str, seed: int, log=print):
    self.work, self.rng, self.log = work, random.Random(seed), log
    self.env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3",
                "TFDS_DATA_DIR": os.path.join(work, "tfds"), "PYTHONPATH": ROOT}
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(ROOT, "configs", "tiny.yaml")) as f:
      config = yaml.safe_load(f)
    config["train"].update(steps=10, steps_per_checkpoint=5, eval_batches=1)
    self.config = os.path.join(work, "config.yaml")
    with open(self.config, "w") as f:
      yaml.safe_dump(config, f)
    self.kills = 0

  def command(self, *args):
    return [sys.executable, "-m", "tpu_embed_ext", *args, "--config", self.config]

  def run(self, *args) -> float:
    """Runs to the end; returns its duration in seconds (for the log only)."""
    began = time.monotonic()
    out = subprocess.run(self.command(*args), env=self.env, cwd=self.work,
                         capture_output=True, text=True)
    if out.returncode:
      raise AssertionError(f"{args[0]} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return time.monotonic() - began

  def kill(self, out: str, *args) -> str:
    """Starts the command and SIGKILLs it once a random stage of ``STAGES``
    shows on disk; 'killed at <stage>' or 'finished before <stage>'."""
    stage = self.rng.choice(sorted(STAGES[args[0]]))
    head, tail = os.path.split(out)
    patterns = [p.format(out=out, out_sibling=os.path.join(head, "." + tail))
                for p in STAGES[args[0]][stage]]
    before = _entries(patterns)
    proc = subprocess.Popen(self.command(*args), env=self.env, cwd=self.work,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Polls until the stage shows or the run ends; no clock decides anything.
    while proc.poll() is None and _entries(patterns) <= before:
      time.sleep(0.005)
    if proc.poll() is None:
      proc.send_signal(signal.SIGKILL)
      proc.wait()
      what = f"killed at {stage}"
      self.kills += 1
    else:
      assert proc.returncode == 0, f"{args[0]} failed ({proc.returncode})"
      what = f"finished before {stage} showed"
    self.log(f"  {args[0]}: {what}")
    return what

  # --- train ------------------------------------------------------------------------

  def train(self, rounds: int):
    straight = os.path.join(self.work, "straight")
    duration = self.run("train", "--model_dir", straight, "--tpu", "none")
    self.log(f"train: reference {duration:.1f}s")
    killed = os.path.join(self.work, "killed")
    for _ in range(rounds):
      self.kill(killed, "train", "--model_dir", killed, "--tpu", "none")
    self.run("train", "--model_dir", killed, "--tpu", "none")
    final = lambda d: os.path.join(d, "checkpoints", "ckpt-10")
    want, got = variables(final(straight)), variables(final(killed))
    assert want.keys() == got.keys() and want, (sorted(want), sorted(got))
    for key in want:
      assert raw(want[key]) == raw(got[key]), f"train: {key} differs"
    with open(os.path.join(killed, "history.csv")) as f:
      steps = [int(float(r.split(",")[0])) for r in f.read().splitlines()[1:]]
    assert steps == [5, 10], steps
    with open(os.path.join(killed, "metrics.json")) as f:
      assert json.load(f)["steps"] == 10
    assert os.path.exists(os.path.join(killed, "learning_curve.png"))
    kept = glob.glob(os.path.join(killed, "checkpoints", "ckpt-*.index"))
    assert len(kept) <= 3, kept
    assert not leftovers(killed), leftovers(killed)
    self.log(f"train: {len(want)} variables bit-identical after {rounds} kill round(s)")
    return straight

  # --- export -----------------------------------------------------------------------

  def export(self, model_dir: str, rounds: int):
    out = os.path.join(self.work, "export_out")
    args = ("export", "--model_dir", model_dir, "--out", out)
    duration = self.run(*args)
    self.log(f"export: reference {duration:.1f}s")
    want = serve(out)  # the uninterrupted export, which the kills try to replace
    for _ in range(rounds):
      self.kill(out, *args)
      got = serve(out)  # the previous complete export, or the new complete one
      np.testing.assert_array_equal(got, want, err_msg="export after a kill")
    # The killed runs' temporary siblings are the next run's to delete.
    self.run(*args)
    np.testing.assert_array_equal(serve(out), want, err_msg="export after the kills")
    assert not leftovers(self.work, "export_out"), leftovers(self.work, "export_out")
    self.log(f"export: --out loads and serves the reference's outputs after "
             f"{rounds} kill round(s); the next run left no temporary file")

  # --- convert-checkpoint -----------------------------------------------------------

  def convert(self, model_dir: str, rounds: int):
    src = os.path.join(model_dir, "checkpoints", "ckpt-10")
    out = os.path.join(self.work, "converted")
    args = ("convert-checkpoint", "--checkpoint", src, "--prefix",
            "model/embedding/embedding", "--topology", "v6e:8", "--out", out)
    duration = self.run(*args)
    self.log(f"convert-checkpoint: reference {duration:.1f}s")
    want = variables(out)  # the uninterrupted conversion

    def check(when):
      got = variables(out)
      assert want.keys() == got.keys(), f"convert {when}: other keys"
      for key in want:
        assert raw(want[key]) == raw(got[key]), f"convert {when}: {key} differs"

    for _ in range(rounds):
      self.kill(out, *args)
      recover(out)  # what every reader in the package does first
      check("after a kill")
    self.run(*args)
    check("after the kills")
    assert not leftovers(self.work, "converted"), leftovers(self.work, "converted")
    self.log(f"convert-checkpoint: --out complete and equal after {rounds} kill "
             f"round(s); the next run left no temporary file")


def _entries(patterns) -> set:
  """(path, inode) of what matches ``patterns`` now (a replaced file is new)."""
  found = set()
  for pattern in patterns:
    for path in glob.glob(pattern):
      try:
        found.add((path, os.stat(path).st_ino))
      except FileNotFoundError:
        pass  # renamed or deleted since glob saw it
  return found


def variables(prefix):
  import tensorflow as tf
  reader = tf.train.load_checkpoint(prefix)
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
          if k != "_CHECKPOINTABLE_OBJECT_GRAPH"}


def raw(value) -> bytes:
  return value if isinstance(value, bytes) else np.asarray(value).tobytes()


def serve(path):
  import tensorflow as tf
  fn = tf.saved_model.load(path).signatures["serving_default"]
  inputs = {}
  for name, spec in fn.structured_input_signature[1].items():
    if spec.dtype.is_floating:
      inputs[name] = np.linspace(-1, 1, 4 * spec.shape[1], dtype=np.float32).reshape(
          4, spec.shape[1])
    elif spec.shape.rank is None or spec.shape.rank == 1:  # single-hot
      inputs[name] = np.array([0, 1, 2, 1], np.int64)
    elif spec.shape[1] == 1:  # single-hot, as older exports took it
      inputs[name] = np.array([[0], [1], [2], [1]], np.int64)
    else:
      inputs[name] = np.array([[1, -1], [0, 2], [2, -1], [1, 1]], np.int64)
  return fn(**{k: tf.constant(v) for k, v in inputs.items()})["outputs"].numpy()


def recover(path):
  sys.path.insert(0, ROOT)
  from tpu_embed_ext.host import atomic
  atomic.recover(path)


def leftovers(directory, name=""):
  """Temporary siblings (.<name>.tmp-*, .old-*, .bak-*; TensorFlow's
  ckpt-N_temp) left in ``directory``."""
  found = []
  for root, dirs, files in os.walk(directory):
    for entry in dirs + files:
      if (entry.startswith(f".{name}") and any(
          f".{k}-" in entry for k in ("tmp", "old", "bak"))) or entry.endswith("_temp"):
        found.append(os.path.join(root, entry))
  return found


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3, help="kills per command")
  parser.add_argument("--seed", type=int, default=None)
  parser.add_argument("--work", default=None, help="work directory (default: a new "
                      "temporary one, deleted at the end)")
  args = parser.parse_args(argv)
  seed = args.seed if args.seed is not None else random.randrange(1 << 30)
  import tempfile
  work = args.work or tempfile.mkdtemp(prefix="fault_injection_")
  print(f"seed {seed}, work {work}")
  harness = Harness(work, seed)
  began = time.monotonic()
  model_dir = harness.train(args.rounds)
  harness.export(model_dir, args.rounds)
  harness.convert(model_dir, args.rounds)
  print(f"all checks passed: {harness.kills} kills, {time.monotonic() - began:.0f}s")
  if not args.work:
    shutil.rmtree(work, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
