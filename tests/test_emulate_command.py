"""``python -m tpu_embed_ext emulate``: a command as dependable as ``python``.

The exit loses nothing ``python SCRIPT`` keeps (files left open, the
script's excepthook, the status); ``-m MODULE`` runs as ``python -m``; a bad
command line is one line and status 2.
"""

import json
import os
import signal
import subprocess
import sys
import zipfile
import zlib

import h5py
import numpy as np
import pytest

from tpu_embed_ext.emulated_tpu import runner

PROGRAMS = os.path.join(os.path.dirname(__file__), "tpu_programs")
LIMIT = 300  # seconds per process; they take seconds.


def _leave_files(tmp_path, how):
  out = tmp_path / how
  out.mkdir()
  script = os.path.join(PROGRAMS, "leaves_files_open.py")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  if how == "python":
    command = [sys.executable, script, str(out)]
  else:
    env["ON_EMULATED_TPU"] = "1"
    command = [sys.executable, "-m", "tpu_embed_ext", "emulate", "--replicas",
               "8", script, str(out)]
  done = subprocess.run(command, capture_output=True, text=True, env=env,
                        timeout=LIMIT, check=False, cwd=str(tmp_path))
  return out, done


def _outcome(out, done) -> dict:
  """What a run left: each file as a reader finds it."""
  found = {"status": done.returncode,
           "traceback printed": "Traceback" in done.stderr,
           "files": sorted(os.listdir(out)),
           "excepthook": (out / "excepthook.txt").read_text()}
  for name in ("text.gz", "binary.gz"):
    reader = zlib.decompressobj(16 + zlib.MAX_WBITS)
    data = reader.decompress((out / name).read_bytes())
    found[name] = (data, reader.eof)  # eof: the trailer was written.
  try:
    with zipfile.ZipFile(out / "data.zip") as archive:
      found["data.zip"] = {n: archive.read(n) for n in archive.namelist()}
  except zipfile.BadZipFile as e:
    found["data.zip"] = f"BadZipFile: {e}"
  try:
    with h5py.File(out / "data.h5", "r") as h5:
      found["data.h5"] = h5["table"][...].tolist()
  except OSError as e:
    found["data.h5"] = f"OSError: {type(e).__name__}"
  return found


def test_files_left_open_end_as_under_python(tmp_path):
  """gzip, zip and HDF5 files left open, a NamedTemporaryFile, an excepthook,
  the status: under emulate --replicas 8, each as python SCRIPT leaves it."""
  python = _outcome(*_leave_files(tmp_path, "python"))
  emulate = _outcome(*_leave_files(tmp_path, "emulate"))
  for key in python:
    assert emulate[key] == python[key], key
  # What Python's exit does for these, which the runner must not lose:
  assert python["status"] == 1 and not python["traceback printed"]
  assert python["excepthook"] == (
      "RuntimeError: the end, 16 examples in the first batch\n")
  assert not [f for f in python["files"] if f.startswith("temporary-")]
  assert python["data.h5"] == np.arange(12.0).reshape(3, 4).tolist()
  # The script's reference cycles, in the run and at exit (the runner freezes
  # only the objects alive before the script starts: start_up_objects.py).
  assert {"cycle-collected-during-the-run.txt", "cycle-freed-by-gc.collect.txt",
          "cycle-finalized-at-exit.txt"} <= set(python["files"])


# --- -m MODULE, in this process -------------------------------------------------

_MODULE = """
import sys
from tpu_embed_ext import emulated_tpu
print("name", __name__)
print("argv", sys.argv)
print("path0", sys.path[0])
print("replicas", emulated_tpu.current().replicas)
"""


def test_dash_m_runs_a_module_as_python_m(tmp_path, monkeypatch, capsys):
  package = tmp_path / "trainers"
  package.mkdir()
  (package / "__init__.py").write_text("")
  (package / "ranking.py").write_text(_MODULE)
  monkeypatch.chdir(tmp_path)
  argv, path0 = list(sys.argv), sys.path[0]
  assert runner.main(["--replicas", "2", "-m", "trainers.ranking", "--steps",
                      "3"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out == ["name __main__",
                 f"argv ['{package / 'ranking.py'}', '--steps', '3']",
                 f"path0 {tmp_path}", "replicas 2"]
  assert (sys.argv, sys.path[0]) == (argv, path0)


def test_the_scripts_excepthook_reports_its_exception(tmp_path, capsys):
  script = tmp_path / "hooked.py"
  script.write_text("import sys\n"
                    "sys.excepthook = lambda t, v, tb: print('hook', t.__name__, v,"
                    " tb.tb_frame.f_code.co_filename == __file__)\n"
                    "raise ValueError('mine')\n")
  hook = sys.excepthook
  try:
    assert runner.main(["--replicas", "1", str(script)]) == 1
  finally:
    sys.excepthook = hook
  captured = capsys.readouterr()
  assert captured.out == "hook ValueError mine True\n"
  assert captured.err == ""


# --- usage errors: one line, status 2 (pinned messages) -------------------------

_USAGE = (" Usage: python -m tpu_embed_ext emulate [--replicas N] [--hosts H] [--sparsecore] "
          "[--topology T] [--no-xla] (SCRIPT | -m MODULE) [ARGS...]\n")


@pytest.mark.parametrize("argv, message", [
    ([], "give the program to run: SCRIPT or -m MODULE."),
    (["--replica", "2", "prog.py"],
     "unknown option '--replica'. Did you mean \"--replicas\"? Options come "
     "before SCRIPT; the script's own go after it."),
    (["--replicas"], "--replicas needs a value (N)."),
    (["--replicas", "eight", "prog.py"],
     "--replicas takes a whole number of TPU cores, got 'eight'. Fix: e.g. "
     "--replicas 8."),
    (["--sparsecore=yes", "prog.py"], "--sparsecore takes no value, got "
     "'--sparsecore=yes'."),
    (["-m"], "-m needs a MODULE, as python -m does."),
    (["-m", "no_such_module_here"], "no module named 'no_such_module_here' "
     "(looked in the current directory and sys.path, as python -m does)."),
    (["missing.py"], "no script 'missing.py'."),
    (["--replicas", "3", "--topology", "v5p:3", "prog.py"],
     "--topology: topology 'v5p:3' is not a v5p slice: v5p slices have a "
     "multiple of 4 chips (2x2x1 = 4, 2x2x2 = 8, ...). Fix: e.g. v5p:4, or "
     "3x4 for 3 chips of 4 SparseCores."),
    (["--replicas", "3", "--topology", "v6e:3", "prog.py"],
     "--topology: topology 'v6e:3' is not a v6e slice: v6e slices have 1, 4, "
     "8, 16, 32, 64, 128 or 256 chips. Fix: e.g. v6e:4, or 3x2 for 3 chips of "
     "2 SparseCores."),
    (["--hosts", "two", "prog.py"],
     "--hosts takes a whole number of hosts (TPU VMs), got 'two'. Fix: e.g. "
     "--hosts 2."),
    (["--hosts", "0", "prog.py"],
     "--hosts takes a positive number of hosts (TPU VMs), got 0. Fix: e.g. "
     "--hosts 2, or leave it out for one host."),
    (["--replicas", "8", "--hosts", "3", "prog.py"],
     "--hosts 3: 8 replicas (--replicas counts every host's cores) do not split "
     "over 3 hosts, each feeding as many. Fix: --replicas a multiple of 3, e.g. "
     "--replicas 6 --hosts 3."),
    (["--topology", "v5p:8", "--hosts", "1", "prog.py"],
     "--hosts 1 with --topology v5p:8: that slice has 2 hosts (4 replicas each, as "
     "Cloud TPU's VMs hold them). Fix: leave --hosts out (the topology implies 2), "
     "or give --replicas 8 --hosts 1 --sparsecore without --topology."),
], ids=["no_program", "unknown_option", "option_without_value",
        "replicas_not_a_number", "switch_with_value", "dash_m_without_module",
        "no_such_module", "no_such_script", "v5p_slice_of_3_chips",
        "v6e_slice_of_3_chips", "hosts_not_a_number", "no_hosts",
        "hosts_not_dividing_the_replicas", "hosts_other_than_the_topologys"])
def test_bad_command_lines_are_one_line_and_status_2(argv, message, tmp_path,
                                                      monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "prog.py").write_text("raise SystemExit(7)\n")
  assert runner.main(argv) == 2
  err = capsys.readouterr().err
  assert err == f"error: emulate: {message}{_USAGE}"


def test_topology_implies_sparsecore():
  command = runner.parse(["--replicas", "4", "--topology", "v5p:4", "prog.py",
                          "--topology", "x"])
  assert runner._shape(command)[:2] == (4, True)  # pylint: disable=protected-access
  assert (command.script, command.args) == ("prog.py", ["--topology", "x"])


def test_help_lists_every_option(capsys):
  assert runner.main(["--help"]) == 0
  out = capsys.readouterr().out
  assert all(name in out for name in runner.OPTIONS)
  assert "-m MODULE" in out


def test_stderr_is_the_scripts_and_tensorflows_start_up_lines_go_to_the_log(tmp_path):
  """TensorFlow's start-up lines (oneDNN, CPU features: written to fd 2 as it
  loads, whatever TF_CPP_MIN_LOG_LEVEL says) go to the library log, as in
  the other commands; what the script writes to stderr reaches the terminal."""
  script = tmp_path / "talks.py"
  script.write_text("import sys, tensorflow as tf\n"
                    "print('script stderr', file=sys.stderr)\n"
                    "print(int(tf.constant(2) * 3))\n")
  env = dict(os.environ)
  env.pop("TF_CPP_MIN_LOG_LEVEL", None)
  done = subprocess.run([sys.executable, "-m", "tpu_embed_ext", "emulate",
                         "--replicas", "2", str(script)], capture_output=True,
                        text=True, env=env, timeout=LIMIT, check=False)
  assert (done.returncode, done.stdout) == (0, "6\n"), done.stderr[-2000:]
  assert done.stderr == "script stderr\n"


# --- the XLA switch: --no-xla runs what a TPU could not compile -----------------

_NO_KERNEL_STEP = """
import tensorflow as tf
tf.config.set_soft_device_placement(False)  # A TPU then refuses ops with no XLA kernel.
resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="")
tf.tpu.experimental.initialize_tpu_system(resolver)
strategy = tf.distribute.TPUStrategy(resolver)

@tf.function
def step(x):
  def replica(v):
    return tf.py_function(lambda t: t * 2.0, [v], tf.float32)
  return strategy.run(replica, args=(x,))

print("result", strategy.experimental_local_results(step(tf.constant(1.5)))[0].numpy())
"""


@pytest.mark.parametrize("flags, status", [([], 1), (["--no-xla"], 0)],
                         ids=["xla_check_refuses", "no_xla_runs"])
def test_no_xla_switches_the_check_off(flags, status, tmp_path):
  script = tmp_path / "step.py"
  script.write_text(_NO_KERNEL_STEP)
  done = subprocess.run(
      [sys.executable, "-m", "tpu_embed_ext", "emulate", "--replicas", "2", *flags,
       str(script)], capture_output=True, text=True, timeout=LIMIT, check=False,
      cwd=str(tmp_path), env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  assert done.returncode == status, done.stdout + done.stderr
  if status:
    assert "NotCompilableError" in done.stderr and "EagerPyFunc" in done.stderr
  else:
    assert "result 3.0" in done.stdout


def test_no_xla_is_parsed_into_the_shape():
  assert runner._shape(runner.parse(["--no-xla", "s.py"]))[3] is False  # pylint: disable=protected-access
  assert runner._shape(runner.parse(["s.py"]))[3] is True  # pylint: disable=protected-access


# --- the script's world until the interpreter exits ---------------------------

_WORLD = '''
import atexit, importlib, json, os, pickle, signal, sys, threading, time

OUT = os.path.abspath(sys.argv[1])
HERE = __file__  # Absolute under python; deleted when the script's code ends.


class Finding:  # Defined in the script: pickled by reference to __main__.
  def __init__(self, where):
    self.where = where


def world(where):
  os.chdir(os.path.dirname(OUT))  # Away from the script's directory.
  found = {"pickled": pickle.loads(pickle.dumps(Finding(where))).where,
           "neighbour": importlib.import_module("neighbour_" + where).NAME,
           "__file__": HERE, "has __file__": "__file__" in globals(), "argv": sys.argv,
           "main": sys.modules["__main__"].__name__}
  if os.environ.get("ON_EMULATED_TPU"):
    import tensorflow as tf
    found["resolver"] = tf.distribute.cluster_resolver.TPUClusterResolver.__module__
  with open(os.path.join(OUT, where + ".json"), "w") as f:
    json.dump(found, f)


def late():
  time.sleep(1.0)  # Still running when the script's last line has run.
  world("thread")


atexit.register(world, "atexit")
threading.Thread(target=late).start()
how = sys.argv[2]
if how == "raise":
  raise ValueError("the end")
if how == "sigterm":
  signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
  os.kill(os.getpid(), signal.SIGTERM)
if how == "sigint":
  os.kill(os.getpid(), signal.SIGINT)
time.sleep(30 if how.startswith("sig") else 0)  # The signal interrupts it.
'''


def _sigint_default():
  signal.signal(signal.SIGINT, signal.SIG_DFL)


def _keeps_its_world(tmp_path, how, runner_words):
  run = tmp_path / ("emulate" if runner_words else "python")
  (run / "project").mkdir(parents=True)
  (run / "out").mkdir()
  (run / "project" / "keeps_its_world.py").write_text(_WORLD)
  for where in ("thread", "atexit"):
    (run / "project" / f"neighbour_{where}.py").write_text(f"NAME = 'next to {where}'\n")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  if runner_words:
    env["ON_EMULATED_TPU"] = "1"
  done = subprocess.run(
      [sys.executable, *runner_words, os.path.join("project", "keeps_its_world.py"),
       "out", how], capture_output=True, text=True, env=env, timeout=LIMIT,
      check=False, cwd=str(run),  # run() kills the process on a timeout.
      # Ctrl-C's default, as from a terminal: a shell without job control
      # starts background jobs with SIGINT ignored, and python then keeps
      # ignoring it (and so does the script).
      preexec_fn=_sigint_default)
  found = {}
  for name in sorted(os.listdir(run / "out")):
    found[name] = json.loads((run / "out" / name).read_text())
    assert os.path.isabs(found[name]["__file__"]), found[name]
    found[name]["__file__"] = os.path.relpath(found[name]["__file__"], run)
  return done, found


@pytest.mark.parametrize("how", ["return", "raise", "sigterm", "sigint"])
def test_atexit_and_threads_keep_the_scripts_world_as_under_python(how, tmp_path):
  """An atexit handler and a non-daemon thread pickle a class of the script
  and import a module next to it after an os.chdir; the status, the
  traceback and the signals' ends are python's (issue 42)."""
  python, python_found = _keeps_its_world(tmp_path, how, [])
  emulate, emulate_found = _keeps_its_world(
      tmp_path, how, ["-m", "tpu_embed_ext", "emulate", "--replicas", "2"])
  resolvers = {emulate_found[name].pop("resolver", None) for name in emulate_found}
  assert emulate_found == python_found, emulate.stderr[-3000:]
  assert sorted(python_found) == ["atexit.json", "thread.json"], python.stderr
  assert python_found["atexit.json"] == {
      "pickled": "atexit", "neighbour": "next to atexit", "main": "__main__",
      "__file__": os.path.join("project", "keeps_its_world.py"),  # Absolute.
      # python deletes it once the script's code ends, unless by sys.exit.
      "has __file__": how == "sigterm",
      "argv": [os.path.join("project", "keeps_its_world.py"), "out", how]}
  # The emulation is still active: TPUClusterResolver is the emulated one.
  assert resolvers == {"tpu_embed_ext.emulated_tpu.strategy"}, resolvers
  assert emulate.returncode == python.returncode == {
      "return": 0, "raise": 1, "sigterm": 143, "sigint": -signal.SIGINT}[how]
  assert emulate.stdout == python.stdout
  if how in ("raise", "sigint"):  # The traceback from the script's frame on.
    assert emulate.stderr == python.stderr.replace(
        str(tmp_path / "python"), str(tmp_path / "emulate"))
  else:
    assert emulate.stderr == python.stderr == ""


# --- a program's own emulation and devices, pytest under emulate ---------------

_OWN_EMULATION = """
import tensorflow as tf
import tpu_embed_ext as tee
with tee.emulate_tpu(replicas=2, xla=False) as emulation:
  print(emulation.replicas, emulation.xla,
        tf.distribute.TPUStrategy().num_replicas_in_sync)
print("after", tee.emulated_tpu.current().replicas, tee.emulated_tpu.current().xla)
"""


def test_a_programs_own_emulate_tpu_joins_the_runners(tmp_path, capsys):
  script = tmp_path / "own.py"
  script.write_text(_OWN_EMULATION)
  assert runner.main(["--replicas", "2", str(script)]) == 0
  assert capsys.readouterr().out == "2 False 2\nafter 2 True\n"


def test_a_programs_own_emulate_tpu_of_another_shape_names_the_command(tmp_path, capsys):
  script = tmp_path / "own.py"
  script.write_text(_OWN_EMULATION)
  assert runner.main(["--replicas", "1", str(script)]) == 1
  assert capsys.readouterr().err.splitlines()[-1] == (
      "tpu_embed_ext.emulated_tpu.errors.EmulationError: emulate_tpu(replicas=2) "
      "entered inside `python -m tpu_embed_ext emulate --replicas 1`, whose emulated "
      "TPU has 1 replicas: one emulation per process, and the program's own "
      "emulate_tpu joins it only with the same shape. Fix: run the program with "
      "`python -m tpu_embed_ext emulate --replicas 2 ...` (its emulate_tpu then "
      "joins the runner's), or with plain `python`, where its emulate_tpu makes "
      "its own.")


def test_a_programs_own_logical_devices_get_the_runners_fix(tmp_path, capsys):
  script = tmp_path / "devices.py"
  script.write_text(
      "import tensorflow as tf\n"
      "cpu = tf.config.list_physical_devices('CPU')[0]\n"
      "tf.config.set_logical_device_configuration(\n"
      "    cpu, [tf.config.LogicalDeviceConfiguration()] * 3)\n")
  assert runner.main(["--replicas", "2", str(script)]) == 1
  assert capsys.readouterr().err.splitlines()[-2:] == [
      "RuntimeError: Virtual devices cannot be modified after being initialized",
      "emulate: the emulated TPU made 2 logical CPU devices (one per replica) before "
      "the program ran, and TensorFlow fixes them then. Fix: give emulate --replicas "
      "the number of CPU devices the program sets (TensorFlow accepts the same "
      "configuration again), or skip its device set-up when "
      "tpu_embed_ext.emulated_tpu.is_active()."]


_OWN_POD = """
import tensorflow as tf
import tpu_embed_ext as tee
print("hosts", tf.distribute.TPUStrategy().extended.num_hosts)
for hosts in (None, 2, 1):
  try:
    with tee.emulate_tpu(replicas=4, hosts=hosts) as emulation:
      print("joined", hosts, emulation.hosts)
  except tee.emulated_tpu.EmulationError as e:
    print("refused", hosts, e)
"""


def test_hosts_reach_the_program_and_its_own_emulate_tpu(tmp_path, capsys):
  """--hosts H: TPUStrategy has H hosts; the program's own emulate_tpu joins
  with the same hosts or none named, and another's fix names --hosts."""
  script = tmp_path / "pod.py"
  script.write_text(_OWN_POD)
  assert runner.main(["--replicas", "4", "--hosts", "2", str(script)]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[:3] == ["hosts 2", "joined None 2", "joined 2 2"]
  assert out[3].startswith(
      "refused 1 emulate_tpu(replicas=4) entered inside `python -m tpu_embed_ext "
      "emulate --replicas 4 --hosts 2`, whose emulated TPU has 4 replicas on 2 "
      "hosts: ")
  assert runner.main(["--replicas", "4", str(script)]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[2].endswith(
      "Fix: run the program with `python -m tpu_embed_ext emulate --replicas 4 "
      "--hosts 2 ...` (its emulate_tpu then joins the runner's), or with plain "
      "`python`, where its emulate_tpu makes its own."), out


_TESTS_UNDER_EMULATE = """
import pytest

@pytest.mark.emulate_tpu(replicas=2)
def test_same_shape(emulated_tpu):
  assert (emulated_tpu.replicas, emulated_tpu.xla) == (2, True)

@pytest.mark.emulate_tpu(replicas=2, xla=False)
def test_xla_off(emulated_tpu):
  assert emulated_tpu.xla is False

@pytest.mark.emulate_tpu(replicas=4)
def test_other_shape(emulated_tpu):
  pass

@pytest.mark.emulate_tpu(replicas=2, hosts=2)
def test_other_hosts(emulated_tpu):
  pass
"""


def test_emulate_m_pytest_gives_emulated_tpu_tests_the_runners_emulation(tmp_path):
  (tmp_path / "test_under_emulate.py").write_text(_TESTS_UNDER_EMULATE)
  done = subprocess.run(
      [sys.executable, "-m", "tpu_embed_ext", "emulate", "--replicas", "2", "-m",
       "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-W", "ignore",
       "test_under_emulate.py"], capture_output=True, text=True, timeout=LIMIT,
      check=False, cwd=str(tmp_path), env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert "2 passed, 2 skipped" in done.stdout
  assert ("needs emulate_tpu(replicas=4, sparsecore=False); the session runs on "
          "`python -m tpu_embed_ext emulate --replicas 2`") in done.stdout
  assert ("needs emulate_tpu(hosts=2); the session runs on `python -m "
          "tpu_embed_ext emulate --replicas 2` (1 host)") in done.stdout
