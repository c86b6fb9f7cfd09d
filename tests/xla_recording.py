"""What the XLA check compiles: each program built and each compile's result."""

from tpu_embed_ext.emulated_tpu import xla_check, xla_compile


def record(monkeypatch):
  """(built, results): per program (its ops, feeds, fetches, op types with
  those of the functions it calls), and what each compile returned (None:
  XLA took it). Clears the check's once-per-reason warnings."""
  built, results = [], []
  build, compile_ = xla_compile._program_graph_def, xla_compile.compile_replica_program  # pylint: disable=protected-access

  def recording_build(program_ops, graph, on_host=frozenset()):
    out = build(program_ops, graph, on_host)
    types = {op.type for op in program_ops} | {
        n.op for f in out[0].library.function for n in f.node_def}
    built.append((program_ops, out[1], out[2], types))
    return out

  def recording_compile(*args):
    results.append(compile_(*args))
    return results[-1]

  monkeypatch.setattr(xla_compile, "_program_graph_def", recording_build)
  monkeypatch.setattr(xla_compile, "compile_replica_program", recording_compile)
  xla_compile._logged.clear()  # pylint: disable=protected-access
  xla_check._warned.clear()  # pylint: disable=protected-access
  return built, results
