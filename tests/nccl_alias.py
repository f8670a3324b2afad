"""safestrategy.nccl_ops aliased under TensorFlow's name, in a process of its own.

``python tests/nccl_alias.py before|after`` puts ours in ``sys.modules`` under
``tensorflow.python.ops.nccl_ops`` (and, once TensorFlow is imported, as the
package's attribute), before or after ``import tensorflow``, exactly as
docs/migrating.md says, then runs, through the alias, over 3 logical CPUs:

1. ``all_sum`` imported the way user code imports TensorFlow's (graph mode on
   TF1; eagerly and in ``tf.function`` on TF2);
2. TensorFlow's own ``all_reduce.build_nccl_all_reduce``, whose module imports
   ``nccl_ops`` (on TF 1.x it is imported with ``tensorflow``, so only the alias
   set before it reaches it);
3. the gradient of the aliased ``all_sum`` (TF's gradient registration ran once).

Prints one line, ``RESULT {json}``, for tests/test_nccl_ops.py.
"""

import json
import sys

ORDER = sys.argv[1]

import safestrategy.nccl_ops  # noqa: E402

if ORDER == "before":  # the docs' lines, before `import tensorflow`
    sys.modules["tensorflow.python.ops.nccl_ops"] = safestrategy.nccl_ops

import tensorflow as tf  # noqa: E402

if ORDER == "after":  # the docs' lines, TensorFlow already imported
    sys.modules["tensorflow.python.ops.nccl_ops"] = safestrategy.nccl_ops
    sys.modules["tensorflow.python.ops"].nccl_ops = safestrategy.nccl_ops

from safestrategy import _tf  # noqa: E402

TF2 = tf.__version__.startswith("2.")
N = 3


def all_reduce_module():
    """TensorFlow's all_reduce.py (moved to distribute/v1 in TF 2.x)."""
    try:
        from tensorflow.python.distribute.v1 import all_reduce
    except ImportError:
        from tensorflow.python.distribute import all_reduce
    return all_reduce


def placed():
    tensors = []
    for i in range(N):
        with tf.device(f"/cpu:{i}"):
            tensors.append(tf.constant([float(i + 1), 10.0 * (i + 1)]))
    return tensors


def numbers(values):
    return [[float(x) for x in value] for value in values]


def run(build):
    """``build()``'s tensors: eagerly and in tf.function on TF2; in a Session on TF1."""
    if TF2:
        return {"eager": numbers(build()), "function": numbers(tf.function(build)())}
    with tf.Graph().as_default():
        out = build()
        with tf.Session(config=tf.ConfigProto(device_count={"CPU": N})) as session:
            return {"graph": numbers(session.run(out))}


def gradient():
    """d(sum of every all_sum output)/d(input i): N for each input."""
    if TF2:
        inputs = placed()
        with tf.GradientTape() as tape:
            for tensor in inputs:
                tape.watch(tensor)
            total = tf.add_n([tf.reduce_sum(t) for t in nccl_ops.all_sum(inputs)])
        return {"eager": numbers(tape.gradient(total, inputs))}
    with tf.Graph().as_default():
        inputs = placed()
        total = tf.add_n([tf.reduce_sum(t) for t in nccl_ops.all_sum(inputs)])
        grads = tf.gradients(total, inputs)
        with tf.Session(config=tf.ConfigProto(device_count={"CPU": N})) as session:
            return {"graph": numbers(session.run(grads))}


if TF2:
    _tf.configure_logical_cpus(tf, N)

from tensorflow.python.ops import nccl_ops  # noqa: E402  (as the code we cannot edit does)

all_reduce = all_reduce_module()
real = safestrategy.nccl_ops._tf_nccl_ops()
result = {
    "imported_ours": nccl_ops is safestrategy.nccl_ops,
    "real_is_tensorflows": real is not safestrategy.nccl_ops and hasattr(real, "_check_device"),
    "all_sum": run(lambda: nccl_ops.all_sum(placed())),
    "all_reduce_uses_ours": all_reduce.nccl_ops is safestrategy.nccl_ops,
    "gradient": gradient(),
}
if result["all_reduce_uses_ours"]:
    result["all_reduce"] = run(lambda: all_reduce.build_nccl_all_reduce(placed(), tf.add))
print("RESULT " + json.dumps(result), flush=True)
