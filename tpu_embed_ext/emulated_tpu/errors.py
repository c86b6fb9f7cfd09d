"""The emulated TPU's errors: what cannot start, what is not emulated, and
what a TPU refuses, refused alike (re-exported by ``tpu_embed_ext.emulated_tpu``)."""

from tpu_embed_ext import errors

__all__ = ["EmulationError", "NotEmulatedError", "TPURuntimeError",
           "DuplicateInputWarning"]


class EmulationError(errors.Error, RuntimeError):
  """The emulated TPU cannot start or continue (nested entry, devices...)."""


class NotEmulatedError(EmulationError, NotImplementedError):
  """A TPU-only feature (model parallelism...) that has no CPU meaning."""


class TPURuntimeError(errors.Error, RuntimeError):
  """What a TPU refuses with TensorFlow's ``RuntimeError``, refused alike.

  A second ``TPUEmbedding`` built on one TPU, ``enqueue`` inside a nested
  ``tf.function`` or control flow within ``strategy.run``, a ``TPUEmbedding``
  used after ``initialize_tpu_system`` discarded its tables: the message starts
  with TensorFlow's own words (users' tests match them), then ours.
  """


class DuplicateInputWarning(UserWarning):
  """Hosts of an emulated pod (``emulate_tpu(hosts=H)``) whose input
  pipelines yield the same first batch: every host reads the same examples,
  which a TPU pod trains on silently. The message names the hosts and the
  fix (shard by ``input_context.input_pipeline_id``)."""
