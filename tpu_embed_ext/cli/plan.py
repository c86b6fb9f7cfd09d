"""The TPU plan of a spec: tables, optimizers, tags, memory, warnings."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Dict, List, Optional

import tensorflow as tf

from tpu_embed_ext import errors
from tpu_embed_ext.spec import numeric_traps, optimizers
from tpu_embed_ext.tf import config as tf_config, rates
from tpu_embed_ext.spec import EmbeddingSpec
from tpu_embed_ext.host.memory import human_bytes as _human
from tpu_embed_ext.cli import sparsecore_report
from tpu_embed_ext.cli.text_table import lines as _table_lines
from tpu_embed_ext.sparsecore import chips, hbm
from tpu_embed_ext.sparsecore import topology as sc_topology

__all__ = ["Plan", "plan", "memory_text"]

_BYTES_PER_FLOAT = 4
# Settings TPUEmbeddingV2 (SparseCore) does not honour (docs/semantics.md).
_SPARSECORE_IGNORES = (
    ("clip_weight_min", lambda o: o.clip_weight_min is not None, "weight clipping"),
    ("clip_weight_max", lambda o: o.clip_weight_max is not None, "weight clipping"),
    ("clipvalue", lambda o: o.clipvalue is not None, "gradient clipping"),
    ("use_gradient_accumulation", lambda o: not o.use_gradient_accumulation,
     "disabling gradient accumulation (SparseCore always sums per id)"),
    ("lazy_adam", lambda o: isinstance(o, optimizers.Adam) and not o.lazy_adam,
     "non-lazy Adam (SparseCore updates only looked-up rows)"),
    ("low_dimensional_packing_status", lambda o: o.low_dimensional_packing_status,
     "low-dimensional packing"),
)

_COMMON_SETTINGS = ("clipvalue", "clip_weight_min", "clip_weight_max",
                    "weight_decay_factor")
_SHORT = {"initial_accumulator_value": "init_acc", "learning_rate_power": "lr_power",
          "l1_regularization_strength": "l1", "l2_regularization_strength": "l2",
          "multiply_linear_by_learning_rate": "linear_x_lr",
          "weight_decay_factor": "wd", "use_nesterov": "nesterov"}


@dataclasses.dataclass(frozen=True)
class TableRow:
  name: str
  rows: int
  dim: int
  combiner: str
  optimizer: optimizers.OptimizerSpec
  tag: Optional[int]
  features: tuple

  @property
  def parameter_bytes(self) -> int:
    return self.rows * self.dim * _BYTES_PER_FLOAT

  @property
  def slot_bytes(self) -> int:
    return self.parameter_bytes * len(self.optimizer.slot_names)

  @property
  def total_bytes(self) -> int:
    return self.parameter_bytes + self.slot_bytes


class Plan:
  """What the TPU embedding engine will get for a spec (pickles as its spec)."""

  def __init__(self, spec):
    self.spec = spec
    step = tf.Variable(0, dtype=tf.int64, trainable=False, name="plan_step")
    self._config = spec.feature_config(step=step)
    self.tags: Dict[str, Optional[int]] = tf_config.tags(self._config)
    self.tables: List[TableRow] = [
        TableRow(t.name, t.vocabulary_size, t.dim, t.combiner,
                 spec.optimizer_for(t.name), self.tags[t.name],
                 tuple(f.name for f in spec.features if f.table == t.name))
        for t in spec.tables]
    self.warnings: List[str] = self._sparsecore_warnings()
    self.numeric_checks: Dict[str, List[str]] = {}
    """``{check id: tables it was applied to}`` (numeric_traps.CHECKS)."""
    self.numeric_warnings: List[str] = []
    for t in self.tables:
      for check in numeric_traps.checks_for(t.optimizer):
        self.numeric_checks.setdefault(check, []).append(t.name)
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", numeric_traps.NumericTrapWarning)
        numeric_traps.check_optimizer(t.optimizer)
      self.numeric_warnings += [f"table '{t.name}': {w.message}" for w in caught
                                if issubclass(w.category,
                                              numeric_traps.NumericTrapWarning)]
    self._rates = {}
    for table in tf_config.table_order(self._config):
      tag = self.tags[table.name]
      if tag is not None:
        self._rates.setdefault(tag, table.optimizer.learning_rate)

  def __reduce__(self):
    # The plan is a function of its spec; its TensorFlow config (a variable,
    # closures over it) is not picklable, so a pickle holds the spec alone.
    return (Plan, (self.spec,))

  @property
  def total_bytes(self) -> int:
    return sum(t.total_bytes for t in self.tables)

  def config_proto(self, **kwargs):
    """The TPUEmbeddingConfiguration (see ``tf.config.config_proto``)."""
    return tf_config.config_proto(self._config, **kwargs)

  def sparsecore(self, topology, batch_size: int = 0):
    """The stacked layout ``TPUEmbeddingV2`` gives these tables on ``topology``
    (a ``sparsecore.Topology`` or its spelling, "v5p:4"): a ``StackingPlan``."""
    return sparsecore_report.stacking_plan(
        self._config, sc_topology.parse_topology(topology),
        {t.name: t.optimizer.slot_names for t in self.tables}, batch_size=batch_size)

  def memory(self, topology, batch_size: int = 0) -> hbm.DeviceMemory:
    """The embedding's HBM per device on ``topology`` (a slice, "v5e:1",
    "v5p:8"; ``chips.parse_slice``): ``TPUEmbedding``'s on a generation without
    SparseCore, ``TPUEmbeddingV2``'s on one with. ``batch_size`` is the
    per-device batch of the activation and gradient buffers (0: not counted)."""
    slice_ = chips.parse_slice(topology)
    shapes = []
    for feature in tf.nest.flatten(self._config):
      if feature.output_shape:
        shapes.append(tf.TensorShape(feature.output_shape))
      elif batch_size:
        shapes.append(tf.TensorShape(
            [batch_size] + ([feature.max_sequence_length]
                            if feature.max_sequence_length else [])))
      else:
        shapes.append(None)
    return hbm.for_engine(slice_.sparsecore, self._config, None, shapes, slice_)

  def _sparsecore_warnings(self) -> List[str]:
    out = []
    for t in self.tables:
      for field, applies, what in _SPARSECORE_IGNORES:
        if applies(t.optimizer):
          out.append(f"table '{t.name}': {field}={getattr(t.optimizer, field)!r} "
                     f"is ignored by TPUEmbeddingV2 (SparseCore): no {what}.")
      if t.optimizer.weight_decay_factor:
        out.append(f"table '{t.name}': weight_decay_factor="
                   f"{t.optimizer.weight_decay_factor!r} is rejected by "
                   "TPUEmbeddingV2 (SparseCore): it raises NotImplementedError.")
    return out

  def _settings(self, o: optimizers.OptimizerSpec) -> str:
    names = o.plan_settings + _COMMON_SETTINGS
    parts = []
    for name in names:
      value = getattr(o, name)
      default = type(o).__dataclass_fields__[name].default
      if name in o.plan_settings or value != default:
        if value is None:
          continue
        parts.append(f"{_SHORT.get(name, name)}={value:g}" if isinstance(value, float)
                     else f"{_SHORT.get(name, name)}={value}")
    return " ".join(parts)

  def __str__(self) -> str:
    return self.text()

  def text(self, sparsecore_notes: bool = True) -> str:
    """The printed plan; ``sparsecore_notes=False`` leaves out what
    TPUEmbeddingV2 (SparseCore) would ignore (``plan`` shows those with
    ``--engine v2`` or ``--topology``)."""
    header = ("table", "rows x dim", "combiner", "optimizer", "lr / tag",
              "slots", "bytes", "features")
    rows = []
    for t in self.tables:
      lr = t.optimizer.learning_rate
      rate = f"tag {t.tag}" if t.tag is not None else f"{lr:g}"
      rows.append((t.name, f"{t.rows:,} x {t.dim}", t.combiner,
                   f"{t.optimizer.type_name} {self._settings(t.optimizer)}".strip(),
                   rate, ",".join(t.optimizer.slot_names) or "-",
                   _human(t.total_bytes), ",".join(t.features)))
    rows.append(("total", f"{sum(t.rows for t in self.tables):,} rows", "", "",
                 f"{len(self._rates)} tags", "", _human(self.total_bytes),
                 f"{len(self.spec.features)} features"))
    out = _table_lines(header, rows)
    if self._rates:
      out += ["", "dynamic learning rates:"]
      out += [f"  tag {tag}: {rates.describe(rate)}"
              for tag, rate in sorted(self._rates.items())]
    out += ["", "numeric checks passed (values that would write NaN or Inf; "
            "docs/numeric-traps.md):"]
    for check, tables in self.numeric_checks.items():
      where = ("every table" if len(tables) == len(self.tables)
               else ", ".join(tables))
      out.append(f"  {check}: {numeric_traps.CHECKS[check]} ({where})")
    if self.numeric_warnings:
      out += ["", "numeric notes:"] + [f"  {w}" for w in self.numeric_warnings]
    if self.warnings and sparsecore_notes:
      out += ["", "SparseCore (TPUEmbeddingV2) notes:"] + [f"  {w}" for w in self.warnings]
    return "\n".join(out)


def memory_text(memory: hbm.DeviceMemory) -> str:
  """``plan --topology``'s memory section: each table (stack) on one device,
  the buffers, the bounds against the capacity, and the verdict."""
  header = ("table" if memory.engine == "TPUEmbedding" else "stack",
            "rows/device x dim", "state", "bytes/device")
  rows = [(t.name, f"{t.rows:,} x {t.dim}", ",".join(t.states), _human(t.lower))
          for t in memory.tables]
  rows.append(("buffers", "", "activations, gradients",
               _human(memory.buffers) if not memory.uncounted else
               f"{_human(memory.buffers)} (no batch for "
               f"{len(memory.uncounted)} features: --batch_size)"))
  out = [f"memory per device, {memory.engine} on {memory.slice} "
         f"({memory.slice.generation.source}):"]
  out += _table_lines(header, rows)
  out.append(memory.summary())
  if not memory.fits:
    out.append("would be refused: " + hbm.refusal(memory, "build()"))
  elif memory.nearly_full:
    out.append(f"warned: over {hbm.WARN_FRACTION:.0%} of the device's HBM.")
  else:
    out.append("fits (the dense model, the program and XLA's buffers are "
               "not counted).")
  return "\n".join(out)


def plan(spec) -> Plan:
  """The plan of ``spec`` (an ``EmbeddingSpec``, a config dict or a config
  file path): ``print(plan(spec))`` for the table."""
  spec = EmbeddingSpec.coerce(spec)
  if not isinstance(spec, EmbeddingSpec):
    raise errors.ConfigTypeError(
        f"plan() takes an EmbeddingSpec, a config dict or a config file path, "
        f"got {type(spec).__name__}. Fix: pass EmbeddingSpec.from_file(path), "
        "or the path itself.")
  return Plan(spec)
