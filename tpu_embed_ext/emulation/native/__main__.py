"""``python -m tpu_embed_ext.emulation.native build``: build the kernels now.

``make install`` and ``make test`` run it so that the first training step
does not wait for the compiler. It never fails the install: without a
compiler it prints why and the engine uses the TensorFlow-op path.
``--strict`` exits 1 instead (CI that must test the native path).
"""

import argparse
import sys

from tpu_embed_ext.emulation.native import loader


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m tpu_embed_ext.emulation.native")
  parser.add_argument("command", choices=["build", "where"])
  parser.add_argument("--force", action="store_true", help="rebuild")
  parser.add_argument("--strict", action="store_true",
                      help="exit 1 if the library cannot be built or loaded")
  args = parser.parse_args(argv)
  if args.command == "where":
    print(loader.library_dir())
    return 0
  try:
    directory = loader.build(force=args.force)
    loader._load_from(directory)  # pylint: disable=protected-access
  except Exception as e:  # pylint: disable=broad-except
    print(f"tpu_embed_ext: native kernels not built ({e}); the engine will use "
          "the TensorFlow-op path (same results, slower).", file=sys.stderr)
    return 1 if args.strict else 0
  print(f"tpu_embed_ext: native kernels ready in {directory}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
