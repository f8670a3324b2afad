"""What safestrategy adds to start-up, measured side by side in one run.

    python benchmarks/startup_cost.py [N_DEVICES]

Times, on N logical CPU devices (default 2): plain
``tf.distribute.MirroredStrategy`` with ``ReductionToOneDevice``, the first
``make_mirrored_strategy()`` (probe process + smoke checks), and a second
call (cached decision). Prints seconds and the ratios to plain. Not a test.
"""

import sys
import time

import tensorflow as tf

import safestrategy


def seconds(function):
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def main(n):
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
    )
    devices = [f"/cpu:{i}" for i in range(n)]
    plain = seconds(
        lambda: tf.distribute.MirroredStrategy(
            devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
        )
    )
    cold = seconds(lambda: safestrategy.make_mirrored_strategy(devices))
    warm = seconds(lambda: safestrategy.make_mirrored_strategy(devices))
    backend = safestrategy.last_report().backend
    print(f"TF {tf.__version__}, {n} logical CPU devices, backend {backend}")
    print(f"plain MirroredStrategy        {plain:8.3f} s  1.0x")
    print(f"make_mirrored_strategy, cold  {cold:8.3f} s  {cold / plain:.1f}x")
    print(f"make_mirrored_strategy, warm  {warm:8.3f} s  {warm / plain:.1f}x")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
