"""Stall records: a backend that stalled during training is remembered for the next launch.

The watchdog (:mod:`safestrategy._watchdog`) writes a record when a call stalls
and withdraws it when the call finishes after all; a record that stays (the
process was ended while stuck) makes the next ``auto`` or listed decision for
this machine and device set treat that backend as failed. For NCCL, the
remedy not tried yet comes first (:func:`verdict`). Records live in the
verdict cache (:mod:`safestrategy._cache`, kind ``stall``), keyed by the
machine, the device set, TensorFlow's version and build, and the backend, and
obey the same switches (``SAFESTRATEGY_CACHE``, ``--refresh``, 7 days).
"""

import datetime
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import _cache, _env, _machine, _tf
from ..backends import NCCL
from ..report import FAILED, CandidateResult, Report, Stall
from . import nccl

logger = logging.getLogger("safestrategy")

KIND = "stall"


def _key(tf: Any, devices: Sequence[str], backend: Optional[str]) -> Dict[str, Any]:
    return {
        "machine": _machine.identity(),
        "devices": list(devices),
        "tf": tf.__version__,
        "build": _tf.build_info(tf),
        "backend": backend,
    }


def directory(cache: bool = True) -> Optional[str]:
    """Where records live; None when the cache is off (or its setting is unreadable)."""
    try:
        return _env.cache_dir() if cache and _env.resolve_switch(_env.ENV_CACHE) else None
    except ValueError:
        return None


def refresh_command(devices: Sequence[str]) -> str:
    """The exact command that forgets the stalls recorded for ``devices``."""
    return nccl.refresh_command(devices)


def record(tf: Any, report: Report, seconds: float) -> None:
    """Record that ``report``'s backend stalled for ``seconds`` (with its remedy, if any)."""
    where = directory()
    if where is None:
        return
    chosen = next((c for c in report.candidates if c.name == report.backend), None)
    value = Stall(
        report.backend,
        round(seconds, 1),
        datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        dict(chosen.remedy) if chosen is not None else {},
    )
    _cache.write(where, KIND, _key(tf, report.devices, report.backend), value.to_dict())


def withdraw(tf: Any, report: Report) -> None:
    """Forget the record of ``report``'s backend: its call finished after all."""
    where = directory()
    if where is not None:
        _cache.remove(where, KIND, _key(tf, report.devices, report.backend))


def recorded(
    tf: Any, devices: Sequence[str], cache: bool = True, refresh: bool = False
) -> Tuple[Stall, ...]:
    """The stalls recorded for this machine and device set on this TensorFlow; with
    ``refresh`` they are forgotten instead (and none is returned)."""
    where = directory(cache)
    if where is None:
        return ()
    mine = _key(tf, devices, None)
    stalls: List[Stall] = []
    for key, value in _cache.entries(where, KIND):
        if {**key, "backend": None} != mine:
            continue
        if refresh:
            _cache.remove(where, KIND, key)
            continue
        try:
            stalls.append(Stall(**value))
        except TypeError:
            logger.debug("stall record %r has the wrong fields; ignored", value)
    return tuple(stalls)


def reason(stall: Stall, devices: Sequence[str]) -> str:
    """Why a backend with a stall record counts as failed, and how to re-allow it."""
    return (
        f"stalled during training on {stall.when[:10]} after {stall.seconds:g} s "
        f"(`{refresh_command(devices)}` re-allows it)"
    )


def verdict(stall: Stall, devices: Sequence[Any], opts: nccl.Options) -> CandidateResult:
    """A stalled backend's result: failed, except that NCCL first gets the remedy not
    tried yet, each in a fresh probe process (not cached: the record decides next time)."""
    names = [str(device) for device in devices]
    failed = CandidateResult(stall.backend, FAILED, reason(stall, names), 0.0, cached=True)
    if stall.backend != NCCL or not opts.remedies:
        return failed
    remedies = nccl.untried(stall.remedy, nccl.user_remedies())
    return nccl.with_remedies(
        failed, remedies, lambda remedy: nccl.attempt(devices, opts.timeout, remedy)
    )


def warn_forced(report: Report, setting: _env.Setting) -> None:
    """A forced backend is used even though it stalled before: say so, once."""
    for stall in report.stalls:
        if setting.mode == "forced" and stall.backend == report.backend:
            logger.warning(
                "all-reduce backend %s %s; it is used because it was forced by %s. "
                "Expect it to stall again, or choose another.",
                report.backend,
                reason(stall, report.devices),
                "the argument" if setting.source == "argument" else _env.ENV_BACKEND,
            )
