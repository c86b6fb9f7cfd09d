"""How long freeing a distributed dataset iterator blocks (docs/guides/cpu-testing.md).

TensorFlow's own ``tf.data`` iterator destructor, measured without this
package: a MirroredStrategy over N logical CPUs, a small ragged pipeline,
two batches taken, then ``del`` of the iterator; three times per variant.

  .venv/bin/python -m benchmarks.iterator_teardown --devices 8

Each variant runs in its own process (logical devices are fixed at start).
"""

import argparse
import gc
import subprocess
import sys
import time

VARIANTS = ("experimental_distribute_dataset", "distribute_datasets_from_function")


def _measure(devices: int, variant: str, repeats: int) -> list:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * devices)
  strategy = tf.distribute.MirroredStrategy(
      [f"/cpu:{i}" for i in range(devices)],
      cross_device_ops=tf.distribute.ReductionToOneDevice())

  def pipeline(batch):
    return tf.data.Dataset.range(10**6).map(
        lambda x: {"ids": tf.range(x % 5 + 1)}).ragged_batch(
            batch, drop_remainder=True)

  seconds = []
  for _ in range(repeats):
    if variant == VARIANTS[0]:
      dist = strategy.experimental_distribute_dataset(pipeline(8 * devices))
    else:
      dist = strategy.distribute_datasets_from_function(lambda ctx: pipeline(8))
    it = iter(dist)
    next(it)
    next(it)
    start = time.perf_counter()
    del it
    gc.collect()
    seconds.append(time.perf_counter() - start)
  return seconds


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, nargs="+", default=[2, 8])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--variant", choices=VARIANTS)
  args = parser.parse_args()
  if args.variant:  # one measurement, in this process
    print(" ".join(f"{s:.2f}" for s in _measure(args.devices[0], args.variant,
                                                args.repeats)))
    return
  for devices in args.devices:
    for variant in VARIANTS:
      out = subprocess.run(
          [sys.executable, "-m", "benchmarks.iterator_teardown", "--devices",
           str(devices), "--variant", variant, "--repeats", str(args.repeats)],
          check=True, capture_output=True, text=True, timeout=900).stdout
      print(f"{devices} devices, {variant}: del iterator "
            f"{', '.join(s + ' s' for s in out.split())}", flush=True)


if __name__ == "__main__":
  main()
