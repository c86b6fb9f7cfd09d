"""Distributed datasets of the emulated TPU: one host iterator that deals.

``strategy.experimental_distribute_dataset`` and
``distribute_datasets_from_function`` (``MirroredStrategy``'s, which the
emulated ``TPUStrategy`` is) build TensorFlow's distributed dataset and
iterator (``input_lib``): rebatching, partial batches, ``PerReplica`` values
and their type specs are all TensorFlow's. Under them, each input worker
feeds its replicas through an ``OwnedMultiDeviceIterator``
(``multi_device_iterator_ops``): a host iterator resource deals elements
round-robin (element ``i`` to replica ``i % replicas``) into one buffer per
replica, and each replica reads its buffer through a dataset and an iterator
of its own (a ``generator_dataset`` of six traced functions that fetch with a
``remote_call``, then a ``prefetch``), so that data lands in each GPU's or
TPU's memory ahead of the step.

Every emulated "device" is the host CPU, so the emulated TPU replaces that
iterator (``patching.PATCHES``, while the emulation is active) with
``HostIterator``: one iterator over the same dataset, with the same options,
read ``replicas`` times in replica order for each step, each element then
placed on its replica's device. That is the same dealing: element
``s * replicas + k`` is replica ``k``'s in step ``s``, and at the end of the
data the first replicas get the last elements and the others get none, as
TensorFlow's round-robin gives them. Inside a ``tf.function`` the reads are
ops on one iterator resource, which TensorFlow runs in program order
(automatic control dependencies).

Why (issue 34): TensorFlow's form costs one dataset, one iterator and six
traced functions per replica for every distributed iterator (at 8 replicas,
a third of a TPU-style test's time), and its per-replica iterators and
prefetch threads are what froze the main thread at 8 replicas:
``tpu_embedding_v2_valid_input_test.py`` hung in 2 runs of 2 in
``RootDataset::Iterator::~Iterator``, joining an autotuning thread
(``UnboundedThreadPool::LogicalThreadWrapper::~LogicalThreadWrapper``, 0%
CPU for minutes). ``HostIterator`` has one iterator per input worker and no
threads of its own. The host dataset runs without tf.data autotuning
(``without_autotuning``): the same elements in the same order; only the
speed of ``AUTOTUNE`` parallelism and buffers can change, which a CPU run
does not predict anyway.

``tests/test_emulated_tpu.py`` compares every replica's batches, eagerly and
in a ``tf.function``, to the end of the data (partial batches included),
with a plain ``MirroredStrategy``'s at 2, 4 and 8 replicas;
``tests/test_emulated_pod_inputs.py`` with what TensorFlow's ``input_lib``
deals from each host's dataset on a pod (``emulate_tpu(hosts=2)``).
"""

from __future__ import annotations

import collections

import tensorflow as tf
from tensorflow.python.data.ops import iterator_ops, multi_device_iterator_ops
from tensorflow.python.data.ops import options as options_lib
from tensorflow.python.distribute import device_util
from tensorflow.python.framework import ops

from tpu_embed_ext.emulated_tpu import session
from tpu_embed_ext.emulated_tpu.errors import EmulationError, NotEmulatedError

__all__ = ["HostIterator", "HostIteratorSpec", "without_autotuning"]


def without_autotuning(dataset):
  """``dataset`` with ``options.autotune.enabled = False`` (see above)."""
  options = tf.data.Options()
  options.autotune.enabled = False
  return dataset.with_options(options)


class HostIteratorSpec(multi_device_iterator_ops.MultiDeviceIteratorSpec):
  """The type spec of a ``HostIterator``: its one host iterator."""

  __slots__ = []

  @property
  def value_type(self):
    return HostIterator

  @property
  def _component_specs(self):
    return [iterator_ops.IteratorSpec(self._element_spec)]

  def _to_components(self, value):
    if not isinstance(value, HostIterator):
      raise EmulationError(
          "a distributed iterator made before emulate_tpu started was passed "
          "to a tf.function inside it; the emulated TPU reads its datasets "
          "through its own iterators. Fix: make the iterator (iter(...) of the "
          "distributed dataset) inside the emulation.")
    return [value._iterator]  # pylint: disable=protected-access

  def _from_components(self, components):
    return HostIterator(devices=self._devices, source_device=self._source_device,
                        components=components, element_spec=self._element_spec)

  @staticmethod
  def from_value(value):
    return value._type_spec  # pylint: disable=protected-access


# The per-replica element shapes of the latest host iterators of the active
# emulation: what a batch read through get_next_as_optional (of a relaxed,
# (None, ...) spec) holds when the step runs, which is the shape a TPU
# compiles the step for (TPUCompile receives the inputs' shapes when the step
# runs). Keyed by the emulation: an earlier one's datasets say nothing here.
_static_shapes = collections.deque(maxlen=32)


def _record_static_shapes(element_spec) -> None:
  owner = session.current()
  for spec in tf.nest.flatten(element_spec, expand_composites=True):
    if isinstance(spec, tf.TensorSpec) and spec.shape.is_fully_defined():
      key = (owner, spec.dtype, tuple(spec.shape.as_list()))
      if key in _static_shapes:
        _static_shapes.remove(key)
      _static_shapes.append(key)  # the latest last


def batch_shape(dtype, shape):
  """The latest static shape of ``dtype`` that partial ``shape`` fits, recorded
  in the active emulation, or None."""
  owner = session.current()
  for o, d, s in reversed(_static_shapes):
    if o is owner and d == dtype and tf.TensorShape(s).is_compatible_with(shape):
      return tf.TensorShape(s)
  return None


class HostIterator(multi_device_iterator_ops.OwnedMultiDeviceIterator):
  """``OwnedMultiDeviceIterator`` of the emulated TPU (see above).

  Takes TensorFlow's arguments. ``max_buffer_size`` and
  ``prefetch_buffer_size`` size TensorFlow's per-device buffers, which this
  iterator does not have: they change when elements are read, never which.
  """

  def __init__(self, dataset=None, devices=None, max_buffer_size=1,  # pylint: disable=super-init-not-called
               prefetch_buffer_size=1, source_device="/cpu:0",
               components=None, element_spec=None):
    del max_buffer_size, prefetch_buffer_size
    if devices is None:
      raise ValueError("`devices` must be provided.")
    self._devices = devices
    self._source_device = source_device
    if dataset is None:
      if components is None or element_spec is None:
        raise ValueError("When `dataset` is not provided, both `components` "
                         "and `element_spec` must be specified.")
      self._iterator, = components
      self._element_spec = element_spec
      return
    if components is not None or element_spec is not None:
      raise ValueError("When `dataset` is provided, `element_spec` and "
                       "`components` must not be specified.")
    # The options TensorFlow's iterator gives its dataset.
    options = options_lib.Options()
    options.experimental_distribute.num_devices = len(devices)
    dataset = dataset.with_options(options)._apply_debug_options()  # pylint: disable=protected-access
    self._element_spec = dataset.element_spec
    _record_static_shapes(self._element_spec)
    with ops.device(source_device):
      self._iterator = iter(dataset)

  def _on_device(self, element, device):
    """``element`` (read on the host) as replica ``device``'s value."""
    if device_util.canonicalize(device) == device_util.canonicalize(
        self._source_device):
      return element
    with ops.device(device):
      return tf.nest.map_structure(tf.identity, element, expand_composites=True)

  def get_next(self, device=None):
    """Every device's next element, in device order (as TensorFlow's)."""
    if device is not None:
      raise NotEmulatedError(
          "OwnedMultiDeviceIterator.get_next(device) is not emulated: the "
          "emulated TPU deals each step's elements to all replicas at once. "
          "Fix: call get_next() and take the device's entry.")
    result = []
    for replica_device in self._devices:
      with ops.device(self._source_device):
        element = self._iterator.get_next()
      result.append(self._on_device(element, replica_device))
    return result

  def get_next_as_optional(self):
    """Every device's next element as an ``Optional``, in device order, its
    value on the device as TensorFlow's per-device optionals hold it.

    Eagerly a read's outputs stay on the optional's device whatever the
    scope ``input_lib`` reads it under: all on the host here, where
    ``MirroredStrategy`` gives replica r its value on device r. So each value
    is moved to its device, in a new ``Optional`` made there. In a
    ``tf.function`` the traced reads carry no device, here as in TensorFlow's
    (a step's outputs are on the call's device), and are left as they are."""
    with ops.device(self._source_device):
      optionals = [self._iterator.get_next_as_optional() for _ in self._devices]
    if not tf.executing_eagerly():
      return optionals
    return [self._optional_on(o, d) for o, d in zip(optionals, self._devices)]

  def _optional_on(self, optional, device):
    if device_util.canonicalize(device) == device_util.canonicalize(
        self._source_device) or not optional.has_value():
      return optional  # An empty one: input_lib makes the dummy on the device.
    value = self._on_device(optional.get_value(), device)
    with ops.device(device):
      return tf.experimental.Optional.from_value(value)

  @property
  def _type_spec(self):
    return HostIteratorSpec(self._devices, self._source_device,
                            self._element_spec)
