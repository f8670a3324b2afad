"""How fast a candidate all-reduces, and what ``auto``'s timings are kept as.

A candidate's time is the median of :data:`RUNS` timed runs of its payload
race (:class:`~safestrategy.checks.allreduce.Race`) after the untimed first
run that checked it. Before the full timing every candidate runs once, and
only those within :data:`SCREEN` of the fastest such run are run again
(:func:`contenders`). Timings are cached per machine, TensorFlow and build,
devices, execution mode and payload (:func:`cache_key`), with the decision they
led to (:func:`stored`, :func:`remembered`).
"""

import logging
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set

from .. import _cache, _machine, _tf
from ..choose import Decision
from ..report import CandidateResult
from . import allreduce, nccl
from .allreduce import Race, in_fresh_thread, payload_sizes

logger = logging.getLogger("safestrategy")

#: The timing cache's kind (see :mod:`safestrategy._cache`).
KIND = "timing"

#: Timed runs whose median is a candidate's time, after its untimed first run.
RUNS = 5

#: Before the full timing, each candidate that passed runs the payload once; only those
#: within this factor of the fastest such run are run again (see :func:`contenders`).
SCREEN = 2.0


def median(times: Sequence[float]) -> float:
    """The median of ``times`` (milliseconds), to the microsecond."""
    import statistics  # here: ~7 ms that `import safestrategy` should not pay for

    return round(statistics.median(times), 3)


def contenders(first_runs: Mapping[str, float]) -> Set[str]:
    """The candidates worth timing in full, given one timed run of each (milliseconds):
    those within :data:`SCREEN` of the fastest. The others cannot win by the 3 % rule
    unless a run is more than twice as slow as the next by chance; their one run stands
    as their time, which spares a cold start their slow runs."""
    if not first_runs:
        return set()
    best = min(first_runs.values())
    return {name for name, ms in first_runs.items() if ms <= best * SCREEN}


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
    summary: Callable[[Sequence[float]], float] = median,
) -> List[float]:
    """Milliseconds of backend ``name``'s all-reduce of each batch of float32 tensors
    (element counts) in ``batches``, over ``devices``, here: the ``summary`` (the median
    unless told) of ``runs`` timed runs after an untimed first run (see
    :func:`~safestrategy.checks.allreduce.race`)."""
    times = []
    for sizes in batches:  # one batch at a time: only its tensors take memory
        ready = allreduce.race(tf, era, devices, name, sizes, config, timeout)
        try:
            in_fresh_thread(ready.first)
            times.append(summary(timed_ms(ready, runs)))
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


def cache_key(
    tf: Any, devices: Sequence[Any], mode: str, payload_mb: float, opts: nccl.Options
) -> Dict[str, Any]:
    """What a timing entry depends on: the machine, TensorFlow and its build, the devices,
    the execution mode and the payload; and, since it holds every candidate's verdict as
    it was, whatever those verdicts rest on (:func:`~safestrategy.checks.nccl.conditions`:
    the probe timeout, ``NCCL_*``, ``CUDA_VISIBLE_DEVICES``, the remedies switch, the
    interpreter)."""
    return {
        "machine": _machine.identity(),
        "tf": tf.__version__,
        "build": _tf.build_info(tf),
        "gpus": _tf.gpu_names(tf),
        "devices": [str(device) for device in devices],
        "mode": mode,
        "payload_mb": payload_mb,
        **nccl.conditions(opts),
    }


def forget(directory: str, tf: Any, devices: Sequence[Any], name: str) -> None:
    """Drop every timing entry for this machine and device set (any mode, payload or
    conditions) that holds a verdict of backend ``name``: re-checking ``name`` must change
    what the next launch does, not only ``name``'s own verdict."""
    mine = {
        "machine": _machine.identity(),
        "tf": tf.__version__,
        "devices": list(map(str, devices)),
    }
    for key, value in _cache.entries(directory, KIND):
        if any(key.get(field) != wanted for field, wanted in mine.items()):
            continue
        results = value.get("results") or []
        if any(isinstance(result, dict) and result.get("name") == name for result in results):
            _cache.remove(directory, KIND, key)


def stored(decision: Decision) -> Dict[str, Any]:
    """What the timing cache keeps of a timed ``auto`` decision."""
    return {
        "backend": decision.backend,
        "reason": decision.reason,
        "results": [result.to_dict() for result in decision.results],
    }


def remembered(value: Optional[Dict[str, Any]]) -> Optional[Decision]:
    """A cached ``auto`` decision, or None when there is none or it is malformed."""
    if value is None:
        return None
    try:
        results = tuple(CandidateResult(**result) for result in value["results"])
        return Decision(str(value["backend"]), str(value["reason"]), results)
    except (KeyError, TypeError) as error:
        logger.debug("cached timings %r are malformed (%s); ignored", value, error)
        return None
