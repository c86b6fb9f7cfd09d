"""Two worker processes under MultiWorkerMirroredStrategy (a CPU pod dry run).

The test starts two workers on 127.0.0.1 ports with a TF_CONFIG each, waits a
bounded time, and stops them whatever happens. Both must end with the tables
of one process training on the global batches.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import tensorflow as tf

import tpu_embed_ext as tee
from tests import multiworker_data as data

TIMEOUT_S = 900
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_ports(n):
  sockets = [socket.socket() for _ in range(n)]
  for s in sockets:
    s.bind(("127.0.0.1", 0))
  ports = [s.getsockname()[1] for s in sockets]
  for s in sockets:
    s.close()
  return ports


def _single_process_tables():
  engine = tee.CPUEmbedding(data.feature_config(),
                            tf.tpu.experimental.embedding.Adagrad(0.1))
  for t in range(data.STEPS):
    engine.enqueue({"watched": tf.ragged.constant(data.batch(t), tf.int64)},
                   training=True)
    with tf.GradientTape() as tape:
      acts = engine.dequeue()
      tape.watch(acts)
      loss = data.loss(acts)
    engine.apply_gradients(tape.gradient(loss, acts))
  return engine


def test_two_workers_train_the_tables_of_one_process(tmp_path):
  workers = [f"127.0.0.1:{p}" for p in _free_ports(data.WORKERS)]
  processes = []
  env_base = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT,
                  CUDA_VISIBLE_DEVICES="")
  try:
    for i in range(data.WORKERS):
      env = dict(env_base, TF_CONFIG=json.dumps(
          {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}))
      processes.append(subprocess.Popen(
          [sys.executable, "-m", "tests.multiworker_worker",
           str(tmp_path / f"worker{i}.npz")], cwd=ROOT, env=env,
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = [p.communicate(timeout=TIMEOUT_S)[0].decode() for p in processes]
  finally:
    for p in processes:
      if p.poll() is None:
        p.kill()
        p.wait()
  for p, out in zip(processes, outputs):
    assert p.returncode == 0, out[-3000:]
  want = _single_process_tables()
  for i in range(data.WORKERS):
    got = np.load(tmp_path / f"worker{i}.npz")
    assert int(got["replicas"]) == data.WORKERS and int(got["task"]) == i
    assert int(got["step"]) == data.STEPS
    for name in ("parameters", "accumulators"):
      np.testing.assert_allclose(got[name], want.variables["video"][name].numpy(),
                                 rtol=1e-6, err_msg=f"worker {i} {name}")
