"""The canary: while a stall lasts, does the strategy's all-reduce itself still answer?

A Python stack cannot see inside a step: a ``py_function`` that hangs, a
``tf.data`` map reading a dead file system and a hung all-reduce all look like
"one TensorFlow call for 600 s". So when a stall fires, a tiny known-sum
all-reduce (replica *i* contributes *i + 1*) runs on the strategy's devices with
its communication, on a thread of its own, bounded by :func:`bound` and
abandoned there. Only a canary that hangs, fails or sums wrong convicts the
backend; one that answers right shows the step is stuck elsewhere.

It never takes the strategy's collective keys: TensorFlow takes them per call
from a counter the training step shares, so a canary through them would
cross-wire with the step (shared/notes/canary.md). The backends that take no
keys (``nccl``, ``hierarchical_copy``, ``reduce_to_*``) are run through the
strategy's own cross-device ops object, eagerly; ``collective`` through eager
raw collectives (``CollectiveReduceV2``) on a group key of safestrategy's own,
one thread per device, never inside a ``tf.function``.
"""

import threading
import time
from typing import Any, Callable, List, Mapping, NamedTuple, Optional, Sequence

from .. import backends
from .._devices import parse_devices
from ..checks.allreduce import (
    VECTOR_SIZE,
    Abandoned,
    Values,
    first_line,
    in_fresh_thread,
    wrong_sums,
)
from ..report import Report
from .sampler import interval

ANSWERED = "answered"  #: the right sum, in time: the all-reduce works
HUNG = "hung"  #: no answer within the bound
FAILED = "failed"  #: an error
WRONG = "wrong"  #: an answer, but a wrong sum
NONE = "none"  #: no canary can run here (TF 1.x, graph mode, the caller's own ops, ...)
KINDS = (ANSWERED, HUNG, FAILED, WRONG, NONE)

#: Backends whose cross-device ops object takes no collective keys.
KEYLESS = ("nccl", "hierarchical_copy", "reduce_to_gpu", "reduce_to_cpu")


class Answer(NamedTuple):
    """What the canary showed, in how long, and the detail the ERROR quotes."""

    kind: str  #: one of ANSWERED, HUNG, FAILED, WRONG, NONE
    seconds: float
    detail: str = ""

    @property
    def convicts(self) -> bool:
        """The all-reduce itself is shown stuck or broken: a record is warranted."""
        return self.kind in (HUNG, FAILED, WRONG)

    def said(self) -> str:
        """The clause the ERROR says of the all-reduce."""
        if self.kind == ANSWERED:
            return f"the all-reduce answered in {_duration(self.seconds)}"
        if self.kind == HUNG:
            return f"the all-reduce itself did not answer in {_duration(self.seconds)}"
        if self.kind == FAILED:
            return f"the all-reduce itself failed ({self.detail})"
        if self.kind == WRONG:
            return f"the all-reduce itself summed wrong ({self.detail})"
        return f"no all-reduce could be run to check it ({self.detail})"


def _duration(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def bound(timeout: float) -> float:
    """Seconds the canary is waited for: min(60, max(5 + 2 samples, 10 % of the timeout))."""
    return min(60.0, max(5.0 + 2 * interval(timeout), timeout / 10))


def from_round(joins: Mapping[str, Any], seconds: float) -> Answer:
    """What a multi-worker canary round showed (``joins``: each worker's
    :class:`~safestrategy.training.peers.Join`, by task): the first worker's that did not
    answer right (no answer in time: hung after ``seconds``), else answered, in the
    slowest worker's time."""
    for join in joins.values():
        if join.kind != ANSWERED:
            if join.kind in (FAILED, WRONG):
                return Answer(join.kind, join.took, f"on {join.task}: {join.detail}")
            return Answer(HUNG, join.took or seconds)
    return Answer(ANSWERED, max((join.took for join in joins.values()), default=0.0))


def unavailable(report: Report, strategy: Any) -> Optional[str]:
    """Why no canary can run for ``strategy`` (None: one can), from what is known without
    running anything."""
    if strategy is None:
        return "the strategy is gone"
    if not report.tf_version.startswith("2."):
        return "TensorFlow 1.x: no eager all-reduce"
    if not report.candidates:
        return f"your own cross_device_ops ({report.backend}) is not one safestrategy can check"
    if report.task is not None:
        return "a multi-worker canary is a round every worker joins (training/rounds.py)"
    if len(report.devices) < 2:
        return "one device: no all-reduce"
    if report.backend not in (*KEYLESS, backends.COLLECTIVE):
        return f"no canary for backend {report.backend}"
    return None


def run(
    tf: Any,
    report: Report,
    strategy: Any,
    seconds: float,
    tick: Optional[Callable[[], None]] = None,
) -> Answer:
    """Run the canary for ``strategy`` (built as ``report`` says), waiting ``seconds`` at
    most and calling ``tick`` each second meanwhile: what it showed. Never raises."""
    why = unavailable(report, strategy)
    if why is not None:
        return Answer(NONE, 0.0, why)
    started = time.monotonic()
    try:
        values = in_fresh_thread(lambda: _allreduce(tf, report, strategy), seconds, tick)
    except Abandoned:
        return Answer(HUNG, seconds)
    except Exception as error:  # any error of the all-reduce is its failure
        return Answer(FAILED, time.monotonic() - started, ": ".join(first_line(error)))
    took = time.monotonic() - started
    if values is None:
        return Answer(NONE, took, "TensorFlow runs graphs here (eager execution is off)")
    wrong = wrong_sums(values, len(report.devices))
    return Answer(WRONG, took, wrong) if wrong else Answer(ANSWERED, took)


def _allreduce(tf: Any, report: Report, strategy: Any) -> Optional[Values]:
    """The canary's all-reduce, in this (fresh) thread: each replica's result as
    ``(device, numbers)``; None in graph mode, where nothing eager can run."""
    if not tf.executing_eagerly():
        return None
    if report.backend == backends.COLLECTIVE:
        return _raw_collective(tf, report.devices)
    from tensorflow.python.distribute import values as values_lib

    tensors = []
    for replica, device in enumerate(report.devices):
        with tf.device(device):
            tensors.append(tf.fill([VECTOR_SIZE], float(replica + 1)))
    value = values_lib.PerReplica(tensors)
    ops = strategy.extended._cross_device_ops  # the object the step all-reduces with
    (reduced,) = ops.batch_reduce(tf.distribute.ReduceOp.SUM, [(value, value)])
    return [(t.device, t.numpy().tolist()) for t in reduced.values]


def _raw_collective(tf: Any, devices: Sequence[str]) -> Values:
    """Eager ``CollectiveReduceV2`` on each of ``devices`` at once, on a group key no
    strategy uses and the implementation the strategy's collective uses."""
    implementation = backends.collective_live(tf, parse_devices(devices)).implementation
    group = backends.fresh_group_key()
    return raw_allreduce(tf, devices, 0, len(devices), group, 1, implementation or "auto")


def raw_allreduce(
    tf: Any, devices: Sequence[str], first: int, size: int, group: int, instance: int, hint: str
) -> Values:
    """Eager ``CollectiveReduceV2`` on each of ``devices`` at once (one thread each, never
    in a ``tf.function``): replica ``first + j`` (on device j) contributes ``first + j + 1``
    to a group of ``size`` replicas; each device's ``(device, numbers)``. Raises the first
    device's error. The caller bounds it (the canary's own thread is the one abandoned)."""
    from tensorflow.python.ops import collective_ops

    results: List[Any] = [None] * len(devices)

    def one(index: int, device: str) -> None:
        try:
            with tf.device(device):
                summed = collective_ops.all_reduce_v2(
                    tf.fill([VECTOR_SIZE], float(first + index + 1)),
                    group_size=size,
                    group_key=group,
                    instance_key=instance,
                    communication_hint=hint.lower(),
                )
            results[index] = (summed.device, summed.numpy().tolist())
        except Exception as error:  # handed to the canary's thread
            results[index] = error

    threads = [
        threading.Thread(target=one, args=pair, name="safestrategy-canary", daemon=True)
        for pair in enumerate(devices)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results
