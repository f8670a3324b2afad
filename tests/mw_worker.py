"""One worker of the two-worker tests (tests/test_multiworker.py); TF_CONFIG says which.

In order, as every worker must call the factory in the same order:

1. ``communication="nccl"`` on CPU workers: must raise NoWorkingBackendError.
2. With the GPU-count seam (``multiworker.local_facts``) saying one GPU and NCCL
   kernels: the real cross-worker check in real probe processes (TensorFlow runs
   RING under "NCCL" on CPUs, so it passes), which must leave no probe process.
3. ``make_multiworker_strategy()`` for real (auto: ring on CPUs), then a few
   training steps whose weights the test compares across workers and with
   :func:`train` in one process.

Prints one line, ``RESULT {json}``, and exits once every worker has printed its own
(:func:`leave_together`, which tests/run_mw_worker.py uses too). :func:`train` is
imported by the test too.
"""

import contextlib
import json
import os
import sys
import time

import numpy as np

GLOBAL_BATCH, STEPS, LEARNING_RATE, FEATURES = 12, 5, 0.1, 4  # 12: 2, 3 or 4 workers
#: Seconds the test waits for a worker.
WAIT = 300


def batch(step):
    """The global batch of ``step``: the same on every worker and in one process."""
    rng = np.random.RandomState(step)
    x = rng.randn(GLOBAL_BATCH, FEATURES).astype("float32")
    y = (x @ np.array([1.0, -2.0, 3.0, 0.5], "float32") + 0.25)[:, None].astype("float32")
    return x, y


def train(tf, strategy=None, index=0, workers=1):
    """Linear regression by SGD; each worker takes its slice of every global batch."""
    scope = strategy.scope() if strategy is not None else contextlib.ExitStack()
    with scope:
        total = tf.VariableAggregation.SUM  # the replicas' updates add up to the full batch's
        w = tf.Variable(tf.zeros([FEATURES, 1]), aggregation=total)
        b = tf.Variable(tf.zeros([1]), aggregation=total)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(tf.matmul(x, w) + b - y)) / GLOBAL_BATCH
        grad_w, grad_b = tape.gradient(loss, [w, b])
        w.assign_sub(LEARNING_RATE * grad_w)
        b.assign_sub(LEARNING_RATE * grad_b)

    if strategy is None:
        step = tf.function(replica_step)
    else:
        step = tf.function(lambda x, y: strategy.run(replica_step, args=(x, y)))
    share = GLOBAL_BATCH // workers
    for number in range(STEPS):
        x, y = batch(number)
        rows = slice(index * share, (index + 1) * share)
        step(tf.constant(x[rows]), tf.constant(y[rows]))
    return [float(v) for v in np.concatenate([w.numpy().ravel(), b.numpy().ravel()])]


def leave_together(within=60.0, index=None, workers=None):
    """Return once every worker has called this (or after ``within`` s). A worker done
    with its last all-reduce may still be serving its peer's (RING: a peer pulls its last
    buffer from it); exiting then fails the peer's last step with "Socket closed".
    ``WORKERS_DONE``: the directory conftest's ``workers_together`` gives the workers of
    one test. ``index`` of ``workers``: this worker's, where TF_CONFIG does not say."""
    done = os.environ["WORKERS_DONE"]
    if index is None:
        config = json.loads(os.environ["TF_CONFIG"])
        index, workers = config["task"]["index"], len(config["cluster"]["worker"])
    open(os.path.join(done, f"done-{index}"), "w").close()
    deadline = time.monotonic() + within
    while len(os.listdir(done)) < workers:
        if time.monotonic() > deadline:
            return
        time.sleep(0.1)


def main():
    import tensorflow as tf

    import safestrategy
    from safestrategy.multiworker import factory as multiworker

    result = {}
    try:
        safestrategy.make_multiworker_strategy(communication="nccl")
        result["forced_nccl"] = "no error"
    except safestrategy.NoWorkingBackendError as error:
        result["forced_nccl"] = str(error)

    real_facts = multiworker.local_facts
    multiworker.local_facts = lambda tf: {**real_facts(tf), "gpus": 1, "nccl_kernels": 1}
    report = multiworker.decide(multiworker.request())
    multiworker.local_facts = real_facts
    result["seamed"] = report.to_dict()
    if not hasattr(os, "WNOHANG"):  # Windows: no way to ask; the probe's own tests cover it
        return True
    try:
        os.waitpid(-1, os.WNOHANG)  # Linux (the legs): raises when no child process is left
        result["children_left"] = True
    except ChildProcessError:
        result["children_left"] = False

    strategy = safestrategy.make_multiworker_strategy()
    report = safestrategy.last_report()
    result["report"] = report.to_dict()
    result["strategy"] = type(strategy).__name__
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    result["weights"] = train(tf, strategy, task["index"], report.workers)
    print("RESULT " + json.dumps(result), flush=True)
    sys.stderr.flush()
    leave_together()
    os._exit(0)  # skip TensorFlow's slow gRPC teardown: the test only needs the line


if __name__ == "__main__":
    import faulthandler

    # A hang (once in a CI run on TF 2.10) leaves every thread's stack on stderr for the test.
    faulthandler.dump_traceback_later(WAIT - 30)
    main()
