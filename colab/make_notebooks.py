"""Writes the Colab notebooks (edit here, then run: python colab/make_notebooks.py)."""
import os
import nbformat as nbf

# Where a fresh Colab runtime clones the package from (then installs it,
# editable). No public URL existed when this was written: set it here when the
# repository is published (TEE_REPO_URL overrides it at run time).
REPO_URL = ""


def nb(cells, accelerator=None):
  n = nbf.v4.new_notebook()
  n.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
  if accelerator:
    n.metadata["accelerator"] = accelerator
  n.cells = [nbf.v4.new_markdown_cell(c[1]) if c[0] == "md" else nbf.v4.new_code_cell(c[1]) for c in cells]
  for i, cell in enumerate(n.cells):
    cell.id = f"cell-{i}"  # stable across regenerations (nbformat's are random)
  return n

SETUP = f"""# Installs tpu_embed_ext, with nothing to upload by hand:
# - fresh runtime: clones the repository to /content/tpu_embed_ext and installs it
#   (editable), importable at once, no restart needed;
# - after a runtime restart: the install is still there; nothing is installed again;
# - from a checkout (as in CI): uses it.
import importlib.util, os, subprocess, sys
REPO_URL = os.environ.get("TEE_REPO_URL", "{REPO_URL}")
REPO_DIR = os.environ.get("TEE_NOTEBOOK_REPO_DIR", "/content/tpu_embed_ext")
found = importlib.util.find_spec("tpu_embed_ext")
if found is not None:
  REPO_DIR = os.path.dirname(os.path.dirname(found.origin))
else:
  if not os.path.isdir(os.path.join(REPO_DIR, "tpu_embed_ext")):
    if not REPO_URL:
      raise RuntimeError("tpu_embed_ext is not installed and REPO_URL is empty. Fix: "
                         "set REPO_URL above to the repository's git URL.")
    subprocess.check_call(["git", "clone", "--depth", "1", REPO_URL, REPO_DIR])
  subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "-e",
                         REPO_DIR + "[data]"])
  sys.path.insert(0, REPO_DIR)
os.chdir(REPO_DIR)  # configs/ lives in the repository.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# CI runs this notebook small: TEE_NOTEBOOK_STEPS overrides the step count.
STEPS = int(os.environ.get("TEE_NOTEBOOK_STEPS", "400"))
CONFIG = os.environ.get("TEE_NOTEBOOK_CONFIG", "configs/ranking.yaml")
WORKDIR = os.environ.get("TEE_NOTEBOOK_WORKDIR", "/tmp/tee_quickstart")
print("tpu_embed_ext from", REPO_DIR)"""

# Run right after SETUP (not inside it: the install-cell tests exec SETUP in
# their own process, which must keep its logging).
QUIET = """# Other libraries' lines go to a log file, not under the cells: TensorFlow's C++
# start-up lines (some CPUs print them whatever TF_CPP_MIN_LOG_LEVEL says), absl,
# TensorFlow and tfds log lines, Python warnings and tfds' progress bars. The
# package's own progress lines stay. `!tail $LIBRARY_LOG` shows the rest.
import logging
LIBRARY_LOG = WORKDIR.rstrip("/") + "-libraries.log"
log_file = open(LIBRARY_LOG, "a")
logging.getLogger().handlers[:] = [logging.StreamHandler(log_file)]
logging.getLogger("tensorflow").handlers[:] = []  # in a notebook it logs to stdout
logging.captureWarnings(True)
stderr_fd = os.dup(2)
os.dup2(log_file.fileno(), 2)  # the C++ lines, while the libraries load
try:
  import tensorflow as tf
  import tensorflow_datasets as tfds
  import tpu_embed_ext.train
finally:
  os.dup2(stderr_fd, 2)
  os.close(stderr_fd)
tfds.disable_progress_bar()
print("library log:", LIBRARY_LOG)"""

CURVE = """from IPython.display import Image, display
# Training loss and AUC per block of steps, beside the held-out ones.
display(Image(filename=os.path.join(WORKDIR, "learning_curve.png")))"""

EXPORT_AND_PREDICT = """import tensorflow as tf
out = train_lib.export(CONFIG, model_dir=WORKDIR, out=os.path.join(WORKDIR, "serving"))
print("exported to", out)
serve = tf.saved_model.load(out).signatures["serving_default"]
# Five held-out examples in the signature's format: dense [n, 13]; per feature
# int64 ids, [n, 1] single-hot or [n, longest] padded with -1 (README: serving).
cfg = train_lib.TrainConfig.from_dict(tee.EmbeddingSpec.from_file(CONFIG).train)
features, labels = next(iter(train_lib.input_datasets(
    tee.EmbeddingSpec.from_file(CONFIG), cfg)[1]))
inputs = {k: v[:5] for k, v in train_lib.serving_inputs(features).items()}
probabilities = tf.sigmoid(serve(**inputs)["outputs"])[:, 0].numpy()
for p, label in zip(probabilities, labels[:5].numpy()):
  print(f"predicted click probability {p:.3f}   clicked: {int(label)}")"""

quick = nb([
 ("md", "# tpu_embed_ext quickstart\n\nSpec -> plan -> train on the CPU emulation of the TPU embedding engine -> evaluate -> export for serving -> predict. Runs on any CPU runtime (no TPU needed; none is requested)."),
 ("code", SETUP),
 ("code", QUIET),
 ("md", "## 1. The spec\nOne frozen spec holds every table, its optimizer (global, pattern overrides, per-table overrides) and its schedule."),
 ("code", """import tpu_embed_ext as tee
spec = tee.EmbeddingSpec.from_file(CONFIG)
print(len(spec.tables), "tables,", len(spec.features), "features")
print("optimizer of t_c0:", spec.optimizer_for(spec.tables[0].name))"""),
 ("md", "## 2. The plan\nWhat the TPU will get: optimizers, dynamic learning-rate tags, memory, and what SparseCore would ignore."),
 ("code", """plan = tee.plan(spec)
print(plan)
print("tags:", {t: g for t, g in plan.tags.items() if g is not None})"""),
 ("md", "## 3. Train on CPU emulation\n`CPUEmbedding` applies each table's own TPU optimizer math, sparsely. Run the cell again and it resumes (or, if finished, does nothing)."),
 ("code", """from tpu_embed_ext import train as train_lib
# 5 blocks of steps, each ending with a checkpoint and a held-out evaluation:
# 5 points on the learning curve.
metrics = train_lib.train(CONFIG, model_dir=WORKDIR, steps=STEPS, tpu="none",
                          overrides={"steps_per_checkpoint": max(1, STEPS // 5)}, verbose=2)
metrics"""),
 ("md", "## 4. Evaluate\nHeld-out AUC next to the AUC of the model that generated the labels (the best any model can do), and the learning curve."),
 ("code", """print(f"held-out AUC {metrics['eval_auc']:.4f} (planted model {metrics.get('planted_auc', float('nan')):.4f})")
assert 0.5 < metrics["eval_auc"] <= 1.0, metrics"""),
 ("code", CURVE),
 ("md", "## 5. Export for serving, and predict\nA SavedModel whose lookups are plain CPU gathers (`serving_embedding_lookup`), no TPU ops. An id outside a feature's vocabulary fails the call, naming the feature."),
 ("code", EXPORT_AND_PREDICT),
])

tpu = nb([
 ("md", "# Training on a Colab TPU (with a CPU fallback)\n\nDetects a TPU runtime and trains with `TPUEmbedding` on it; without one (or in CI) it falls back to the CPU emulation and says so. The TPU path was not run by this package's CI: no TPU is reachable there."),
 ("code", SETUP.replace("tee_quickstart", "tee_tpu")),
 ("code", QUIET),
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
# 5 blocks of steps, each ending with a checkpoint and a held-out evaluation:
# 5 points on the learning curve.
metrics = train_lib.train(CONFIG, model_dir=WORKDIR, steps=STEPS, tpu=TPU,
                          overrides={"steps_per_checkpoint": max(1, STEPS // 5)}, verbose=2)
print("trained on:", metrics["where"])
print(f"held-out AUC {metrics['eval_auc']:.4f}")"""),
 ("code", CURVE),
 ("md", "Export for CPU serving (from the checkpoint, whichever engine trained it) and predict."),
 ("code", EXPORT_AND_PREDICT),
], accelerator="TPU")
HERE = os.path.dirname(os.path.abspath(__file__))
nbf.write(quick, os.path.join(HERE, "quickstart.ipynb"))
nbf.write(tpu, os.path.join(HERE, "tpu_training.ipynb"))
