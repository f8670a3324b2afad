"""Steady-state Keras step time with the stall watchdog on and off: the watchdog's cost.

    PYTHONPATH=. python benchmarks/watchdog_overhead.py [--rounds 9] [--steps 200] [--timeout 1]

One process, one model on ``make_mirrored_strategy(["/cpu:0", "/cpu:1"])``; the
watchdog is switched on and off between rounds (interleaved: on, off, on, ...),
each round times ``--steps`` single-step ``train_on_batch`` calls after a
warm-up, and the result is the median step time over the rounds of each kind,
reported as on/off. ``--timeout`` sets SAFESTRATEGY_STALL_TIMEOUT for the "on"
rounds; the default 1 s samples every 0.2 s, 25 times as often as the default
600 s (every 5 s), so the figure is an upper bound. A benchmark, not a test:
run it on a quiet machine.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="rounds of each kind (on, off)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per round")
    parser.add_argument("--timeout", type=float, default=1.0, help="stall timeout when on (s)")
    args = parser.parse_args()

    import numpy as np
    import tensorflow as tf

    import safestrategy
    from safestrategy import _env, _tf
    from safestrategy.training import watchdog

    _tf.configure_logical_cpus(tf, 2)
    strategy = safestrategy.make_mirrored_strategy(["/cpu:0", "/cpu:1"])
    report = safestrategy.last_report()
    with strategy.scope():
        model = tf.keras.Sequential(
            [tf.keras.Input((64,)), tf.keras.layers.Dense(256), tf.keras.layers.Dense(1)]
        )
        model.compile(optimizer="sgd", loss="mse")
    x = np.ones((64, 64), np.float32)
    y = np.ones((64, 1), np.float32)
    for _ in range(10):  # warm-up: tracing, compiling
        model.train_on_batch(x, y)

    times = {"on": [], "off": []}
    for _ in range(args.rounds):
        for kind in ("on", "off"):
            timeout = args.timeout if kind == "on" else None
            watchdog.watch(_env.StallSettings(timeout, "warn"), report)
            time.sleep(0.5)  # the watchdog thread starts (on) or ends (off)
            started = time.perf_counter()
            for _ in range(args.steps):
                model.train_on_batch(x, y)
            times[kind].append((time.perf_counter() - started) / args.steps)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(f"step time, watchdog on:  {on * 1e3:.3f} ms (median of {args.rounds} rounds)")
    print(f"step time, watchdog off: {off * 1e3:.3f} ms")
    print(f"ratio on/off: {on / off:.4f}")


if __name__ == "__main__":
    main()
