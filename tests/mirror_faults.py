"""Test-only faults of an all-reduce: the injection seam of the mirror's check (0.7).

:func:`inject` makes the cross-device ops the factory builds from now on faulty
from their ``start``-th all-reduce batch on: ``corrupt`` adds 1e-3 to one
replica's copy of each result (its copy differs from the others'), ``drop``
leaves one replica's contribution out of the sum (every copy equally wrong).
Each is a subclass of the real backend's class made here; the check never looks
at the class, only at the numbers.
"""

from safestrategy import factory

FAULTS = ("corrupt", "drop")


def _faulty(cls, kind, replica, start):
    import tensorflow as tf
    from tensorflow.python.distribute import values

    def batch_reduce_implementation(self, reduce_op, pairs, *args):
        on = self._fault_batches.assign_add(1) >= start
        if kind == "drop":
            pairs = [(_without(tf, values, value, replica, on), to) for value, to in pairs]
        outs = super(faulty, self).batch_reduce_implementation(reduce_op, pairs, *args)
        if kind == "corrupt":
            outs = [_corrupted(tf, values, out, replica, on) for out in outs]
        return outs

    faulty = type(
        f"Faulty{cls.__name__}",
        (cls,),
        {"batch_reduce_implementation": batch_reduce_implementation},
    )
    return faulty


def _float(part):
    return getattr(getattr(part, "dtype", None), "is_floating", False)


def _without(tf, values, value, replica, on):
    parts = list(value.values)
    if len(parts) > replica and _float(parts[replica]):
        with tf.device(parts[replica].device):
            parts[replica] = tf.where(on, tf.zeros_like(parts[replica]), parts[replica])
        return values.PerReplica(parts)
    return value


def _corrupted(tf, values, out, replica, on):
    parts = list(getattr(out, "values", ()))
    if len(parts) > replica and _float(parts[replica]):
        with tf.device(parts[replica].device):
            parts[replica] = tf.where(on, parts[replica] + 1e-3, parts[replica])
        return values.Mirrored(parts)
    return out


def inject(kind, replica, start=1, monkeypatch=None):
    """From now on, the factory's cross-device ops go wrong the ``kind`` way on ``replica``
    from their ``start``-th all-reduce batch on (``monkeypatch``: undone after the test;
    None: for the rest of the process)."""
    import tensorflow as tf

    assert kind in FAULTS
    real = factory.build_cross_device_ops

    def build(*args, **kwargs):
        ops = real(*args, **kwargs)
        ops.__class__ = _faulty(type(ops), kind, replica, start)
        with tf.init_scope(), tf.device("/cpu:0"):
            ops._fault_batches = tf.Variable(0, dtype=tf.int64, trainable=False)
        return ops

    if monkeypatch is None:
        factory.build_cross_device_ops = build
    else:
        monkeypatch.setattr(factory, "build_cross_device_ops", build)
