"""The engine's subclasses use its declared hooks only.

The emulated TPU's ``TPUEmbedding`` (``mid_level.py``), ``TPUEmbeddingV2``
(``sparsecore.py``) and the ``PipelinedSteps`` mixin (``pipelining.py``)
build on ``CPUEmbedding``. Of its private members they may read, call or
override those in ``engine.HOOKS`` (documented there) and TensorFlow's own
private names in ``engine.TENSORFLOW_PRIVATE_API``, nothing else, and never
reach through one (``self._batches._pending``). Read statically from the
source, as tests/test_import_graph.py reads imports; both lists are pinned
here, as that test pins the stages.
"""

import ast
import os

import pytest

from tpu_embed_ext.emulation import engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = os.path.join(ROOT, "tpu_embed_ext", "emulation", "engine.py")
EMULATED_TPU = os.path.join(ROOT, "tpu_embed_ext", "emulated_tpu")

EXPECTED_HOOKS = (
    "_features", "_tables", "_table_vars", "_replicas", "_shapes",
    "_batches", "_sparsecore",
    "_prepare_batches", "_table_lookup", "_apply_payloads",
    "_check_gradients", "_local_replica", "_native_step",
)

EXPECTED_TENSORFLOW_PRIVATE_API = (
    "_variables", "_output_shapes", "_create_config_proto",
    "_retrieve_variables", "_load_variables", "_checkpoint_adapter",
    "_lookup_dependency",
)


def _private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def _self_attr(node):
  """``x`` of ``self._x`` (or ``super()._x``), else None."""
  if not isinstance(node, ast.Attribute) or not _private(node.attr):
    return None
  value = node.value
  if isinstance(value, ast.Name) and value.id == "self":
    return node.attr
  if (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
      and value.func.id == "super"):
    return node.attr
  return None


def _defined(cls: ast.ClassDef) -> set:
  """Private names a class defines: its methods, the attributes it sets."""
  names = {n.name for n in cls.body
           if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
  for node in ast.walk(cls):
    if isinstance(node, ast.Call):
      func = node.func
      setter = (isinstance(func, ast.Attribute) and func.attr == "__setattr__"
                and node.args[1:] and isinstance(node.args[1], ast.Constant))
      if setter:  # object.__setattr__(self, "_x", ...)
        names.add(node.args[1].value)
      if isinstance(func, ast.Name) and func.id == "_untracked":
        names.update(k.arg for k in node.keywords)
    targets = (node.targets if isinstance(node, ast.Assign)
               else [node.target] if isinstance(node, ast.AnnAssign) else [])
    names.update(_self_attr(t) for t in targets if _self_attr(t))
  return {n for n in names if _private(n)}


def engine_private() -> set:
  """Every private member ``CPUEmbedding`` defines in engine.py."""
  with open(ENGINE) as f:
    tree = ast.parse(f.read())
  [cls] = [n for n in tree.body
           if isinstance(n, ast.ClassDef) and n.name == "CPUEmbedding"]
  return _defined(cls)


def _classes(sources):
  """``{name: ClassDef}`` of every class in ``sources`` (``{path: text}``)."""
  return {n.name: n for text in sources.values()
          for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef)}


def _base_name(base) -> str:
  return base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")


def engine_classes(sources) -> dict:
  """The classes of ``sources`` that subclass ``CPUEmbedding`` (at any
  depth), and the classes of ``sources`` mixed into one of them."""
  classes = _classes(sources)
  found = {}
  changed = True
  while changed:
    changed = False
    for name, cls in classes.items():
      if name not in found and any(_base_name(b) in ("CPUEmbedding", *found)
                                   for b in cls.bases):
        found[name] = cls
        changed = True
  for cls in list(found.values()):
    for base in cls.bases:
      if _base_name(base) in classes:
        found.setdefault(_base_name(base), classes[_base_name(base)])
  return found


def violations(sources, private, allowed) -> list:
  """``(class, line, what)`` of every use of an engine-private name that is
  not ``allowed``, and of every reach through one (``self._a._b``)."""
  found = []
  for name, cls in engine_classes(sources).items():
    for node in ast.walk(cls):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if node.name in private and node.name not in allowed:
          found.append((name, node.lineno, f"overrides {node.name}"))
        continue
      if (isinstance(node, ast.Attribute) and _private(node.attr)
          and _self_attr(node.value) in private):
        found.append((name, node.lineno,
                      f"reaches self.{node.value.attr}.{node.attr}"))
      attr = _self_attr(node)
      if attr in private and attr not in allowed:
        found.append((name, node.lineno, f"uses self.{attr}"))
  return sorted(found)


def _emulated_tpu_sources():
  sources = {}
  for name in sorted(os.listdir(EMULATED_TPU)):
    if name.endswith(".py"):
      with open(os.path.join(EMULATED_TPU, name)) as f:
        sources[name] = f.read()
  return sources


def test_the_hooks_are_pinned():
  assert engine.HOOKS == EXPECTED_HOOKS
  assert engine.TENSORFLOW_PRIVATE_API == EXPECTED_TENSORFLOW_PRIVATE_API
  assert not set(engine.HOOKS) & set(engine.TENSORFLOW_PRIVATE_API)


def test_every_hook_is_a_member_of_the_engine():
  assert set(engine.HOOKS) <= engine_private()
  # The methods among them exist on the class; each says it is a hook.
  for name in engine.HOOKS:
    member = getattr(engine.CPUEmbedding, name, None)
    if callable(member):
      assert member.__doc__.startswith("Hook:"), name


def test_the_emulated_tpu_classes_are_found():
  assert set(engine_classes(_emulated_tpu_sources())) == {
      "TPUEmbedding", "TPUEmbeddingV2", "PipelinedSteps"}


def test_subclasses_use_declared_hooks_only():
  allowed = set(engine.HOOKS) | set(engine.TENSORFLOW_PRIVATE_API)
  found = violations(_emulated_tpu_sources(), engine_private(), allowed)
  assert not found, (
      "emulated-TPU classes use private engine members that are not hooks "
      "(declare a hook in engine.HOOKS, or use a public method):\n"
      + "\n".join(f"  {c} line {line}: {what}" for c, line, what in found))


@pytest.mark.parametrize("body, expected", [
    ("def f(self):\n    return self._validate\n", ["uses self._validate"]),
    ("def f(self):\n    return self._batches._pending\n",
     ["reaches self._batches._pending"]),
    ("def _put(self, b, t):\n    pass\n", ["overrides _put"]),
    ("def f(self):\n    return super()._activations(1)\n",
     ["uses self._activations"]),
    ("def f(self):\n    object.__setattr__(self, '_mine', 1)\n"
     "    return self._mine, self._tables, self._variables\n", []),
])
def test_violations_are_found(body, expected):
  source = ("class Mixin:\n  pass\n\n"
            "class E(Mixin, engine.CPUEmbedding):\n  "
            + body.replace("\n", "\n  "))
  allowed = set(engine.HOOKS) | set(engine.TENSORFLOW_PRIVATE_API)
  found = violations({"x.py": source}, engine_private(), allowed)
  assert [what for _, _, what in found] == expected


def test_the_engines_differences_are_read_from_rules_not_strings():
  """No ``== "v1"``/``"v2"`` in the engine, the emulated TPU, the layer or
  SparseCore: they read ``EngineRules`` fields (emulation/rules.py). Only
  ``dispatch.create_embedding`` reads a user's ``engine=`` string."""
  import re  # pylint: disable=g-import-not-at-top
  compare = re.compile(r'[=!]=\s*["\']v[12]["\']|["\']v[12]["\']\s*[=!]=')
  found = []
  for package in ("emulation", "emulated_tpu", "keras", "sparsecore"):
    for directory, _, files in os.walk(os.path.join(ROOT, "tpu_embed_ext", package)):
      for name in files:
        if name.endswith(".py"):
          path = os.path.join(directory, name)
          with open(path) as f:
            found += [f"{os.path.relpath(path, ROOT)}:{i}"
                      for i, line in enumerate(f, 1) if compare.search(line)]
  assert [f.split(":")[0] for f in found] == [
      "tpu_embed_ext/emulation/dispatch.py"], found
