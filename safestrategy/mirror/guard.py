"""A strategy's mirror guarded during training: the check installed, and what a finding does.

:func:`guard` is what a factory calls on the strategy it built: it says once why
a strategy is not checked (TF 1.x, TF 2.0-2.3, graph mode, ``off``) or installs
the check (:mod:`~safestrategy.mirror.instep`). On a finding, in the step that
caught it and before that step's update: one ERROR in the words of
:mod:`~safestrategy.mirror.verdict`, a ``corrupt`` record against the backend
(with the devices) where a next decision reads it (:mod:`safestrategy.records`),
the run directory told (``run`` relaunches on the next backend, or says why
not), then the process ends with exit 75 under ``SAFESTRATEGY_STALL_ACTION=exit``
or the step raises :class:`~safestrategy.mirror.verdict.MirrorBrokenError`.
"""

import logging
import os
import threading
import time
from typing import Any, Optional, Sequence, Tuple

from packaging.version import Version

from .. import _env, _rundir, _tf, records
from ..records import Place
from ..report import CORRUPT, Report
from ..training import watchdog
from . import instep, verdict
from .verdict import Finding, MirrorBrokenError

logger = logging.getLogger("safestrategy")

#: The first TensorFlow whose strategies are checked (tested on 2.10 and 2.21).
FIRST_VERSION = Version("2.4")

_said = set()
_said_lock = threading.Lock()


def not_checked(why: str) -> None:
    """Say once per reason (INFO) that strategies are not checked during training."""
    with _said_lock:
        if why in _said:
            return
        _said.add(why)
    logger.info("the mirror is not checked during training: %s", why)


def _why_not(tf: Any, every: Optional[int]) -> Optional[str]:
    """Why strategies are not checked here (said once), or None: they are."""
    if every is None:
        return f"{_env.ENV_VERIFY_EVERY}=off"
    if _tf.release(tf.__version__) < FIRST_VERSION:
        return f"TF {tf.__version__} is older than {FIRST_VERSION} (checked from TF 2.4 on)"
    if not tf.executing_eagerly():
        return "TF1-style graph mode (the check needs TF2's eager functions)"
    return None


def guard(
    tf: Any,
    strategy: Any,
    report: Report,
    place: Optional[Place],
    action: str,
    every: Optional[int],
) -> Optional[instep.Watch]:
    """Check ``strategy``'s all-reduce every ``every`` batches while it trains (``every``:
    :func:`~safestrategy._env.resolve_verify_every`); ``report``: its decision, ``place``:
    where a record of it goes (None: none is written), ``action``: the stall action."""
    why = _why_not(tf, every)
    if why is not None:
        not_checked(why)
    if why is not None or len(report.devices) < 2:  # one replica: nothing is all-reduced
        return None
    started = time.monotonic()

    def on_finding(
        finding: Finding, devices: Sequence[str], passed: Optional[Tuple[int, float]]
    ) -> MirrorBrokenError:
        return _broken(report, place, action, started, finding, tuple(devices), passed)

    return instep.install(tf, strategy, every, on_finding)  # type: ignore[arg-type]


def _broken(
    report: Report,
    place: Optional[Place],
    action: str,
    started: float,
    finding: Finding,
    devices: Tuple[str, ...],
    passed: Optional[Tuple[int, float]],
) -> MirrorBrokenError:
    """Everything a finding does (ending the process under ``exit``); the error the step
    raises otherwise."""
    where = verdict.where(finding, devices)
    last = (
        None
        if records.another(report)
        else verdict.take_out(finding, devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
    )
    if place is not None:
        records.record(
            place,
            report.backend,
            time.monotonic() - started,
            records.remedy(report),
            CORRUPT,
            where,
            evidence=finding.check,
        )
        then = f"Recorded against {report.backend}: {records.after_record(report, place)}."
    else:
        then = f"Nothing is recorded: {records.unread(report, place)}."
    if last is not None:
        then += f" No other backend passes on these devices: {last}."
    clock = (
        None
        if passed is None
        else (passed[0], time.strftime("%H:%M:%S", time.localtime(passed[1])))
    )
    text = verdict.message(finding, report.backend, devices, clock, then)
    logger.error("%s", text)
    _rundir.stalled(
        {"kind": CORRUPT, "where": where, "recorded": place is not None, "last_resort": last}
    )
    if action == "exit":
        watchdog.end_process()
    return MirrorBrokenError(
        text,
        step=finding.step,
        backend=report.backend,
        replicas=finding.replicas,
        devices=tuple(verdict.short(devices[r]) for r in finding.replicas),
        check=finding.check,
    )
