"""The check in the step: a strategy's own cross-device ops check what they return.

Every gradient all-reduce of Keras 3 ``fit``, tf.keras ``fit`` and a custom loop's
``apply_gradients`` reaches the strategy's cross-device ops through
``merge_call`` -> ``batch_reduce_to`` -> ``batch_reduce_implementation``, with
(PerReplica, destination) pairs in and Mirrored values out, in the step's own
graph and in cross-replica context (TF 2.4-2.21, any graph but XLA's). So the
check is there: :func:`install` gives the ops object a subclass of its own class
(``isinstance`` checks and its state stay as they are) whose batch all-reduce:

1. calls the real one, then counts the batch on an int64 variable of its own: a
   value the step computes, equal on every replica (a Python counter would be
   traced once and never advance inside ``tf.function`` or ``steps_per_execution``);
2. every ``every`` batches, in a ``tf.cond``, fingerprints each replica's copy of
   each output on its own device (exact: a weighted int64 sum of its bits; linear:
   ``sum(x * w)``) and each replica's input, and hands the few numbers to a
   ``tf.py_function`` that judges them (:mod:`~safestrategy.mirror.verdict`) and
   raises :class:`~safestrategy.mirror.verdict.MirrorBrokenError` on a finding;
3. returns the outputs through ``tf.identity`` under a control dependency on that
   verdict, so every variable and slot update of the step, which consumes them as
   data, waits for it and never runs when it fails. The values are untouched:
   gradients are bit-identical to an unchecked run.

TensorFlow turns an exception raised in a ``py_function`` into ``UnknownError``
and loses its class; :func:`install` registers, for that error code, a subclass of
TensorFlow's ``UnknownError`` that gives back a ``MirrorBrokenError`` (which is
then also an ``UnknownError``) when the text is ours, and TensorFlow's own class
otherwise.

Not checked: one replica (TensorFlow never calls the implementation), an XLA
graph (``jit_compile=True``: no ``py_function`` compiles), non-float or sparse
values, reductions other than SUM.
"""

import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import verdict
from .verdict import Finding, MirrorBrokenError

logger = logging.getLogger("safestrategy")

#: What a finding is told to: the finding, the replicas' devices, the last passing check
#: (step, time) or None; returns the error the step raises (or ends the process).
OnFinding = Callable[[Finding, Sequence[str], Optional[Tuple[int, float]]], MirrorBrokenError]

_lock = threading.Lock()
_classes: Dict[type, type] = {}  #: the checked subclass of each cross-device-ops class
_raised: List[MirrorBrokenError] = []  #: the error a check raised last (its fields)
_xla_said = False


class Watch:
    """One strategy's check: its counter, how often it checks, and what it tells."""

    def __init__(self, tf: Any, every: int, on_finding: OnFinding) -> None:
        self.tf = tf
        self.every = every
        self.on_finding = on_finding
        self.passed: Optional[Tuple[int, float]] = None  #: the last check that passed
        from tensorflow.python.ops import resource_variable_ops

        # the class itself, not tf.Variable: no strategy's scope (the caller's own, when the
        # factory is called inside one) may turn it into a distributed variable
        with tf.init_scope(), tf.device("/cpu:0"):
            self.count = resource_variable_ops.ResourceVariable(
                0, dtype=tf.int64, trainable=False, name="safestrategy_mirror_batches"
            )

    def gate(self, reduce_op: Any, pairs: Sequence[Any], outs: List[Any]) -> List[Any]:
        """``outs``, the batch's results, held until this batch's check (when due) passed."""
        tf = self.tf
        checked = [(value, out) for (value, _), out in zip(pairs, outs) if _checkable(value, out)]
        if not checked or str(getattr(reduce_op, "value", reduce_op)).upper() != "SUM":
            return outs
        if _in_xla():
            return outs
        step = self.count.assign_add(1)
        sound = tf.cond(
            tf.equal(step % self.every, 0),
            lambda: self._check(step, checked),
            lambda: tf.constant(True),
        )
        return [_after(tf, out, sound) for out in outs]

    def _check(self, step: Any, checked: Sequence[Tuple[Any, Any]]) -> Any:
        tf = self.tf
        copies, ins, out, scale, tolerance = [], [], [], [], []
        for value, result in checked:
            copies.append(tf.stack([_on(tf, part, _exact) for part in result.values]))
            linear = [_on(tf, part, _linear) for part in value.values]
            ins.append(tf.stack([fingerprint for fingerprint, _ in linear]))
            scale.append(tf.add_n([size for _, size in linear]))
            out.append(_on(tf, result.values[0], _linear)[0])
            tolerance.append(verdict.tolerance(result.values[0].dtype.name))
        devices = tuple(part.device for part in checked[0][1].values)

        def judge(*numbers: Any) -> bool:
            step, copies, ins, out, scale = (n.numpy().tolist() for n in numbers)
            finding = verdict.judge(step, copies, ins, out, scale, tolerance)
            if finding is None:
                self.passed = (step, time.time())
                return True
            error = self.on_finding(finding, devices, self.passed)
            with _lock:
                _raised[:] = [error]
            raise error

        with tf.device("/cpu:0"):
            numbers = [step, tf.stack(copies), tf.stack(ins), tf.stack(out), tf.stack(scale)]
            return tf.py_function(judge, numbers, tf.bool)


def _checkable(value: Any, out: Any) -> bool:
    """A dense float all-reduce of 2+ replicas, with as many copies out as values in."""
    parts = getattr(value, "values", ())
    copies = getattr(out, "values", ())
    if len(parts) < 2 or len(copies) != len(parts):
        return False
    first = parts[0]
    dtype = getattr(first, "dtype", None)
    dense = type(first).__name__ not in ("IndexedSlices", "IndexedSlicesValue")
    return dense and dtype is not None and dtype.is_floating


def _on(tf: Any, part: Any, fingerprint: Callable[[Any, Any], Any]) -> Any:
    with tf.device(part.device):
        return fingerprint(tf, part)


def _weights(tf: Any, size: Any, dtype: Any) -> Any:
    """1, 2, ..., 7, 1, 2, ...: a swap of two values changes a weighted sum."""
    return tf.cast(tf.range(size, dtype=tf.int64) % 7 + 1, dtype)


def _exact(tf: Any, x: Any) -> Any:
    """The bits of ``x`` as one int64: a weighted sum of its 16- or 32-bit words (equal
    copies give equal sums; integer sums do not depend on the order they are added in)."""
    words = tf.reshape(tf.bitcast(x, tf.int16 if x.dtype.size == 2 else tf.int32), [-1])
    words = tf.cast(words, tf.int64)
    return tf.reduce_sum(words * _weights(tf, tf.size(words, out_type=tf.int64), tf.int64))


def _linear(tf: Any, x: Any) -> Tuple[Any, Any]:
    """``sum(x * w)`` and ``sum(|x| * w)``, in float32 at least."""
    x = tf.reshape(x, [-1])
    if x.dtype.size < 4:
        x = tf.cast(x, tf.float32)
    weights = _weights(tf, tf.size(x, out_type=tf.int64), x.dtype)
    return tf.reduce_sum(x * weights), tf.reduce_sum(tf.abs(x) * weights)


def _after(tf: Any, out: Any, sound: Any) -> Any:
    from tensorflow.python.distribute import values

    if not isinstance(out, values.Mirrored):
        return out
    parts = []
    for part in out.values:
        with tf.device(part.device), tf.control_dependencies([sound]):
            parts.append(tf.identity(part))
    return values.Mirrored(parts)


def _in_xla() -> bool:
    """The step is compiled by XLA, where no ``py_function`` runs: said once, not checked."""
    global _xla_said
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import control_flow_util

    if not control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()):
        return False
    if not _xla_said:
        _xla_said = True
        logger.info("the mirror is not checked in a step XLA compiles (jit_compile=True)")
    return True


def checked_class(cls: type) -> type:
    """The subclass of cross-device-ops class ``cls`` whose batch all-reduce is checked
    (one per class; ``cls`` itself when it is one)."""
    if getattr(cls, "_safestrategy_checked", False):
        return cls
    with _lock:
        if cls not in _classes:

            def batch_reduce_implementation(self: Any, reduce_op: Any, pairs: Any, *args: Any):
                outs = super(checked, self).batch_reduce_implementation(reduce_op, pairs, *args)
                watch = getattr(self, "_safestrategy_watch", None)
                return outs if watch is None else watch.gate(reduce_op, pairs, list(outs))

            checked = type(
                cls.__name__,
                (cls,),
                {
                    "__doc__": f"{cls.__name__}, its results checked during training.",
                    "__module__": __name__,
                    "_safestrategy_checked": True,
                    "batch_reduce_implementation": batch_reduce_implementation,
                },
            )
            _classes[cls] = checked
        return _classes[cls]


def install(tf: Any, strategy: Any, every: int, on_finding: OnFinding) -> Optional[Watch]:
    """Check ``strategy``'s all-reduce every ``every`` batches from now on (None: it has no
    cross-device ops of its own to check). Before the first step is traced: a traced step
    keeps the ops it was traced with."""
    ops = getattr(strategy.extended, "_cross_device_ops", None)
    if ops is None:
        return None
    _restore_errors()
    ops.__class__ = checked_class(type(ops))
    ops._safestrategy_watch = Watch(tf, every, on_finding)
    return ops._safestrategy_watch


def _restore_errors() -> None:
    """Once: TensorFlow's ``UnknownError`` gives back a check's error (as a subclass of both)
    when its text is ours, and stays itself for every other text. The class object is kept
    (TensorFlow's C++ side holds it, registered at import): only its ``__new__`` is ours."""
    from tensorflow.python.framework import errors_impl

    unknown = errors_impl.UnknownError
    if getattr(unknown, "_safestrategy_restores", False):
        return

    class InStep(MirrorBrokenError, unknown):  # type: ignore[misc, valid-type]
        """A check's ``MirrorBrokenError``, as the step raised it (also an ``UnknownError``)."""

        def __init__(self, node_def: Any, op: Any, message: str, *args: Any) -> None:
            with _lock:
                raised = _raised[0] if _raised else MirrorBrokenError(message)
            unknown.__init__(self, node_def, op, str(raised), *args)
            self.__dict__.update(raised.__dict__)

    InStep.__name__ = InStep.__qualname__ = verdict.NAME
    made = unknown.__new__

    def __new__(cls: Any, *args: Any, **kwargs: Any) -> Any:
        message = args[2] if len(args) > 2 else kwargs.get("message", "")
        if cls is unknown and _raised and f"{verdict.NAME}: " in str(message):
            cls = InStep
        return made(cls, *args, **kwargs)

    unknown.__new__ = __new__  # type: ignore[method-assign]
    unknown._safestrategy_restores = True  # type: ignore[attr-defined]
