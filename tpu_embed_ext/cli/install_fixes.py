"""The fix for a missing optional dependency, spelled for the install at hand.

A command that needs an extra (TensorFlow, the training data's libraries)
names every missing one on the first try, with a command that runs as printed
here (README: "printed commands run as printed"):

- from a clone (the package beside its ``setup.py``): ``pip install -e
  '<clone>[cpu,data]'`` with this installation's pip, by its path when the
  virtualenv is not active (``.venv/bin/pip install -e '.[data]'``);
- from a wheel (or an index): the extra's real requirements, ``pip install
  tensorflow-cpu``: the package may not be on any index, so
  ``'tpu_embed_ext[cpu]'`` could not be installed by name.
"""

from __future__ import annotations

import os
import re
import shlex
from typing import Dict, List, Optional, Sequence

from tpu_embed_ext.cli import console

__all__ = ["EXTRAS", "clone_root", "missing_line"]

# Importable module -> (what it is, the extra that installs it).
EXTRAS = {
    "tensorflow": ("TensorFlow", "cpu"),
    "tensorflow_datasets": ("tensorflow_datasets (the training data)", "data"),
    "importlib_resources": ("importlib_resources (for tensorflow_datasets)", "data"),
    "matplotlib": ("matplotlib (the learning curve)", "data"),
}
# Each extra's requirements when the package's metadata cannot be read.
_REQUIREMENTS = {"cpu": ["tensorflow-cpu", "protobuf<7"],
                 "data": ["tensorflow-datasets", "importlib-resources",
                          "matplotlib", "tensorboard"]}
_OTHER_TF = {"clone": " (or [tf], or [tpu] on a Cloud TPU VM)",
             "wheel": " (or tensorflow, or tensorflow-tpu on a Cloud TPU VM, in "
                      "place of tensorflow-cpu)"}


def clone_root() -> Optional[str]:
  """The clone this package runs from (editable install or PYTHONPATH), or
  None for an installed wheel."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if os.path.exists(os.path.join(root, "setup.py")) and os.path.isdir(
      os.path.join(root, "configs")):
    return root
  return None


def _requirements(extra: str) -> List[str]:
  """The distribution names the extra installs (the package's metadata)."""
  try:
    from importlib import metadata  # pylint: disable=g-import-not-at-top
    found = []
    for line in metadata.requires("tpu_embed_ext") or []:
      if re.search(rf"""extra\s*==\s*['"]{extra}['"]""", line):
        # The name, and the bound where it excludes releases that break
        # (protobuf<7); a plain lower bound is what pip picks anyway.
        requirement = line.split(";")[0].strip().replace(" ", "")
        if ">" in requirement or "<" not in requirement:
          requirement = re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0)
        if requirement not in found:
          found.append(requirement)
    return found or _REQUIREMENTS[extra]
  except Exception:  # pylint: disable=broad-except
    return _REQUIREMENTS[extra]


def install_command(extras: Sequence[str]) -> str:
  """The pip command that installs ``extras`` into this installation."""
  pip = console.tool("pip", "pip")
  root = clone_root()
  if root is not None:
    where = os.path.relpath(root)
    where = root if where.startswith("..") else where
    target = f"{where}[{','.join(extras)}]"
    return f"{pip} install -e {shlex.quote(target)}"
  names = [n for e in extras for n in _requirements(e)]
  return f"{pip} install {' '.join(shlex.quote(n) for n in dict.fromkeys(names))}"


def missing_line(command: str, modules: Sequence[str]) -> str:
  """``train needs X and Y, which are not installed. Fix: <command>.``"""
  whats: Dict[str, None] = dict.fromkeys(EXTRAS[m][0] for m in modules)
  extras = list(dict.fromkeys(EXTRAS[m][1] for m in modules))
  names = list(whats)
  what = names[0] if len(names) == 1 else (
      ", ".join(names[:-1]) + " and " + names[-1])
  verb = "is" if len(names) == 1 else "are"
  more = ""
  if "cpu" in extras:
    more = _OTHER_TF["clone" if clone_root() else "wheel"]
  return (f"{command} needs {what}, which {verb} not installed. Fix: "
          f"{install_command(extras)}{more}.")
