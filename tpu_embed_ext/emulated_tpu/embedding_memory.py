"""The emulated TPU's embedding engine: one per TPU, as on the hardware.

A TPU holds the tables of one ``TPUEmbedding``: ``build`` under a
``TPUStrategy`` configures the TPU's embedding engine and loads the tables
into it, and TensorFlow 2.21 (``tpu_embedding_v2.py`` ``build``) refuses a
second ``build`` while the engine is configured (``RuntimeError: TPU is
already initialized for embeddings``), even if the first object is gone.
``initialize_tpu_system`` resets the TPU and so the engine. The host
variables of an object built before that reset are then stale: saving it
retrieves (``_retrieve_variables``, which TensorFlow's checkpoint callback
runs before every save) whatever tables the TPU holds now, by name, i.e. those
of the ``TPUEmbedding`` built since, and restoring it loads
(``_load_variables``) into them.

Here the engine's tables are the variables of the object that configured it
(the host variables are the tables, ``mid_level.py``). ``claim`` is ``build``'s
check, ``reset`` is ``initialize_tpu_system``'s, and ``retrieve`` / ``load``
copy between a stale object and the current one where the TPU would, refusing
where the TPU's tables are not laid out as the object's (no engine
configured, or other tables, shapes or slots).
"""

from __future__ import annotations

import weakref
from typing import Dict

from tpu_embed_ext.emulated_tpu import session
from tpu_embed_ext.emulated_tpu.errors import TPURuntimeError

__all__ = ["reset", "check_free", "claim", "is_current", "retrieve", "load"]

# The engine of the active emulation: which emulation, whether it is
# configured, and the object whose tables it holds (weakly).
_engine = {"emulation": None, "owner": None, "configured": False}


def _current() -> dict:
  emulation = session.current()
  if _engine["emulation"] is not emulation:
    _engine.update(emulation=emulation, owner=None, configured=False)
  return _engine


def reset() -> None:
  """``initialize_tpu_system`` / ``shutdown_tpu_system``: the engine is cleared."""
  _current().update(owner=None, configured=False)


def check_free(tables) -> None:
  """``build``'s first check: ``TPURuntimeError`` if the engine is configured."""
  if _current()["configured"]:
    raise TPURuntimeError(
        "TPU is already initialized for embeddings. This may be caused by "
        "using multiple TPUEmbedding instances in a TPU scope which is "
        f"unsupported. A TPUEmbedding (tables {tables}) was built on a TPU "
        "whose embedding engine another TPUEmbedding configured already (two "
        "EmbeddingLayers in one model under a TPUStrategy do this). Fix: put "
        "every table in one TPUEmbedding (one EmbeddingLayer), or call "
        "tf.tpu.experimental.initialize_tpu_system(resolver) first, which "
        "discards the first one's tables on a TPU.")


def claim(embedding, tables) -> None:
  """``build`` done: the engine holds ``embedding``'s tables."""
  check_free(tables)
  _current().update(configured=True, owner=weakref.ref(embedding))


def is_current(embedding) -> bool:
  """Whether ``embedding``'s tables are the ones the TPU holds."""
  engine = _current()
  owner = engine["owner"]() if engine["owner"] is not None else None
  return owner is embedding


def _holder(embedding, what: str):
  """The object whose tables the TPU holds, for a stale ``embedding``."""
  engine = _current()
  owner = engine["owner"]() if engine["owner"] is not None else None
  layout = _layout(embedding)
  if owner is None or _layout(owner) != layout:
    held = "no tables" if owner is None else f"tables {_layout(owner)}"
    raise TPURuntimeError(
        f"{what}: this TPUEmbedding (tables {layout}) was built before "
        "initialize_tpu_system reset the TPU, which now holds "
        f"{held}; a TPU would read or write tables laid out otherwise. Fix: "
        "build a new TPUEmbedding after initialize_tpu_system and restore "
        "the checkpoint into it.")
  return owner


def _layout(embedding) -> Dict[str, tuple]:
  return {table: tuple(sorted((slot, tuple(v.shape.as_list()))
                              for slot, v in variables.items()))
          for table, variables in (embedding._table_vars or {}).items()}  # pylint: disable=protected-access


def retrieve(embedding) -> None:
  """``_retrieve_variables``: a stale object's variables get the TPU's tables."""
  if embedding._table_vars is None or is_current(embedding):  # pylint: disable=protected-access
    return
  holder = _holder(embedding, "saving (retrieving the tables from the TPU)")
  _copy(holder, embedding)


def load(embedding) -> None:
  """``_load_variables``: a stale object's variables overwrite the TPU's tables."""
  if embedding._table_vars is None or is_current(embedding):  # pylint: disable=protected-access
    return
  holder = _holder(embedding, "loading the tables onto the TPU")
  _copy(embedding, holder)


def _copy(source, target) -> None:
  for table, variables in source._table_vars.items():  # pylint: disable=protected-access
    for slot, variable in variables.items():
      target._table_vars[table][slot].assign(variable)  # pylint: disable=protected-access
