"""A TPUEmbeddingV2 program, unmodified, under ``python -m tpu_embed_ext emulate --sparsecore``.

``tests/tpu_programs/sparsecore_mid_level.py`` is written against TensorFlow's
API only (SparseCore's ``embedding_lookup`` and ``apply_gradients(gradients,
preserved_outputs)`` inside ``strategy.run``). It trains in a subprocess at 2
and 8 replicas (chips); its stacked checkpoint, converted back to per-table
form by our converter, must equal (a) ``CPUEmbedding(engine="v2")`` trained on
the same global batches on one device and (b) the TPU's math in numpy (each
id's gradient summed over every replica, one Adagrad update per step), both
from ``tests/sparsecore_program.py``, whose batches the program draws.
"""

import os

import numpy as np
import pytest

from tests import sparsecore_program as sc
from tests.builders import checkpoint_values
from tests.test_emulated_tpu_programs import PROGRAMS, _python
from tpu_embed_ext.sparsecore import convert_checkpoint

# The program's global batch: at 8 replicas, 4 examples per replica, one per
# SparseCore of a chip (4 by default).
GLOBAL_BATCH = 32


@pytest.fixture(scope="module")
def references():
  batches = sc.global_batches(GLOBAL_BATCH)
  cpu = sc.cpu_run(batches)
  cpu_tables = {n: {s: v.numpy() for s, v in cpu.variables[n].items()}
                for n in sc.VOCAB}
  return cpu_tables, sc.numpy_reference(batches)


def test_the_references_agree_and_train(references):
  cpu, (params, acc) = references
  for name in sc.VOCAB:
    assert not np.allclose(params[name], sc.initial(name))
    np.testing.assert_allclose(cpu[name]["parameters"], params[name], rtol=2e-5,
                               atol=1e-6, err_msg=name)
    np.testing.assert_allclose(cpu[name]["accumulators"], acc[name], rtol=2e-5,
                               err_msg=name)


@pytest.mark.parametrize("replicas", [2, 8])
def test_sparsecore_program_trains_under_the_runner(replicas, tmp_path, references):
  model_dir = tmp_path / "model"
  out = _python(["-m", "tpu_embed_ext", "emulate", "--sparsecore",
              "--replicas", str(replicas),
              os.path.join(PROGRAMS, "sparsecore_mid_level.py"), "--tpu", "my-tpu",
              "--model_dir", str(model_dir), f"--steps={sc.STEPS}"])
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"saved {model_dir}" in out.stdout
  # The stacked checkpoint, back to per-table keys (each chip's output_shape).
  per_table = str(tmp_path / "per_table" / "ckpt")
  convert_checkpoint(str(model_dir), per_table,
                     sc.feature_config(GLOBAL_BATCH // replicas), log=lambda _: None)
  saved = checkpoint_values(per_table)
  cpu, (params, acc) = references
  for name in sc.VOCAB:
    tables = {"parameters": saved[f"embedding/{name}/.ATTRIBUTES/VARIABLE_VALUE"],
              "accumulators": saved[
                  f"embedding/{name}.Saccumulators/.ATTRIBUTES/VARIABLE_VALUE"]}
    for slot, reference in (("parameters", params), ("accumulators", acc)):
      np.testing.assert_array_equal(tables[slot], cpu[name][slot],
                                    err_msg=f"{name} {slot}")
      np.testing.assert_allclose(tables[slot], reference[name], rtol=2e-5,
                                 atol=1e-6, err_msg=f"{name} {slot}")
