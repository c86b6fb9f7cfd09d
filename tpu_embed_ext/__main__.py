"""``python -m tpu_embed_ext``: the command line (tpu_embed_ext/cli/main.py).

Before the layout move this module held the commands: ``COMMANDS``, ``main``
and ``run`` are ``cli/main.py``'s, ``where_everything_went`` is ``cli/job_commands.py``'s
(loaded on first use: it imports the job and TensorFlow).
"""

import importlib

from tpu_embed_ext.cli.main import COMMANDS, main, run  # pylint: disable=unused-import

__all__ = ["where_everything_went", "main", "run"]


def __getattr__(name):  # PEP 562: the job's names load on first use.
  if name != "where_everything_went":
    raise AttributeError(f"module 'tpu_embed_ext.__main__' has no attribute {name!r}")
  return getattr(importlib.import_module("tpu_embed_ext.cli.job_commands"), name)


def __dir__():
  return sorted(set(globals()) | {"where_everything_went"})


if __name__ == "__main__":
  run()
