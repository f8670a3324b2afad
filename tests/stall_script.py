"""Trainings for the stall watchdog's tests, each run in its own process (tests/test_watchdog.py).

    python tests/stall_script.py SCENARIO

Every scenario trains a small Keras model with ``make_mirrored_strategy`` on two
logical CPUs; a layer calls ``tf.py_function`` that sleeps as the scenario says.
``SAFESTRATEGY_STALL_TIMEOUT`` (T below) comes from the environment.

- ``block``: the 5th step's all-reduce blocks for an hour (hung_allreduce: the
  canary through the same cross-device ops blocks too); a probe process is left open
  (the fake one) to show ``exit`` ends it too. The step is compiled before the
  watchdog is on, so only the 5th step can stall.
- ``pyfunc``: the 5th step blocks for an hour in the layer's ``py_function`` (the
  user's code: the all-reduce still answers). Compiled first, as ``block``.
- ``map``: ``fit`` on a ``tf.data`` pipeline whose ``map`` (a ``py_function``, like a
  read from a dead file system) blocks for an hour from the 3rd step on; a later step
  waits for it once the prefetched batches are used up.
- ``slow``: the 5th step takes 2 T, then training goes on.
- ``never``: a first step that compiles, fast steps, steps of 0.8 T, 3 T idle after ``fit``, then a
  notebook-like loop that pauses 1.5 T between cells: none of it is a stall.
- ``report``: build the strategy only and print its report as JSON.
- ``two``: two strategies of different backends (hierarchical_copy first, then
  reduce_to_cpu); Keras ``fit`` on the first blocks its 5th step's all-reduce.
- ``loop``: the same two strategies; a custom loop's traced ``tf.function`` step on
  the first blocks: no strategy shows on the stuck stack.
- ``input``: a custom loop whose input pipeline (a generator) blocks between steps:
  outside the all-reduce, so no backend is to blame.

Lines starting with ``MARK`` carry ``time.time()`` so the test can time the ERROR.

The one fake is tests/hung_allreduce.py: the all-reduce of ``hierarchical_copy`` and
``reduce_to_cpu``, hung once ``hang`` is set (``two``: the canary fails at once; its
subject is which strategy is blamed, not the canary's bound).
"""

import logging
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import tensorflow as tf

import safestrategy
from safestrategy import _tf, records
from safestrategy.checks import probe as _probe
from tests import hung_allreduce

SCENARIO = sys.argv[1]
T = float(os.environ.get("SAFESTRATEGY_STALL_TIMEOUT", "600"))
logging.basicConfig(
    stream=sys.stderr, level=logging.INFO, format="%(created)f %(levelname)s %(message)s"
)
_tf.configure_logical_cpus(tf, 2)
DEVICES = ["/cpu:0", "/cpu:1"]
sleep_for = {"seconds": 0.0}
lock = threading.Lock()


def mark(text):
    print(f"MARK {time.time():f} {text}", file=sys.stderr, flush=True)


def pause(x):
    with lock:  # one replica sleeps per step; the step waits for it
        seconds, sleep_for["seconds"] = sleep_for["seconds"], 0.0
    if seconds:
        time.sleep(seconds)  # the stuck line
    return x


hang = hung_allreduce.install(tf, canary_fails=SCENARIO == "two")  # hung once it is set


class Hang(tf.keras.callbacks.Callback):
    """Sets ``event`` (by default ``hang``: the all-reduce blocks) from step ``at`` on."""

    def __init__(self, at, event=hang):
        super().__init__()
        self.at, self.event = at, event

    def on_train_batch_begin(self, batch, logs=None):
        mark(f"step {batch + 1} starts")
        if batch == self.at:
            self.event.set()


class Sleepy(tf.keras.layers.Layer):
    def call(self, x):
        y = tf.py_function(pause, [x], tf.float32)
        y.set_shape(x.shape)
        return y


class Steps(tf.keras.callbacks.Callback):
    """Sets each step's sleep: ``plan[batch]`` seconds (default 0)."""

    def __init__(self, plan):
        super().__init__()
        self.plan = plan

    def on_train_batch_begin(self, batch, logs=None):
        sleep_for["seconds"] = self.plan.get(batch, 0.0)
        mark(f"step {batch + 1} starts")

    def on_train_batch_end(self, batch, logs=None):
        sleep_for["seconds"] = 0.0
        mark(f"step {batch + 1} ends")


if SCENARIO in ("block", "pyfunc", "two", "loop"):  # unwatched until compiled: a loaded machine may
    os.environ["SAFESTRATEGY_STALL_TIMEOUT"] = "off"  # compile for > T
if SCENARIO in ("two", "loop"):
    strategy = safestrategy.make_mirrored_strategy(
        DEVICES, backend="hierarchical_copy,reduce_to_cpu"
    )
    other = safestrategy.make_mirrored_strategy(DEVICES, backend="reduce_to_cpu,hierarchical_copy")
else:
    strategy = safestrategy.make_mirrored_strategy(DEVICES)
if SCENARIO == "report":
    print(safestrategy.last_report().to_json(indent=None), flush=True)
    sys.exit(0)
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.Input((4,)), Sleepy(), tf.keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
x = np.ones((64, 4), np.float32)
y = np.ones((64, 1), np.float32)

if SCENARIO == "block":
    _probe.CHILD_COMMAND = [
        sys.executable,
        os.path.join(os.path.dirname(__file__), "fake_worker.py"),
    ]
    os.environ["FAKE_WORKER"] = "hang"
    _probe.start({"job": "mirrored", "devices": DEVICES}, 60)  # left open on purpose
    model.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)  # compiles the step
    os.environ["SAFESTRATEGY_STALL_TIMEOUT"] = f"{T:g}"
    safestrategy.make_mirrored_strategy(DEVICES)  # the same decision; now watched
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[Hang(4)])
elif SCENARIO == "pyfunc":
    model.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)  # compiles the step
    os.environ["SAFESTRATEGY_STALL_TIMEOUT"] = f"{T:g}"
    safestrategy.make_mirrored_strategy(DEVICES)  # the same decision; now watched
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[Steps({4: 3600.0})])
elif SCENARIO == "map":
    dead = threading.Event()  # the file system dies once the 3rd step starts

    def read(i):
        if dead.is_set():  # a read that never returns
            mark("the map blocks")
            time.sleep(3600)
        return np.ones(4, np.float32)

    def element(i):
        features = tf.py_function(read, [i], tf.float32)
        features.set_shape((4,))
        return features, tf.ones((1,))

    # Enough batches that the prefetched ones run out: a later step waits for input.
    data = tf.data.Dataset.range(8 * 400).map(element).batch(8)
    model.fit(data, epochs=1, verbose=0, callbacks=[Hang(2, dead)])
elif SCENARIO == "two":
    model.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)  # compiles the step
    os.environ["SAFESTRATEGY_STALL_TIMEOUT"] = f"{T:g}"
    safestrategy.make_mirrored_strategy(DEVICES, backend="reduce_to_cpu,hierarchical_copy")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[Hang(4)])
elif SCENARIO == "loop":

    @tf.function
    def step():
        return strategy.run(lambda: Sleepy()(tf.ones((2, 4))))

    step()  # traced and compiled before the watchdog is on
    os.environ["SAFESTRATEGY_STALL_TIMEOUT"] = f"{T:g}"
    safestrategy.make_mirrored_strategy(DEVICES, backend="reduce_to_cpu,hierarchical_copy")
    sleep_for["seconds"] = 3600.0
    mark("step starts")
    step()
elif SCENARIO == "slow":
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[Steps({4: 2 * T})])
    time.sleep(T / 2)  # a sample or two after the step, for the INFO
    left = records.recorded(tf, safestrategy.last_report().devices)
    print(f"RECORDS {len(left)}", flush=True)
elif SCENARIO == "never":
    plan = {3: 0.8 * T, 4: 0.8 * T, 5: 0.8 * T}
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[Steps(plan)])
    mark("idle")
    time.sleep(3 * T)
    for _ in range(2):  # notebook cells, a pause between them
        model.train_on_batch(x[:8], y[:8])
        model.predict(x[:8], verbose=0)
        time.sleep(1.5 * T)
    print("DONE", flush=True)
elif SCENARIO == "input":  # the input pipeline blocks between steps: outside the all-reduce

    def batches():
        yield np.ones((8, 4), np.float32)
        mark("input blocks")
        time.sleep(3600)
        yield np.ones((8, 4), np.float32)

    spec = tf.TensorSpec((8, 4), tf.float32)
    for batch in tf.data.Dataset.from_generator(batches, output_signature=spec):
        strategy.run(model, (batch,))
else:
    raise SystemExit(f"unknown scenario {SCENARIO!r}")
