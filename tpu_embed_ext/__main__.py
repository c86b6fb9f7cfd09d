"""Command line: ``python -m tpu_embed_ext plan|train|export`` (also ``tpu-embed``).

  plan    --config FILE [--proto]        print the TPU plan of a config
  train   --config FILE [--steps N] [--model_dir DIR] [--tpu auto|none|NAME]
  export  --config FILE --model_dir DIR --out DIR
  convert-checkpoint --config FILE --checkpoint PREFIX --out PREFIX --topology T|none
"""

import os
import sys

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "configs/ranking.yaml", "Config file (YAML or JSON).")
flags.DEFINE_bool("proto", False, "plan: also print the TPUEmbeddingConfiguration.")
flags.DEFINE_integer("steps", None, "train: steps to train (default: the config's).")
flags.DEFINE_string("model_dir", None, "train/export: checkpoints, logs, metrics "
                    "(default: runs/<config name>).")
flags.DEFINE_string("tpu", "auto", "train: 'auto' (use a TPU if one is attached), "
                    "'none' (CPU emulation), or a TPU name/address.")
flags.DEFINE_string("out", None, "export: where to write the SavedModel.")
# SparseCore (TPUEmbeddingV2): tpu_embed_ext/sparsecore/, docs/sparsecore.md.
flags.DEFINE_enum("engine", "v1", ["v1", "v2"], "plan: v2 adds TPUEmbeddingV2's "
                  "(SparseCore) stacked layout on --topology.")
flags.DEFINE_string("topology", "v5p:4", "plan --engine v2 / convert-checkpoint: "
                    "GENERATION:CHIPS (v5p:4, v6e:8, tpu7x:4) or CHIPSxSPARSECORES.")
flags.DEFINE_integer("data", 0, "plan --engine v2: measure the ids each stack sends "
                     "to each SparseCore over this many training batches.")
flags.DEFINE_string("checkpoint", None, "convert-checkpoint: the checkpoint prefix to "
                    "convert (per-table or SparseCore-stacked).")
flags.DEFINE_string("prefix", "embedding", "convert-checkpoint: the embedding's path "
                    "in the checkpoint (tf.train.Checkpoint(embedding=...)).")
flags.DEFINE_integer("batch_size", 0, "plan --engine v2: per-chip batch of features "
                     "without output_shape (the stacker's output samples).")


def _model_dir():
  if FLAGS.model_dir:
    return FLAGS.model_dir
  return os.path.join("runs", os.path.splitext(os.path.basename(FLAGS.config))[0])


def _plan():
  import tpu_embed_ext as tee
  plan = tee.plan(tee.EmbeddingSpec.from_file(FLAGS.config))
  print(plan)
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
          plan.spec, topology.parse_topology(FLAGS.topology), FLAGS.data))


def _train():
  from tpu_embed_ext import train
  metrics = train.train(FLAGS.config, model_dir=_model_dir(), steps=FLAGS.steps,
                        tpu=FLAGS.tpu)
  print(f"\nheld-out AUC {metrics['eval_auc']:.4f}"
        + (f" (planted model: {metrics['planted_auc']:.4f})"
           if "planted_auc" in metrics else "")
        + f", {metrics['examples_per_second'] or 0:,.0f} examples/s on "
        f"{metrics['where']}.\nmetrics: {os.path.join(_model_dir(), 'metrics.json')}")


def _export():
  from tpu_embed_ext import train
  if not FLAGS.out:
    raise app.UsageError("export needs --out DIR.")
  print("SavedModel written to", train.export(FLAGS.config, model_dir=_model_dir(),
                                              out=FLAGS.out))


def _convert_checkpoint():
  import tpu_embed_ext as tee
  from tpu_embed_ext import sparsecore
  if not (FLAGS.checkpoint and FLAGS.out and FLAGS["topology"].present):
    raise app.UsageError("convert-checkpoint needs --checkpoint PREFIX --out PREFIX "
                         "--topology T (a SparseCore topology, or none for per-table).")
  topology = None if FLAGS.topology == "none" else FLAGS.topology
  layouts = sparsecore.convert_checkpoint(
      FLAGS.checkpoint, FLAGS.out, tee.EmbeddingSpec.from_file(FLAGS.config),
      topology, prefix=FLAGS.prefix)
  form = (f"SparseCore layout for {sparsecore.parse_topology(topology)} "
          f"({len({l.stack for l in layouts})} stacks)" if layouts else "per-table")
  print(f"{FLAGS.checkpoint} -> {FLAGS.out}: {form}.")


COMMANDS = {"plan": _plan, "train": _train, "export": _export,
            "convert-checkpoint": _convert_checkpoint}


def main(argv):
  if len(argv) != 2 or argv[1] not in COMMANDS:
    raise app.UsageError(f"usage: python -m tpu_embed_ext {{{'|'.join(COMMANDS)}}} "
                         "--config FILE [flags]")
  from tpu_embed_ext import errors
  try:
    COMMANDS[argv[1]]()
  except errors.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


def run():
  app.run(main)


if __name__ == "__main__":
  run()
