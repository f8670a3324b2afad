"""The smoke all-reduce itself, and how its numbers are judged.

One real sum all-reduce across exactly the given devices through a real
``MirroredStrategy`` with one backend's cross-device ops, replica *i*
contributing a vector of *i + 1*. It runs in the caller's process for the
backends that cannot hang, and in the probe process for NCCL (see
:mod:`safestrategy._worker`). Soft placement is off, so a replica can never
quietly run on another device than the one named.
"""

import contextlib
import time
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from .backends import build_cross_device_ops, build_strategy
from .report import FAILED, OK, CandidateResult

#: Replica i contributes a vector filled with i + 1; the expected sum is n(n+1)/2.
VECTOR_SIZE = 4

Values = List[Tuple[str, List[float]]]


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
    """The TF1-style API when this process builds graphs (TF 1.x, or TF2 with eager
    execution disabled, e.g. through ``tf.compat.v1.disable_v2_behavior()``); None when eager."""
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


@contextlib.contextmanager
def hard_placement(tf: Any) -> Iterator[None]:
    """TF2: soft placement off inside the block, the caller's setting restored after."""
    before = tf.config.get_soft_device_placement()
    tf.config.set_soft_device_placement(False)
    try:
        yield
    finally:
        tf.config.set_soft_device_placement(before)


def _eager_all_reduce(tf: Any, strategy: Any) -> Values:
    """TF2: ``ReplicaContext.all_reduce`` inside a ``tf.function``."""

    def replica_fn() -> Any:
        context = tf.distribute.get_replica_context()
        replica = tf.cast(context.replica_id_in_sync_group, tf.float32)
        return context.all_reduce(tf.distribute.ReduceOp.SUM, tf.fill([VECTOR_SIZE], replica + 1.0))

    run = getattr(strategy, "run", None) or strategy.experimental_run_v2
    with hard_placement(tf):  # no AutoGraph: nothing to convert, and it costs ~0.1 s
        result = tf.function(lambda: run(replica_fn), autograph=False)()
    return [(t.device, t.numpy().tolist()) for t in strategy.experimental_local_results(result)]


def _graph_all_reduce(tf: Any, era: str, strategy: Any, config: Any) -> Values:
    """TF 1.x graph mode: merge_call into the strategy's own reduce, run in a Session.

    ``destinations=value`` makes it an all-reduce through the cross-device ops;
    TF 1.12 spells everything "tower" and passes merge_call arguments directly.
    """
    contrib = era == "contrib-tower"

    def merge_fn(distribution: Any, value: Any) -> Any:
        if contrib:
            return distribution.reduce(tf.VariableAggregation.SUM, value, destinations=value)
        return distribution.extended.reduce_to(
            tf.distribute.ReduceOp.SUM, value, destinations=value
        )

    def replica_fn() -> Any:
        if contrib:
            context = tf.contrib.distribute.get_tower_context()
            replica = context.tower_id
        else:
            context = tf.distribute.get_replica_context()
            replica = context.replica_id_in_sync_group
        value = tf.fill([VECTOR_SIZE], tf.cast(replica, tf.float32) + 1.0)
        if contrib:
            return context.merge_call(merge_fn, value)
        return context.merge_call(merge_fn, args=(value,))

    with strategy.scope():
        if contrib:
            result = strategy.call_for_each_tower(replica_fn)
        else:
            result = strategy.extended.call_for_each_replica(replica_fn)
        unwrap = getattr(strategy, "experimental_local_results", None) or strategy.unwrap
        tensors = list(unwrap(result))
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

    ``config`` is the TF1 session config (see :func:`session_config`); TF2 runs eagerly.
    ``timeout`` bounds a ``collective`` backend's ops (TF raises instead of waiting).
    """
    if config is None:
        ops = build_cross_device_ops(tf, era, name, devices, timeout)
        return _eager_all_reduce(tf, build_strategy(tf, era, devices, ops))
    with tf.Graph().as_default():  # TF1: the strategy's ops belong to this graph only
        ops = build_cross_device_ops(tf, era, name, devices, timeout)
        strategy = build_strategy(tf, era, devices, ops)
        return _graph_all_reduce(tf, era, strategy, config)


def smoke_check(
    tf: Any,
    era: str,
    devices: Sequence[str],
    name: str,
    config: Any = None,
    timeout: Optional[float] = None,
) -> CandidateResult:
    """Run backend ``name``'s smoke all-reduce here, in this process, and judge it."""
    started = time.monotonic()
    try:
        values = all_reduce(tf, era, devices, name, config, timeout)
    except Exception as error:
        reason = ": ".join(part for part in first_line(error) if part)
        return CandidateResult(name, FAILED, reason, round(time.monotonic() - started, 3))
    return judge(name, values, len(devices), time.monotonic() - started)
