"""Writes the Colab notebooks (edit here, then run: python colab/make_notebooks.py)."""
import os
import nbformat as nbf

# The git URL the install cell installs from on a fresh runtime (route 3
# below): set it when the repository is published; TEE_REPO_URL overrides it.
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

SETUP = f"""# Installs tpu_embed_ext by the first route that applies:
#  1. already installed (a restarted runtime, a local Jupyter): nothing to do;
#  2. a wheel uploaded to the working directory (tpu_embed_ext-*.whl, `make dist`);
#  3. a git URL: REPO_URL below (the one edit), or the TEE_REPO_URL variable;
#  4. the package index, by name, once the package is published there.
# Colab's own TensorFlow is kept; tensorflow-cpu is added only where none is.
import glob, importlib, importlib.util, os, subprocess, sys
REPO_URL = os.environ.get("TEE_REPO_URL", "{REPO_URL}")
if importlib.util.find_spec("tpu_embed_ext") is None:
  extras = "data" if importlib.util.find_spec("tensorflow") else "cpu,data"
  wheels = sorted(glob.glob("tpu_embed_ext-*.whl"))
  if wheels:
    source = f"{{os.path.abspath(wheels[-1])}}[{{extras}}]"
  elif REPO_URL:
    url = REPO_URL if REPO_URL.startswith("git+") else "git+" + REPO_URL
    source = f"tpu_embed_ext[{{extras}}] @ {{url}}"
  else:
    source = f"tpu_embed_ext[{{extras}}]"
  print(f"installing {{source}} (about 1 minute; 3 with TensorFlow)...", flush=True)
  done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", source],
                        capture_output=True, text=True)
  if done.returncode != 0:
    raise RuntimeError(
        "tpu_embed_ext is not installed and could not be installed from "
        f"{{source}} ({{(done.stderr.strip().splitlines() or ['pip failed'])[-1]}}). "
        "Fix, one of: upload its wheel (tpu_embed_ext-*.whl, from `make dist`) to "
        f"{{os.getcwd()}}; set REPO_URL at the top of this cell (or TEE_REPO_URL) "
        "to its git URL; or, once it is published, pip install tpu_embed_ext.")
  importlib.invalidate_caches()
import tpu_embed_ext
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# CI runs this notebook small: TEE_NOTEBOOK_STEPS overrides the step count.
STEPS = int(os.environ.get("TEE_NOTEBOOK_STEPS", "400"))
# A shipped config, by name (tiny, ranking, criteo, movielens), or a file.
CONFIG = os.environ.get("TEE_NOTEBOOK_CONFIG", "ranking")
WORKDIR = os.environ.get("TEE_NOTEBOOK_WORKDIR", "/tmp/tee_quickstart")
print("tpu_embed_ext", tpu_embed_ext.__version__, "from",
      os.path.dirname(tpu_embed_ext.__file__))"""

# Run right after SETUP (not inside it: SETUP must keep the process's logging
# when run on its own).
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
  import tpu_embed_ext.job
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
 ("md", "# tpu_embed_ext quickstart\n\nSpec -> plan -> train on the CPU emulation of the TPU embedding engine -> evaluate -> export for serving -> predict. Runs on any CPU runtime (no TPU needed; none is requested).\n\n**Open it in Colab:** File > Upload notebook in [Colab](https://colab.research.google.com) and pick this file (from the repository's `colab/` folder), or, once the repository is public on GitHub, File > Open notebook > GitHub and paste its URL. The first cell installs the package: upload the wheel (`make dist` builds `dist/tpu_embed_ext-*.whl`) into the runtime's files first, or set `REPO_URL` at the top of that cell to the repository's git URL."),
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
 ("code", """from tpu_embed_ext import job as train_lib
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
 ("md", "# Training on a Colab TPU (with a CPU fallback)\n\nDetects a TPU runtime and trains with `TPUEmbedding` on it; without one (or in CI) it falls back to the CPU emulation and says so. The TPU path was not run by this package's CI: no TPU is reachable there.\n\n**Open it in Colab:** File > Upload notebook in [Colab](https://colab.research.google.com) and pick this file (from the repository's `colab/` folder), or, once the repository is public on GitHub, File > Open notebook > GitHub and paste its URL. The first cell installs the package: upload the wheel (`make dist` builds `dist/tpu_embed_ext-*.whl`) into the runtime's files first, or set `REPO_URL` at the top of that cell to the repository's git URL."),
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
  print("No TPU attached to this runtime: falling back to CPU emulation.")"""),
 ("code", """import tpu_embed_ext as tee
spec = tee.EmbeddingSpec.from_file(CONFIG)
for line in tee.plan(spec).warnings:
  print("SparseCore note:", line)"""),
 ("code", """from tpu_embed_ext import job as train_lib
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
