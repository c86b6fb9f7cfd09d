"""What an engine emulating ``TPUEmbeddingV2`` on a topology keeps: layouts, limits.

``SparseCoreState`` is built once from the engine's feature config; the engine
calls ``track`` with its per-table variables after creating them (untracked),
``check_checkpoint`` before a restore, ``checkpoint_adapter`` / ``claims``
from its restore hooks (a checkpoint of another layout: ``restore.Router``),
and ``keep`` on each step's ids. The
engine's variables, lookups and updates stay per table.

Before a batch's ids are counted, ``check_compile`` runs once per set of
sample counts what the TPU's compiler checks when it compiles that step
(``scratchpad.py``: E3001, the scratchpad; E3000, the HBM stack): a refusal
raises ``SparseCoreCompileError`` before the step changes anything; what only
an estimate flags warns ``SparseCoreCompileWarning``.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Mapping, Sequence

import numpy as np
import tensorflow as tf

from tpu_embed_ext import errors
from tpu_embed_ext.tf import optimizers
from tpu_embed_ext.sparsecore import layout as sc_layout
from tpu_embed_ext.sparsecore import limits as sc_limits
from tpu_embed_ext.sparsecore import restore as sc_restore
from tpu_embed_ext.sparsecore import scratchpad as sc_scratchpad
from tpu_embed_ext.sparsecore import trackable
from tpu_embed_ext.sparsecore.topology import parse_topology

__all__ = ["SparseCoreState", "SparseCoreCompileError", "SparseCoreCompileWarning"]


class SparseCoreCompileError(errors.Error, tf.errors.ResourceExhaustedError):
  """What SparseCore's compiler refuses (OpenXLA E3001, E3000): XLA's words
  first, then ours. ``code_name`` is "E3001" or "E3000"."""

  def __init__(self, message: str, code_name: str = ""):
    tf.errors.ResourceExhaustedError.__init__(self, None, None, message)
    self.code_name = code_name

  def __str__(self):
    return self.message


class SparseCoreCompileWarning(UserWarning):
  """A stacked table's scratchpad may not fit (E3001 on an estimate): warned only."""


class SparseCoreState:
  """Layouts and limits of ``feature_config`` on ``topology``.

  Args:
    feature_config: the engine's nested ``FeatureConfig``.
    optimizer: the optimizer of tables without one.
    topology: a ``Topology`` or its spelling ("v5p:4").
    sparse_core_config: a ``SparseCoreEmbeddingConfig`` (or ``Limits``);
      None: TPUEmbeddingV2's defaults.
  """

  def __init__(self, feature_config, optimizer, topology, sparse_core_config=None):
    self.topology = parse_topology(topology)
    self.limits = (sparse_core_config if isinstance(sparse_core_config, sc_limits.Limits)
                   else sc_limits.Limits.from_config(sparse_core_config))
    stacking = not getattr(sparse_core_config, "disable_table_stacking", False)
    self.layouts: List[sc_layout.TableLayout] = sc_layout.compute_layouts(
        sc_layout.stacking_inputs(feature_config, optimizer), self.topology,
        stacking=stacking)
    from tensorflow.python.util import nest  # pylint: disable=g-import-not-at-top
    paths = nest.flatten_with_joined_string_paths(feature_config)
    self._paths = [p for p, _ in paths]
    self._features = [f for _, f in paths]
    self.padding: Dict[str, Dict[str, float]] = {}
    for f in self._features:
      spec = optimizers.as_spec(f.table.optimizer or optimizer)
      self.padding[f.table.name] = {
          "parameters": 0.0, **dict(zip(spec.slot_names, spec.slot_initial_values()))}
    self.router = sc_restore.Router(self.layouts)
    self._compiled = set()  # sample counts already checked (check_compile)

  def track(self, owner, variables: Mapping[str, Mapping[str, object]]) -> None:
    """Makes ``owner`` save and restore ``variables`` in the stacked layout."""
    # TensorFlow's own deferred restores of the stacked objects (a checkpoint
    # of this layout) wait until the router's (other layouts) are merged with
    # them: every restore then applies in restore order, the latest last.
    held = self.router.hold_deferred(owner, variables)
    tracked = trackable.track_stacked(owner, variables, self.layouts, self.padding)
    self.router.built(variables, tracked, held)

  def checkpoint_adapter(self, owner, path: str) -> None:
    """``_checkpoint_adapter``: a restore of checkpoint ``path`` begins
    (``restore.Router``); returns None, the router being the adapter."""
    self.router.adapt(owner, path)

  def claims(self, name: str) -> bool:
    """Whether the restore's child ``name`` is loaded by the router (the
    engine's ``_lookup_dependency`` then answers None)."""
    return self.router.claims(name)

  def check_checkpoint(self, path: str, prefix: str = "embedding") -> None:
    trackable.check_checkpoint(path, self.layouts, prefix)

  def compile_verdicts(self, sample_counts: Sequence[int]):
    """``(scratchpad per stack, HBM stack)`` of a step with these global
    sample counts, one per flat feature (``scratchpad.py``)."""
    samples = sc_scratchpad.samples_per_sparsecore(
        self.layouts, [(f.table.name, int(n)) for f, n in zip(self._features, sample_counts)],
        self.topology)
    stacks = sc_scratchpad.scratchpad(self.layouts, samples, self.limits, self.topology)
    generation = sc_scratchpad.generation_of(self.topology)
    used = sc_scratchpad.tables_and_slots_bytes(
        self.layouts, {t: len(states) for t, states in self.padding.items()},
        self.topology)
    return stacks, sc_scratchpad.hbm_stack(stacks, used, generation.capacity_bytes,
                                           f"{generation.name}, chips.py")

  def check_compile(self, sample_counts: Sequence[int]) -> None:
    """What the compiler refuses for a step of these sample counts, before it
    runs: raises ``SparseCoreCompileError`` (E3001, then E3000), warns
    ``SparseCoreCompileWarning`` where only the estimate does not fit. Once
    per set of sample counts."""
    key = tuple(int(n) for n in sample_counts)
    if key in self._compiled or len(key) != len(self._features):
      return
    stacks, stack_hbm = self.compile_verdicts(key)
    for s in stacks:
      if s.refused:
        raise SparseCoreCompileError(s.message(), "E3001")
    if stack_hbm.refused:
      raise SparseCoreCompileError(stack_hbm.message(), "E3000")
    self._compiled.add(key)
    for s in stacks:
      if s.verdict == sc_scratchpad.WARNED:
        warnings.warn(s.message(), SparseCoreCompileWarning, stacklevel=2)

  def keep(self, samples: Sequence[np.ndarray], ids: Sequence[np.ndarray],
           sample_counts: Sequence[int]) -> List[np.ndarray]:
    """Per flat feature, which ids SparseCore keeps this step (or InputError)."""
    if len(ids) != len(self._features):
      raise errors.InputError(
          f"expected ids for {len(self._features)} features "
          f"({', '.join(self._paths)}), got {len(ids)}. Fix: pass one entry per "
          "feature, in flat order.")
    features = [sc_limits.FeatureIds(f.table.name, np.asarray(s, np.int64),
                                     np.asarray(i, np.int64), int(n), path)
                for f, path, s, i, n in zip(self._features, self._paths, samples, ids,
                                            sample_counts)]
    self.check_compile(sample_counts)
    _, keep = sc_limits.check_limits(features, self.layouts, self.topology, self.limits)
    return keep

  def keep_masks(self, samples, ids, sample_counts):
    """``keep`` on tensors, eagerly or inside ``tf.function`` (``tf.numpy_function``).

    In a graph, a limit error surfaces as the ``InvalidArgumentError`` of
    ``tf.numpy_function`` carrying the same message.
    """
    n = len(ids)
    if tf.executing_eagerly():
      return [tf.constant(k) for k in self.keep(
          [np.asarray(s) for s in samples], [np.asarray(i) for i in ids],
          [int(c) for c in sample_counts])]
    static = [tf.get_static_value(c) for c in sample_counts]
    if all(c is not None for c in static):
      # Shapes are static: the batch's layout is refused now, when the step
      # is traced, not when it runs (inside the numpy_function's traceback).
      empty = np.zeros(0, np.int64)
      sc_limits.validate([sc_limits.FeatureIds(f.table.name, empty, empty, int(c), path)
                          for f, path, c in zip(self._features, self._paths, static)],
                         self.topology)
      self.check_compile(static)  # E3001 / E3000 when the step is traced
    masks = tf.numpy_function(
        lambda *a: self.keep(a[:n], a[n:2 * n], [int(c) for c in a[2 * n:]]),
        [tf.cast(s, tf.int64) for s in samples] + [tf.cast(i, tf.int64) for i in ids]
        + [tf.cast(c, tf.int64) for c in sample_counts], [tf.bool] * n,
        stateful=False)
    return [tf.ensure_shape(m, i.shape) for m, i in zip(masks, ids)]
