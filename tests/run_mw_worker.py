"""One worker of the two-worker ``python -m safestrategy run`` test (tests/test_run.py).

    python tests/run_mw_worker.py DIES

A custom training loop on ``make_multiworker_strategy()`` (TF_CONFIG says which
worker this is, else Slurm's step: ``SLURM_PROCID``). The GPU-count seam is applied
here, in the child (a patch in the test process does not reach ``run``'s children):
each worker says it has one GPU and NCCL kernels, so NCCL is checked across the workers
for real, in real probe processes, and chosen (TensorFlow runs RING under it on CPUs,
so it sums right).

On the first launch (``SAFESTRATEGY_RESTART`` is 0) worker ``DIES`` aborts mid-step:
inside the step, once its heartbeat says a thread is inside a TF call, SIGABRT, as a
crashing NCCL does. Its peer is left waiting in the step's all-reduce. Every step
all-reduces a value read through ``tf.py_function`` and adds the sum to a variable.

Prints ``REPORT {json}`` (the decision) and ``TOTAL <value>`` at the end.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf

import safestrategy
from safestrategy import _rundir
from safestrategy.multiworker import factory as multiworker
from tests.mw_worker import leave_together

STEPS = 6
DIES = int(sys.argv[1])
if os.environ.get("TF_CONFIG"):
    INDEX = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
else:
    INDEX = int(os.environ["SLURM_PROCID"])
FIRST = os.environ.get("SAFESTRATEGY_RESTART") == "0"
_real_facts = multiworker.local_facts
multiworker.local_facts = lambda tf: {**_real_facts(tf), "gpus": 1, "nccl_kernels": 1}


def inside_a_call():
    """Whether this process's heartbeat says a thread is inside a TF call now (read as
    ``run`` reads it)."""
    beat = _rundir.heartbeats(os.environ["SAFESTRATEGY_RUN_DIR"]).get(os.getpid(), "")
    return _rundir.in_call(beat)


def value(step):
    if FIRST and INDEX == DIES and int(step) == 3:
        deadline = time.monotonic() + 60
        while not inside_a_call() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.abort()
    return tf.constant(float(INDEX + 1))


strategy = safestrategy.make_multiworker_strategy()
print("REPORT " + json.dumps(safestrategy.last_report().to_dict()), flush=True)
with strategy.scope():
    total = tf.Variable(0.0, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


@tf.function
def step(number):
    def replica():
        mine = tf.py_function(value, [number], tf.float32)
        summed = tf.distribute.get_replica_context().all_reduce("sum", mine)
        total.assign_add(summed)

    strategy.run(replica)


for number in range(STEPS):
    step(tf.constant(number))
print("TOTAL", float(total.numpy()), flush=True)
sys.stderr.flush()
leave_together(index=INDEX, workers=2)  # neither ends while the other may pull from it
os._exit(0)  # skip TensorFlow's slow gRPC teardown: the training is done
