"""``plan`` and ``convert-checkpoint``: the commands that need TensorFlow only.

``main.py`` imports this module when one of them runs, once other libraries'
output goes to the library log (TensorFlow loads here). ``plan --data`` also
reads the job's data: ``training_data.py``.
"""

import os

from tpu_embed_ext import errors, sparsecore
from tpu_embed_ext.cli import plan as plan_lib
from tpu_embed_ext.host import memory as host_memory
from tpu_embed_ext.host import model_dir as model_dir_lib
from tpu_embed_ext.sparsecore import chips
from tpu_embed_ext.spec import files
from tpu_embed_ext.spec.embedding_spec import EmbeddingSpec

__all__ = ["COMMANDS", "plan_command", "convert_checkpoint_command"]


def _topology(f) -> str:
  """``--topology`` as the command line reads it everywhere (``emulate``
  too): GENERATION:CHIPS names a Cloud TPU slice (``v5p:2`` is none: v5p
  slices start at 2x2x1, 4 chips); CHIPSxSPARSECORES (``2x4``) any count."""
  try:
    sparsecore.check_slice(f.topology)
  except errors.ConfigError as e:
    raise errors.ConfigError(f"--topology: {' '.join(str(e).split())}") from None
  return f.topology


def _slice(f):
  """``plan --topology``: any generation's slice (``v5e:1``, ``v3:4``,
  ``v5p:8``), and the engine it runs: a generation with SparseCore runs
  ``TPUEmbeddingV2``, one without runs ``TPUEmbedding``."""
  generation = chips.GENERATIONS.get(str(f.topology).split(":")[0])
  if generation is None or generation.embedding_v2:
    _topology(f)  # A SparseCore spelling: the words emulate and convert use.
  try:
    slice_ = chips.parse_slice(f.topology)
  except errors.ConfigError as e:
    raise errors.ConfigError(f"--topology: {' '.join(str(e).split())}") from None
  engine = "v2" if slice_.sparsecore else "v1"
  if f["engine"].present and f.engine != engine:
    raise errors.ConfigError(
        f"--engine {f.engine} with --topology {f.topology}: "
        f"{slice_.generation.name} runs "
        f"{'TPUEmbeddingV2 (SparseCore)' if engine == 'v2' else 'TPUEmbedding'}"
        f". Fix: drop --engine, or give --engine {engine}.")
  return slice_, engine


def _per_device_batch(f, config: str, slice_) -> int:
  """``--batch_size``, else the job's global batch over the slice's devices."""
  if f.batch_size:
    return f.batch_size
  data = files.load(config)
  train = data.get("train") if isinstance(data, dict) else None
  batch = train.get("batch_size") if isinstance(train, dict) else None
  if isinstance(batch, int) and not isinstance(batch, bool) and batch > 0:
    return max(1, batch // slice_.replicas)
  return 0


def plan_command(f, config: str, progress):
  del progress
  slice_, engine = _slice(f) if f["topology"].present else (None, f.engine)
  spec = EmbeddingSpec.from_file(config)
  hotness = None
  if f.data:
    # Lazy: the job's data (tensorflow_datasets) loads only for plan --data.
    from tpu_embed_ext.cli import training_data  # pylint: disable=g-import-not-at-top
    if f.hotness:  # Checked before the plan is computed.
      hotness = training_data.parse_hotness(f.hotness, spec)
  plan = plan_lib.plan(spec)
  # SparseCore only when asked about: --engine v2, or a --topology given.
  print(plan.text(sparsecore_notes=engine == "v2"))
  shortfall = host_memory.memory_shortfall(spec)
  if shortfall:
    print(f"\nCPU emulation (train --tpu none) would not fit: {shortfall}")
  if f.proto:
    print()
    print(plan.config_proto())
  if slice_ is not None:
    print()
    print(plan_lib.memory_text(plan.memory(slice_, _per_device_batch(f, config, slice_))))
  if engine == "v2":
    print()
    print(plan.sparsecore(f.topology, batch_size=f.batch_size))
    if f.data:
      print()
      print(training_data.measure_training_data(
          plan.spec, sparsecore.parse_topology(f.topology), f.data,
          hotness=hotness, distribution=f.ids, batch_size=f.batch_size))


def _tables_spec(path: str):
  """The config's spec for converting tables: feature names play no part in
  it, so they are replaced (in their sorted order, which decides the first
  feature the stacker sees) by names every check accepts ('0'..'7' are
  Model Garden's, refused as serving-signature inputs)."""
  data = files.load(path)
  features = data.get("features") if isinstance(data, dict) else None
  if isinstance(features, dict):
    data = dict(data, features={f"feature_{i:06d}": value for i, (_, value)
                                in enumerate(sorted(features.items()))})
  try:
    return EmbeddingSpec.from_dict(data, source=path)
  except errors.ConfigError as e:
    raise e.at(file=path) from None


def convert_checkpoint_command(f, config: str, progress):
  del progress
  if not (f.checkpoint and f.out and f["topology"].present):
    raise errors.ConfigError(
        "convert-checkpoint needs --checkpoint PREFIX|DIR --out PREFIX --topology T "
        "(a SparseCore topology, or none for per-table). Fix: pass all three.")
  topology = None if f.topology == "none" else _topology(f)
  # Without --config the checkpoint's own tables, slots and shapes are used.
  spec = _tables_spec(config) if f["config"].present else None
  source = f.checkpoint
  if os.path.isdir(source):  # A checkpoints directory: its newest readable one.
    source, _ = model_dir_lib.resume_point(source, repair=False)
    if source is None:
      raise model_dir_lib.CheckpointError(
          f"no checkpoint (ckpt-<step>.index) in {f.checkpoint}. Fix: pass a "
          "checkpoint prefix, e.g. runs/ranking/checkpoints/ckpt-1500.")
  print(f"Converting {source} table by table...", flush=True)
  layouts = sparsecore.convert_checkpoint(source, f.out, spec, topology,
                                          prefix=f.prefix)
  form = (f"SparseCore layout for {sparsecore.parse_topology(topology)} "
          f"({len({l.stack for l in layouts})} stacks)" if layouts else "per-table")
  print(f"{source} -> {f.out}: {form}.")


# name -> run(flags, config path, progress): what ``main._AbslCommand`` runs.
COMMANDS = {"plan": plan_command,
            "convert-checkpoint": convert_checkpoint_command}
