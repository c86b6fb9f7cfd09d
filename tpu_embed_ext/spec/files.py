"""Reading config files in bounded time and memory, whatever they contain.

A config is read into the spec's dict form (spec.py) from YAML or JSON. Three
things bound the work: the file's size (read at most MAX_BYTES + 1 bytes, so a
FIFO or /dev/zero cannot stall it), the nesting depth, and the size of the
document once YAML aliases are expanded. Aliases are shared nodes in the
composed graph, so a 1.5 KB file of nested aliases (a "billion laughs")
composes quickly but constructs into billions of objects; the expanded size is
counted on the graph first (linear in the file), and refused above
MAX_NODES. A recursive alias is refused the same way.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from typing import Dict

from tpu_embed_ext import errors

__all__ = ["load", "resolve", "shipped_configs", "MAX_BYTES", "MAX_NODES",
           "MAX_DEPTH"]

MAX_BYTES = 16 * 1024 * 1024
MAX_NODES = 1_000_000
"""Nodes of the document with every alias expanded: a config of 1,000 tables
has about 10,000."""
MAX_DEPTH = 100


def shipped_configs() -> Dict[str, str]:
  """``{name: path}`` of the configs shipped with the package (``tiny``...).

  They are the clone's top-level ``configs/``, installed as package data in
  ``tpu_embed_ext/configs/`` (setup.py); a source checkout that is not
  installed reads them from ``configs/`` beside the package.
  """
  package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for directory in (os.path.join(package, "configs"),
                    os.path.join(os.path.dirname(package), "configs")):
    if os.path.isdir(directory):
      return {name[:-len(".yaml")]: os.path.join(directory, name)
              for name in sorted(os.listdir(directory)) if name.endswith(".yaml")}
  return {}


def resolve(config: str, flag: str = "--config") -> str:
  """The file a config value names: a path as given, or a shipped name.

  The one resolver of the command line (``--config``) and the Python API
  (``EmbeddingSpec.from_file``, so ``CPUEmbedding("tiny")`` and
  ``plan("criteo")`` too; ``flag=None`` names the value, not a flag, in an
  error). An existing path wins (a ``configs/tiny.yaml`` edited in the working
  directory is read, not the shipped one). Otherwise a bare name, with or
  without ``.yaml``, is a shipped config; anything else is returned as given,
  for ``load`` to report.
  """
  config = os.fspath(config)
  if os.path.exists(config) or os.sep in config:
    return config
  shipped = shipped_configs()
  name = config[:-len(".yaml")] if config.endswith(".yaml") else config
  if name in shipped:
    return shipped[name]
  if "." in name:  # c.json, c.yml: a file name, reported by load.
    return config
  raise errors.ConfigError(
      f"no config file or shipped config named {config!r}."
      f"{errors.did_you_mean(name, shipped)} Fix: pass a path to a .yaml or "
      f".json file, or a shipped config: {_names(shipped)}.",
      **({"path": flag} if flag else {}))


def _names(shipped) -> str:
  return ", ".join(shipped) or "(none found: reinstall tpu_embed_ext)"


def _near(path: str) -> str:
  """' Did you mean ...?' for a missing config file: a config file beside
  it with a close name, else a shipped config with a close name."""
  directory, name = os.path.split(path)
  try:
    siblings = [os.path.join(directory, n) for n in os.listdir(directory or ".")
                if n.endswith((".yaml", ".yml", ".json"))]
  except OSError:
    siblings = []
  near = errors.did_you_mean(path, siblings)
  if near:
    return near
  stem, shipped = os.path.splitext(name)[0], shipped_configs()
  match = ([stem] if stem in shipped else
           difflib.get_close_matches(stem, shipped, n=1, cutoff=0.6))
  return (f" Did you mean the shipped config {match[0]!r} (--config {match[0]})?"
          if match else "")


def load(path: str):
  """The dict form of the ``.yaml``/``.yml``/``.json`` file at ``path``."""
  if not os.path.exists(path):
    raise errors.ConfigError(
        f"config file not found.{_near(path)} Fix: check the path, or name a "
        f"shipped config: {_names(shipped_configs())}.", file=path)
  if os.path.isdir(path):
    raise errors.ConfigError(
        "is a directory, not a config file. Fix: name a .yaml or .json file, "
        "e.g. configs/ranking.yaml.", file=path)
  try:
    with open(path, "rb") as f:
      raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
      raise errors.ConfigError(
          f"the config file is larger than {MAX_BYTES // 2 ** 20} MiB. Fix: name "
          "the config file (a config is a few KB), not a data file.", file=path)
    text = raw.decode("utf-8")
  except (OSError, UnicodeDecodeError) as e:
    raise errors.ConfigError(
        f"cannot read the config: {getattr(e, 'strerror', None) or e}. Fix: "
        "name a readable UTF-8 .yaml or .json file.", file=path) from None
  try:
    if path.endswith(".json"):
      return _load_json(text)
    return _load_yaml(text)
  except errors.ConfigError as e:
    raise e.at(file=path) from None


def _load_json(text: str):
  try:
    data = json.loads(text, object_pairs_hook=_unique_json_keys)
  except json.JSONDecodeError as e:
    raise errors.ConfigError(
        f"invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}.") from None
  except RecursionError:
    raise errors.ConfigError(
        "the JSON is nested deeper than Python can read. Fix: flatten it "
        "(a config nests a few levels).") from None
  _check_depth(data)
  return data


def _check_depth(data):
  """The YAML limits for JSON: MAX_DEPTH levels and MAX_NODES values (a
  16 MiB file of `0,` holds eight million, each of which the spec's checks
  then visit)."""
  stack, count = [(data, 0)], 0
  while stack:
    node, depth = stack.pop()
    count += 1
    if count > MAX_NODES:
      raise errors.ConfigError(
          f"the config holds more than {MAX_NODES:,} values. Fix: name the "
          "config file (a config of 1,000 tables has about 10,000), not a "
          "data file.")
    if depth > MAX_DEPTH:
      raise errors.ConfigError(
          f"the config nests more than {MAX_DEPTH} levels. Fix: flatten it (a "
          "config nests a few levels).")
    if isinstance(node, dict):
      stack.extend((v, depth + 1) for v in node.values())
    elif isinstance(node, list):
      stack.extend((v, depth + 1) for v in node)


def _check_expansion(root) -> None:
  """ConfigError if the document, aliases expanded, exceeds MAX_NODES nodes
  or MAX_DEPTH levels, or an alias refers to itself. Each node is sized once
  (memoized), so this is linear in the composed graph."""
  import yaml  # pylint: disable=g-import-not-at-top
  sizes = {}
  active = set()
  # Iterative post-order walk: deep documents cannot exhaust Python's stack.
  stack = [(root, 0, False)]
  while stack:
    node, depth, done = stack.pop()
    key = id(node)
    if done:
      active.discard(key)
      children = _children(node, yaml)
      total = 1 + sum(sizes[id(c)] for c in children)
      if total > MAX_NODES:
        line = node.start_mark.line + 1
        raise errors.ConfigError(
            f"the YAML expands to more than {MAX_NODES:,} values once its "
            f"aliases (*name) are expanded (the node at line {line}). Fix: "
            "use aliases for repeated settings only, not nested in each other.")
      sizes[key] = total
      continue
    if key in sizes:
      continue
    if key in active:
      raise errors.ConfigError(
          f"the YAML alias at line {node.start_mark.line + 1} refers to itself "
          "(a recursive structure). Fix: remove the self-reference.")
    if depth > MAX_DEPTH:
      raise errors.ConfigError(
          f"the YAML nests more than {MAX_DEPTH} levels (line "
          f"{node.start_mark.line + 1}). Fix: flatten it (a config nests a few "
          "levels).")
    active.add(key)
    stack.append((node, depth, True))
    for child in _children(node, yaml):
      if id(child) in active:
        raise errors.ConfigError(
            f"the YAML alias at line {child.start_mark.line + 1} refers to a "
            "node that contains it (a recursive structure). Fix: remove the "
            "self-reference.")
      if id(child) not in sizes:
        stack.append((child, depth + 1, False))


def _children(node, yaml):
  if isinstance(node, yaml.MappingNode):
    return [n for pair in node.value for n in pair]
  if isinstance(node, yaml.SequenceNode):
    return list(node.value)
  return []


def _unique_json_keys(pairs):
  out = {}
  for key, value in pairs:
    if key in out:
      raise errors.ConfigError(f'duplicate key "{key}". Fix: keep one.', path=key)
    out[key] = value
  return out


def _load_yaml(text: str):
  import yaml

  class UniqueKeyLoader(yaml.SafeLoader):
    pass

  # YAML 1.2 (core schema) numbers: PyYAML resolves YAML 1.1, where a float
  # needs a dot, so `learning_rate: 1e-3` would be the string "1e-3".
  UniqueKeyLoader.add_implicit_resolver(
      "tag:yaml.org,2002:float",
      re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)$"),
      list("-+.0123456789"))

  def construct_mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
      if key_node.tag == "tag:yaml.org,2002:merge":
        continue  # `<<: *base`: merged keys may be overridden, not duplicates.
      key = loader.construct_object(key_node, deep=deep)
      if key in seen:
        raise errors.ConfigError(
            f'duplicate key "{key}" at line {key_node.start_mark.line + 1}. '
            "Fix: keep one (YAML would silently use the last).", path=str(key))
      seen.add(key)
    return loader.construct_mapping(node, deep)

  UniqueKeyLoader.add_constructor(
      yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
  loader = UniqueKeyLoader(text)
  try:
    node = loader.get_single_node()
    if node is None:
      return None
    _check_expansion(node)
    return loader.construct_document(node)
  except RecursionError:
    raise errors.ConfigError(
        "the YAML is nested deeper than Python can read. Fix: flatten it "
        "(a config nests a few levels).") from None
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    raise errors.ConfigError(
        f"invalid YAML{where}: {getattr(e, 'problem', e)}. Fix: check the "
        "indentation and quoting there.") from None
  finally:
    loader.dispose()
