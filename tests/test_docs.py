"""The documentation cannot drift from the code.

* The site builds with ``mkdocs build --strict``, which fails on a broken link,
  a broken anchor or an API symbol that does not resolve (shown below by
  breaking a copy of the site on purpose), and the API page covers every
  public name.
* The site includes every page of docs/ (BAD_INPUTS.md too).
* Every code block of docs/ runs in a test, or is marked: ```python blocks
  run here (the blocks of one page in order, in one namespace, from an empty
  working directory that must stay empty: the pages write into temporary
  directories), ```sh commands in tests/test_doc_commands.py, the ```yaml
  examples of config.md here. A block that needs a TPU is skipped only under
  ``<!-- docs-test: skip (reason) -->`` on the line before it; a block that is
  not a program (output, a formula, commands for another machine) carries
  ``<!-- docs-test: fragment (reason) -->``. Each ```python block of the
  README runs in a fresh process.
* No file refers to a markdown document that is not in the repository, and
  every ``tests/test_x.py::test_y`` the docs cite exists.
"""

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DOC_PAGES = sorted(DOCS.rglob("*.md"))
SCANNED = ["README.md", "mkdocs.yml", "docs", "tpu_embed_ext", "tests", "benchmarks",
           "colab", "configs"]
TEXT_SUFFIXES = {".md", ".py", ".yaml", ".yml", ".ipynb", ".json", ".txt"}
_MARK = re.compile(r"<!--\s*docs-test:\s*(?P<kind>skip|fragment)\s*"
                   r"\((?P<reason>[^)]*)\)\s*-->")
_MKDOCS = importlib.util.find_spec("mkdocs") is not None
_NO_MKDOCS = "mkdocs is not installed: pip install -e '.[docs]' (the test extra has it)"


# --- the site ------------------------------------------------------------------

def _build(config_dir: pathlib.Path, site: pathlib.Path):
  # No -q: mkdocs then drops warnings before --strict counts them.
  return subprocess.run(
      [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
      cwd=config_dir, capture_output=True, text=True, timeout=600,
      env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.mark.skipif(not _MKDOCS, reason=_NO_MKDOCS)
def test_site_builds_strict(tmp_path):
  out = _build(ROOT, tmp_path / "site")
  assert out.returncode == 0, out.stdout + out.stderr
  api = (tmp_path / "site" / "api" / "index.html").read_text()
  assert "CPUEmbedding" in api and "export_for_serving" in api
  # Every page of docs/ is in the site, BAD_INPUTS.md (linked from the README) too.
  pages = {p.relative_to(DOCS).with_suffix("") for p in DOC_PAGES}
  built = {p.parent.relative_to(tmp_path / "site")
           for p in (tmp_path / "site").rglob("index.html")} | {pathlib.Path("index")}
  assert pages <= built, sorted(map(str, pages - built))
  bad_inputs = (tmp_path / "site" / "BAD_INPUTS" / "index.html").read_text()
  assert "id 9 is out of range [0, 6)" in bad_inputs  # brackets kept as text


@pytest.mark.skipif(not _MKDOCS, reason=_NO_MKDOCS)
@pytest.mark.parametrize("breakage,message", [
    ("[a page](no_such_page.md)", "no_such_page.md"),
    ("[a section](semantics.md#no-such-section)", "no-such-section"),
    ("::: tpu_embed_ext.spec.NoSuchSymbol", "tpu_embed_ext.spec.NoSuchSymbol"),
], ids=["link", "anchor", "api_symbol"])
def test_strict_build_fails_on_a_broken_reference(tmp_path, breakage, message):
  copy = tmp_path / "repo"
  shutil.copytree(DOCS, copy / "docs")
  shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
  (copy / "tpu_embed_ext").symlink_to(ROOT / "tpu_embed_ext")
  page = copy / "docs" / "index.md"
  page.write_text(page.read_text() + f"\n\n{breakage}\n")
  out = _build(copy, tmp_path / "site")
  assert out.returncode != 0
  assert message in out.stdout + out.stderr


def test_api_page_documents_every_public_name():
  # Each name at the module that defines it: mkdocstrings reads the source and
  # cannot follow a package's lazy __getattr__ (tpu_embed_ext.spec.TableSpec).
  import tpu_embed_ext
  text = (DOCS / "api.md").read_text()
  documented = set(re.findall(r"^::: (tpu_embed_ext\.[\w.]+)$", text, re.M))
  missing = [f"{getattr(tpu_embed_ext, name).__module__}.{name}"
             for name in tpu_embed_ext.__all__ if name != "__version__"]
  missing = [path for path in missing if path not in documented]
  assert not missing, f"add `::: <module>.<name>` to docs/api.md: {missing}"



def test_layout_page_follows_the_import_guard():
  """docs/layout.md: the stages of tests/test_import_graph.py in their order,
  each package of a stage in its rows, and every former module path."""
  from tests import test_import_graph
  text = (DOCS / "layout.md").read_text()
  rows = re.findall(r"^\| (\w+) \| ([^|]+) \|", text, re.M)[1:]  # [0]: the header
  stages = [name for i, (name, _) in enumerate(rows) if i == 0 or rows[i - 1][0] != name]
  assert stages == [name for name, _ in test_import_graph.STAGES]
  for name, members in test_import_graph.STAGES:
    cells = " ".join(cell for stage, cell in rows if stage == name)
    for member in members:
      assert f"`{member or '__init__'}" in cells, (name, member)
  import tpu_embed_ext
  former = set(re.findall(r"^\| `([\w.]+)`", text, re.M))
  assert set(tpu_embed_ext.MOVED) <= former, set(tpu_embed_ext.MOVED) - former

# --- the code of the docs --------------------------------------------------------

def fenced_blocks(text: str):
  """``(line, language, code, mark)`` of every fenced block, indented ones too.

  ``mark`` is ``(kind, reason)`` from ``<!-- docs-test: skip (reason) -->``
  or ``<!-- docs-test: fragment (reason) -->`` on the line before the fence,
  else None; a marker without a reason is a ValueError.
  """
  blocks, lines, i = [], text.splitlines(), 0
  while i < len(lines):
    fence = lines[i].strip()
    if fence.startswith("```"):
      indent = len(lines[i]) - len(lines[i].lstrip())
      start, previous = i + 1, next((l for l in reversed(lines[:i]) if l.strip()), "")
      end = next(j for j in range(start, len(lines)) if lines[j].strip() == "```")
      mark = _MARK.search(previous)
      if mark and not mark.group("reason").strip():
        raise ValueError(f"line {i + 1}: a {mark.group('kind')} marker needs a reason")
      blocks.append((start + 1, fence[3:].strip(),
                     "\n".join(l[indent:] for l in lines[start:end]) + "\n",
                     (mark.group("kind"), mark.group("reason").strip()) if mark else None))
      i = end
    i += 1
  return blocks


def code_blocks(text: str):
  """``(line number, code, skip reason or None)`` of every ```python block."""
  return [(line, code, mark[1] if mark else None)
          for line, language, code, mark in fenced_blocks(text) if language == "python"]


CODE_PAGES = [p for p in DOC_PAGES if code_blocks(p.read_text())]


@pytest.mark.parametrize("page", CODE_PAGES,
                         ids=[str(p.relative_to(DOCS)) for p in CODE_PAGES])
def test_docs_code_runs(page, tmp_path, monkeypatch):
  """A page's blocks in order, in one namespace, from an empty working
  directory that stays empty: run from the clone's root, a page leaves
  nothing in the clone (it writes into temporary directories)."""
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  monkeypatch.chdir(cwd)
  namespace = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
  ran = 0
  for line, code, skip in code_blocks(page.read_text()):
    if skip is None:
      exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), namespace)  # pylint: disable=exec-used
      ran += 1
  assert ran, f"{page.name}: every block is skipped"
  assert not os.listdir(cwd), (f"{page.relative_to(ROOT)} wrote {sorted(os.listdir(cwd))} "
                               "into the working directory: write into tempfile.mkdtemp()")


def _commands_run():
  """``page:line`` of every command tests/test_doc_commands.py runs."""
  from tests import test_doc_commands
  return {where for where, _ in test_doc_commands.doc_commands()}


def unrun_blocks(where: str, text: str, commands_run) -> list:
  """Blocks of page ``where`` (its ``text``) that no test runs and no marker excuses.

  Run: ```python blocks (test_docs_code_runs), ```sh blocks whose every
  command test_doc_commands.py runs, and the ```yaml examples of config.md
  (test_config_examples_load). Anything else (output, formulas, shell lines
  for another machine) needs a skip or fragment marker with a reason.
  """
  unrun = []
  for line, language, code, mark in fenced_blocks(text):
    if mark or language == "python":
      continue
    if language == "yaml" and where == "docs/config.md":
      continue
    if language in ("sh", "bash", "shell"):
      logical, number, starts = "", line, []
      for n, text in enumerate(code.splitlines(), line):
        if not logical:
          number = n
        logical += text.rstrip("\\")
        if text.endswith("\\"):
          continue
        if logical.strip() and not logical.strip().startswith("#"):
          starts.append(number)
        logical = ""
      if all(f"{where}:{n}" in commands_run for n in starts):
        continue
    unrun.append(f"{where}:{line} ({language or 'no language'})")
  return unrun


def test_every_docs_block_runs_or_is_marked():
  commands_run = _commands_run()
  unrun = [b for page in DOC_PAGES
           for b in unrun_blocks(str(page.relative_to(ROOT)), page.read_text(), commands_run)]
  assert not unrun, (
      "blocks no test runs: make them run, or put <!-- docs-test: fragment "
      "(why) --> on the line before:\n" + "\n".join(unrun))


def test_unrun_blocks_are_found():
  text = ("```sh\npython -m tpu_embed_ext plan \\\n  --config c.yaml\n# note\n```\n"
          "```\nw = w - lr * g\n```\n"
          "<!-- docs-test: fragment (the update, as math) -->\n```\nw = 0\n```\n"
          "```python\nx = 1\n```\n"
          "```sh\npip install x\n```\n")
  blocks = fenced_blocks(text)
  assert [(b[0], b[1], b[3]) for b in blocks] == [
      (2, "sh", None), (7, "", None), (11, "", ("fragment", "the update, as math")),
      (14, "python", None), (17, "sh", None)]
  assert unrun_blocks("docs/x.md", text, {"docs/x.md:2"}) == [
      "docs/x.md:7 (no language)", "docs/x.md:17 (sh)"]
  assert unrun_blocks("docs/x.md", text, set()) == [
      "docs/x.md:2 (sh)", "docs/x.md:7 (no language)", "docs/x.md:17 (sh)"]
  with pytest.raises(ValueError, match="fragment marker needs a reason"):
    fenced_blocks("<!-- docs-test: fragment ( ) -->\n```\nx\n```\n")


README_BLOCKS = [(line, code) for line, code, skip in code_blocks(
    (ROOT / "README.md").read_text()) if skip is None]


@pytest.mark.parametrize("line,code", README_BLOCKS, ids=[f"README.md:{l}" for l, _ in README_BLOCKS])
def test_readme_code_runs(line, code):
  """Each ```python block of the README in a fresh process (they are independent
  snippets; one splits the CPU into devices, which only a fresh process can)."""
  import textwrap
  out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, f"README.md:{line}\n{out.stdout}\n{out.stderr}"


def test_a_skipped_block_needs_a_reason():
  marked = "<!-- docs-test: skip (needs a TPU) -->\n```python\nx = 1\n```\n"
  assert code_blocks(marked) == [(3, "x = 1\n", "needs a TPU")]
  with pytest.raises(ValueError, match="needs a reason"):
    code_blocks(marked.replace("needs a TPU", " "))


# --- references to documents ---------------------------------------------------

def _text_files():
  this_file = pathlib.Path(__file__).resolve()  # names broken references on purpose
  for entry in SCANNED:
    path = ROOT / entry
    files = [path] if path.is_file() else sorted(path.rglob("*"))
    for f in files:
      if (f.is_file() and f.suffix in TEXT_SUFFIXES and "__pycache__" not in f.parts
          and f.resolve() != this_file):
        yield f


def _exists(reference: str, source: pathlib.Path) -> bool:
  target = reference.split("#", 1)[0]
  if not target:
    return True
  bases = [source.parent, ROOT]
  if source.name == "mkdocs.yml":
    bases.append(DOCS)  # nav entries are relative to docs_dir
  # Inside the repository: an absolute path (/work/shared/X.md) or one out of
  # it may exist on the machine that wrote it, never in a reader's clone.
  return any((base / target).exists() and (base / target).resolve().is_relative_to(
      ROOT.resolve()) for base in bases)


def _dangling(path: pathlib.Path):
  text = re.sub(r"\w+://\S+", "", path.read_text(errors="replace"))
  for name in set(re.findall(r"[\w./-]*[\w-]\.md\b", text)):
    if not _exists(name, path):
      yield name
  if path.suffix in (".md", ".ipynb"):
    for target in set(re.findall(r"\]\(([^)\s]+)\)", text)):
      if not target.startswith(("mailto:", "#")) and not _exists(target, path):
        yield target


def test_no_reference_to_a_document_outside_the_repository():
  dangling = {f"{f.relative_to(ROOT)}: {ref}" for f in _text_files()
              for ref in _dangling(f)}
  assert not dangling, sorted(dangling)


def test_dangling_reference_detection():
  page = DOCS / "guides" / "cpu-testing.md"
  assert _exists("../semantics.md#replicas", page) and _exists("README.md", page)
  assert not _exists("SEMANTICS" + ".md", page)


def test_a_document_outside_the_repository_is_dangling_even_if_it_exists(tmp_path):
  outside = tmp_path / "SEMANTICS.md"  # As tests/references.py once named one.
  outside.write_text("# outside\n")
  page = DOCS / "guides" / "cpu-testing.md"
  assert not _exists(str(outside), page)
  assert _exists(str(DOCS / "semantics.md"), page)


def test_cited_tests_exist():
  cited = set()
  for page in [ROOT / "README.md", *DOCS.rglob("*.md")]:
    cited |= set(re.findall(r"tests/(test_\w+\.py)::(test_\w+)", page.read_text()))
  assert cited
  missing = sorted(f"{module}::{name}" for module, name in cited
                   if not (ROOT / "tests" / module).exists()
                   or f"def {name}(" not in (ROOT / "tests" / module).read_text())
  assert not missing, missing


# --- the config format page ----------------------------------------------------

def _sections(text: str):
  """``{### heading: {`key`: default text}}`` from the tables under each heading."""
  out, heading = {}, None
  for line in text.splitlines():
    if line.startswith("## ") or line.startswith("### "):
      heading = line.lstrip("#").strip()
      out[heading] = {}
    row = re.match(r"\| `(\w+)` \| ([^|]*) \|", line)
    if row and heading is not None:
      out[heading][row.group(1)] = row.group(2).strip()
  return out


def test_config_examples_load():
  from tpu_embed_ext import spec as spec_lib
  from tpu_embed_ext import job as train
  import yaml
  blocks = re.findall(r"```yaml\n(.*?)```", (DOCS / "config.md").read_text(), re.S)
  assert len(blocks) >= 5
  for block in blocks:
    config = yaml.safe_load(block)
    spec = spec_lib.EmbeddingSpec.from_dict(config)
    train.TrainConfig.from_dict(spec.train)


def test_config_page_lists_every_key_with_its_default():
  import dataclasses
  import yaml
  from tpu_embed_ext.spec import optimizers
  from tpu_embed_ext import spec as spec_lib, job as train
  from tpu_embed_ext.spec import entries, parsing
  sections = _sections((DOCS / "config.md").read_text())
  assert set(sections["Top-level keys"]) == set(parsing.TOP_LEVEL)
  assert set(sections["`tables`"]) == set(entries.written_fields(spec_lib.TableSpec))
  assert set(sections["`features`"]) == set(entries.written_fields(spec_lib.FeatureSpec))
  assert set(sections["`train`"]) == {f.name for f in dataclasses.fields(train.TrainConfig)}
  for heading, cls in (("`tables`", spec_lib.TableSpec), ("`features`", spec_lib.FeatureSpec)):
    for field in dataclasses.fields(cls):
      if field.name in sections[heading] and field.default is not dataclasses.MISSING:
        assert yaml.safe_load(sections[heading][field.name].strip("`")) == field.default, (
            heading, field.name)
  common = sections["Common fields"]
  for name, cls in optimizers.TYPES.items():
    rows = {**common, **sections[f"`{name}`"]}
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    assert set(rows) == set(fields), name
    for key, default in fields.items():
      assert yaml.safe_load(rows[key].strip("`")) == default, (name, key)


# --- figures quoted from runs ----------------------------------------------------

def test_quoted_figures_are_those_measured():
  """Every ``<!-- figure:NAME -->`` span equals docs/figures.json (docs/make_figures.py)."""
  import json
  spec = importlib.util.spec_from_file_location("make_figures", DOCS / "make_figures.py")
  make_figures = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(make_figures)
  figures = json.loads((DOCS / "figures.json").read_text())["figures"]
  quoted = [(page.relative_to(ROOT), m.group("name"), m.group("text"))
            for page in make_figures.PAGES
            for m in make_figures.SPAN.finditer(page.read_text())]
  assert quoted
  stale = [q for q in quoted if figures.get(q[1]) != q[2]]
  assert not stale, ("run `python docs/make_figures.py --spans` (or measure again "
                     f"without --spans): {stale}")


def test_readme_quotes_no_auc_outside_a_figure_span():
  text = re.sub(r"<!-- figure:[\w.]+ -->.*?<!-- /figure -->", "",
                (ROOT / "README.md").read_text(), flags=re.S)
  assert not re.findall(r"AUC \*{0,2}0\.\d{3,}", text)


def test_criteo_header_states_what_plan_computes():
  import tpu_embed_ext as tee
  header = (ROOT / "configs" / "criteo.yaml").read_text().split("\noptimizer:")[0]
  rows, gib = re.search(r"([\d,]+) rows; ([\d.]+) GiB", header).groups()
  tables = tee.plan(tee.EmbeddingSpec.from_file(str(ROOT / "configs" / "criteo.yaml"))).tables
  assert int(rows.replace(",", "")) == sum(t.rows for t in tables)
  assert gib == f"{sum(t.total_bytes for t in tables) / 2**30:.1f}"


def test_the_sparsecore_page_says_which_engines_load_keras_weight_files():
  """docs/sparsecore.md once said every engine loads a .weights.h5 file; a
  TPU engine refuses it (issue 42): the page quotes the refusal."""
  import types
  from tpu_embed_ext import errors
  from tpu_embed_ext.keras import adapters, weights
  with pytest.raises(errors.ConfigError) as refused:
    weights.keyed_variables(types.SimpleNamespace(
        _adapter=adapters.SparseCoreAdapter(None, "<name>"), name="<name>"))
  text = " ".join((DOCS / "sparsecore.md").read_text().split())
  assert f"ConfigError: {refused.value}" in text
  assert "on every engine" not in text
