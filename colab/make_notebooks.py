"""Writes the Colab notebooks (edit here, then run: python colab/make_notebooks.py)."""
import os
import nbformat as nbf

def nb(cells):
  n = nbf.v4.new_notebook()
  n.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
  n.metadata["accelerator"] = "TPU"
  n.cells = [nbf.v4.new_markdown_cell(c[1]) if c[0] == "md" else nbf.v4.new_code_cell(c[1]) for c in cells]
  return n

SETUP = """# On Colab: copy this repository to /content/tpu_embed_ext first (upload or
# clone it); the cell installs it unless it is importable already (as in CI).
import importlib.util, os, subprocess, sys
if importlib.util.find_spec("tpu_embed_ext") is None:
  subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                         "-e", "/content/tpu_embed_ext[data]"])
  os.chdir("/content/tpu_embed_ext")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# CI runs this notebook small: TEE_NOTEBOOK_STEPS overrides the step count.
STEPS = int(os.environ.get("TEE_NOTEBOOK_STEPS", "400"))
CONFIG = os.environ.get("TEE_NOTEBOOK_CONFIG", "configs/ranking.yaml")
WORKDIR = os.environ.get("TEE_NOTEBOOK_WORKDIR", "/tmp/tee_quickstart")"""

quick = nb([
 ("md", "# tpu_embed_ext quickstart\n\nSpec -> plan -> train on the CPU emulation of the TPU embedding engine -> evaluate -> export for serving. Runs on any CPU runtime; no TPU needed."),
 ("code", SETUP),
 ("md", "## 1. The spec\nOne frozen spec holds every table, its optimizer (global, pattern overrides, per-table overrides) and its schedule."),
 ("code", """import tpu_embed_ext as tee
spec = tee.EmbeddingSpec.from_file(CONFIG)
print(len(spec.tables), "tables,", len(spec.features), "features")
print("optimizer of t_c0:", spec.optimizer_for(spec.tables[0].name))"""),
 ("md", "## 2. The plan\nWhat the TPU will get: optimizers, dynamic learning-rate tags, memory, and what SparseCore would ignore."),
 ("code", """plan = tee.plan(spec)
print(plan)
print("tags:", {t: g for t, g in plan.tags.items() if g is not None})"""),
 ("md", "## 3. Train on CPU emulation\n`CPUEmbedding` applies each table's own TPU optimizer math, sparsely."),
 ("code", """from tpu_embed_ext import train as train_lib
metrics = train_lib.train(CONFIG, model_dir=WORKDIR, steps=STEPS, tpu="none",
                          overrides={"steps_per_checkpoint": STEPS // 2}, verbose=2)
metrics"""),
 ("md", "## 4. Evaluate\nHeld-out AUC next to the AUC of the model that generated the labels (the best any model can do)."),
 ("code", """print(f"held-out AUC {metrics['eval_auc']:.4f} (planted model {metrics.get('planted_auc', float('nan')):.4f})")
assert 0.5 < metrics["eval_auc"] <= 1.0, metrics"""),
 ("md", "## 5. Export for serving\nA SavedModel whose lookups are plain CPU gathers (`serving_embedding_lookup`), no TPU ops."),
 ("code", """import tensorflow as tf
out = train_lib.export(CONFIG, model_dir=WORKDIR, out=WORKDIR + "/serving")
print("exported to", out)
loaded = tf.saved_model.load(out)
print(list(loaded.signatures["serving_default"].structured_input_signature[1])[:5], "...")"""),
])

tpu = nb([
 ("md", "# Training on a Colab TPU (with a CPU fallback)\n\nDetects a TPU runtime and trains with `TPUEmbedding` on it; without one (or in CI) it falls back to the CPU emulation and says so. The TPU path was not run by this package's CI: no TPU is reachable there."),
 ("code", SETUP.replace("tee_quickstart", "tee_tpu")),
 ("code", """import tensorflow as tf
try:
  resolver = tf.distribute.cluster_resolver.TPUClusterResolver()
  tf.config.experimental_connect_to_cluster(resolver)
  tf.tpu.experimental.initialize_tpu_system(resolver)
  TPU = "auto"
  print("TPU runtime found:", resolver.master())
except (ValueError, RuntimeError, tf.errors.OpError) as e:
  TPU = "none"
  print("No TPU runtime (" + type(e).__name__ + "): falling back to CPU emulation.")"""),
 ("code", """import tpu_embed_ext as tee
spec = tee.EmbeddingSpec.from_file(CONFIG)
for line in tee.plan(spec).warnings:
  print("SparseCore note:", line)"""),
 ("code", """from tpu_embed_ext import train as train_lib
metrics = train_lib.train(CONFIG, model_dir=WORKDIR, steps=STEPS, tpu=TPU,
                          overrides={"steps_per_checkpoint": STEPS // 2}, verbose=2)
print("trained on:", metrics["where"])
print(f"held-out AUC {metrics['eval_auc']:.4f}")"""),
])
HERE = os.path.dirname(os.path.abspath(__file__))
nbf.write(quick, os.path.join(HERE, "quickstart.ipynb"))
nbf.write(tpu, os.path.join(HERE, "tpu_training.ipynb"))
