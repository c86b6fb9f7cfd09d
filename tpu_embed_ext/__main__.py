"""Command line: ``python -m tpu_embed_ext COMMAND [flags]`` (also ``tpu-embed``).

  plan    --config FILE [--proto] [--engine v2 --topology T [--data N]]
  train   --config FILE [--steps N] [--model_dir DIR] [--tpu auto|none|NAME]
  export  --config FILE --model_dir DIR [--out DIR]
  convert-checkpoint --config FILE --checkpoint PREFIX --out PREFIX --topology T|none

``--help`` prints every command's flags and examples (``console.help_text``),
the same for ``tpu-embed`` and ``python -m tpu_embed_ext``. Other libraries'
log lines go to a log file (``console.ThirdPartyLog``) unless ``--verbose``.

A user error (a bad config or flag, a model_dir in use or not writable, a
damaged checkpoint, tables larger than memory) prints one line, ``error:``
with what is wrong, where and the fix, and exits with status 2;
``--verbose`` shows the traceback instead.
"""

import os
import sys

# `emulate` runs a user's script, whose absl flags must not meet ours: it is
# dispatched before any flag below is defined.
if (sys.argv[1:2] == ["emulate"]
    and os.path.basename(sys.argv[0]) in ("__main__.py", "tpu-embed")):
  from tpu_embed_ext.emulated_tpu import runner  # pylint: disable=g-import-not-at-top
  sys.exit(runner.main(sys.argv[2:]))

from absl import app, flags  # pylint: disable=g-import-not-at-top,wrong-import-position

from tpu_embed_ext import console

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "configs/ranking.yaml", "The config file (YAML or JSON).")
flags.DEFINE_bool("proto", False, "Also print the TPUEmbeddingConfiguration proto.")
flags.DEFINE_integer("steps", None, "The table step to train to (default: the "
                     "config's train.steps; a resumed run counts the steps before "
                     "it).")
flags.DEFINE_string("model_dir", None, "Checkpoints, logs, metrics (default: "
                    "runs/<config file name without extension>).")
flags.DEFINE_string("tpu", "auto", "'auto' (use a TPU if one is attached), "
                    "'none' (CPU emulation), 'emulate' or 'emulate:N' (the job's "
                    "TPU path on an emulated TPU of N replicas, default 8, on "
                    "CPU), or a TPU name/address.")
flags.DEFINE_string("out", None, "export: where to write the SavedModel (default: "
                    "<model_dir>/serving); convert-checkpoint: the prefix of the "
                    "converted checkpoint (required).")
flags.DEFINE_bool("verbose", False, "Show TensorFlow's and other libraries' log "
                  "lines and progress bars (default: a log file), and on an error "
                  "the traceback.")
# SparseCore (TPUEmbeddingV2): tpu_embed_ext/sparsecore/, docs/sparsecore.md.
flags.DEFINE_enum("engine", "v1", ["v1", "v2"], "v2 adds TPUEmbeddingV2's "
                  "(SparseCore) stacked layout on --topology.")
flags.DEFINE_string("topology", "v5p:4", "GENERATION:CHIPS (v5p:4, v6e:8, tpu7x:4) "
                    "or CHIPSxSPARSECORES; convert-checkpoint: none for per-table "
                    "keys (required there).")
flags.DEFINE_integer("data", 0, "With --engine v2: measure the ids each stack "
                     "sends to each SparseCore over this many training batches "
                     "(drawn from the spec when the config names no dataset).")
flags.DEFINE_string("hotness", "", "--data drawn from the spec: ids per example, "
                    "N for every feature or FEATURE=N,... (default: a sequence "
                    "feature's max_sequence_length, else 1).")
flags.DEFINE_enum("ids", "zipf", ["zipf", "uniform"], "--data drawn from the "
                  "spec: how ids are drawn over each table's vocabulary.")
flags.DEFINE_string("checkpoint", None, "The checkpoint to convert (per-table or "
                    "SparseCore-stacked): a prefix, or a directory for its newest "
                    "checkpoint (required).")
flags.DEFINE_string("prefix", None, "The embedding's path in the checkpoint "
                    "(default: found in its object graph; needed only when several "
                    "objects hold the tables).")
flags.DEFINE_integer("batch_size", 0, "With --engine v2: per-chip batch of features "
                     "without output_shape (the stacker's output samples).")


def _model_dir():
  if FLAGS.model_dir:
    return FLAGS.model_dir
  return os.path.join("runs", os.path.splitext(os.path.basename(FLAGS.config))[0])


def _plan():
  import tpu_embed_ext as tee
  from tpu_embed_ext import job
  spec = tee.EmbeddingSpec.from_file(FLAGS.config)
  hotness = None
  if FLAGS.data and FLAGS.hotness:  # Checked before the plan is computed.
    from tpu_embed_ext.data import spec_ids
    hotness = spec_ids.parse_hotness(FLAGS.hotness, spec)
  plan = tee.plan(spec)
  print(plan)
  shortfall = job.memory_shortfall(spec)
  if shortfall:
    print(f"\nCPU emulation (train --tpu none) would not fit: {shortfall}")
  if FLAGS.proto:
    print()
    print(plan.config_proto())
  if FLAGS.engine == "v2":
    print()
    print(plan.sparsecore(FLAGS.topology, batch_size=FLAGS.batch_size))
    if FLAGS.data:
      from tpu_embed_ext.sparsecore import report, topology
      print()
      print(report.measure_training_data(
          plan.spec, topology.parse_topology(FLAGS.topology), FLAGS.data,
          hotness=hotness, distribution=FLAGS.ids, batch_size=FLAGS.batch_size))


def _train():
  from tpu_embed_ext import job
  model_dir = _model_dir()
  metrics = job.train(FLAGS.config, model_dir=model_dir, steps=FLAGS.steps,
                        tpu=FLAGS.tpu)
  speed = metrics.get("examples_per_second")
  print(f"\nheld-out AUC {metrics['eval_auc']:.4f}"
        + (f" (planted model: {metrics['planted_auc']:.4f})"
           if "planted_auc" in metrics else "")
        + f" at step {metrics['steps']}, on {metrics['where']}"
        + (f", {speed:,.0f} examples/s." if speed else
           " (already trained: nothing to do)."))
  print(where_everything_went(FLAGS.config, model_dir))


def where_everything_went(config: str, model_dir: str) -> str:
  """The closing summary of ``train``: every output and the next command."""
  from tpu_embed_ext import model_dir as model_dir_lib
  checkpoints = os.path.join(model_dir, "checkpoints")
  steps = model_dir_lib.checkpoint_steps(checkpoints)
  newest = f" (newest: ckpt-{steps[0]})" if steps else ""
  rows = [("checkpoints", checkpoints + newest),
          ("metrics", os.path.join(model_dir, "metrics.json")),
          ("learning curve", os.path.join(model_dir, "learning_curve.png")),
          ("history", os.path.join(model_dir, "history.csv")),
          ("TensorBoard logs", os.path.join(model_dir, "logs") +
           f"   (tensorboard --logdir {os.path.join(model_dir, 'logs')})")]
  lines = [f"Results in {model_dir}:"]
  lines += [f"  {name:<17} {path}" for name, path in rows]
  lines += ["Next, export for serving:",
            f"  python -m tpu_embed_ext export --config {config} --model_dir "
            f"{model_dir} --out {os.path.join(model_dir, 'serving')}"]
  return "\n".join(lines)


def _export():
  from tpu_embed_ext import job
  out = FLAGS.out or os.path.join(_model_dir(), "serving")
  print("SavedModel written to", job.export(FLAGS.config, model_dir=_model_dir(),
                                              out=out))


def _convert_checkpoint():
  import tpu_embed_ext as tee
  from tpu_embed_ext import sparsecore
  if not (FLAGS.checkpoint and FLAGS.out and FLAGS["topology"].present):
    raise app.UsageError("convert-checkpoint needs --checkpoint PREFIX|DIR --out PREFIX "
                         "--topology T (a SparseCore topology, or none for per-table).")
  topology = None if FLAGS.topology == "none" else FLAGS.topology
  spec = tee.EmbeddingSpec.from_file(FLAGS.config)
  source = FLAGS.checkpoint
  if os.path.isdir(source):  # A checkpoints directory: its newest readable one.
    from tpu_embed_ext import model_dir as model_dir_lib
    source, _ = model_dir_lib.resume_point(source, repair=False)
    if source is None:
      raise model_dir_lib.CheckpointError(
          f"no checkpoint (ckpt-<step>.index) in {FLAGS.checkpoint}. Fix: pass a "
          "checkpoint prefix, e.g. runs/ranking/checkpoints/ckpt-1500.")
  print(f"Converting {source} table by table...", flush=True)
  layouts = sparsecore.convert_checkpoint(source, FLAGS.out, spec, topology,
                                          prefix=FLAGS.prefix)
  form = (f"SparseCore layout for {sparsecore.parse_topology(topology)} "
          f"({len({l.stack for l in layouts})} stacks)" if layouts else "per-table")
  print(f"{source} -> {FLAGS.out}: {form}.")


COMMANDS = {"plan": _plan, "train": _train, "export": _export,
            "convert-checkpoint": _convert_checkpoint}


def _one_line(e: BaseException):
  """The line a user sees for an error they can fix, or None for a bug."""
  from tpu_embed_ext import errors
  if isinstance(e, errors.Error):
    return " ".join(str(e).split())
  if isinstance(e, KeyboardInterrupt):
    return ("interrupted. Run the same command again to resume from the newest "
            "checkpoint.")
  return None


def main(argv):
  if len(argv) != 2 or argv[1] not in COMMANDS:
    raise app.UsageError(f"usage: python -m tpu_embed_ext {{{'|'.join(COMMANDS)}}} "
                         "--config FILE [flags]; --help lists every flag")
  command = argv[1]
  log = None
  if not FLAGS.verbose:
    model_dir = _model_dir() if command in ("train", "export") else None
    if command == "export" and not os.path.isdir(model_dir):
      model_dir = None  # Not made here: export reports the missing checkpoint.
    log = console.ThirdPartyLog(
        os.path.join(model_dir, "logs", "libraries.log") if model_dir else None,
        datasets=command == "train" or (command == "plan" and FLAGS.data > 0))
  try:
    COMMANDS[command]()
  except (Exception, KeyboardInterrupt) as e:  # pylint: disable=broad-except
    line = None if FLAGS.verbose else _one_line(e)
    if line is None:
      raise
    print(f"error: {line} (--verbose shows the traceback)", file=sys.stderr)
    return 2
  finally:
    note = log.close() if log else ""
    if note:
      print(note, flush=True)
  return 0


_HELP = ("--help", "-h", "--helpshort", "--helpfull", "-?", "help")


def run(argv=None):
  """The entry point of ``tpu-embed`` and ``python -m tpu_embed_ext``."""
  argv = list(sys.argv if argv is None else argv)
  if len(argv) == 1 or any(a in _HELP for a in argv[1:]):
    print(console.help_text(FLAGS))
    sys.exit(0 if len(argv) > 1 else 2)
  console.quiet_cpp(argv)
  app.run(main, argv=argv)


if __name__ == "__main__":
  run()
