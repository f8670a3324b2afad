"""One worker of the cluster-source tests: the cluster from a resolver or a Slurm step.

    python tests/cluster_worker.py simple|slurm|slurm-resolver|auto|tf_config|stock|fit

- ``simple``: ``cluster_resolver=`` a ``SimpleClusterResolver`` of ``CLUSTER`` (JSON list of
  "host:port") as task ``INDEX``; TF_CONFIG unset;
- ``slurm``: nothing given: the factory reads Slurm's step (under ``srun``);
- ``slurm-resolver``: TensorFlow's own ``SlurmClusterResolver`` (as on a CPU node it can
  be built: no ``nvidia-smi``, ``num_accelerators()`` none, ports from ``PORT``);
- ``auto``: ``safestrategy.auto_strategy()``, the cluster wherever it finds one;
- ``tf_config``: TF_CONFIG, as always; ``stock``: stock TensorFlow's strategy over
  TF_CONFIG, for the weights to compare with;
- ``fit``: TF_CONFIG, the regression trained by ``tf.keras``'s ``Model.fit`` (:func:`fit`).

Trains tests/mw_worker.py's regression (a custom loop, but for ``fit``) and prints
``RESULT {json}``: the weights, the report's cluster fields and its first lines; then
leaves with the others.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.mw_worker import GLOBAL_BATCH, LEARNING_RATE, STEPS, WAIT, batch, leave_together, train


def fit(tf, strategy, index, workers):
    """tests/mw_worker.py's regression by ``tf.keras``'s ``Model.fit``, as its users feed it:
    every worker the same dataset of global batches, which TensorFlow splits by replica
    and shards by worker (DATA), so each worker takes its slice of every global batch, and
    the loss is the mean over the global batch: the weights are :func:`train`'s in one
    process."""
    import numpy as np

    x = np.concatenate([batch(number)[0] for number in range(STEPS)])
    y = np.concatenate([batch(number)[1] for number in range(STEPS)])
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    options = tf.data.Options()  # the elements, not files: from_tensor_slices has none
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    with strategy.scope():
        model = tf.keras.Sequential(
            [tf.keras.layers.Dense(1, kernel_initializer="zeros", input_shape=(x.shape[1],))]
        )
        model.compile(optimizer=tf.keras.optimizers.SGD(LEARNING_RATE), loss="mse")
    model.fit(data.with_options(options), epochs=1, verbose=0)
    kernel, bias = model.layers[0].get_weights()
    return [float(v) for v in np.concatenate([kernel.ravel(), bias.ravel()])]


def resolver(tf, how):
    """The ClusterResolver ``how`` names, and this task's index and the worker count."""
    if how == "simple":
        addresses = json.loads(os.environ["CLUSTER"])
        spec = tf.train.ClusterSpec({"worker": addresses})
        index = int(os.environ["INDEX"])
        made = tf.distribute.cluster_resolver.SimpleClusterResolver(
            spec, task_type="worker", task_id=index
        )
        return made, index, len(addresses)

    class CpuSlurm(tf.distribute.cluster_resolver.SlurmClusterResolver):
        def num_accelerators(self, *args, **kwargs):  # nvidia-smi is not on a CPU node
            return {}

    tasks = int(os.environ["SLURM_STEP_NUM_TASKS"])
    made = CpuSlurm(
        port_base=int(os.environ["PORT"]),
        gpus_per_node=tasks,  # 0 divides by zero in TF's resolver
        gpus_per_task=1,
        auto_set_gpu=False,
    )
    made.cluster_spec()  # TF's resolver knows its task_id only once it resolved the cluster
    return made, made.task_id, tasks


def main(how):
    started = time.monotonic()
    import tensorflow as tf

    import safestrategy

    if how == "stock":
        config = json.loads(os.environ["TF_CONFIG"])
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        index, workers, report = config["task"]["index"], len(config["cluster"]["worker"]), None
    elif how in ("simple", "slurm-resolver"):
        given, index, workers = resolver(tf, how)
        strategy = safestrategy.make_multiworker_strategy(cluster_resolver=given)
        report = safestrategy.last_report()
    else:
        make = (
            safestrategy.auto_strategy if how == "auto" else safestrategy.make_multiworker_strategy
        )
        strategy = make()
        report = safestrategy.last_report()
        index, workers = int(report.task.split(":")[1]), report.workers
    built = time.monotonic() - started
    result = {
        "weights": (fit if how == "fit" else train)(tf, strategy, index, workers),
        "keras": tf.keras.layers.Dense.__module__.split(".")[0],
        "task": index,
        "startup": built,
        "strategy": type(strategy).__name__,
    }
    if report is not None:
        result.update(
            source=report.cluster_source,
            origin=report.cluster_origin,
            backend=report.backend,
            branch=report.branch,
            text=str(report).splitlines(),
        )
    print("RESULT " + json.dumps(result), flush=True)
    sys.stderr.flush()
    leave_together(index=index, workers=workers)
    os._exit(0)  # skip TensorFlow's slow gRPC teardown: the test only needs the line


if __name__ == "__main__":
    import faulthandler

    faulthandler.dump_traceback_later(WAIT - 30)
    main(sys.argv[1])
