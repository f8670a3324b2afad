"""The one fake of a hung all-reduce, for the trainings the tests run (stall_script.py,
run_script.py): TensorFlow cannot hang an all-reduce on a CPU.

:func:`install` replaces ``tf.distribute.HierarchicalCopyAllReduce`` and
``ReductionToOneDevice`` (what the factory builds for ``hierarchical_copy`` and
``reduce_to_*``) by subclasses whose reduction waits at a gate, a ``py_function`` on
each replica's value, for an hour once the returned event is set; until then they are
the real ones (their smoke checks pass). The canary, run through the same
cross-device ops object, then waits at the same gate: what a hung NCCL does.

``canary_fails``: the calls that reach the gate over a second after the first one
blocked (the canary's, a stall timeout later) fail at once instead, as a new call to an
NCCL communicator that is stuck may: the canary convicts without waiting out its bound.
For the tests whose subject is what follows a conviction (``run``'s relaunches), not the
bound; the step itself still hangs.
"""

import threading
import time


def install(tf, canary_fails=False):
    """Install the gated classes; the event that, once set, hangs every all-reduce after."""
    from tensorflow.python.distribute import values as values_lib

    hang = threading.Event()
    blocked = []  # when the first call blocked at the gate

    def gate(x):
        if hang.is_set():
            blocked.append(time.monotonic())
            if canary_fails and blocked[-1] - blocked[0] > 1.0:
                raise RuntimeError("NCCL communicator is stuck (fake): the call fails")
            time.sleep(3600)  # the all-reduce that never answers
        return x

    def gated(value):
        parts = []
        for part in value.values:
            with tf.device(part.device):
                waited = tf.py_function(gate, [part], part.dtype)
            waited.set_shape(part.shape)
            parts.append(waited)
        return values_lib.PerReplica(parts)

    class Gated:
        def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
            pairs = [(gated(value), where) for value, where in value_destination_pairs]
            return super().batch_reduce_implementation(reduce_op, pairs, options)

    for name in ("HierarchicalCopyAllReduce", "ReductionToOneDevice"):
        real = getattr(tf.distribute, name)
        setattr(tf.distribute, name, type(name, (Gated, real), {}))
    return hang
