"""The smoke all-reduce itself, and how its numbers are judged.

One real sum all-reduce across exactly the given devices through a real
``MirroredStrategy`` with one backend's cross-device ops, replica *i*
contributing a vector of *i + 1*, through the path training takes: in eager
mode ``ReplicaContext.all_reduce``, in graph mode ``merge_call`` into the
strategy's ``batch_reduce_to``. It runs in the caller's process for the
backends that cannot hang (in a helper thread of its own, outside the caller's
strategy scope), and in the probe process for NCCL (see
:mod:`safestrategy._worker`).

No replica may quietly run on another device than the one named. Graph mode
turns soft placement off in the check's own session; eager mode leaves
TensorFlow's process-wide setting alone (another thread may be training) and
verifies instead where each replica's result was placed.
"""

import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple, TypeVar

from ._devices import Device, parse_device
from .backends import build_cross_device_ops, build_strategy
from .report import FAILED, OK, CandidateResult

#: Replica i contributes a vector filled with i + 1; the expected sum is n(n+1)/2.
VECTOR_SIZE = 4

Values = List[Tuple[str, List[float]]]
T = TypeVar("T")


def first_line(error: BaseException) -> Tuple[str, str]:
    """An exception's type name and the first line of its message."""
    text = str(error).strip()
    return type(error).__name__, text.splitlines()[0] if text else ""


def wrong_sums(
    values: Sequence[Sequence[Any]], replicas: int, local: Optional[int] = None
) -> Optional[str]:
    """Why the all-reduced ``[device, numbers]`` pairs are wrong, or None if all are right.

    ``local``: how many of the ``replicas`` ``values`` should hold (all of them,
    unless a worker of a multi-worker all-reduce sees its own only).
    """
    expected = replicas * (replicas + 1) / 2
    got = [numbers for _, numbers in values]
    if len(got) == (replicas if local is None else local) and all(
        numbers and all(abs(x - expected) < 1e-6 for x in numbers) for numbers in got
    ):
        return None
    firsts = [numbers[0] if numbers else None for numbers in got]
    return f"wrong sum: expected {expected:g} on each of {replicas} replicas, got {firsts}"


def judge(name: str, values: Values, replicas: int, seconds: float) -> CandidateResult:
    """The result of a smoke all-reduce that returned ``values``."""
    wrong = wrong_sums(values, replicas)
    if wrong:
        return CandidateResult(name, FAILED, wrong, round(seconds, 3))
    reason = f"all {replicas} replicas got the right sum"
    return CandidateResult(name, OK, reason, round(seconds, 3))


def from_reply(name: str, reply: Any, replicas: int, seconds: float) -> CandidateResult:
    """The result of a check that ran elsewhere (the probe process) and replied ``reply``."""
    if "values" in reply:
        return judge(name, reply["values"], replicas, seconds)
    reason = ": ".join(str(part) for part in reply.get("error") or ["no reply"] if part)
    return CandidateResult(name, FAILED, reason, round(seconds, 3))


def graph_api(tf: Any) -> Optional[Any]:
    """The TF1-style API when the calling thread builds graphs, else None (eager).

    Graph mode: TF 1.x; TF2 with eager execution disabled (e.g. through
    ``tf.compat.v1.disable_v2_behavior()``), inside ``with tf.Graph().as_default()``
    or while a ``tf.function`` is traced. Thread-local in TF2: ask in the caller's thread.
    """
    if not tf.__version__.startswith("2."):
        return tf
    return None if tf.executing_eagerly() else tf.compat.v1


def session_config(tf: Any, cpus: int, gpus: bool) -> Any:
    """TF1: ``cpus`` CPU devices, soft placement off; no GPU at all unless ``gpus``.

    Without GPUs the session creates no GPU device, so it cannot fix the
    process-wide GPU options before the caller's own session does.
    """
    config = tf.ConfigProto(device_count={"CPU": max(cpus, 1)}, allow_soft_placement=False)
    if gpus:
        config.gpu_options.allow_growth = True
    else:
        config.device_count["GPU"] = 0
    return config


class PlacementError(RuntimeError):
    """A replica's result was placed on another device than the one asked for."""


#: Where TF2 reports a ``tf.function``'s results that live in host memory.
HOST = Device("CPU", 0)


def check_placement(values: Values, devices: Sequence[str]) -> None:
    """``PlacementError`` unless replica *i*'s result is on ``devices[i]``.

    Names are compared as devices ("/cpu:1" is
    "/job:localhost/replica:0/task:0/device:CPU:1"). TensorFlow reports a
    ``tf.function``'s results in host memory on the host CPU, whichever logical
    CPU computed them (``ProcessFunctionLibraryRuntime::GetOutputDevices``), so
    a CPU's result may read CPU:0; a GPU's result must be on that GPU.
    """
    for (placed, _), asked in zip(values, devices):
        want = parse_device(asked)
        try:
            got: Optional[Device] = parse_device(placed)
        except ValueError:  # not a local device name: not where asked either
            got = None
        if got != want and not (want.kind == "CPU" and got == HOST):
            raise PlacementError(
                f"the result for {want} was placed on {placed or 'no device'}: "
                "TensorFlow ran the check elsewhere than asked"
            )


def _eager_all_reduce(tf: Any, strategy: Any) -> Values:
    """TF2: ``ReplicaContext.all_reduce`` inside a ``tf.function``."""

    def replica_fn() -> Any:
        context = tf.distribute.get_replica_context()
        replica = tf.cast(context.replica_id_in_sync_group, tf.float32)
        return context.all_reduce(tf.distribute.ReduceOp.SUM, tf.fill([VECTOR_SIZE], replica + 1.0))

    run = getattr(strategy, "run", None) or strategy.experimental_run_v2
    # no AutoGraph: nothing to convert, and it costs ~0.1 s
    result = tf.function(lambda: run(replica_fn), autograph=False)()
    return [(t.device, t.numpy().tolist()) for t in strategy.experimental_local_results(result)]


def replica_index(tf: Any, context: Any) -> int:
    """This replica's index as a Python int (TF2 graphs give a constant tensor, TF 1.12 a
    ``tower_id``)."""
    value = getattr(context, "replica_id_in_sync_group", None)
    if value is None:
        value = context.tower_id
    if isinstance(value, int):
        return value
    from tensorflow.python.framework import tensor_util

    return int(tensor_util.constant_value(value))


def graph_batch_all_reduce(
    tf: Any, era: str, strategy: Any, values_for: Callable[[int], Sequence[Any]]
) -> List[List[Any]]:
    """Graph mode: each replica's tensors ``values_for(replica)`` summed across replicas in
    one merge_call into the strategy's own batch reduce; for each value, every replica's
    result tensor.

    ``batch_reduce_to`` is what training's all-reduce takes (optimizers,
    ``ReplicaContext.all_reduce``); ``reduce_to`` is not: TF 2.x reroutes it to
    ``ReductionToOneDevice`` whenever a destination is a CPU, so it passed
    ``hierarchical_copy`` on 3 CPUs that training then summed wrong. The pairs
    ``(value, value)`` make it an all-reduce through the cross-device ops.
    TF 1.12 spells everything "tower", has ``batch_reduce(aggregation, pairs)``
    and passes merge_call arguments directly.
    """
    contrib = era == "contrib-tower"

    def merge_fn(distribution: Any, *values: Any) -> Any:
        pairs = [(value, value) for value in values]
        if contrib:
            return distribution.batch_reduce(tf.VariableAggregation.SUM, pairs)
        return distribution.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, pairs)

    def replica_fn() -> Any:
        if contrib:
            context = tf.contrib.distribute.get_tower_context()
        else:
            context = tf.distribute.get_replica_context()
        values = tuple(values_for(replica_index(tf, context)))
        if contrib:
            return context.merge_call(merge_fn, *values)
        return context.merge_call(merge_fn, args=values)

    with strategy.scope():
        if contrib:
            result = strategy.call_for_each_tower(replica_fn)
        else:
            result = strategy.extended.call_for_each_replica(replica_fn)
        unwrap = getattr(strategy, "experimental_local_results", None) or strategy.unwrap
        return [list(unwrap(reduced)) for reduced in result]


def _graph_all_reduce(tf: Any, era: str, strategy: Any, config: Any) -> Values:
    """Graph mode: the smoke all-reduce through :func:`graph_batch_all_reduce`, run in a
    Session."""

    def values_for(replica: int) -> List[Any]:
        return [tf.fill([VECTOR_SIZE], float(replica + 1))]

    (tensors,) = graph_batch_all_reduce(tf, era, strategy, values_for)
    session = tf.Session if hasattr(tf, "Session") else tf.compat.v1.Session  # TF2: graph mode
    with session(config=config) as running:
        values = running.run(tensors)
    return [(t.device, v.tolist()) for t, v in zip(tensors, values)]


def all_reduce(
    tf: Any,
    era: str,
    devices: Sequence[str],
    name: str,
    config: Any = None,
    timeout: Optional[float] = None,
) -> Values:
    """Every replica's result of one sum all-reduce with backend ``name`` over ``devices``.

    ``config`` is the session config for graph mode (see :func:`session_config`);
    None runs it eagerly (TF2), and then ``PlacementError`` if a result is
    elsewhere than asked. ``timeout`` bounds a ``collective`` backend's ops (TF
    raises instead of waiting).
    """
    if config is None:
        ops = build_cross_device_ops(tf, era, name, devices, timeout)
        values = _eager_all_reduce(tf, build_strategy(tf, era, devices, ops))
        check_placement(values, devices)
        return values
    with tf.Graph().as_default():  # TF1: the strategy's ops belong to this graph only
        ops = build_cross_device_ops(tf, era, name, devices, timeout)
        strategy = build_strategy(tf, era, devices, ops)
        return _graph_all_reduce(tf, era, strategy, config)


def in_fresh_thread(function: Callable[[], T]) -> T:
    """``function()`` run in a short-lived thread of its own; its result or its exception.

    TensorFlow keeps the strategy scope, the default graph and ``tf.device``
    per thread, so a fresh thread sees none of the caller's: a check inside
    another strategy's scope would otherwise fail with "Mixing different
    tf.distribute.Strategy objects". No other thread's state is touched. The
    execution mode is per thread too: decide it in the caller's thread.
    """
    outcome: List[Any] = []

    def run() -> None:
        try:
            outcome.append((True, function()))
        except BaseException as error:  # handed to the caller's thread
            outcome.append((False, error))

    thread = threading.Thread(target=run, name="safestrategy-check", daemon=True)
    thread.start()
    thread.join()
    ok, result = outcome[0]
    if not ok:
        raise result
    return result


def smoke_check(
    tf: Any,
    era: str,
    devices: Sequence[str],
    name: str,
    config: Any = None,
    timeout: Optional[float] = None,
) -> CandidateResult:
    """Run backend ``name``'s smoke all-reduce in this process and judge it.

    It runs outside the caller's strategy scope and device scope (see
    :func:`in_fresh_thread`), in graph mode when ``config`` is given.
    """
    started = time.monotonic()
    try:
        values = in_fresh_thread(lambda: all_reduce(tf, era, devices, name, config, timeout))
    except Exception as error:
        reason = ": ".join(part for part in first_line(error) if part)
        return CandidateResult(name, FAILED, reason, round(time.monotonic() - started, 3))
    return judge(name, values, len(devices), time.monotonic() - started)
