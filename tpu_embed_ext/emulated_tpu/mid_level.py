"""``TPUEmbedding`` on the emulated TPU: the engine with its TPU-side contract.

Under the emulated ``TPUStrategy``, ``tf.tpu.experimental.embedding.TPUEmbedding``
is ``TPUEmbedding`` here: ``CPUEmbedding`` (engine ``"v1"``), which already
has the TPU's protocol, optimizer math, shapes, input checks and checkpoint
keys, plus what ``tpu_embedding_v2.py`` does differently under a
``TPUStrategy`` (TensorFlow 2.21):

* created outside a ``TPUStrategy`` scope, ``TPUEmbedding`` is TensorFlow's
  own object in its CPU mode (``_using_tpu`` False: ``embedding_tables``
  works, ``enqueue`` raises), exactly as on a TPU host;
* every table needs one of TensorFlow's optimizers (``ValueError`` there);
  ``EmbeddingSpec`` and our optimizer specs are ``create_embedding``'s, not
  ``TPUEmbedding``'s;
* ``embedding_tables`` raises the TPU's ``RuntimeError`` (the tables live on
  the TPU), except while a SavedModel is being written;
* it is not callable (lookups go through ``enqueue`` / ``dequeue``);
* ``build`` refuses tables that cannot fit a device's HBM on the emulated
  slice, with XLA's words first, before any variable is created
  (``hbm_check.py``);
* ``pipeline_execution_with_tensor_core=True`` makes the TPU look up with
  tables one step old (TensorFlow's docstring); that schedule is not
  emulated, so it is refused rather than silently giving other numbers.

Private state TPU programs and TensorFlow's own tests touch, with its CPU
meaning: ``_output_shapes`` can be assigned (the shapes ``build`` would
fix); ``_retrieve_variables`` / ``_load_variables`` copy between the TPU and
the host variables on a TPU, and do nothing here (the host variables are the
tables); each table and slot variable has ``.variables``, its shards as on a
TPU (``TPUEmbeddingVariable``): one, the whole table, as on a one-host TPU.

On a pod (``emulate_tpu(hosts=H)``) TensorFlow creates each table and slot
as one shard per host (``make_sharded_variable_creator``: rows split, the
first ``rows % H`` hosts one more), each initialised by its own call of the
initializer. Here the table stays one variable (``.variables`` one shard;
checkpoint keys and values those of the whole table, as TensorFlow saves its
shards as slices of it, so a pod's checkpoint restores on one host and on
CPU), but its initial value is built as the pod's (``_initialized_per_host``):
a sharding-aware initializer (one taking ``shard_info``) gets each shard's
``ShardInfo``, any other each shard's shape, so a full-table
``tf.constant_initializer`` fails on the pod with TensorFlow's TypeError.
The configuration proto counts the hosts (``num_hosts``, each table's
vocabulary at least ``num_hosts``), from the strategy, as TensorFlow's.

Identity: ``isinstance(e, tf.tpu.experimental.embedding.TPUEmbedding)`` and
``isinstance(e, tpu_embedding_v2.TPUEmbedding)`` hold while the emulation is
active (the names are patched; ``EmbeddingLayer`` decides its TPU branch
so). This class does not subclass TensorFlow's ``TPUEmbedding``: every
method of it would reach for a TPU, and nothing in TensorFlow, Keras or
keras-rs checks an embedding against the class it imported before.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import types
from typing import List

import tensorflow as tf
from tensorflow.python.saved_model import save_context
from tensorflow.python.tpu import tpu_embedding_v2_utils
from tensorflow.python.trackable import base as trackable_base
from tensorflow.python.util import nest, tf_inspect

from tpu_embed_ext import errors
from tpu_embed_ext.emulated_tpu import (embedding_memory, hbm_check, outer_jit,
                                        patching, session, strategy as strategy_lib,
                                        tpu_inputs)
from tpu_embed_ext.emulated_tpu.errors import NotEmulatedError
from tpu_embed_ext.emulation import engine, structure_checks

__all__ = ["TPUEmbedding", "TPUEmbeddingV2WithoutSparseCore"]


class TPUEmbedding(engine.CPUEmbedding):
  """``tf.tpu.experimental.embedding.TPUEmbedding`` under the emulated TPU."""

  def __new__(cls, feature_config=None, optimizer=None,
              pipeline_execution_with_tensor_core: bool = False):
    if not strategy_lib.is_emulated_tpu_strategy(tf.distribute.get_strategy()):
      # Not under a TPUStrategy: TensorFlow's own object, in its CPU mode.
      real = patching.original("tensorflow.python.tpu.tpu_embedding_v2",
                               "TPUEmbedding")
      return real(feature_config, optimizer, pipeline_execution_with_tensor_core)
    return super().__new__(cls)

  def __init__(self, feature_config, optimizer,
               pipeline_execution_with_tensor_core: bool = False):
    if pipeline_execution_with_tensor_core:
      raise NotEmulatedError(
          "TPUEmbedding(pipeline_execution_with_tensor_core=True) is not "
          "emulated: a TPU then looks ids up in tables one step old, a schedule "
          "the emulation does not reproduce. Fix: "
          "pipeline_execution_with_tensor_core=False under emulate_tpu (the "
          "results a TPU gives without pipelining).")
    _check_tpu_optimizers(feature_config, optimizer)
    super().__init__(feature_config, optimizer, engine="v1")
    object.__setattr__(self, "_tf_optimizer", optimizer)
    object.__setattr__(self, "_engine_builds", 0)

  @contextlib.contextmanager
  def _engine_build(self):
    """``build()`` calls from the engine (``enqueue``, ``variables``): as
    ``TPUEmbedding._maybe_build``, they leave unset shapes to the batch."""
    object.__setattr__(self, "_engine_builds", self._engine_builds + 1)
    try:
      yield
    finally:
      object.__setattr__(self, "_engine_builds", self._engine_builds - 1)

  def build(self, per_replica_input_shapes=None, per_replica_batch_size=None):
    """``TPUEmbedding.build``: configures the TPU's embedding engine, once."""
    if self._table_vars is not None:
      return
    tables = [t.name for t in self._tables]
    _check_config_proto_writable()
    embedding_memory.check_free(tables)
    if (not self._engine_builds and per_replica_input_shapes is None
        and not per_replica_batch_size):
      # tpu_embedding_v2.py build -> _check_output_shapes_fully_defined: with
      # no shapes given, every feature needs a fully defined output shape.
      for feature, shape in zip(self._features, self._output_shapes):
        structure_checks.check_fully_defined(feature.where, shape)
    # The shapes build fixes, worked out on a copy (a refused build fixes
    # none), then the TPU's HBM per device, before any variable exists.
    shapes = copy.copy(self._shapes)
    shapes.build(per_replica_input_shapes, per_replica_batch_size)
    hbm_check.check("TPUEmbedding.build()", False, self.feature_config,
                    self._tables, self._features, shapes.stored)
    with _initialized_per_host(self, self._replicas.strategy.extended.num_hosts):
      super().build(per_replica_input_shapes, per_replica_batch_size)
    embedding_memory.claim(self, tables)
    for variables in self._table_vars.values():
      for variable in variables.values():
        variable.variables = (variable,)  # One shard: the whole table.

  @property
  def variables(self):
    with self._engine_build():
      return super().variables

  @tf.autograph.experimental.do_not_convert
  def enqueue(self, features, weights=None, training: bool = True,
              name=None, device=None):
    """``TPUEmbedding.enqueue`` with the TPU's checks (``tpu_inputs.py``)."""
    strategy = self._replicas.strategy
    in_tpu_context = tpu_inputs.check_control_flow(strategy)
    structure_checks.check_structure(
        self.feature_config, "features", features,
        "pass one entry per FeatureConfig, in the same containers.")
    tpu_inputs.check_inputs_on_host(strategy, nest.flatten(features),
                                    [f.path for f in self._features])
    if in_tpu_context:
      tpu_inputs.check_direct_inputs(strategy, features)
    # On the host inside jit_compile=True: TensorFlow's XLA error (outer_jit),
    # raised when the enqueue op is made, after the checks above.
    outer_jit.check_host_enqueue(self._replicas)
    with self._engine_build():
      return super().enqueue(features, weights, training, name, device)

  def _check_gradients(self, gradients):
    """``TPUEmbedding.apply_gradients``: float32 gradients only, as the TPU's
    ``SendTPUEmbeddingGradients`` op takes them (TensorFlow casts nothing)."""
    # TensorFlow's order: each gradient's type and shape, then the op's dtype.
    super()._check_gradients(gradients)
    flat = nest.flatten(gradients)
    wrong = [(f, g) for f, g in zip(self._features, flat)
             if g is not None and g.dtype != tf.float32]
    if wrong:
      feature, grad = wrong[0]
      types_ = [(g.dtype if g is not None else tf.float32).name for g in flat]
      raise errors.InputTypeError(
          "Tensors in list passed to 'inputs' of 'SendTPUEmbeddingGradients' "
          f"Op have types [{', '.join(types_)}] that do not match expected "
          f"type float32. {feature.where}: gradient dtype {grad.dtype.name}; "
          "the TPU takes float32 gradients only and casts nothing. Fix: "
          "tf.cast the gradient to tf.float32 (e.g. take it with respect to "
          "the float32 activations dequeue() returned).")

  @property
  def embedding_tables(self):
    if save_context.in_save_context():
      return super().embedding_tables
    raise RuntimeError(
        "Unable to retrieve embedding tables when using a TPU strategy. If you "
        "need access, save your model, create this object under a CPU strategy "
        "and restore.")

  @property
  def _output_shapes(self) -> List[tf.TensorShape]:
    return self._shapes.stored

  @_output_shapes.setter
  def _output_shapes(self, shapes):
    shapes = [tf.TensorShape(s) for s in shapes]
    if len(shapes) != len(self._features):
      raise errors.InputError(
          f"_output_shapes has {len(shapes)} shapes for {len(self._features)} "
          "features. Fix: one shape per FeatureConfig, in its flattened order.")
    self._shapes.stored = shapes

  def _retrieve_variables(self):
    # The host variables are the tables, unless initialize_tpu_system gave
    # the TPU to another TPUEmbedding since (embedding_memory.py).
    embedding_memory.retrieve(self)

  def _load_variables(self):
    embedding_memory.load(self)

  def _create_config_proto(self):
    """The ``TPUEmbeddingConfiguration`` a TPU would be configured with.

    TensorFlow's own ``TPUEmbedding._create_config_proto`` run on this
    object's tables, optimizers and output shapes. TensorFlow names unnamed
    tables (``table_<i>``) and gives tables without an optimizer the global
    one by writing into the user's ``TableConfig``s; we never modify them, so
    it reads copies carrying those names and optimizers.
    """
    copies = {}
    for table in self._tables:
      config = copy.copy(table.config)
      config.name = table.name
      if config.optimizer is None:
        config.optimizer = self._tf_optimizer
      copies[id(table.config)] = config
    features = nest.map_structure(
        lambda f: _with_table(f, copies[id(f.table)]), self.feature_config)
    rates = []
    for config in copies.values():
      rate = config.optimizer.learning_rate
      if callable(rate) and rate not in rates:
        rates.append(rate)
    shim = types.SimpleNamespace(
        _dynamic_learning_rates=rates, _table_config=list(copies.values()),
        _strategy=self._replicas.strategy, _feature_config=features,
        _output_shapes=list(self._output_shapes), _num_cores_per_replica=None,
        _pipeline_execution_with_tensor_core=False)
    real = patching.original("tensorflow.python.tpu.tpu_embedding_v2",
                             "TPUEmbedding")
    return real._create_config_proto(shim)  # pylint: disable=protected-access

  def __call__(self, features, weights=None):
    raise errors.InputTypeError(
        "TPUEmbedding is not callable, on a TPU either. Fix: enqueue the "
        "features, then dequeue the activations inside strategy.run.")


def host_rows(rows: int, hosts: int) -> List[int]:
  """Rows of each host's shard of a table on a pod, as TensorFlow splits
  them (``make_sharded_variable_creator``): the first ``rows % hosts`` hosts
  one more; a host may get none."""
  return [rows // hosts + (host < rows % hosts) for host in range(hosts)]


@contextlib.contextmanager
def _initialized_per_host(owner: TPUEmbedding, hosts: int):
  """While ``owner`` builds on a pod of ``hosts`` hosts: each table's
  initializer is called once per host shard (``host_rows``), as
  ``tpu_embedding_v2.make_sharded_variable_creator`` creates a table's
  shards, and the shards concatenated are the one variable. A restore
  waiting for the build replaces the initializer (nothing is called)."""
  if hosts == 1:
    yield
    return
  tables = owner._tables  # pylint: disable=protected-access
  per_host = []
  for table in tables:
    config = copy.copy(table.config)  # the user's is never modified
    config.initializer = functools.partial(_per_host_value, table.name,
                                           table.config.initializer, hosts)
    per_host.append(table._replace(config=config))
  object.__setattr__(owner, "_tables", type(tables)(per_host))
  try:
    yield
  finally:
    object.__setattr__(owner, "_tables", tables)


def _per_host_value(name: str, initializer, hosts: int, shape, dtype=None):
  """The table ``name`` as TensorFlow initialises it on ``hosts`` hosts: a
  sharding-aware ``initializer`` (one taking ``shard_info``) is called with
  the whole shape and each shard's ``ShardInfo``, any other with each
  shard's shape."""
  rows, cols = shape
  whole = functools.partial(initializer, shape, dtype=dtype)
  aware = "shard_info" in tf_inspect.getargspec(whole).args
  sizes = host_rows(rows, hosts)
  shards, offset = [], 0
  for size in sizes:
    if not size:  # TensorFlow creates no shard for a host without rows.
      continue
    if aware:
      shards.append(whole(shard_info=trackable_base.ShardInfo((size, cols),
                                                              (offset, 0))))
    else:
      try:
        shards.append(initializer((size, cols), dtype=dtype))
      except (TypeError, ValueError) as e:
        kind = errors.ConfigTypeError if isinstance(e, TypeError) else errors.ConfigError
        raise kind(
            f"{e} (TPUEmbedding on a pod of {hosts} hosts creates table "
            f"{name!r} as one shard per host, rows {sizes} of {rows}, and calls "
            f"its initializer with each shard's shape, ({size}, {cols}) here: "
            "tpu_embedding_v2.make_sharded_variable_creator; one host calls it "
            "once with the whole shape.) Fix: an initializer for any shape "
            "(a scalar or random one), or one taking shard_info: def init("
            "shape, dtype=None, shard_info=None) returning the rows "
            "shard_info.offset[0] to shard_info.offset[0] + shard_info.shape[0] "
            "of the table when shard_info is given.") from None
    offset += size
  return tf.concat(shards, 0) if len(shards) > 1 else shards[0]


def _with_table(feature, table):
  feature = copy.copy(feature)
  feature.table = table
  return feature


def _check_config_proto_writable() -> None:
  """Refuses, as a TPU's ``build`` would, an install whose protobuf refuses
  TensorFlow's TPU embedding config: ``TPUEmbedding._create_config_proto``
  sets ``OptimizationParameters.low_dimensional_packing_status`` (an enum)
  to a bool for every table (``tpu_embedding_v2_utils.py``,
  ``_set_optimization_parameters``), which protobuf 7 refuses."""
  from tensorflow.core.protobuf.tpu import optimization_parameters_pb2  # pylint: disable=g-import-not-at-top
  try:
    optimization_parameters_pb2.OptimizationParameters().low_dimensional_packing_status = False
  except TypeError as e:
    import google.protobuf  # pylint: disable=g-import-not-at-top
    raise errors.ConfigTypeError(
        f"{e} (TensorFlow {tf.__version__}'s TPUEmbedding.build writes this bool "
        f"into its TPU configuration for every table, and protobuf "
        f"{google.protobuf.__version__} refuses it: on a TPU, TPUEmbedding "
        "cannot build with this install). Fix: pip install 'protobuf<7'.") from None


def _check_tpu_optimizers(feature_config, optimizer):
  """Every table's optimizer is one of TensorFlow's (as under a TPUStrategy)."""
  if hasattr(feature_config, "feature_config"):
    raise errors.ConfigTypeError(
        "TPUEmbedding takes a nested structure of FeatureConfigs, not an "
        "EmbeddingSpec. Fix: tpu_embed_ext.create_embedding(spec), which builds "
        "TPUEmbedding from it under a TPUStrategy.")
  for feature in nest.flatten(feature_config):
    table = getattr(feature, "table", None)
    chosen = getattr(table, "optimizer", None) or optimizer
    if not isinstance(chosen, tpu_embedding_v2_utils._Optimizer):  # pylint: disable=protected-access
      name = getattr(table, "name", None) or "(unnamed)"
      raise errors.ConfigTypeError(
          f"{type(chosen)} is an unsupported optimizer class. Please pass an "
          "instance of one of the optimizer classes under "
          f"tf.tpu.experimental.embedding. table {name!r}: TPUEmbedding under "
          "a TPUStrategy needs one of "
          f"tf.tpu.experimental.embedding's optimizers, got {chosen!r}. Fix: "
          "pass optimizer= (e.g. tf.tpu.experimental.embedding.SGD(0.1)) or "
          "set TableConfig.optimizer; for our optimizer specs use "
          "tpu_embed_ext.create_embedding.")


class TPUEmbeddingV2WithoutSparseCore:
  """``TPUEmbeddingV2`` on an emulated TPU without SparseCore: refused."""

  def __init__(self, *args, **kwargs):
    del args, kwargs
    emulation = session.current()
    slice_ = getattr(emulation, "slice", None)
    raise NotEmulatedError(
        "TPUEmbeddingV2 needs SparseCore, and this emulated TPU"
        + (f" ({slice_})" if slice_ is not None else "") + " has none (as a "
        "TPU v2, v3, v4 or v5e). Fix: emulate_tpu(sparsecore=True) (or `emulate "
        "--sparsecore`) or a SparseCore topology (v5p:4, v6e:4), or use "
        "tf.tpu.experimental.embedding.TPUEmbedding.")
