"""The all-reduce a check runs, and how its numbers are judged: one routine, any payload.

One real sum all-reduce across exactly the given devices through a real
``MirroredStrategy`` with one backend's cross-device ops, replica *i*
contributing tensors filled with *i + 1*, through the path training takes: in
eager mode ``ReplicaContext.all_reduce`` of the batch inside a ``tf.function``,
in graph mode ``merge_call`` into the strategy's ``batch_reduce_to`` run in a
session. A :class:`Race` is that all-reduce built and traced once, ready to run
again: its first run is judged (the first and last element of every result on
every replica, and where each replica's results were placed), later runs are
timed (:mod:`safestrategy.checks.timing`). The smoke check is a race on one
small tensor (:func:`smoke_check`); ``auto``'s payload is one shaped like a
Keras step's gradients (:func:`payload_sizes`), so a cold ``auto`` traces each
candidate once: its race's first run is its check.

It runs in the caller's process for the backends that cannot hang (in a helper
thread of its own, outside the caller's strategy scope), and in the probe
process for NCCL (see :mod:`safestrategy.checks.child`).

No replica may quietly run on another device than the one named. Graph mode
turns soft placement off in the check's own session; eager mode leaves
TensorFlow's process-wide setting alone (another thread may be training) and
verifies instead where each replica's result was placed.
"""

import threading
import time
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple, TypeVar

from .._devices import Device, parse_device
from ..backends import build_cross_device_ops, build_strategy
from ..report import FAILED, OK, CandidateResult

#: The smoke check's one tensor: replica i contributes a vector of this many i + 1's; the
#: expected sum is n(n+1)/2.
VECTOR_SIZE = 4
#: Tensors in ``auto``'s payload (see :func:`payload_sizes`).
TENSORS = 20

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


class Abandoned(TimeoutError):
    """A call run by :func:`in_fresh_thread` did not return within its bound: its thread is
    left behind (a daemon: it never keeps the process alive)."""


def in_fresh_thread(
    function: Callable[[], T],
    bound: Optional[float] = None,
    tick: Optional[Callable[[], None]] = None,
    every: float = 1.0,
) -> T:
    """``function()`` run in a short-lived thread of its own; its result or its exception.
    ``bound``: seconds to wait for it at most (:class:`Abandoned` after; None: no bound);
    ``tick``: called every ``every`` seconds while it runs (a watchdog keeps beating).

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
    deadline = None if bound is None else time.monotonic() + bound
    while thread.is_alive():
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            break
        thread.join(left if tick is None else every if left is None else min(every, left))
        if tick is not None and thread.is_alive():
            tick()
    if not outcome:
        raise Abandoned(f"no answer in {bound:g} s")
    ok, result = outcome[0]
    if not ok:
        raise result
    return result


def payload_sizes(megabytes: float) -> List[int]:
    """Element counts of the :data:`TENSORS` float32 tensors: mixed sizes (shares 1, 2,
    ..., 20, like a model's small biases and large kernels), ``megabytes`` MiB in all."""
    total = max(int(megabytes * 2**20 / 4), TENSORS)
    shares = range(1, TENSORS + 1)
    sizes = [max(total * share // sum(shares), 1) for share in shares]
    sizes[-1] += total - sum(sizes)
    return sizes


class Race:
    """One candidate's payload all-reduce, built and traced, ready to run again.

    Made of ``run`` (one all-reduce, returning its results), ``values`` (the
    check's numbers from those results, for :meth:`first`) and ``close`` (frees
    what the runs hold: a graph-mode session). Build it, and call its methods,
    through :func:`in_fresh_thread`.
    """

    def __init__(
        self,
        run: Callable[[], Any],
        values: Callable[[Any], Values],
        close: Callable[[], None] = lambda: None,
    ) -> None:
        self._run, self._values, self.close = run, values, close

    def first(self) -> Values:
        """The untimed first run: each replica's result device and the first and last
        element of each of its result tensors, to judge like a smoke check."""
        return self._values(self._run())

    def times(self, runs: int) -> List[float]:
        """Milliseconds of each of ``runs`` timed runs."""
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            self._run()
            times.append((time.perf_counter() - started) * 1000)
        return times


def payload(tf: Any, devices: Sequence[str], sizes: Sequence[int]) -> List[List[Any]]:
    """TF2 eager: each replica's tensors (element counts ``sizes``) on its device, replica
    *i*'s filled with *i + 1*. One payload serves every candidate of a race."""
    inputs = []
    for replica, device in enumerate(devices):
        with tf.device(device):
            inputs.append([tf.fill([size], float(replica + 1)) for size in sizes])
    return inputs


def _ends(array: Any) -> List[float]:
    """The first and last element of a result: what a check reads of each."""
    return [float(array[0]), float(array[-1])]


def _ends_op(tf: Any, tensor: Any, size: int) -> Any:
    """Graph mode: :func:`_ends` as one gather (slices cost ~10 ops each to build), so a
    session fetches two numbers, not 32 MB."""
    return tf.gather(tensor, [0, size - 1])


def eager_race(tf: Any, strategy: Any, inputs: Sequence[Sequence[Any]]) -> Race:
    """TF2: ``strategy`` all-reducing ``inputs`` (one list per replica, see :func:`payload`)."""
    run = getattr(strategy, "run", None) or strategy.experimental_run_v2

    def replica_fn() -> Any:
        context = tf.distribute.get_replica_context()
        mine = inputs[replica_index(tf, context)]
        return context.all_reduce(tf.distribute.ReduceOp.SUM, list(mine))

    step = tf.function(lambda: run(replica_fn), autograph=False)

    def values(reduced: Any) -> Values:
        per_replica = zip(*(strategy.experimental_local_results(value) for value in reduced))
        return [
            (tensors[0].device, [x for tensor in tensors for x in _ends(tensor.numpy())])
            for tensors in per_replica
        ]

    return Race(step, values)


def _placeholder(tf: Any) -> Any:
    return getattr(tf, "placeholder_with_default", None) or tf.compat.v1.placeholder_with_default


def graph_race(
    tf: Any,
    era: str,
    strategy: Any,
    devices: Sequence[str],
    sizes: Sequence[int],
    config: Any,
    timed: bool = True,
) -> Race:
    """Graph mode: ``strategy`` (built in the default graph, which this builds in too)
    all-reducing replica-local tensors of element counts ``sizes``, in a session with
    ``config``: variables when the race is ``timed`` (so a run times the all-reduce, not
    the fill), else the fills themselves (a check: no variables to initialise). The
    session fetches both ends of every result: fetching only a ``tf.group`` of them timed
    32 MB in 0.3 ms on TF 1.15 (they did not all run)."""

    inputs = []  # outside the strategy's scope: plain variables, not mirrored ones
    for replica, device in enumerate(devices):
        with tf.device(device):
            # a placeholder, not a constant: Grappler would fold each fill into a constant
            # of its size, which cost TF 1.15 ~0.5 s for 32 MB
            value = _placeholder(tf)(float(replica + 1), [])
            fill = [tf.fill([size], value) for size in sizes]
            inputs.append([tf.Variable(each, trainable=False) for each in fill] if timed else fill)

    def values_for(replica: int) -> List[Any]:
        return [tensor.value() if timed else tensor for tensor in inputs[replica]]

    reduced = graph_batch_all_reduce(tf, era, strategy, values_for)
    per_replica = list(zip(*reduced))
    fetches = [
        tf.concat([_ends_op(tf, t, size) for t, size in zip(tensors, sizes)], 0)
        for tensors in per_replica
    ]
    session = tf.Session if hasattr(tf, "Session") else tf.compat.v1.Session  # TF2: graph mode
    initialize = getattr(tf, "global_variables_initializer", None)
    initialize = initialize or tf.compat.v1.global_variables_initializer
    running = session(config=config)
    if timed:
        running.run(initialize())

    def values(fetched: Any) -> Values:
        return [(t[0].device, v.tolist()) for t, v in zip(per_replica, fetched)]

    return Race(lambda: running.run(fetches), values, running.close)


def race(
    tf: Any,
    era: str,
    devices: Sequence[str],
    name: Optional[str],
    sizes: Sequence[int],
    config: Any = None,
    timeout: Optional[float] = None,
    inputs: Optional[Sequence[Sequence[Any]]] = None,
    timed: bool = True,
) -> Race:
    """Backend ``name``'s :class:`Race` over ``devices`` on a batch of ``sizes``, built in
    a fresh thread (``name`` None: stock ``MirroredStrategy(devices)``, for benchmarks).
    ``config``: the session config in graph mode (None: TF2 eager, on ``inputs`` when
    given); ``timeout`` bounds a ``collective`` backend's ops; ``timed`` False: it only
    checks (graph mode then holds its inputs in no variables)."""

    def strategy() -> Any:
        ops = None if name is None else build_cross_device_ops(tf, era, name, devices, timeout)
        return build_strategy(tf, era, devices, ops)

    def build() -> Race:
        if config is None:
            return eager_race(tf, strategy(), inputs or payload(tf, devices, sizes))
        with tf.Graph().as_default():
            return graph_race(tf, era, strategy(), devices, sizes, config, timed)

    return in_fresh_thread(build)


class Checked(NamedTuple):
    """A race after its first run, and what that run gave (to judge)."""

    race: Race
    values: Values


def checked(ready: Race, devices: Sequence[str], eager: bool) -> Values:
    """The race's first run, in a fresh thread; ``PlacementError`` (eager) if a replica's
    results are elsewhere than asked (graph mode: the session's config forbids it)."""
    values = in_fresh_thread(ready.first)
    if eager:
        check_placement(values, devices)
    return values


def smoke_check(
    tf: Any,
    era: str,
    devices: Sequence[str],
    name: str,
    config: Any = None,
    timeout: Optional[float] = None,
) -> CandidateResult:
    """Run backend ``name``'s smoke all-reduce in this process and judge it: the race on
    one small tensor (:data:`VECTOR_SIZE`), its first run.

    It runs outside the caller's strategy scope and device scope (see
    :func:`in_fresh_thread`), in graph mode when ``config`` is given.
    """
    started = time.monotonic()
    try:
        values = check_values(tf, era, devices, name, config, timeout)
    except Exception as error:
        reason = ": ".join(part for part in first_line(error) if part)
        return CandidateResult(name, FAILED, reason, round(time.monotonic() - started, 3))
    return judge(name, values, len(devices), time.monotonic() - started)


def check_values(
    tf: Any,
    era: str,
    devices: Sequence[str],
    name: Optional[str],
    config: Any = None,
    timeout: Optional[float] = None,
) -> Values:
    """Every replica's result of backend ``name``'s smoke all-reduce over ``devices``
    (``PlacementError`` if one is elsewhere than asked): what :func:`smoke_check` judges,
    and what the probe process replies."""
    ready = race(tf, era, devices, name, [VECTOR_SIZE], config, timeout, timed=False)
    try:
        return checked(ready, devices, config is None)
    finally:
        ready.close()
