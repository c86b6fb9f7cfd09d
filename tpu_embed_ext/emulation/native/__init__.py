"""Native (C++) kernels for the CPU engine's hot path, and their loader: the
step's second back end beside TensorFlow ops, chosen by ``choose(kernels)``.

Two implementations of one step live side by side in ``emulation/``: the
TensorFlow-op path (``lookups.activation``, ``updates``) and this one:

* ``lookup``: one fused gather + combiner op per feature (``lookup_op.cc``);
* ``update``: the fused backward pass and update of all tables of a step
  (``update_op.cc``);
* ``use_huge_pages``: large tables on 2 MiB pages (``huge_pages.cc``).

``load()`` returns the compiled op module, building it on first use against
the installed TensorFlow (``loader.py``: cache, version check, fallback), or
None. ``choose(kernels)`` resolves an engine's ``kernels=`` argument and the
``TPU_EMBED_EXT_KERNELS`` environment variable to ``"native"`` or ``"tf"``.
XLA (``jit_compile=True``) and SavedModel serving always use the TF-op path:
XLA cannot compile a custom op, and a served model must not need the library.
"""

from __future__ import annotations

import importlib
import os

from tensorflow.python.ops import resource_variable_ops

from tpu_embed_ext import errors
from tpu_embed_ext.emulation.native.loader import load, why_not

__all__ = ["load", "why_not", "choose", "use_huge_pages", "CHOICES", "ENV",
           "HUGE_PAGES_ENV"]

CHOICES = ("auto", "native", "tf")
ENV = "TPU_EMBED_EXT_KERNELS"
HUGE_PAGES_ENV = "TPU_EMBED_EXT_HUGE_PAGES"


def choose(kernels: str = "auto") -> str:
  """``"native"`` or ``"tf"``: the path an engine created now runs.

  ``kernels`` (the engine's argument) wins unless it is ``"auto"``; then the
  ``TPU_EMBED_EXT_KERNELS`` environment variable (same values) decides;
  ``"auto"`` is native when the library loads. A forced ``"native"`` that
  cannot load raises ``ConfigError`` saying why.
  """
  if kernels not in CHOICES:
    raise errors.ConfigError(
        f"kernels={kernels!r} is not one of {list(CHOICES)}. Fix: pass "
        '"auto" (native when the library loads), "native" or "tf".')
  source = "kernels="
  if kernels == "auto":
    kernels = os.environ.get(ENV, "").strip().lower() or "auto"
    source = f"{ENV}="
    if kernels not in CHOICES:
      raise errors.ConfigError(
          f"{ENV}={kernels!r} is not one of {list(CHOICES)}. Fix: set it to "
          '"auto", "native" or "tf", or unset it.')
  if kernels == "tf":
    return "tf"
  if load() is not None:
    return "native"
  if kernels == "native":
    raise errors.ConfigError(
        f"{source}\"native\" was asked for, but the native kernels cannot be "
        f"loaded: {why_not()}. Fix: install a C++ compiler (g++), or use "
        f'{source}"auto" / "tf" to run the TensorFlow-op path.')
  return "tf"


def use_huge_pages(variables) -> None:
  """Asks Linux to back each variable of 8 MiB or more with 2 MiB pages.

  Random rows of a large table then cost far fewer TLB misses (the W2
  Adagrad step measured 13% faster; ``huge_pages.cc``). A hint: values never
  change; nothing happens without the library, off Linux, where transparent
  huge pages are "never", or with ``TPU_EMBED_EXT_HUGE_PAGES=0``. Pages
  already in use are collapsed once (a copy, on Linux 6.1+). Eager only.
  """
  ops = load()
  handles = [v.handle for v in variables
             if isinstance(v, resource_variable_ops.BaseResourceVariable)]
  if ops is not None and handles:
    ops.tpu_embed_ext_use_huge_pages(handles)


def __getattr__(name):
  # ``native.lookup`` / ``native.update`` import on first use.
  if name in ("lookup", "update"):
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(name)
