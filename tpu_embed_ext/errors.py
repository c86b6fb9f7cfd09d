"""The package's error types.

One base class, ``Error``, so callers can catch everything this package raises
on purpose. Subclasses also derive from the builtin that fits (``ValueError``
for a bad value, ``TypeError`` for the wrong kind of thing), so code written
against TensorFlow's own exceptions keeps working.
"""

from __future__ import annotations

import difflib
from typing import Iterable, Optional


class Error(Exception):
  """Base class of every error raised on purpose by tpu_embed_ext.

  ``ag_pass_through``: when an exception escapes code that a ``tf.function``
  traces, autograph (``autograph/impl/api.py``, ``_attach_error_metadata``
  and ``_ErrorMetadata.create_exception``) re-creates it with a traceback
  added to the message, but only for builtin types and types whose
  ``__init__`` is ``Exception.__init__``; anything else becomes a
  ``StagingError``, which is not a ``ValueError``. An exception with an
  ``ag_pass_through`` attribute is re-raised unchanged, so ours keep their
  class (and message) eagerly and inside ``tf.function`` alike, as
  TensorFlow's own ``ValueError``s do.
  """

  ag_pass_through = True


class ConfigError(Error, ValueError):
  """An invalid embedding spec, optimizer spec or config file.

  ``path`` is the key path inside the config (``tables.item.optimizer.lr``),
  ``file`` the config file when the spec came from one. Both are optional and
  are added while the error travels up through the loader (see ``at``).
  """

  def __init__(self, message: str, *, path: str = "", file: str = ""):
    self.message = message
    self.path = path
    self.file = file
    super().__init__(self._render())

  def _render(self) -> str:
    where = ": ".join(p for p in (self.file, self.path) if p)
    return f"{where}: {self.message}" if where else self.message

  def at(self, prefix: str = "", file: str = "") -> "ConfigError":
    """Returns a copy located under ``prefix`` (a key path) and ``file``."""
    if prefix and self.path:
      path = f"{prefix}.{self.path}"
    else:
      path = prefix or self.path
    return type(self)(self.message, path=path, file=file or self.file)

  def __reduce__(self):
    return (_rebuild, (type(self), self.message, self.path, self.file))


class ConfigTypeError(ConfigError, TypeError):
  """A config value of the wrong type (a string where a number belongs...)."""


class InputError(Error, ValueError):
  """Bad features, weights, ids or gradients given to an embedding engine."""


class InputTypeError(InputError, TypeError):
  """Inputs of the wrong kind (a list of gradients for a tuple of features).

  A ``TypeError`` where ``TPUEmbedding`` raises one (``nest``'s structure
  check), and an ``InputError`` like every other bad input.
  """


def _rebuild(cls, message, path, file):
  return cls(message, path=path, file=file)


def did_you_mean(name: str, choices: Iterable[str]) -> str:
  """Returns ' Did you mean "x"?' for the closest choice, or ''."""
  choices = [str(c) for c in choices]
  match = difflib.get_close_matches(str(name), choices, n=1, cutoff=0.6)
  if not match:  # "dimension" for "dim": a choice that starts the name.
    match = sorted((c for c in choices if len(c) >= 3 and str(name).startswith(c)),
                   key=len, reverse=True)
  return f' Did you mean "{match[0]}"?' if match else ""


def one_of(choices: Iterable[str]) -> str:
  return ", ".join(f'"{c}"' for c in sorted(choices))


def unknown_name(kind: str, name: str, choices: Iterable[str],
                 path: str = "", error: Optional[type] = None) -> ConfigError:
  """The error for a name that is not among ``choices``."""
  choices = list(choices)
  cls = error or ConfigError
  return cls(
      f'unknown {kind} "{name}".{did_you_mean(name, choices)} '
      f"Valid: {one_of(choices)}.", path=path)


def require_name(value, path: str, what: str) -> None:
  """ConfigTypeError unless ``value`` is a string (a name to look up)."""
  if not isinstance(value, str):
    raise ConfigTypeError(
        f"{what} must be a name (a string), got {type(value).__name__} "
        f"{value!r}. Fix: write one of the names it accepts.", path=path)


def require_bool(value, path: str, name: str) -> None:
  """ConfigTypeError unless ``value`` is a bool: ``"false"`` is a non-empty
  string, which Python (and so Keras) would take as true."""
  if not isinstance(value, bool):
    raise ConfigTypeError(
        f"{name} must be true or false, got {type(value).__name__} "
        f"{value!r}. Fix: write true or false (unquoted).", path=path)
