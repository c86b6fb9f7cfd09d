"""Figures the docs quote from runs: measured here, never typed.

Run from the repository root:

  .venv/bin/python docs/make_figures.py           # measure, write docs/figures.json, rewrite spans
  .venv/bin/python docs/make_figures.py --spans   # rewrite the spans from docs/figures.json only

Measuring runs what ``make run`` runs (``python -m tpu_embed_ext train --config
configs/ranking.yaml --tpu none``) in a scratch model_dir with an empty tfds
data_dir, so the first-run dataset build is timed too, and reads the numbers
from ``metrics.json``. A figure in a page is a span,
``<!-- figure:NAME -->TEXT<!-- /figure -->``; ``--spans`` puts figures.json's
text for NAME there. tests/test_docs.py checks that every span equals
figures.json, so a page cannot quote a number the last measurement did not give.
"""

import datetime
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIGURES = ROOT / "docs" / "figures.json"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SPAN = re.compile(r"<!-- figure:(?P<name>[\w.]+) -->(?P<text>.*?)<!-- /figure -->", re.S)
CONFIG = "configs/ranking.yaml"


def _duration(seconds: float) -> str:
  seconds = round(seconds)
  return f"{seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"{seconds} s"


def measure() -> dict:
  """Trains CONFIG twice in scratch directories: a fresh machine, then a warm one."""
  with tempfile.TemporaryDirectory(prefix="figures-") as scratch:
    env = {**os.environ, "TFDS_DATA_DIR": os.path.join(scratch, "tfds")}
    runs = []
    for name in ("fresh", "warm"):  # fresh: builds the dataset; warm: reads it.
      model_dir = os.path.join(scratch, name)
      load = os.getloadavg()[0]
      began = time.perf_counter()
      subprocess.run([sys.executable, "-m", "tpu_embed_ext", "train", "--config", CONFIG,
                      "--model_dir", model_dir, "--tpu", "none"],
                     cwd=ROOT, env=env, check=True)
      seconds = time.perf_counter() - began
      with open(os.path.join(model_dir, "metrics.json")) as f:
        runs.append((seconds, load, json.load(f)))
  (fresh_s, load, metrics), (warm_s, warm_load, warm) = runs
  if warm["eval_auc"] != metrics["eval_auc"]:
    raise SystemExit(f"two runs of {CONFIG} gave AUC {metrics['eval_auc']} and "
                     f"{warm['eval_auc']}: the job is not deterministic.")
  import yaml  # pylint: disable=g-import-not-at-top
  batch_size = yaml.safe_load((ROOT / CONFIG).read_text())["train"]["batch_size"]
  per_step_ms = 1000 * batch_size / warm["examples_per_second"]
  values = {
      "ranking.eval_auc": f"{metrics['eval_auc']:.4f}",
      "ranking.planted_auc": f"{metrics['planted_auc']:.4f}",
      "ranking.steps": f"{metrics['steps']:,}",
      "ranking.examples_per_second": f"{warm['examples_per_second']:,.0f}",
      "ranking.ms_per_step": f"{per_step_ms:.1f}",
      "ranking.train_seconds_warm": _duration(warm_s),
      "ranking.train_seconds_fresh": _duration(fresh_s),
      "ranking.dataset_build_seconds": _duration(max(fresh_s - warm_s, 0)),
      "ranking.load_average": f"{(load + warm_load) / 2:.1f}",
  }
  return {"measured": {"command": f"python -m tpu_embed_ext train --config {CONFIG} --tpu none",
                       "date": datetime.date.today().isoformat(),
                       "cpus": os.cpu_count()},
          "figures": values}


def rewrite_spans(figures: dict) -> list:
  """Puts each figure's text into its spans; returns the pages changed."""
  changed = []
  for page in PAGES:
    text = page.read_text()

    def put(m):
      name = m.group("name")
      if name not in figures:
        raise SystemExit(f"{page.relative_to(ROOT)}: no figure {name!r} in {FIGURES.name}")
      return f"<!-- figure:{name} -->{figures[name]}<!-- /figure -->"
    new = SPAN.sub(put, text)
    if new != text:
      page.write_text(new)
      changed.append(str(page.relative_to(ROOT)))
  return changed


def main(argv):
  if "--spans" not in argv:
    FIGURES.write_text(json.dumps(measure(), indent=2) + "\n")
  figures = json.loads(FIGURES.read_text())["figures"]
  print("rewrote", rewrite_spans(figures) or "nothing")


if __name__ == "__main__":
  main(sys.argv[1:])
