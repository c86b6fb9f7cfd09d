"""An emulated TPU: unmodified TPU embedding programs run on CPU, with the TPU's math.
``emulate_tpu`` puts the engine behind TensorFlow's own TPU entry points.

    with tpu_embed_ext.emulate_tpu(replicas=2):
      resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="")
      tf.tpu.experimental.initialize_tpu_system(resolver)
      strategy = tf.distribute.TPUStrategy(resolver)
      ...

``session.py`` holds the emulation and what is not emulated, ``patching.py``
the patched names, ``strategy.py`` and ``mid_level.py`` the stand-ins. This
face loads no TensorFlow: ``import tpu_embed_ext`` exports ``emulate_tpu`` lazily.
"""

from tpu_embed_ext.emulated_tpu.errors import (DuplicateInputWarning, EmulationError,
                                               NotEmulatedError, TPURuntimeError)
from tpu_embed_ext.emulated_tpu.session import (Emulation, current, emulate_tpu,
                                                is_active)

__all__ = ["emulate_tpu", "is_active", "current", "Emulation", "EmulationError",
           "NotEmulatedError", "TPURuntimeError", "DuplicateInputWarning"]
