"""The two TPU embedding engines' differences, as one frozen value each.

``CPUEmbedding(engine="v1")`` emulates ``TPUEmbedding`` (``tpu_embedding_v2.py``,
TPU v2 to v4) and ``engine="v2"`` emulates ``TPUEmbeddingV2``
(``tpu_embedding_v3.py``, SparseCore: v5p, v6e). Everything the engine does
differently for the two reads a field of its ``EngineRules`` (``V1`` or
``V2``); the user's ``engine=`` string is read once, by ``of``.
docs/semantics.md ("Engine v1 and v2 differences") gives each field's source.
"""

from __future__ import annotations

import dataclasses

__all__ = ["EngineRules", "V1", "V2", "of"]


@dataclasses.dataclass(frozen=True)
class EngineRules:
  """What one engine does, where the two differ."""
  name: str      # the user's engine= value: "v1" or "v2"
  tf_class: str  # the TensorFlow class emulated
  # The step: gradient clipping, decoupled weight decay and weight clipping
  # (v1). SparseCore passes no clipping bounds and refuses weight decay.
  clips_and_decays: bool
  refuses_weight_decay: bool
  # Non-lazy Adam (lazy_adam=False) steps every row of the table (v1);
  # SparseCore ignores lazy_adam.
  updates_every_row: bool
  # use_gradient_accumulation=False applies contributions one by one (v1);
  # SparseCore always sums.
  accumulation_optional: bool
  # Inputs: dense ids may carry weights (v2: one weighted id per sample).
  weights_on_dense_ids: bool
  # max_sequence_length makes sequence activations (v1); v2 ignores it.
  sequence_length_honoured: bool
  # Every dense id, ragged row or sparse row is one of prod(output_shape)
  # samples, and activation shapes are output_shape, which must be fully
  # defined when the engine is created (v2).
  output_shape_required: bool
  # Tables are stacked and sharded over SparseCores (a topology applies).
  stacks_tables: bool
  # Its refusals of weights start with TensorFlow's own phrase
  # (tpu_embedding_v2.py _add_data_for_*), which users' tests match.
  tf_weight_phrases: bool


V1 = EngineRules(
    name="v1", tf_class="TPUEmbedding", clips_and_decays=True,
    refuses_weight_decay=False, updates_every_row=True,
    accumulation_optional=True, weights_on_dense_ids=False,
    sequence_length_honoured=True, output_shape_required=False,
    stacks_tables=False, tf_weight_phrases=True)

V2 = EngineRules(
    name="v2", tf_class="TPUEmbeddingV2", clips_and_decays=False,
    refuses_weight_decay=True, updates_every_row=False,
    accumulation_optional=False, weights_on_dense_ids=True,
    sequence_length_honoured=False, output_shape_required=True,
    stacks_tables=True, tf_weight_phrases=False)

_BY_NAME = {r.name: r for r in (V1, V2)}


def of(engine) -> EngineRules:
  """The rules of a user's ``engine=`` argument (``"v1"``, ``"v2"``, or
  already an ``EngineRules``)."""
  if isinstance(engine, EngineRules):
    return engine
  if engine not in _BY_NAME:
    raise ValueError(f'engine must be "v1" or "v2", got engine={engine!r}.')
  return _BY_NAME[engine]
