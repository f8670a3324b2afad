"""How fast a candidate all-reduces: the payload ``auto`` races candidates on.

A payload shaped like one Keras step's gradients (:data:`TENSORS` float32
tensors of mixed sizes, ``payload_mb`` in all) is all-reduced in one batch the
way Keras does it: ``ReplicaContext.all_reduce(SUM, list)`` inside a
``tf.function`` in TF2, and ``merge_call`` into ``batch_reduce_to`` run in a
session in graph mode. Every replica's tensors are made once on its own
device beforehand, so a run times the all-reduce alone. :data:`WARMUP` runs
(tracing, first allocation) are not timed; the median of :data:`RUNS` is.

It runs only for candidates that passed their smoke check, in a fresh thread
(outside any strategy scope of the caller's), or in the probe process for a
candidate that may hang (NCCL): see :func:`in_probe_process`.
"""

import functools
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from ._allreduce import graph_batch_all_reduce, in_fresh_thread, replica_index
from .backends import build_cross_device_ops, build_strategy

TENSORS = 20
WARMUP = 1
RUNS = 5


def payload_sizes(megabytes: float) -> List[int]:
    """Element counts of the :data:`TENSORS` float32 tensors: mixed sizes (shares 1, 2,
    ..., 20, like a model's small biases and large kernels), ``megabytes`` MiB in all."""
    total = max(int(megabytes * 2**20 / 4), TENSORS)
    shares = range(1, TENSORS + 1)
    sizes = [max(total * share // sum(shares), 1) for share in shares]
    sizes[-1] += total - sum(sizes)
    return sizes


def _median_ms(run: Callable[[], Any], runs: int) -> float:
    import statistics  # here: ~7 ms that `import safestrategy` should not pay for

    for _ in range(WARMUP):
        run()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(times), 3)  # to the microsecond


def _eager(
    tf: Any, strategy: Any, devices: Sequence[str], batches: Sequence[Sequence[int]], runs: int
) -> List[float]:
    run = getattr(strategy, "run", None) or strategy.experimental_run_v2
    times = []
    for sizes in batches:  # one batch's tensors at a time: only they take memory
        inputs = []
        for device in devices:
            with tf.device(device):
                inputs.append([tf.fill([size], 1.0) for size in sizes])

        def replica_fn(inputs: List[Any] = inputs) -> Any:
            context = tf.distribute.get_replica_context()
            mine = inputs[replica_index(tf, context)]
            return context.all_reduce(tf.distribute.ReduceOp.SUM, mine)

        step = tf.function(lambda: run(replica_fn), autograph=False)
        times.append(_median_ms(step, runs))
    return times


def _graph(
    tf: Any,
    era: str,
    strategy: Any,
    devices: Sequence[str],
    batches: Sequence[Sequence[int]],
    config: Any,
    runs: int,
) -> List[float]:
    def step(sizes: Sequence[int]) -> Any:
        inputs = []
        for device in devices:
            with tf.device(device):
                inputs.append([tf.Variable(tf.ones([size]), trainable=False) for size in sizes])

        def values_for(replica: int) -> List[Any]:
            return [tf.identity(v) for v in inputs[replica]]

        reduced = graph_batch_all_reduce(tf, era, strategy, values_for)
        # One element of every result, not tf.group(results): a session fetching only a
        # group measured 0.3 ms for 32 MB on TF 1.15 (the reductions did not all run).
        return [tensor[:1] for tensors in reduced for tensor in tensors]

    steps = [step(sizes) for sizes in batches]
    session = tf.Session if hasattr(tf, "Session") else tf.compat.v1.Session  # TF2: graph mode
    initialize = getattr(tf, "global_variables_initializer", None)
    initialize = initialize or tf.compat.v1.global_variables_initializer
    with session(config=config) as running:
        running.run(initialize())
        return [_median_ms(functools.partial(running.run, each), runs) for each in steps]


def batches_ms(
    tf: Any,
    era: str,
    devices: Sequence[str],
    name: str,
    batches: Sequence[Sequence[int]],
    config: Any = None,
    timeout: Optional[float] = None,
    runs: int = RUNS,
) -> List[float]:
    """Median milliseconds (of ``runs``) of backend ``name``'s all-reduce of each batch
    of float32 tensors (element counts) in ``batches``, over ``devices``, here, on one
    strategy. ``config``: the session config in graph mode (None: TF2 eager);
    ``timeout`` bounds a ``collective`` backend's ops."""

    def timed() -> List[float]:
        if config is None:
            ops = build_cross_device_ops(tf, era, name, devices, timeout)
            return _eager(tf, build_strategy(tf, era, devices, ops), devices, batches, runs)
        with tf.Graph().as_default():
            ops = build_cross_device_ops(tf, era, name, devices, timeout)
            strategy = build_strategy(tf, era, devices, ops)
            return _graph(tf, era, strategy, devices, batches, config, runs)

    return in_fresh_thread(timed)


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
    batch = payload_sizes(payload_mb)
    return batches_ms(tf, era, devices, name, [batch], config, timeout)[0]


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
