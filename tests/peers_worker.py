"""One worker of the which-worker-holds-the-others-back tests (tests/test_peers.py).

    python tests/peers_worker.py SCENARIO CULPRIT

``make_multiworker_strategy()`` (RING on CPUs), one compiled step while the
watchdog is off, then ``SAFESTRATEGY_STALL_TIMEOUT`` (from ``PEERS_STALL_TIMEOUT``)
turns it on and the workers step until one of:

- ``sleep``: worker CULPRIT sleeps in its own Python between steps;
- ``input``: worker CULPRIT's input pipeline (a generator) blocks;
- ``stop``: nothing here: the test SIGSTOPs worker CULPRIT after ``READY``;
- ``all``: every worker's step blocks in a ``py_function`` (the same step).

Prints ``READY <pid>`` once stepping.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["SAFESTRATEGY_STALL_TIMEOUT"] = "off"  # the first step compiles unwatched

import tensorflow as tf

import safestrategy
from safestrategy import _env, _watchdog

SCENARIO, CULPRIT = sys.argv[1], int(sys.argv[2])
INDEX = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
armed = {"on": False}

strategy = safestrategy.make_multiworker_strategy()


def value(x):
    if armed["on"] and SCENARIO == "all":
        time.sleep(3600)
    return x


@tf.function
def step(x):
    def replica(x):
        x = tf.py_function(value, [x], tf.float32)
        return tf.distribute.get_replica_context().all_reduce("sum", x)

    return strategy.run(replica, (x,))


def batches():
    while True:
        if armed["on"] and SCENARIO == "input" and INDEX == CULPRIT:
            time.sleep(3600)
        yield 1.0


data = iter(tf.data.Dataset.from_generator(batches, output_signature=tf.TensorSpec((), tf.float32)))
step(next(data))  # traced and compiled
os.environ["SAFESTRATEGY_STALL_TIMEOUT"] = os.environ["PEERS_STALL_TIMEOUT"]
watched = _watchdog._watched[-1]
_watchdog.watch(_env.resolve_stall(), watched.report, strategy, watched.place, _watchdog._board)
armed["on"] = True
print("READY", os.getpid(), flush=True)
for number in range(100000):
    if SCENARIO == "sleep" and INDEX == CULPRIT and number == 3:
        time.sleep(3600)  # the user's own Python, between steps
    step(next(data))
