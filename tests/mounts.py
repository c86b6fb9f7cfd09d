"""Real small or read-only filesystems for the fault tests (tests run as root)."""

import contextlib
import subprocess

import pytest


@contextlib.contextmanager
def tmpfs(path, size="64k", read_only=False):
  """A real small (or read-only) filesystem at ``path``; skips where mount is refused."""
  path.mkdir(parents=True, exist_ok=True)
  options = f"size={size}" + (",ro" if read_only else "")
  if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                    capture_output=True).returncode:
    pytest.skip("cannot mount a tmpfs here (needs root in a container)")
  try:
    yield path
  finally:
    subprocess.run(["umount", "-l", str(path)], check=True)
