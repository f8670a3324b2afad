"""How fast a candidate all-reduces: the payload ``auto`` races candidates on.

A payload shaped like one Keras step's gradients (:data:`TENSORS` float32
tensors of mixed sizes, ``payload_mb`` in all) is all-reduced in one batch the
way Keras does it: ``ReplicaContext.all_reduce(SUM, list)`` inside a
``tf.function`` in TF2, and ``merge_call`` into ``batch_reduce_to`` run in a
session in graph mode. Replica *i*'s tensors are filled with *i + 1* and made
once on its own device beforehand, so a run times the all-reduce alone.

A :class:`Race` is one candidate's payload all-reduce, built and traced once:
its first run (tracing, first allocation) is not timed but judged like a smoke
check (the first and last element of every result, and where each replica's
results were placed), so a cold ``auto`` traces each candidate once, not twice.
Later runs are timed.

It runs in the caller's process in fresh threads (outside any strategy scope of
the caller's), or in the probe process for a candidate that may hang (NCCL):
see :func:`in_probe_process`.
"""

import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

from ._allreduce import (
    Values,
    check_placement,
    graph_batch_all_reduce,
    in_fresh_thread,
    replica_index,
)
from .backends import build_cross_device_ops, build_strategy

TENSORS = 20
#: Timed runs whose median is a candidate's time, after its untimed first run.
RUNS = 5


def payload_sizes(megabytes: float) -> List[int]:
    """Element counts of the :data:`TENSORS` float32 tensors: mixed sizes (shares 1, 2,
    ..., 20, like a model's small biases and large kernels), ``megabytes`` MiB in all."""
    total = max(int(megabytes * 2**20 / 4), TENSORS)
    shares = range(1, TENSORS + 1)
    sizes = [max(total * share // sum(shares), 1) for share in shares]
    sizes[-1] += total - sum(sizes)
    return sizes


def median(times: Sequence[float]) -> float:
    """The median of ``times`` (milliseconds), to the microsecond."""
    import statistics  # here: ~7 ms that `import safestrategy` should not pay for

    return round(statistics.median(times), 3)


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
    tf: Any, era: str, strategy: Any, devices: Sequence[str], sizes: Sequence[int], config: Any
) -> Race:
    """Graph mode: ``strategy`` (built in the default graph, which this builds in too)
    all-reducing replica-local variables of element counts ``sizes``, in a session with
    ``config``. The session fetches both ends of every result: fetching only a
    ``tf.group`` of them timed 32 MB in 0.3 ms on TF 1.15 (they did not all run)."""

    inputs = []  # outside the strategy's scope: plain variables, not mirrored ones
    for replica, device in enumerate(devices):
        with tf.device(device):
            # a placeholder, not a constant: Grappler would fold each fill into a constant
            # of its size, which cost TF 1.15 ~0.5 s for 32 MB
            value = _placeholder(tf)(float(replica + 1), [])
            fill = [tf.fill([size], value) for size in sizes]
            inputs.append([tf.Variable(value, trainable=False) for value in fill])

    def values_for(replica: int) -> List[Any]:
        return [variable.value() for variable in inputs[replica]]

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
) -> Race:
    """Backend ``name``'s :class:`Race` over ``devices`` on a batch of ``sizes``, built in
    a fresh thread (``name`` None: stock ``MirroredStrategy(devices)``, for benchmarks).
    ``config``: the session config in graph mode (None: TF2 eager, on ``inputs`` when
    given); ``timeout`` bounds a ``collective`` backend's ops."""

    def strategy() -> Any:
        ops = None if name is None else build_cross_device_ops(tf, era, name, devices, timeout)
        return build_strategy(tf, era, devices, ops)

    def build() -> Race:
        if config is None:
            return eager_race(tf, strategy(), inputs or payload(tf, devices, sizes))
        with tf.Graph().as_default():
            return graph_race(tf, era, strategy(), devices, sizes, config)

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


def timed_ms(ready: Race, runs: int = RUNS) -> List[float]:
    """Milliseconds of ``runs`` timed runs of a race whose first run is done."""
    return in_fresh_thread(lambda: ready.times(runs))


def batches_ms(
    tf: Any,
    era: str,
    devices: Sequence[str],
    name: Optional[str],
    batches: Sequence[Sequence[int]],
    config: Any = None,
    timeout: Optional[float] = None,
    runs: int = RUNS,
) -> List[float]:
    """Median milliseconds (of ``runs``, after an untimed first run) of backend ``name``'s
    all-reduce of each batch of float32 tensors (element counts) in ``batches``, over
    ``devices``, here (see :func:`race`)."""
    times = []
    for sizes in batches:  # one batch at a time: only its tensors take memory
        ready = race(tf, era, devices, name, sizes, config, timeout)
        try:
            in_fresh_thread(ready.first)
            times.append(median(timed_ms(ready, runs)))
        finally:
            ready.close()
    return times


def median_ms(
    tf: Any,
    era: str,
    devices: Sequence[str],
    name: str,
    payload_mb: float,
    config: Any = None,
    timeout: Optional[float] = None,
) -> float:
    """Median milliseconds of backend ``name``'s batch all-reduce of the payload over
    ``devices``, here (see :func:`batches_ms`)."""
    return batches_ms(tf, era, devices, name, [payload_sizes(payload_mb)], config, timeout)[0]


def in_probe_process(process: Any, name: str, payload_mb: float, timeout: float) -> Optional[float]:
    """Time ``name`` in a started probe process (for what may hang); None when it failed."""
    from ._probe import ProbeDied, ProbeTimeout

    try:
        reply = process.ask({"time": name, "payload_mb": payload_mb}, timeout)
    except (ProbeTimeout, ProbeDied):
        return None
    ms = reply.get("ms")
    return float(ms) if isinstance(ms, (int, float)) else None


def cache_key(tf: Any, devices: Sequence[Any], mode: str, payload_mb: float) -> Dict[str, Any]:
    """What a timing depends on: the machine, TensorFlow and its build, the devices, the
    execution mode and the payload (not the probe timeout)."""
    from . import _machine, _tf

    return {
        "machine": _machine.identity(),
        "tf": tf.__version__,
        "build": _tf.build_info(tf),
        "gpus": _tf.gpu_names(tf),
        "devices": [str(device) for device in devices],
        "mode": mode,
        "payload_mb": payload_mb,
    }
