"""``--topology`` reads alike in every command, and convert-checkpoint's help
says what it does (issue 42).

GENERATION:CHIPS names a Cloud TPU slice: v5p and tpu7x slices are built
from 4-chip hosts (the smallest v5p topology is 2x2x1, 4 chips: Cloud TPU's
v5p page), so ``v5p:2`` is refused by ``emulate``, ``convert-checkpoint`` and
``plan`` with the same words, and ``2x4`` (2 chips of 4 SparseCores) is the
spelling for any chip count: TensorFlow's ``TPUEmbeddingV2`` lays tables out
by ``num_replicas_in_sync`` and the SparseCores per chip alone.
"""

import pytest

from tests import jobs
from tpu_embed_ext.emulated_tpu import runner

_V5P_2 = ("--topology: topology 'v5p:2' is not a v5p slice: v5p slices have a "
          "multiple of 4 chips (2x2x1 = 4, 2x2x2 = 8, ...). Fix: e.g. v5p:4, or "
          "2x4 for 2 chips of 4 SparseCores.")


@pytest.mark.parametrize("args", [
    ("convert-checkpoint", "--checkpoint", "ckpt", "--out", "out", "--topology", "v5p:2"),
    ("plan", "--config", "tiny", "--engine", "v2", "--topology", "v5p:2"),
], ids=["convert_checkpoint", "plan"])
def test_a_slice_no_tpu_has_is_refused_as_emulate_refuses_it(args, capsys, tmp_path,
                                                            monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "prog.py").write_text("raise SystemExit(7)\n")
  assert jobs.one_line_error(capsys, *args) == _V5P_2
  assert runner.main(["--topology", "v5p:2", "prog.py"]) == 2
  assert capsys.readouterr().err == f"error: emulate: {_V5P_2} Usage: {runner.USAGE}\n"


def test_chips_by_sparsecores_is_any_chip_count(capsys, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  status, out, err = jobs.run_cli(capsys, "plan", "--config", "tiny", "--engine", "v2",
                                  "--topology", "2x4")
  assert status == 0, err
  assert "2 chips x 4 SparseCores" in out


def test_convert_checkpoint_help_does_not_contradict_itself(capsys):
  status, out, _ = jobs.run_cli(capsys, "convert-checkpoint", "--help")
  flags = out[out.index("flags:"):out.index("examples:")]
  assert status == 0
  assert "Default:" not in flags  # --config is optional, --topology required.
  assert "export" not in flags
  assert ("Without it, the tables, slots and shapes are read from the "
          "checkpoint.") in " ".join(flags.split())
  assert "none for per-table keys (required)." in " ".join(flags.split())


def test_convert_checkpoint_without_a_topology_says_it_is_required(capsys):
  assert jobs.one_line_error(capsys, "convert-checkpoint", "--checkpoint", "c",
                             "--out", "o") == (
      "convert-checkpoint needs --checkpoint PREFIX|DIR --out PREFIX --topology T "
      "(a SparseCore topology, or none for per-table). Fix: pass all three.")


@pytest.mark.parametrize("argv, replicas", [
    (["--topology", "v5p:8", "s.py"], 8), (["--topology", "v6e:4", "s.py"], 4),
    (["--topology", "2x4", "s.py"], 2), (["--replicas", "4", "--topology", "v5p:4",
                                          "s.py"], 4),
    (["s.py"], 8)], ids=["v5p_8", "v6e_4", "2x4", "both_given", "neither"])
def test_emulate_takes_the_replicas_from_the_topology(argv, replicas):
  assert runner._shape(runner.parse(argv))[0] == replicas  # pylint: disable=protected-access


def test_replicas_other_than_the_topologys_chips_are_one_line(tmp_path, monkeypatch,
                                                               capsys):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "prog.py").write_text("raise SystemExit(7)\n")
  assert runner.main(["--replicas", "8", "--topology", "v5p:4", "prog.py"]) == 2
  assert capsys.readouterr().err == (
      "error: emulate: emulate_tpu topology 'v5p:4' has 4 chips but replicas=8: a "
      "TPU runs one replica per chip. Fix: replicas=4, or a topology of 8 chips.\n")


@pytest.mark.parametrize("argv, hosts", [
    (["--replicas", "8", "--hosts", "2", "s.py"], 2), (["--hosts=4", "s.py"], 4),
    (["--topology", "v5p:8", "s.py"], None), (["--topology", "v5p:8", "--hosts", "2",
                                               "s.py"], 2), (["s.py"], None)],
    ids=["both_given", "default_replicas", "the_topologys", "the_topologys_given",
         "neither"])
def test_emulate_takes_the_hosts(argv, hosts):
  """None: emulate_tpu's default (the topology's hosts, else 1)."""
  assert runner._shape(runner.parse(argv))[4] == hosts  # pylint: disable=protected-access


def test_help_says_replicas_count_every_hosts_cores(capsys):
  assert runner.main(["--help"]) == 0
  out = " ".join(capsys.readouterr().out.split())
  assert "--replicas N TPU cores (replicas) of the whole slice, every host's" in out
  assert "--hosts H Hosts (TPU VMs) of a pod slice" in out
