"""The emulated TPU's cores: logical CPU devices, one per replica.

TensorFlow fixes its logical devices when it first initialises, so they are
made here before any op runs (by ``emulate_tpu``, the runner or the pytest
plugin), and refused with the fix when it is too late.
"""

from __future__ import annotations

from typing import Tuple

import tensorflow as tf
from tensorflow.python.eager import context

from tpu_embed_ext.emulated_tpu.errors import EmulationError

__all__ = ["configure_logical_devices", "logical_devices"]

_HOW_TO_GET_DEVICES = (
    "Fix: enter emulate_tpu before any TensorFlow op runs, or run the program "
    "with `python -m tpu_embed_ext emulate --replicas {n} SCRIPT`, or its tests "
    "with `pytest --emulate-tpu={n}`, which set the devices up first.")


def configure_logical_devices(replicas: int) -> None:
  """Splits the CPU into ``replicas`` logical devices if TensorFlow still can.

  TensorFlow fixes its logical devices when it initialises (the first op);
  before that, a split into fewer devices is replaced (one into at least as
  many is kept). Initialises nothing.
  """
  if context.context()._initialized:  # pylint: disable=protected-access
    return
  cpu = tf.config.list_physical_devices("CPU")[0]
  configured = tf.config.get_logical_device_configuration(cpu) or []
  if len(configured) < replicas:
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)


def logical_devices(replicas: int) -> Tuple[str, ...]:
  """The first ``replicas`` logical CPU devices (made first if TF still can)."""
  configure_logical_devices(replicas)
  devices = tf.config.list_logical_devices("CPU")
  if len(devices) < replicas:
    raise EmulationError(
        f"emulate_tpu(replicas={replicas}) needs {replicas} logical CPU devices, "
        f"but TensorFlow is already initialised with {len(devices)} and cannot "
        "add more. " + _HOW_TO_GET_DEVICES.format(n=replicas))
  return tuple(d.name for d in devices[:replicas])
