"""The package's import graph is one-way: no cycle, not even one hidden by an
import inside a function, and no stage imports a later one.

Read statically from the source (every ``import`` anywhere in a module,
except under ``if TYPE_CHECKING:``), so a cycle that only closes when some
function runs is found too. The flow is spec -> TF objects -> engine ->
layer -> job: the engine imports neither the layer nor the job, the layer not
the job, the specs none of them.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "tpu_embed_ext"

# Stages of the flow, in order: a module may import its own stage or an
# earlier one, never a later one. Every module of the package is in a stage
# (test_every_module_has_a_stage).
STAGES = [
    ("base", ("", "errors")),  # "": the package face, tpu_embed_ext/__init__.py
    ("host", ("host",)),
    ("spec", ("spec",)),
    # The spec as TensorFlow's objects: tf/ reads spec values; the spec
    # imports nothing of tf/ (EmbeddingSpec.feature_config() goes through the
    # package's public tpu_embed_ext.feature_config, as a user does).
    ("tf", ("tf",)),
    ("data", ("data",)),
    ("sparsecore", ("sparsecore",)),
    ("engine", ("emulation",)),
    ("keras", ("keras",)),
    ("emulated_tpu", ("emulated_tpu",)),
    ("job", ("job",)),
    ("cli", ("cli", "__main__")),
]


def _modules():
  """``{dotted name: path}`` of every module of the package."""
  found = {}
  for directory, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(directory, name)
        dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        found[dotted.removesuffix(".__init__")] = path
  return found


def _is_type_checking(node) -> bool:
  test = node.test
  return isinstance(node, ast.If) and (
      getattr(test, "id", None) == "TYPE_CHECKING"
      or getattr(test, "attr", None) == "TYPE_CHECKING")


def _imports(tree, module: str, is_package: bool, known) -> set:
  """Modules of the package that ``tree`` imports, at any depth."""
  here = module if is_package else module.rsplit(".", 1)[0]
  found = set()
  stack = [tree]
  while stack:
    node = stack.pop()
    if isinstance(node, ast.If) and _is_type_checking(node):
      stack.extend(node.orelse)
      continue
    stack.extend(ast.iter_child_nodes(node))
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = here.split(".")[:len(here.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
      for alias in node.names:  # `from pkg import module` names a module
        full = f"{base}.{alias.name}"
        found.add(full if full in known else base)
  # A submodule's import of its own package (for a name it defines) is not an
  # edge: Python initialises a package before any of its submodules, so that
  # direction holds whatever the package imports later.
  return {m for m in found if m in known and m != module
          and not module.startswith(m + ".")}


def import_graph():
  modules = _modules()
  graph = {}
  for module, path in modules.items():
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    graph[module] = _imports(tree, module, path.endswith("__init__.py"), modules)
  return graph


def cycles(graph):
  """Strongly connected components of more than one module (or a self-loop),
  each as one cycle through it, e.g. ``[a, b, c, a]``."""
  index, low, on_stack, stack, found = {}, {}, set(), [], []

  def visit(v):  # Tarjan, iterative: no recursion limit on a deep chain.
    work = [(v, iter(sorted(graph[v])))]
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    while work:
      node, edges = work[-1]
      for w in edges:
        if w not in index:
          index[w] = low[w] = len(index)
          stack.append(w)
          on_stack.add(w)
          work.append((w, iter(sorted(graph[w]))))
          break
        if w in on_stack:
          low[node] = min(low[node], index[w])
      else:
        work.pop()
        if work:
          low[work[-1][0]] = min(low[work[-1][0]], low[node])
        if low[node] == index[node]:
          component = []
          while True:
            w = stack.pop()
            on_stack.discard(w)
            component.append(w)
            if w == node:
              break
          if len(component) > 1:
            found.append(_cycle_through(graph, set(component)))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def _cycle_through(graph, component):
  """A shortest path from the component's first module back to itself."""
  start = min(component)
  paths = {start: [start]}
  frontier = [start]
  while frontier:
    nxt = []
    for v in frontier:
      for w in sorted(graph[v] & component):
        if w == start:
          return paths[v] + [start]
        if w not in paths:
          paths[w] = paths[v] + [w]
          nxt.append(w)
    frontier = nxt
  raise AssertionError(f"no cycle through {component}")


def _stage(module: str):
  local = module[len(PACKAGE) + 1:]
  for i, (name, members) in enumerate(STAGES):
    if any(local == m or local.startswith(m + ".") for m in members):
      return i, name
  return None


def test_the_package_has_no_import_cycle():
  found = cycles(import_graph())
  assert not found, "import cycles (one module each way; make one direction go):\n" + \
      "\n".join(" -> ".join(m[len(PACKAGE) + 1:] for m in c) for c in found)


def test_every_module_has_a_stage():
  free = [m for m in sorted(import_graph()) if _stage(m) is None]
  assert not free, "modules in no stage (add their package to STAGES): " + \
      ", ".join(free)


def test_no_stage_imports_a_later_one():
  wrong = []
  for module, imported in sorted(import_graph().items()):
    mine = _stage(module)
    for other in sorted(imported):
      theirs = _stage(other)
      if theirs[0] > mine[0]:
        wrong.append(f"{module} ({mine[1]}) imports {other} ({theirs[1]})")
  assert not wrong, "\n".join(wrong)


# Fewer than this many imports of our own modules inside functions. Each one
# keeps TensorFlow (or another heavy library) off an import path, and says so
# in a "# Lazy: ..." comment on its line or in the comment block just above.
MAX_FUNCTION_LEVEL_IMPORTS = 10


def function_level_imports(tree, lines):
  """``[(line, reason or None)]`` of imports of the package inside a function."""
  found = []

  def visit(node, in_function):
    for child in ast.iter_child_nodes(node):
      if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
        if isinstance(child, ast.Import):
          ours = any(a.name.split(".")[0] == PACKAGE for a in child.names)
        else:
          ours = child.level > 0 or (child.module or "").split(".")[0] == PACKAGE
        if ours:
          found.append((child.lineno, _lazy_reason(lines, child.lineno)))
      visit(child, in_function or isinstance(
          child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

  visit(tree, False)
  return found


def _lazy_reason(lines, lineno):
  """The ``Lazy:`` comment on line ``lineno`` (1-based) or in the comment
  lines directly above it, else None."""
  comments = [lines[lineno - 1].partition("#")[2]]
  i = lineno - 2
  while i >= 0 and lines[i].lstrip().startswith("#"):
    comments.insert(0, lines[i].lstrip()[1:])
    i -= 1
  text = " ".join(c.strip() for c in comments
                  if c.strip() and not c.strip().startswith("pylint:"))
  return text[text.index("Lazy:"):] if "Lazy:" in text else None


def _function_level_imports_of_the_package():
  found = []
  for module, path in sorted(_modules().items()):
    with open(path) as f:
      source = f.read()
    for line, reason in function_level_imports(ast.parse(source, path),
                                               source.splitlines()):
      found.append((f"{os.path.relpath(path, ROOT)}:{line}", reason))
  return found


def test_function_level_imports_are_few_and_each_says_why():
  found = _function_level_imports_of_the_package()
  listing = "\n".join(f"  {where}  {reason or '(no Lazy: comment)'}"
                       for where, reason in found)
  assert len(found) < MAX_FUNCTION_LEVEL_IMPORTS, (
      f"{len(found)} imports of {PACKAGE} inside functions (at most "
      f"{MAX_FUNCTION_LEVEL_IMPORTS - 1}); move them to the top of the module, "
      "or the function to the stage it belongs to:\n" + listing)
  unexplained = [where for where, reason in found if reason is None]
  assert not unexplained, (
      "imports inside functions without a '# Lazy: <what it keeps off which "
      "import>' comment on the line or just above: " + ", ".join(unexplained)
      + "\nall of them:\n" + listing)


@pytest.mark.parametrize("source, expected", [
    ("def f():\n  from tpu_embed_ext import b\n", [(2, None)]),
    ("def f():\n  # Lazy: keeps TensorFlow off a.\n  import tpu_embed_ext.b\n",
     [(3, "Lazy: keeps TensorFlow off a.")]),
    ("def f():\n  from . import b  # Lazy: keeps X off a.\n",
     [(2, "Lazy: keeps X off a.")]),
    ("class C:\n  def m(self):\n    g = lambda: 1\n    from tpu_embed_ext.x import y\n",
     [(4, None)]),
    ("from tpu_embed_ext import b\ndef f():\n  import os\n", []),
])
def test_function_level_imports_and_their_reasons_are_found(source, expected):
  assert function_level_imports(ast.parse(source), source.splitlines()) == expected


@pytest.mark.parametrize("source, expected", [
    # The cycle this test was written for: closed only inside functions.
    ({"a": "def f():\n  from tpu_embed_ext import b\n",
      "b": "from tpu_embed_ext import c\n",
      "c": "import tpu_embed_ext.a\n"}, [["a", "b", "c", "a"]]),
    ({"a": "from tpu_embed_ext import b\n", "b": "from . import a\n"},
     [["a", "b", "a"]]),
    ({"a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
           "  from tpu_embed_ext import b\n",
      "b": "from tpu_embed_ext import a\n"}, []),
    ({"a": "from tpu_embed_ext import b\n", "b": "import os\n"}, []),
    # A package that imports its submodule, which takes a name from the package.
    ({"p": "def f():\n  from tpu_embed_ext.p import q\n",
      "p.q": "from tpu_embed_ext import p\n"}, []),
])
def test_cycles_are_found_wherever_the_import_is(source, expected):
  known = {f"{PACKAGE}.{k}" for k in source}
  is_package = lambda name: any(m.startswith(name + ".") for m in known)
  graph = {f"{PACKAGE}.{k}": _imports(ast.parse(text), f"{PACKAGE}.{k}",
                                      is_package(f"{PACKAGE}.{k}"), known)
           for k, text in source.items()}
  found = [[m[len(PACKAGE) + 1:] for m in c] for c in cycles(graph)]
  assert found == expected


# --- module size -----------------------------------------------------------------

MAX_LINES = 450
# Modules allowed up to 500 lines, each because one concern needs the room
# (not split to meet a count: docs/layout.md).
LONGER = {
    "tpu_embed_ext.emulation.engine": "TPUEmbedding's protocol, its variables "
    "and the declared hooks of its subclasses (HOOKS)",
    "tpu_embed_ext.spec.optimizers": "each optimizer's fields with its facts: "
    "TensorFlow's class, plan settings and numeric traps",
}


def test_modules_are_small():
  sizes = {}
  for name, path in _modules().items():
    with open(path) as f:
      sizes[name] = sum(1 for _ in f)
  over = {n: s for n, s in sizes.items() if s > (500 if n in LONGER else MAX_LINES)}
  assert not over, (f"modules over {MAX_LINES} lines (500 for LONGER): {over}. "
                    "Fix: give a second concern its own module.")
  assert set(LONGER) <= set(sizes)
