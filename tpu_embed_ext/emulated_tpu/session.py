"""The emulated TPU's session: ``emulate_tpu``, the one active ``Emulation``
and the checks of its shape (replicas, SparseCore, topology, XLA).

Patched TensorFlow names are process-wide, so one emulation at a time: entry
and exit hold ``_lock``, and ``current()`` is what the patched entry points
read. Importing this module loads no TensorFlow (``devices.py`` is imported
when an emulation is entered).

Replicas are logical CPU devices, which TensorFlow fixes when it first
initialises: enter ``emulate_tpu`` before any TensorFlow op, or use the runner
(``python -m tpu_embed_ext emulate SCRIPT``) or the pytest plugin
(``pytest --emulate-tpu=N``), which set them up first.

Not emulated (each raises ``NotEmulatedError`` naming it, or is listed here
as a difference):

* model parallelism: ``experimental_assign_to_logical_device``,
  ``experimental_split_to_logical_devices``,
  ``experimental_replicate_to_logical_devices``,
  ``extended.experimental_logical_device``, device assignments with several
  cores per replica, ``experimental_spmd_xla_partitioning``;
* TF1's ``tf.compat.v1.distribute.experimental.TPUStrategy``;
* ``TPUEmbedding(pipeline_execution_with_tensor_core=True)`` (a TPU then
  looks up in tables one step old; ``TPUEmbeddingV2``'s is emulated,
  ``pipelining.py``);
* ``TPUEmbeddingV2`` without ``sparsecore=True`` (as on a TPU without
  SparseCore);
* what a TPU refuses of ``TPUEmbedding`` is refused alike, with TensorFlow's
  exception class and its words first (``mid_level.py``, ``tpu_inputs.py``,
  ``embedding_memory.py``): a second ``TPUEmbedding`` built on one TPU (two
  ``EmbeddingLayer``s in one model), ``build()`` without fully defined
  shapes, inputs prefetched to the cores
  (``InputOptions(experimental_fetch_to_device=True)``), ids computed inside
  ``strategy.run``, ``enqueue`` in a nested ``tf.function`` or control flow
  inside ``strategy.run``, gradients other than float32;
* differences that raise nothing: a pod's hosts (``hosts``) are input
  workers in this one process, each host's CPU its first core's device
  (``Emulation.host_devices``; ``docs/guides/tpu-on-cpu.md``, "Pods");
  steps run as TensorFlow ops on CPU devices (with ``xla=True``, the
  default, each replica's program is checked when first traced against the
  rules XLA and the TPU apply, and replica 0's TensorCore program, without
  the engine's work and ``merge_call``'s cross-replica sums, is compiled
  with XLA on CPU but not run: ``xla_check.py``, ``xla_compile.py``; a
  ``jit_compile=True`` function around ``strategy.run`` runs as ops:
  ``outer_jit.py``); variables
  made under ``strategy.scope()`` are ``MirroredVariable``s and the strategy
  is also a ``MirroredStrategy``; core 0's device is also the host
  (``/device:CPU:0``), so inputs prefetched to core 0 (all of them with one
  replica) cannot be told from the host's, and, as in TensorFlow's own check,
  tensors of an iterator passed to a ``tf.function`` as an argument carry no
  device; distributed datasets feed the
  replicas from one host iterator, without tf.data autotuning
  (``device_datasets.py``: the same elements per replica as
  ``MirroredStrategy``'s per-replica iterators, whose threads hung their
  destructors at 8 replicas);
  the host's memory limits and speed are the CPU's (the TPU's HBM per
  device is the slice's: ``build()`` refuses tables that cannot fit it,
  ``hbm_check.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import threading
from typing import Optional

from tpu_embed_ext import errors
from tpu_embed_ext.emulated_tpu import patching
from tpu_embed_ext.emulated_tpu.errors import EmulationError

__all__ = ["emulate_tpu", "is_active", "current", "Emulation", "xla_switched",
           "hosted_by", "host", "no_sparsecore"]


@dataclasses.dataclass(frozen=True)
class Emulation:
  """The active emulated TPU.

  ``replicas`` TPU cores, one per logical CPU device in ``devices``, fed by
  ``hosts`` hosts of ``replicas_per_host`` cores each (a pod slice when
  more than one: ``host_devices``, ``host_of``). ``slice`` is the TPU slice
  (``sparsecore.chips.Slice``: generation, chips, HBM per device), always
  set by ``emulate_tpu``: the ``topology``
  given, else ``chips.default_slice`` (v4 without SparseCore, v5p with it,
  one chip per replica). ``topology`` is the SparseCore topology
  (``sparsecore.Topology``: ``replicas`` chips, SparseCores per chip) when
  ``sparsecore`` is on, else None. ``xla``: each replica's step is checked
  to compile with XLA, as a TPU's must (``xla_check.py``).
  """
  replicas: int
  sparsecore: bool
  topology: Optional[object]
  devices: tuple
  xla: bool = True
  slice: Optional[object] = None
  hosts: int = 1

  @property
  def replicas_per_host(self) -> int:
    """Cores (replicas) each host feeds: ``replicas / hosts``."""
    return self.replicas // self.hosts

  @functools.cached_property
  def _canonical(self) -> tuple:
    return tuple(_canonicalize(d) for d in self.devices)

  @property
  def host_devices(self) -> tuple:
    """Each host's CPU (canonical names), in host order: its first core's
    device (host k's cores are ``devices[k*R : (k+1)*R]``, host-major as
    TensorFlow orders a pod's cores)."""
    return self._canonical[::self.replicas_per_host]

  def host_of(self, device) -> Optional[str]:
    """The host device (canonical) of an emulated core or host ``device``,
    or None for any other device."""
    try:
      index = self._canonical.index(_canonicalize(device))
    except (ValueError, TypeError):
      return None
    return self.host_devices[index // self.replicas_per_host]


def _canonicalize(device) -> str:
  # Lazy: TensorFlow loads when an emulation is entered (module doc).
  from tensorflow.python.distribute import device_util  # pylint: disable=g-import-not-at-top
  return device_util.canonicalize(device)


_lock = threading.Lock()
_active: Optional[Emulation] = None


def is_active() -> bool:
  """Whether an ``emulate_tpu`` context is active (in any thread)."""
  return _active is not None


def current() -> Optional[Emulation]:
  """The active emulation, or None."""
  return _active


def _checked(replicas, sparsecore, topology, xla=True, hosts=None) -> tuple:
  """(replicas, sparsecore, SparseCore topology or None, slice, hosts), or
  ConfigError.

  ``replicas`` None: the topology's replicas, else 8. ``hosts`` None: the
  topology's hosts, else 1."""
  if replicas is None and topology is None:
    replicas = 8
  if replicas is not None and (isinstance(replicas, bool) or
                               not isinstance(replicas, int) or replicas < 1):
    raise errors.ConfigError(
        f"emulate_tpu needs a positive integer replicas, got replicas={replicas!r}. "
        "Fix: e.g. replicas=8 (one per TPU core).")
  if not isinstance(sparsecore, bool):
    raise errors.ConfigTypeError(
        f"emulate_tpu sparsecore must be True or False, got "
        f"sparsecore={sparsecore!r}.")
  if not isinstance(xla, bool):
    raise errors.ConfigTypeError(
        f"emulate_tpu xla must be True or False, got xla={xla!r}.")
  # Lazy: the tpu_embed_ext.sparsecore package imports TensorFlow (convert.py);
  # keeps it off `import tpu_embed_ext.emulated_tpu`.
  from tpu_embed_ext.sparsecore import chips as chips_lib, topology as topology_lib  # pylint: disable=g-import-not-at-top
  if topology is None:
    slice_ = chips_lib.default_slice(replicas, sparsecore)
  else:
    given = topology
    if isinstance(topology, topology_lib.Topology):  # A SparseCore topology object.
      given = (topology.name if re.fullmatch(r"[a-z0-9]+:\d+", topology.name)
               else f"{topology.chips}x{topology.sparsecores_per_chip}")
    slice_ = chips_lib.parse_slice(given, check=False)
    if sparsecore and not slice_.sparsecore:
      raise errors.ConfigError(no_sparsecore("emulate_tpu ", "sparsecore=True", slice_))
    sparsecore = slice_.sparsecore  # A SparseCore generation implies SparseCore.
    if replicas is None:
      replicas = slice_.replicas
    if slice_.replicas != replicas:
      raise errors.ConfigError(_other_replicas(str(topology), slice_, replicas))
  parsed = None
  if sparsecore and topology is None:  # TPUEmbeddingV2's default SparseCores per chip.
    parsed = topology_lib.Topology(replicas, 4, name=f"v5p:{replicas}")
  elif sparsecore:
    parsed = topology_lib.parse_topology(topology)
  return replicas, sparsecore, parsed, slice_, _checked_hosts(hosts, replicas,
                                                              topology, slice_)


def _checked_hosts(hosts, replicas: int, topology, slice_) -> int:
  """The hosts of the emulation (see ``_checked``), or ConfigError."""
  if hosts is not None and (isinstance(hosts, bool) or not isinstance(hosts, int)
                            or hosts < 1):
    raise errors.ConfigError(
        f"emulate_tpu needs a positive integer hosts, got hosts={hosts!r}. "
        "Fix: e.g. hosts=2 (a pod slice of two TPU VMs), or leave it out for one.")
  if topology is not None and slice_.hosts != (hosts or slice_.hosts):
    per_host = slice_.replicas // slice_.hosts
    raise errors.ConfigError(
        f"emulate_tpu topology {slice_.name!r} has {slice_.hosts} "
        f"host{'s' if slice_.hosts != 1 else ''} ({per_host} replicas each, as "
        f"Cloud TPU's VMs hold them) but hosts={hosts}. Fix: leave hosts out "
        f"(the topology implies {slice_.hosts}), or give replicas={replicas} "
        f"and hosts={hosts} without a topology.")
  hosts = hosts or (slice_.hosts if topology is not None else 1)
  if replicas % hosts:
    # TensorFlow's words (input_lib.DistributedDataset._make_rebatch_fn).
    raise errors.ConfigError(
        "tf.distribute expects every worker to have the same number of "
        f"replicas. However, encountered `num_replicas_in_sync` ({replicas}) "
        f"that cannot be divided by `num_workers` ({hosts}). (emulate_tpu("
        f"replicas={replicas}, hosts={hosts}): a pod's hosts feed as many "
        f"cores each.) Fix: replicas a multiple of hosts, e.g. replicas="
        f"{hosts * max(1, replicas // hosts)} with hosts={hosts}.")
  return hosts


def no_sparsecore(who: str, asked: str, slice_) -> str:
  """The refusal of SparseCore on a slice of a generation without it
  (``asked``: the field that asked for it, e.g. ``--sparsecore``)."""
  name = slice_.generation.name
  return (f"{who}{asked} with topology {slice_.name!r}: a TPU {name} has no "
          f"SparseCore for TPUEmbeddingV2 (its embedding engine is TPUEmbedding, "
          f"embedding_feature V1). Fix: drop {asked} to "
          f"emulate {slice_.name} with TPUEmbedding, or name a SparseCore slice "
          "(v5p:4, v6e:4, tpu7x:4 or CHIPSxSPARSECORES, e.g. 4x4).")


def _other_replicas(topology: str, slice_, replicas: int) -> str:
  per_chip = slice_.generation.replicas_per_chip
  if per_chip == 1:
    return (f"emulate_tpu topology {topology!r} has {slice_.chips} chips but "
            f"replicas={replicas}: a TPU runs one replica per chip. Fix: "
            f"replicas={slice_.chips}, or a topology of {replicas} chips.")
  chips = replicas // per_chip
  other = (f"a topology of {chips} chip{'s' if chips != 1 else ''}"
           if replicas % per_chip == 0 else f"a multiple of {per_chip} replicas")
  return (f"emulate_tpu topology {topology!r} has {slice_.chips} chips but "
          f"replicas={replicas}: a TPU {slice_.generation.name} runs {per_chip} "
          f"replicas per chip (one per TensorCore), {slice_.replicas} in all. "
          f"Fix: replicas={slice_.replicas}, or {other}.")


@contextlib.contextmanager
def emulate_tpu(replicas: Optional[int] = None, sparsecore: bool = False, topology=None,
                xla: bool = True, hosts: Optional[int] = None):
  """Runs TensorFlow's TPU entry points on an emulated TPU while active.

  Args:
    replicas: TPU cores (replicas in sync), one logical CPU device each
      (default: the ``topology``'s, else 8).
    sparsecore: the TPU has SparseCore (``embedding_feature`` V2):
      ``TPUEmbeddingV2`` is emulated, and ``create_embedding`` /
      ``EmbeddingLayer`` / keras-rs choose it. Refused with a ``topology``
      of a generation without SparseCore.
    topology: the TPU slice, ``GENERATION:CHIPS`` of any generation of
      ``sparsecore/chips.py`` (``"v5e:4"``, ``"v3:4"``: 8 replicas, two per
      chip; ``"v5p:8"``) or ``CHIPSxSPARSECORES`` (``"8x2"``), with
      ``replicas`` its replicas. Its generation decides the embedding engine
      (v2, v3, v4, v5e: ``TPUEmbedding``; v5p, v6e, tpu7x and ``CxS``:
      SparseCore, implying ``sparsecore``) and the HBM per device that
      ``build()`` checks the tables against. Default: ``chips.default_slice``
      (v4 without SparseCore, v5p with it, one chip per replica).
    xla: when a step is first traced, check that each replica's program
      (``strategy.run``'s function, without the embedding engine's work)
      compiles with XLA as a TPU's must: an op with no XLA kernel or a type a
      TPU does not have raises ``xla_check.NotCompilableError`` (a
      ``tf.errors.InvalidArgumentError``) with soft device placement off,
      and is run with a warning with it on (a TPU then runs it on its host).
      If every op passes, replica 0's program is compiled with XLA on CPU
      (not run); what XLA's compiler refuses (a compile-time constant
      computed from the data) raises ``NotCompilableError``. ``False``
      skips both.
    hosts: the TPU VMs of a pod slice, each feeding ``replicas / hosts``
      cores from its own input pipeline (default: the ``topology``'s, else
      1). ``TPUStrategy`` then reports them (``extended.num_hosts``, one
      input worker per host) and calls an input function once per host with
      its ``InputContext``, through TensorFlow's own ``input_lib``.
      ``replicas`` must be a multiple of it.

  Yields the ``Emulation``. Raises ``EmulationError`` if another emulation is
  active (patched names are process-wide) or TensorFlow already runs with
  fewer logical CPU devices than ``replicas``. Inside the runner's or the
  pytest session's emulation (``hosted_by``), one of the same replicas and
  SparseCore joins it (with this ``xla``) instead; another shape is refused
  with the command line that gives it.
  """
  global _active
  asked_hosts = hosts if topology is None else None  # A topology's are checked.
  replicas, sparsecore, parsed, slice_, hosts = _checked(replicas, sparsecore,
                                                        topology, xla, hosts)
  with _lock:
    outer = _active
    if outer is not None:
      _refuse_nested(outer, replicas, sparsecore, parsed,
                     slice_ if topology is not None else None, asked_hosts)
    else:
      # Lazy: TensorFlow loads when an emulation is entered, not at
      # `import tpu_embed_ext.emulated_tpu` (the runner sets devices up first).
      from tpu_embed_ext.emulated_tpu import devices  # pylint: disable=g-import-not-at-top
      emulation = Emulation(replicas, sparsecore, parsed,
                            devices.logical_devices(replicas), xla, slice_, hosts)
      patches = patching.apply(emulation)
      _active = emulation
  if outer is not None:  # Joins the runner's or the pytest session's.
    with (xla_switched(xla) if xla != outer.xla
          else contextlib.nullcontext(outer)) as joined:
      yield joined
    return
  try:
    yield emulation
  finally:
    with _lock:
      _active = None
      _host.clear()
      patching.restore(patches)


# Who entered the active emulation for the whole program (the runner, the
# pytest session), and the fix for a program asking another: see hosted_by.
_host: dict = {}


def hosted_by(description: str, fix: str) -> None:
  """Marks the active emulation as the program's, entered by ``description``
  (``python -m tpu_embed_ext emulate --replicas 8``): the program's own
  ``emulate_tpu`` of the same shape then joins it instead of being refused,
  and another shape is refused with ``fix`` (``{replicas}``, ``{flags}``:
  what the program asked for)."""
  _host.update(description=description, fix=fix)


def host() -> Optional[str]:
  """Who entered the active emulation for the whole program (``hosted_by``),
  or None."""
  return _host.get("description")


def _shape(replicas, sparsecore, parsed) -> tuple:
  return replicas, sparsecore, parsed and (parsed.chips, parsed.sparsecores_per_chip)


def _refuse_nested(outer: Emulation, replicas, sparsecore, parsed, slice_=None,
                   hosts: Optional[int] = None) -> None:
  """Returns if ``emulate_tpu(...)`` may join the program's ``outer``
  (``slice_``: the topology the program named, if it named one; ``hosts``:
  the hosts it named, None joining the outer's, as a program run with
  ``emulate --hosts H`` is meant to run on H hosts)."""
  if not _host:
    raise EmulationError(
        f"emulate_tpu(replicas={replicas}) entered while emulate_tpu("
        f"replicas={outer.replicas}) is active: nested or concurrent "
        "emulations are refused, as the patched TensorFlow names are shared "
        "by the whole process. Fix: leave the first emulate_tpu before "
        "entering another.")
  same_slice = slice_ is None or outer.slice is None or (
      (slice_.generation.name, slice_.chips)
      == (outer.slice.generation.name, outer.slice.chips))
  if slice_ is not None:
    hosts = slice_.hosts
  same_hosts = hosts in (None, outer.hosts)
  if same_slice and same_hosts and _shape(replicas, sparsecore, parsed) == _shape(
      outer.replicas, outer.sparsecore, outer.topology):
    return
  flags = (f" --topology {slice_.name}" if slice_ is not None
           else " --sparsecore" if sparsecore else "")
  if hosts not in (None, 1) and slice_ is None:
    flags += f" --hosts {hosts}"
  asked = f"replicas={replicas}" + (f", topology={slice_.name!r}" if slice_ is not None
                                    else ", sparsecore=True" if sparsecore else "")
  asked += f", hosts={hosts}" if hosts not in (None, 1) and slice_ is None else ""
  outer_slice = (f" on {outer.slice.name}" if slice_ is not None and outer.slice is not None
                 else "")
  raise EmulationError(
      f"emulate_tpu({asked}) entered inside {_host['description']}, whose "
      f"emulated TPU has {outer.replicas} replicas"
      + (f" and SparseCore ({outer.topology})" if outer.sparsecore else "")
      + (f" on {outer.hosts} hosts" if outer.hosts != 1 else "")
      + outer_slice + ": one emulation per process, and the program's own "
      "emulate_tpu joins it only with the same shape. Fix: "
      + _host["fix"].format(replicas=replicas, flags=flags))

@contextlib.contextmanager
def xla_switched(xla: bool):
  """The active emulation with its XLA check ``xla`` while this is active.

  The pytest plugin's way to honour a test's ``emulate_tpu(xla=...)`` marker
  in a session already under ``--emulate-tpu``. What the test creates
  (resolvers, strategies) reads the switched emulation; a strategy made
  before keeps its own. The embedding engine is cleared on entry and exit,
  as on a new emulation (``embedding_memory.py``). Yields the ``Emulation``.
  """
  global _active
  if not isinstance(xla, bool):
    raise errors.ConfigTypeError(
        f"emulate_tpu xla must be True or False, got xla={xla!r}.")
  with _lock:
    before = _active
    if before is None:
      raise EmulationError(
          "xla_switched needs an active emulate_tpu: it switches that "
          "emulation's XLA check. Fix: enter emulate_tpu first.")
    _active = dataclasses.replace(before, xla=xla)
    switched = _active
  try:
    yield switched
  finally:
    with _lock:
      _active = before
