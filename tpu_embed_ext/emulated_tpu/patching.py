"""Every TensorFlow name the emulated TPU replaces, and how it is undone.

``PATCHES`` is the one table. Each row is a module attribute that programs
reach a TPU entry point through; ``apply`` sets every row's attribute to the
row's replacement and ``restore`` sets the originals back (the very same
objects, in reverse order). Nothing is patched at import, only inside
``emulate_tpu``. Programs that import a name before the emulation starts
(``from tensorflow.python.tpu.tpu_embedding_v2 import TPUEmbedding`` at module
level) keep the real one: ``isinstance`` against the real strategy and
resolver classes still holds (``strategy.py``), but a real ``TPUEmbedding``
built that way looks for a TPU.

Checked against TensorFlow 2.21 (tensorflow-cpu 2.21.0): every row's original
exists and is the object named in ``ORIGINALS``, and no other module under
``tensorflow`` holds any of those objects after ``import tensorflow``
(``tests/test_emulated_tpu.py::test_patch_table_covers_every_alias`` scans
``sys.modules``). The names patched, per object (module, attribute):

* ``TPUStrategyV2`` (``tf.distribute.TPUStrategy``) -> ``EmulatedTPUStrategy``:
  ``tensorflow.python.distribute.tpu_strategy.TPUStrategyV2``,
  ``tf.distribute.TPUStrategy``, ``tf.compat.v2.distribute.TPUStrategy``.
* ``TPUStrategy`` (the experimental class) -> ``EmulatedExperimentalTPUStrategy``:
  ``tpu_strategy.TPUStrategy``, ``tf.distribute.experimental.TPUStrategy``
  (and under ``tf.compat.v2``).
* ``TPUStrategyV1`` -> a class that refuses (TF1 graph mode is not emulated):
  ``tpu_strategy.TPUStrategyV1``, ``tf.compat.v1.distribute.experimental.TPUStrategy``.
* ``TPUClusterResolver`` -> ``EmulatedTPUClusterResolver``: both resolver
  modules (``cluster_resolver.tpu.tpu_cluster_resolver`` and the shim
  ``cluster_resolver.tpu_cluster_resolver``), the package
  ``tensorflow.python.distribute.cluster_resolver``, and
  ``tf.distribute.cluster_resolver`` (v1, v2, compat.v2).
* ``initialize_tpu_system`` / ``shutdown_tpu_system``: both resolver modules and
  ``tf.tpu.experimental`` (v1, v2, compat.v2).
* ``connect_to_cluster``: ``tensorflow.python.eager.remote`` and
  ``tf.config.experimental_connect_to_cluster`` (v1, v2, compat.v2).
* ``TPUEmbedding`` -> ``mid_level.TPUEmbedding``:
  ``tensorflow.python.tpu.tpu_embedding_v2`` and
  ``tf.tpu.experimental.embedding`` (v1, v2, compat.v2).
* ``TPUEmbeddingV2`` -> ``sparsecore.TPUEmbeddingV2`` with ``sparsecore=True``,
  else a class that refuses (no SparseCore, as on a TPU without one):
  ``tensorflow.python.tpu.tpu_embedding_v3`` and ``tf.tpu.experimental.embedding``.

* ``device_assignment`` (``tensorflow.python.tpu.device_assignment``, also
  what ``tf.tpu.experimental.DeviceAssignment.build`` calls) ->
  ``strategy.device_assignment``: TensorFlow's own, except that several cores
  per replica which the emulated topology cannot hold raise
  ``NotEmulatedError`` (model parallelism) instead of TensorFlow's
  ``ValueError`` about the topology.

* ``multi_device_iterator_ops.OwnedMultiDeviceIterator`` and its
  ``MultiDeviceIteratorSpec`` (internal, no alias; what ``input_lib`` feeds
  the replicas of distributed datasets through) -> ``device_datasets.
  HostIterator`` and ``HostIteratorSpec``: one host iterator dealing each
  step's elements to the replicas as TensorFlow's round-robin does, instead
  of one dataset, iterator and thread per replica (``device_datasets.py``).

* ``tpu_replication.outside_compilation_impl`` (internal, no alias; what
  ``tf.tpu.outside_compilation`` calls) -> ``host_ops.outside_compilation_impl``:
  in a replica of the emulated strategy it marks the host's ops with
  ``_xla_outside_compilation`` as TensorFlow does inside a
  ``TPUReplicateContext``, so that the XLA check leaves them out.

* ``device_util.get_host_for_device`` (internal, no alias; how ``input_lib``,
  ``tpu_embedding_v2`` and ``tpu_embedding_v3`` find the host of a core) ->
  ``pod.get_host_for_device``: on an emulated pod, the host of an emulated
  core; TensorFlow's answer for any other device.

``tf.X`` above is the module ``tensorflow._api.v2.X`` (what ``tf.X`` is), v1 is
``tensorflow._api.v2.compat.v1.X``, compat.v2 ``tensorflow._api.v2.compat.v2.X``.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Dict, List, Tuple

from tpu_embed_ext.emulated_tpu.errors import NotEmulatedError

__all__ = ["Patch", "PATCHES", "ORIGINALS", "apply", "restore", "original"]

CHECKED_TF_VERSIONS = ("2.21",)

_API = "tensorflow._api.v2"
_V1 = f"{_API}.compat.v1"
_V2 = f"{_API}.compat.v2"


@dataclasses.dataclass(frozen=True)
class Patch:
  """One module attribute and what it is while the emulation runs.

  ``replacement`` names an object of this package, ``module:attribute``
  relative to ``tpu_embed_ext.emulated_tpu``; ``original`` the key of the
  TensorFlow object the attribute holds outside the emulation (``ORIGINALS``).
  """
  module: str
  attribute: str
  replacement: str
  original: str
  tf_versions: Tuple[str, ...] = CHECKED_TF_VERSIONS


# Key -> (module, attribute) of the TensorFlow object where it is defined.
ORIGINALS = {
    "TPUStrategyV2": ("tensorflow.python.distribute.tpu_strategy", "TPUStrategyV2"),
    "TPUStrategy": ("tensorflow.python.distribute.tpu_strategy", "TPUStrategy"),
    "TPUStrategyV1": ("tensorflow.python.distribute.tpu_strategy", "TPUStrategyV1"),
    "TPUClusterResolver": (
        "tensorflow.python.distribute.cluster_resolver.tpu.tpu_cluster_resolver",
        "TPUClusterResolver"),
    "initialize_tpu_system": (
        "tensorflow.python.distribute.cluster_resolver.tpu.tpu_cluster_resolver",
        "initialize_tpu_system"),
    "shutdown_tpu_system": (
        "tensorflow.python.distribute.cluster_resolver.tpu.tpu_cluster_resolver",
        "shutdown_tpu_system"),
    "connect_to_cluster": ("tensorflow.python.eager.remote", "connect_to_cluster"),
    "TPUEmbedding": ("tensorflow.python.tpu.tpu_embedding_v2", "TPUEmbedding"),
    "TPUEmbeddingV2": ("tensorflow.python.tpu.tpu_embedding_v3", "TPUEmbeddingV2"),
    "device_assignment": ("tensorflow.python.tpu.device_assignment",
                          "device_assignment"),
    "OwnedMultiDeviceIterator": (
        "tensorflow.python.data.ops.multi_device_iterator_ops",
        "OwnedMultiDeviceIterator"),
    "MultiDeviceIteratorSpec": (
        "tensorflow.python.data.ops.multi_device_iterator_ops",
        "MultiDeviceIteratorSpec"),
    "outside_compilation_impl": ("tensorflow.python.tpu.tpu_replication",
                                 "outside_compilation_impl"),
    "get_host_for_device": ("tensorflow.python.distribute.device_util",
                            "get_host_for_device"),
}

# Key -> replacement (module:attribute under tpu_embed_ext.emulated_tpu).
# TPUEmbeddingV2 depends on the emulation: see _replacement.
_REPLACEMENTS = {
    "TPUStrategyV2": "strategy:EmulatedTPUStrategy",
    "TPUStrategy": "strategy:EmulatedExperimentalTPUStrategy",
    "TPUStrategyV1": "strategy:TPUStrategyV1NotEmulated",
    "TPUClusterResolver": "strategy:EmulatedTPUClusterResolver",
    "initialize_tpu_system": "strategy:initialize_tpu_system",
    "shutdown_tpu_system": "strategy:shutdown_tpu_system",
    "connect_to_cluster": "strategy:connect_to_cluster",
    "TPUEmbedding": "mid_level:TPUEmbedding",
    # SparseCore: the partner module tpu_embed_ext/emulated_tpu/sparsecore.py
    # (TPUEmbeddingV2 adapter). Without SparseCore, a class that refuses.
    "TPUEmbeddingV2": "sparsecore:TPUEmbeddingV2",
    "device_assignment": "strategy:device_assignment",
    # Not entry points: what feeds the replicas from distributed datasets,
    # one host iterator instead of one per replica (device_datasets.py).
    "OwnedMultiDeviceIterator": "device_datasets:HostIterator",
    "MultiDeviceIteratorSpec": "device_datasets:HostIteratorSpec",
    # What tf.tpu.outside_compilation and map_outside_compilation call:
    # marks the host's ops in an emulated replica (host_ops.py).
    "outside_compilation_impl": "host_ops:outside_compilation_impl",
    # The host of a core on a pod (emulate_tpu(hosts=H)): pod.py.
    "get_host_for_device": "pod:get_host_for_device",
}
_WITHOUT_SPARSECORE = "mid_level:TPUEmbeddingV2WithoutSparseCore"


def _rows(key: str, *places: Tuple[str, str]) -> List[Patch]:
  return [Patch(module, attribute, _REPLACEMENTS[key], key)
          for module, attribute in (ORIGINALS[key],) + places]


_RESOLVER_SHIM = "tensorflow.python.distribute.cluster_resolver.tpu_cluster_resolver"

PATCHES: Tuple[Patch, ...] = tuple(
    _rows("TPUStrategyV2", (f"{_API}.distribute", "TPUStrategy"),
          (f"{_V2}.distribute", "TPUStrategy"))
    + _rows("TPUStrategy", (f"{_API}.distribute.experimental", "TPUStrategy"),
            (f"{_V2}.distribute.experimental", "TPUStrategy"))
    + _rows("TPUStrategyV1", (f"{_V1}.distribute.experimental", "TPUStrategy"))
    + _rows("TPUClusterResolver", (_RESOLVER_SHIM, "TPUClusterResolver"),
            ("tensorflow.python.distribute.cluster_resolver", "TPUClusterResolver"),
            *((f"{api}.distribute.cluster_resolver", "TPUClusterResolver")
              for api in (_API, _V1, _V2)))
    + [row for name in ("initialize_tpu_system", "shutdown_tpu_system")
       for row in _rows(name, (_RESOLVER_SHIM, name),
                        *((f"{api}.tpu.experimental", name)
                          for api in (_API, _V1, _V2)))]
    + _rows("connect_to_cluster",
            *((f"{api}.config", "experimental_connect_to_cluster")
              for api in (_API, _V1, _V2)))
    + [row for name in ("TPUEmbedding", "TPUEmbeddingV2")
       for row in _rows(name, *((f"{api}.tpu.experimental.embedding", name)
                                for api in (_API, _V1, _V2)))]
    + _rows("device_assignment")
    + _rows("OwnedMultiDeviceIterator")
    + _rows("MultiDeviceIteratorSpec")
    + _rows("outside_compilation_impl")
    + _rows("get_host_for_device"))


def _object(path: str, emulation):
  if path == _REPLACEMENTS["TPUEmbeddingV2"] and not emulation.sparsecore:
    path = _WITHOUT_SPARSECORE
  name, attribute = path.split(":")
  name = f"tpu_embed_ext.emulated_tpu.{name}"
  try:
    module = importlib.import_module(name)
  except ModuleNotFoundError as e:
    if e.name != name:
      raise
    raise NotEmulatedError(
        f"emulate_tpu(sparsecore=True) needs {e.name} (the TPUEmbeddingV2 "
        "adapter), which this install lacks. Fix: sparsecore=False.") from None
  return getattr(module, attribute)


# (module, attribute) -> the original, while the emulation is active.
_saved: Dict[Tuple[str, str], object] = {}


def apply(emulation) -> List[Tuple[Patch, object, object]]:
  """Patches every row; returns what ``restore`` needs. All or nothing."""
  done = []
  try:
    for row in PATCHES:
      module = importlib.import_module(row.module)
      replacement = _object(row.replacement, emulation)
      done.append((row, module, getattr(module, row.attribute)))
      _saved[(row.module, row.attribute)] = done[-1][2]
      setattr(module, row.attribute, replacement)
  except BaseException:
    restore(done)
    raise
  return done


def restore(done) -> None:
  """Sets every patched attribute back to its original object."""
  for row, module, value in reversed(done):
    setattr(module, row.attribute, value)
    _saved.pop((row.module, row.attribute), None)


def original(module: str, attribute: str):
  """TensorFlow's own object for a patched name (the current one if unpatched)."""
  if (module, attribute) in _saved:
    return _saved[(module, attribute)]
  return getattr(importlib.import_module(module), attribute)

