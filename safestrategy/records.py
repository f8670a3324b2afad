"""What the records say: trouble during training, remembered for the next decision.

The one place that answers it, for one machine and multi-worker alike: records
are written (the watchdog when a call stalls, ``run`` for a crash or a silent
training), withdrawn (the call finished after all), read, listed and forgotten
here, and what they mean for the next decision is decided here and handed back
as data: a backend with a record counts as failed (:func:`demotion`), except that
NCCL's untried remedies come first (the remedy loop itself runs in
:mod:`safestrategy.checks.nccl`); a stall outside the all-reduce, or one a peer
caused, is never recorded (:func:`recordable`); no record leaves a machine
without a backend: when every candidate that passes has one, the last of them
in the order is taken anyway (:func:`set_aside`, :func:`anyway`, :func:`warn`);
RING, the multi-worker last resort, is never failed by a record (:data:`READ`).
:func:`next_step` says in words what a next decision does with a record
(``run``'s relaunch line).

Records live in the verdict cache (:mod:`safestrategy._cache`) in two key
spaces (a :class:`Place`): one machine's (kind ``stall``: the machine, the
device set, TensorFlow's version and build, the backend) and a worker's of
multi-worker training (kind ``mwstall``: the cluster, this task, TensorFlow's
version and build, the communication), so a multi-worker NCCL stall (a peer
that stopped is the usual cause) never demotes NCCL for one machine. Both obey
the same switches (``SAFESTRATEGY_CACHE``, ``--refresh``, 7 days).
"""

import datetime
import logging
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from . import _cache, _env, _machine, _tf
from ._env import untried, user_remedies
from .backends import COLLECTIVE, NCCL, RING
from .report import FAILED, NOT_TRIED, OK, SKIPPED, CandidateResult, Report, Stall, refresh_command

logger = logging.getLogger("safestrategy")

#: The two key spaces: one machine's records, and a multi-worker worker's.
KIND = "stall"
MULTIWORKER_KIND = "mwstall"
KINDS = (KIND, MULTIWORKER_KIND)
#: NCCL's remedy retries after a stall, cached like verdicts (by :mod:`safestrategy.checks.nccl`).
RETRY_KIND = "stallretry"
#: The multi-worker communications a record fails: RING, the last resort, is never failed by
#: one (a record against it is reported, not obeyed).
READ = (NCCL,)


def _key(tf: Any, devices: Sequence[str], backend: Optional[str]) -> Dict[str, Any]:
    return {
        "machine": _machine.identity(),
        "devices": list(devices),
        "tf": tf.__version__,
        "build": _tf.build_info(tf),
        "backend": backend,
    }


class Place(NamedTuple):
    """Where a strategy's records go: a key space and the key without its backend."""

    kind: str  #: :data:`KIND` or :data:`MULTIWORKER_KIND`
    key: Mapping[str, Any]
    #: A next decision reads records here (one machine: ``auto`` and lists skip a backend
    #: with a record; multi-worker: every worker's hello carries its records, from 0.4).
    read: bool
    devices: Tuple[str, ...] = ()  #: one machine: the devices (for the re-allow command)


def on_machine(tf: Any, devices: Sequence[str]) -> Place:
    """One machine's place for ``devices``."""
    return Place(KIND, _key(tf, devices, None), True, tuple(devices))


def place_for(tf: Any, report: Report, cache: bool = True) -> Optional[Place]:
    """Where a stall of ``report``'s strategy is recorded on one machine; None where no
    next decision would read a record: the cache off, one device, a forced backend."""
    place = on_machine(tf, report.devices) if directory(cache) is not None else None
    return Standing((), place).place_for(report)


def decision_entry(
    report: Report, place: Optional[Place], stall_timeout: Optional[float]
) -> Dict[str, Any]:
    """What a factory tells ``python -m safestrategy run`` of a strategy it built (the run
    directory's ``decision-<pid>.json``): enough to write its record without TensorFlow."""
    remedy, retries = _retries(report)
    return {
        "backend": report.backend,
        "devices": list(report.devices),
        "mode": report.mode,
        "task": report.task,
        "tf_version": report.tf_version,
        "remedy": remedy,
        "place": None if place is None else {"kind": place.kind, "key": dict(place.key)},
        "read": place is not None and place.read,
        "unread": unread(report, place),
        "cache": directory(),
        "stall_timeout": stall_timeout,
        #: what a next decision retries after a record of this strategy, before moving on
        "next_remedies": retries,
    }


def unread(report: Report, place: Optional[Place]) -> Optional[str]:
    """The one reason no next decision reads a record of ``report``'s strategy (None: one
    does), in the words ``run`` says it."""
    if place is not None and place.read:
        return None
    if report.mode == "forced" and not report.candidates:
        return "your own cross_device_ops is used as given"
    if directory() is None:
        return f"{_env.ENV_CACHE}=off keeps no record"
    if report.task is not None:
        return "RING, the multi-worker last resort, is never failed by a record"
    if report.mode == "forced":
        return "a forced backend is used whatever its records say"
    return "one device has no all-reduce to change"


def _retries(report: Report) -> Tuple[Dict[str, str], List[Dict[str, str]]]:
    """The remedy ``report``'s strategy uses, and those a next decision retries first after
    a record of it (none unless it all-reduces with NCCL)."""
    chosen = next((c for c in report.candidates if c.name == report.backend), None)
    remedy = dict(chosen.remedy) if chosen is not None else {}
    on_nccl = report.backend == NCCL or (
        report.backend == COLLECTIVE and chosen is not None and "(NCCL requested)" in chosen.reason
    )
    return remedy, _next_remedies(remedy) if on_nccl else []


def remedy(report: Report) -> Dict[str, str]:
    """The NCCL remedy ``report``'s strategy uses (``{}``: none)."""
    return _retries(report)[0]


def another(report: Report) -> bool:
    """A next decision on these devices has something else to take after a record of
    ``report``'s backend: an untried NCCL remedy, or a candidate without a record that
    passed its check here or was not tried (a list stops at the first that passes).
    False: it is the last resort."""
    recorded = {stall.backend for stall in report.stalls} | {report.backend}
    return bool(_retries(report)[1]) or any(
        c.status in (OK, NOT_TRIED) and c.name not in recorded for c in report.candidates
    )


def after_record(report: Report, place: Optional[Place]) -> str:
    """What the next decision does after a record of ``report``'s strategy at ``place``."""
    remedy, retries = _retries(report)
    return next_step(place, report.backend, remedy, retries)


def _next_remedies(remedy: Mapping[str, str]) -> List[Dict[str, str]]:
    """NCCL's remedies a next decision retries after a record made under ``remedy``: those
    not tried yet, none the user set, none with ``SAFESTRATEGY_NCCL_REMEDIES=off``."""
    try:
        allowed = _env.resolve_switch(_env.ENV_NCCL_REMEDIES)
    except ValueError:
        allowed = False
    return untried(remedy, user_remedies()) if allowed else []


def next_step(
    place: Optional[Place], backend: str, remedy: Mapping[str, str], remedies: Any = None
) -> str:
    """What the next decision does after a record of ``backend`` made under ``remedy`` at
    ``place``, in words (``run``'s relaunch line). ``remedies``: the NCCL remedies it retries
    first, as a decision entry's ``next_remedies`` lists them (not a list, e.g. an entry
    written before 0.4.1: those after ``remedy`` when ``backend`` is ``nccl``). Pure.

    One machine: the untried remedies, then the next backend; a backend with a record is
    avoided while another passes without one (none left: the last with a record, anyway).
    Multi-worker: every worker together, the untried remedies, then RING, which no record
    fails."""
    if not isinstance(remedies, list):
        remedies = untried(remedy, {}) if backend == NCCL else []
    remedies = [env for env in remedies if isinstance(env, dict)]
    tries = ", then with ".join(
        ", ".join(f"{name}={value}" for name, value in env.items()) for env in remedies
    )
    if place is not None and place.kind == MULTIWORKER_KIND and backend == RING:
        return "ring, the last resort, is never failed by a record: it is taken again"
    if place is None or not place.read:
        return "no next decision reads a record of it"
    if place.kind == MULTIWORKER_KIND:
        if tries:
            return f"the next decision tries {backend} with {tries} on every worker, then ring"
        return "the next decision takes ring on every worker"
    if tries:
        return f"the next decision tries {backend} with {tries}, then the next backend"
    return f"the next decision avoids {backend} while another backend passes without a record"


def place_of(entry: Mapping[str, Any]) -> Optional[Place]:
    """The place a decision entry (:func:`decision_entry`) names, or None."""
    place = entry.get("place")
    if not isinstance(place, dict) or place.get("kind") not in KINDS:
        return None
    return Place(place["kind"], dict(place.get("key") or {}), bool(entry.get("read")))


def on_worker(tf: Any, cluster: Sequence[str], task: str, read: bool = False) -> Optional[Place]:
    """A multi-worker worker's place: the cluster (every worker's address, in order) and
    this task; None with the cache off. ``read``: whether the workers' next choice reads a
    record of the strategy's communication (it avoids one any worker recorded, RING, the
    last resort, excepted: the factory says which)."""
    if directory() is None:
        return None
    key = {
        "cluster": list(cluster),
        "task": task,
        "tf": tf.__version__,
        "build": _tf.build_info(tf),
    }
    return Place(MULTIWORKER_KIND, {**key, "backend": None}, read)


def carried(tf: Any, cluster: Sequence[str], task: str) -> List[Dict[str, Any]]:
    """This worker's records of trouble during multi-worker training on ``cluster``, as its
    hello carries them: what each communication's record says happened, and the NCCL
    remedy it happened under (so that every worker moves on to the next one together).
    Only the communications a record fails (:data:`READ`)."""
    place = on_worker(tf, cluster, task)
    found = [(name, read(place, name)) for name in READ] if place else []
    return [
        {"backend": name, "happened": stall.happened(), "remedy": dict(stall.remedy)}
        for name, stall in found
        if stall
    ]


def directory(cache: bool = True) -> Optional[str]:
    """Where records live; None when the cache is off (or its setting is unreadable)."""
    try:
        return _env.cache_dir() if cache and _env.resolve_switch(_env.ENV_CACHE) else None
    except ValueError:
        return None


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def record(
    place: Place,
    backend: str,
    seconds: float,
    remedy: Mapping[str, str],
    kind: str = "stall",
    cause: str = "",
    where: Optional[str] = None,
    evidence: str = "",
) -> None:
    """Record that ``backend`` stalled for ``seconds`` at ``place`` (with its remedy), or
    (``kind`` "crash") that a launch on it died of ``cause`` after ``seconds``: the same
    entry, the latest record for a backend wins. ``where``: the cache directory (default:
    this process's; ``run`` gives the training's); ``evidence``: what showed it ("canary";
    a ``corrupt`` record: the check that caught it)."""
    where = where or directory()
    if where is not None:
        value = Stall(backend, round(seconds, 1), _now(), dict(remedy), kind, cause, evidence)
        _cache.write(where, place.kind, {**place.key, "backend": backend}, value.to_dict())


def read(place: Place, backend: str, where: Optional[str] = None) -> Optional[Stall]:
    """The record of ``backend`` at ``place``, if there is one (``where``: as for
    :func:`record`)."""
    where = where or directory()
    value = _cache.read(where, place.kind, {**place.key, "backend": backend}) if where else None
    try:
        return Stall(**value) if value is not None else None
    except TypeError:
        return None


def withdraw(place: Place, backend: str) -> None:
    """Forget the record of ``backend`` at ``place``: its call finished after all."""
    where = directory()
    if where is not None:
        _cache.remove(where, place.kind, {**place.key, "backend": backend})


def every(where: str) -> List[Tuple[str, Dict[str, Any], Stall]]:
    """Every record in the cache at ``where``, of both key spaces: (kind, key, record)."""
    found = []
    for kind in KINDS:
        for key, value in _cache.entries(where, kind):
            try:
                found.append((kind, key, Stall(**value)))
            except TypeError:
                logger.debug("stall record %r has the wrong fields; ignored", value)
    return found


def unread_here(
    key: Mapping[str, Any], machine: Mapping[str, Any], tf_version: Optional[str]
) -> str:
    """Why no decision on this machine and TensorFlow reads the record under ``key`` ("":
    one may): a record is read only by decisions on the TensorFlow and (one machine) the
    machine identity it was written on, so one left by an old build stays listed, unread."""
    if key.get("tf") != tf_version:
        return f"written on TF {key.get('tf')}, this is {tf_version or 'no TensorFlow'}"
    if "machine" in key and key["machine"] != dict(machine):
        return "written for another machine identity (host, GPUs or /dev/shm size)"
    return ""


def forget(where: str, backend: Optional[str] = None) -> int:
    """Forget every record (of ``backend`` only, when given), both key spaces; how many."""
    gone = 0
    for kind, key, stall in every(where):
        if backend is None or stall.backend == backend:
            _cache.remove(where, kind, key)
            gone += 1
    return gone


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
    forgotten: List[str] = []
    for key, value in _cache.entries(where, KIND):
        if {**key, "backend": None} != mine:
            continue
        try:
            stall: Optional[Stall] = Stall(**value)
        except TypeError:
            logger.debug("stall record %r has the wrong fields; ignored", value)
            stall = None
        if refresh:
            _cache.remove(where, KIND, key)
            forgotten.append(stall.line() if stall is not None else "an unreadable record")
        elif stall is not None:
            stalls.append(stall)
    if forgotten:  # the user asked for it: say what is gone, each one
        logger.warning(
            "--refresh forgot %d record%s of these devices:\n%s",
            len(forgotten),
            "" if len(forgotten) == 1 else "s",
            "\n".join(f"  {line}" for line in forgotten),
        )
    return tuple(stalls)


class Demotion(NamedTuple):
    """What a record means for its backend in the next decision: ``failed``, unless one of
    ``retries`` (NCCL's untried remedies, in order) passes first; ``retries`` None: none is
    tried (not NCCL, or ``SAFESTRATEGY_NCCL_REMEDIES=off``)."""

    stall: Stall
    failed: CandidateResult
    retries: Optional[List[Dict[str, str]]]


class Standing(NamedTuple):
    """What the records say for one decision on one machine's device set: read once, then
    asked (pure) for each candidate, for the last resort, and for where a stall of the
    strategy it builds is recorded."""

    stalls: Tuple[Stall, ...]
    place: Optional[Place]  #: these devices' place (None: the cache is off)
    forced: bool = False  #: a forced setting: records are reported, not obeyed

    @property
    def obeyed(self) -> Dict[str, Stall]:
        """The records a decision obeys, by backend (none for a forced setting)."""
        return {} if self.forced else {stall.backend: stall for stall in self.stalls}

    def demotion(self, name: str, on_nccl: bool, remedies: bool) -> Optional[Demotion]:
        """What ``name``'s record means for the decision (None: it has none). ``on_nccl``:
        it all-reduces with NCCL (``nccl``, a ``collective`` on NCCL), whose untried remedies
        come first (``remedies``: ``SAFESTRATEGY_NCCL_REMEDIES`` allows them)."""
        stall = self.obeyed.get(name)
        if stall is None or self.place is None:
            return None
        devices = self.place.devices
        failed = CandidateResult(name, FAILED, reason(stall, devices), 0.0, cached=True)
        retries = untried(stall.remedy, user_remedies()) if on_nccl and remedies else None
        return Demotion(stall, failed, retries)

    def place_for(self, report: Report) -> Optional[Place]:
        """Where a stall of ``report``'s strategy is recorded: only where a next decision
        reads it (not one device, not a forced backend, not with the cache off)."""
        if self.place is None or len(report.devices) < 2 or report.mode == "forced":
            return None
        return self.place


def standing(
    tf: Any, devices: Sequence[str], cache: bool = True, refresh: bool = False, forced: bool = False
) -> Standing:
    """The records for this machine and device set, read once for a decision (``refresh``:
    forgotten instead); ``forced``: the setting forces a backend, whose records are then
    reported but not obeyed."""
    place = on_machine(tf, devices) if directory(cache) is not None else None
    return Standing(recorded(tf, devices, cache, refresh), place, forced)


def reason(stall: Stall, devices: Sequence[str]) -> str:
    """Why a backend with a stall record counts as failed, and how to re-allow it."""
    return f"{stall.happened()} (`{refresh_command(devices)}` re-allows it)"


def set_aside(results: Sequence[CandidateResult], recorded: Sequence[str]) -> List[str]:
    """No record leaves a machine without a backend: when nothing passed, the candidates to
    check again with their record set aside (``recorded``: the backends with one), the
    last in the order first; the first of them that passes is used."""
    return [
        result.name
        for result in reversed(results)
        if result.name in recorded and result.status not in (SKIPPED, OK)
    ]


def recordable(
    place: Optional[Place], outside: bool, peer: bool = False, convicted: bool = True
) -> Optional[Place]:
    """Where a stall is recorded: ``place``, unless it is not shown to be the backend's
    doing: a stall outside the all-reduce (``outside``: input, an eager op no strategy
    runs), one a peer caused (``peer``: a worker held the others back, or stopped
    answering) and one whose all-reduce was not convicted (``convicted`` False: the canary
    answered right, or none could run) are never recorded."""
    return None if outside or peer or not convicted else place


def anyway(result: CandidateResult, stall: Stall) -> CandidateResult:
    """``result`` of a check run with ``stall``'s record set aside, as the report shows it
    when it passed: the last resort (see :func:`warn`)."""
    if result.status != OK:
        return result
    return result._replace(reason=f"{result.reason}; used although it {stall.happened()}")


def last_resort(report: Report) -> bool:
    """``report``'s backend has a record and was not forced: every candidate that passed
    its check had one, and the last of them in the order was taken anyway."""
    return report.mode != "forced" and any(s.backend == report.backend for s in report.stalls)


def warn(report: Report, setting: _env.Setting, fresh: bool = True) -> None:
    """A backend with a record is used: forced (a WARNING at each call), or the last resort
    (one WARNING naming every record here and the command that forgets them; DEBUG when
    the decision was remembered)."""
    if last_resort(report):
        order = [c.name for c in report.candidates]
        ranked = sorted(
            report.stalls,
            key=lambda s: order.index(s.backend) if s.backend in order else len(order),
        )
        named = "; ".join(f"{stall.backend} {stall.happened()}" for stall in ranked)
        logger.log(
            logging.WARNING if fresh else logging.DEBUG,
            "every all-reduce backend that passes its check on %s has a record of trouble "
            "during training (%s): %s, the last of them in the order, is used anyway rather "
            "than none. Expect it to stall again; if the trouble was not the all-reduce's "
            "(input, a long first compile), `%s` forgets these records.",
            ", ".join(report.devices),
            named,
            report.backend,
            refresh_command(report.devices),
        )
    for stall in report.stalls:
        if setting.mode == "forced" and stall.backend == report.backend:
            logger.warning(
                "all-reduce backend %s %s; it is used because it was forced by %s. "
                "Expect it to stall again, or choose another.",
                report.backend,
                reason(stall, report.devices),
                "the argument" if setting.source == "argument" else _env.ENV_BACKEND,
            )
