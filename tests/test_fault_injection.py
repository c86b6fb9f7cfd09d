"""tests/fault_injection.py in CI: one random SIGKILL per command (train,
export, convert-checkpoint) on the tiny config, compared with uninterrupted
runs. The seed is printed; rerun it with
``.venv/bin/python tests/fault_injection.py --seed S --rounds N``."""

import random

from tests import fault_injection


def test_killed_commands_leave_old_or_new_complete_outputs(tmp_path):
  seed = random.randrange(1 << 30)
  lines = [f"seed {seed}"]
  harness = fault_injection.Harness(str(tmp_path), seed, log=lines.append)
  try:
    model_dir = harness.train(rounds=1)
    harness.export(model_dir, rounds=1)
    harness.convert(model_dir, rounds=1)
  finally:
    print("\n".join(lines))
