"""``python -m tpu_embed_ext``: the command line (tpu_embed_ext/cli/main.py)."""

from tpu_embed_ext.cli.main import run

if __name__ == "__main__":
  run()
