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

TPU_RUNTIMES = """## Which TPU, which embedding API

The next cell asks the TPU what embedding hardware it has (`embedding_feature`, [TensorFlow: `tf.tpu.experimental.HardwareFeature.EmbeddingFeature`](https://www.tensorflow.org/api_docs/python/tf/tpu/experimental/HardwareFeature/EmbeddingFeature)) and picks the path before anything is built. Colab's TPU runtimes differ:

| Runtime | What the TPU has | What this notebook does |
|---|---|---|
| **v2-8, v3-8** (4 chips, 8 TensorCores) | no SparseCore; what it reports is read at runtime, not assumed | `V1`: `TPUEmbedding` under `TPUStrategy`, 8 replicas, tables sharded over the cores; `UNSUPPORTED`: the one line and CPU emulation |
| **v5e, one chip** (v5litepod-1) | one TensorCore per chip (four MXUs, a vector and a scalar unit), no SparseCore listed ([Cloud TPU v5e](https://cloud.google.com/tpu/docs/v5e)); `TPUEmbeddingV2` needs SparseCore, v5p or v6e ([keras-rs SparseCore tutorial](https://keras.io/keras_rs/examples/distributed_embedding_tf/)) | reads `embedding_feature`: `UNSUPPORTED` (no embedding accelerator) means `TPUEmbedding` cannot run there, so the next cell says so in one line, with the source, and trains on the CPU emulation; `V1` would train with `TPUEmbedding`, 1 replica. Which one a v5e reports is not checked here: no v5e was reachable. |
| **v5p, v6e** (SparseCore) | `V2`: SparseCore | `TPUEmbeddingV2` (the layer picks it), one replica per chip |
| no TPU | | CPU emulation (`CPUEmbedding`), said in one line |

**How CI runs the TPU branch.** `tests/test_notebooks.py` runs this notebook, unchanged, in a kernel started by `python -m tpu_embed_ext emulate --replicas 2 -m ipykernel_launcher ...`: the kernel's process has an emulated TPU (`tee.emulate_tpu`), so the next cell's `TPUClusterResolver`, `initialize_tpu_system` and `TPUStrategy` are the emulation's and report `V1` with 2 cores, like a small v2/v3. It also runs the notebook in a plain kernel (the CPU branch). Neither ran on a real TPU."""

TPU_DETECT = """import tensorflow as tf
from tpu_embed_ext import emulated_tpu
EmbeddingFeature = tf.tpu.experimental.HardwareFeature.EmbeddingFeature
try:
  resolver = tf.distribute.cluster_resolver.TPUClusterResolver()
  tf.config.experimental_connect_to_cluster(resolver)
  tf.tpu.experimental.initialize_tpu_system(resolver)
  strategy = tf.distribute.TPUStrategy(resolver)
except (ValueError, RuntimeError, tf.errors.OpError) as e:
  strategy = None
if strategy is None:
  TPU = "none"
  print("No TPU attached to this runtime: falling back to CPU emulation.")
else:
  cores = strategy.num_replicas_in_sync
  feature = strategy.extended.tpu_hardware_feature.embedding_feature
  found = ("an emulated TPU (tpu_embed_ext.emulate_tpu, not a real TPU)"
           if emulated_tpu.is_active() else f"a TPU ({resolver.master() or 'local'})")
  if feature == EmbeddingFeature.UNSUPPORTED:
    TPU = "none"
    print(f"Found {found}, {cores} cores, whose embedding_feature is UNSUPPORTED "
          "(no embedding accelerator), so TPUEmbedding cannot run on it (TensorFlow: "
          "https://www.tensorflow.org/api_docs/python/tf/tpu/experimental/HardwareFeature/EmbeddingFeature"
          "): training on CPU emulation instead.")
  else:
    TPU = "auto"
    api = ("TPUEmbeddingV2 (SparseCore)" if feature == EmbeddingFeature.V2
           else "TPUEmbedding")
    print(f"Found {found}, {cores} cores, embedding_feature {feature.value}: "
          f"training with {api}.")"""

tpu = nb([
 ("md", "# Training on a Colab TPU (with a CPU fallback)\n\nDetects a TPU runtime and trains with the TPU's embedding API on it (`TPUEmbedding`, or `TPUEmbeddingV2` on SparseCore); without one, or on a TPU without an embedding accelerator, it falls back to the CPU emulation and says so. This package's CI runs the TPU branch under its emulated TPU (see below), never on a real TPU: none is reachable there.\n\n**Open it in Colab:** File > Upload notebook in [Colab](https://colab.research.google.com) and pick this file (from the repository's `colab/` folder), or, once the repository is public on GitHub, File > Open notebook > GitHub and paste its URL. The first cell installs the package: upload the wheel (`make dist` builds `dist/tpu_embed_ext-*.whl`) into the runtime's files first, or set `REPO_URL` at the top of that cell to the repository's git URL."),
 ("code", SETUP.replace("tee_quickstart", "tee_tpu")),
 ("code", QUIET),
 ("md", TPU_RUNTIMES),
 ("code", TPU_DETECT),
 ("code", """import tpu_embed_ext as tee
spec = tee.EmbeddingSpec.from_file(CONFIG)
for line in tee.plan(spec).warnings:
  print("SparseCore note:", line)"""),
 ("code", """from tpu_embed_ext import job as train_lib
# 5 blocks of steps, each ending with a checkpoint and a held-out evaluation:
# 5 points on the learning curve. It prints where it trains ("Training on ...").
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
