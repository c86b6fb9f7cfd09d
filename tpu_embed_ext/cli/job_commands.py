"""``train`` and ``export``: the commands that run the job (TensorFlow and
tensorflow_datasets), and the summary ``train`` closes with.

``main.py`` imports this module when one of them runs, once other libraries'
output goes to the library log.
"""

import os

from tpu_embed_ext import job
from tpu_embed_ext.cli import console
from tpu_embed_ext.host import model_dir as model_dir_lib

__all__ = ["COMMANDS", "train_command", "export_command", "where_everything_went"]


def _model_dir(f, config: str) -> str:
  if f.model_dir:
    return f.model_dir
  return os.path.join("runs", os.path.splitext(os.path.basename(config))[0])


def train_command(f, config: str, progress):
  model_dir = _model_dir(f, f.config)
  said = []
  line = progress(model_dir)

  def log(text):
    said.append(text)
    line(text)
  metrics = job.train(config, model_dir=model_dir, steps=f.steps, tpu=f.tpu,
                      log=log)
  finished_before = any(t.startswith("Already trained") for t in said)
  speed = None if finished_before else metrics.get("examples_per_second")
  # One device line: "Training on ..." of this run, or, for a finished run
  # that trained nothing now, where it trained.
  print(f"\nheld-out AUC {metrics['eval_auc']:.4f}"
        + (f" (planted model: {metrics['planted_auc']:.4f})"
           if "planted_auc" in metrics else "")
        + (f" at step {metrics['steps']}, {speed:,.0f} examples/s." if speed else
           f" at step {metrics['steps']} (already trained, on "
           f"{metrics['where']}: nothing to do)."))
  print(where_everything_went(f.config, model_dir))


def where_everything_went(config: str, model_dir: str) -> str:
  """The closing summary of ``train``: every output and the next command,
  spelled so that it runs as printed from here (``console.program``)."""
  checkpoints = os.path.join(model_dir, "checkpoints")
  steps = model_dir_lib.checkpoint_steps(checkpoints)
  newest = f" (newest: ckpt-{steps[0]})" if steps else ""
  rows = [("checkpoints", checkpoints + newest),
          ("metrics", os.path.join(model_dir, "metrics.json")),
          ("learning curve", os.path.join(model_dir, "learning_curve.png")),
          ("history", os.path.join(model_dir, "history.csv")),
          ("TensorBoard logs", os.path.join(model_dir, "logs") +
           f"   ({console.tool('tensorboard', 'tensorboard.main')} --logdir "
           f"{os.path.join(model_dir, 'logs')})")]
  library_log = os.path.join(model_dir, "logs", "libraries.log")
  if os.path.exists(library_log):  # Not with --verbose: they were shown.
    rows.append(("library log", library_log + "   (TensorFlow's and other "
                 "libraries' lines)"))
  lines = [f"Results in {model_dir}:"]
  lines += [f"  {name:<17} {path}" for name, path in rows]
  lines += ["Next, export for serving:",
            f"  {console.program()} export --config {config} --model_dir "
            f"{model_dir} --out {os.path.join(model_dir, 'serving')}"]
  return "\n".join(lines)


def export_command(f, config: str, progress):
  model_dir = _model_dir(f, f.config)
  out = f.out or os.path.join(model_dir, "serving")
  print("SavedModel written to", job.export(config, model_dir=model_dir, out=out,
                                              log=progress(model_dir)))


# name -> run(flags, config path, progress): what ``main._AbslCommand`` runs.
COMMANDS = {"train": train_command, "export": export_command}
