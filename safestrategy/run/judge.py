"""How a launch ended, and what follows: API.md's table as one pure function, :func:`judge`.

``run`` reads what a launch left in its run directory (:mod:`safestrategy._rundir`:
its decisions, its heartbeat, its stall, an uncaught error, a fault dump) and
asks :func:`judge` whether to relaunch it: only when a different all-reduce can
cure the failure *and* a record was written that the training's own next
decision reads (:mod:`safestrategy.records`), so that it trains on the next
backend. Tested as a table, without processes.
"""

import signal
from typing import Callable, Mapping, NamedTuple, Optional, Sequence

from .. import _rundir, records
from .._env import EXIT_STALL
from ..records import Place
from ..report import CORRUPT, Stall
from ..training.peers import A_WORKERS_DOING, HELD, PEER_GONE, STOPPED
from ..training.sampler import in_tf_call

#: Deaths that are a crash when a thread was inside a TensorFlow call.
CRASH_SIGNALS = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS)
#: An uncaught error of the all-reduce itself (NCCL, TF's collectives).
ALLREDUCE_ERRORS = (
    "NcclError",
    "ncclUnhandledCudaError",
    "ncclSystemError",
    "ncclInternalError",
    "ncclInvalidUsage",
    "Collective ops is aborted by",
    "NCCL error",
)
#: Signals that end a process from outside (a user, a scheduler, the OOM killer).
OUTSIDE_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGKILL)
NOT_CURABLE = "not an all-reduce failure: a relaunch would fail the same way"
#: Where a last heartbeat put a call that runs none of the strategy's collectives.
OWN_WORK = "in a TensorFlow call of its own (one that runs none of the strategy's collectives)"


class Ended(NamedTuple):
    """How one launch ended, as ``run`` saw it."""

    returncode: int  #: the child's (negative: killed by that signal)
    seconds: float  #: how long it ran
    starved: bool = False  #: ``run`` killed it: its heartbeat stopped inside a TF call
    signalled: Optional[int] = None  #: a signal ``run`` itself got (forwarded to the child)
    hung: bool = False  #: ``run`` ended a training that said ``finished`` but did not exit


class Record(NamedTuple):
    """A record ``run`` writes for a launch (a crash, or a stall the watchdog could not)."""

    place: Place
    backend: str
    seconds: float
    remedy: Mapping[str, str]
    kind: str  #: "stall" or "crash"
    cause: str = ""
    where: Optional[str] = None  #: the cache directory the training's next decision reads


class Verdict(NamedTuple):
    """What follows from how a launch ended."""

    relaunch: bool
    code: int  #: ``run``'s exit code, if this launch is the last
    ended: str  #: how it ended, for the table ("exit 0", "stalled on nccl", ...)
    why: str  #: the line a user reads
    record: Optional[Record] = None


def exit_code(returncode: int) -> int:
    """A child's return code as a shell gives it: 128+N for a death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _signal_of(returncode: int, numbers: Sequence[int]) -> Optional[int]:
    """The signal of ``numbers`` a child died of (-N, or 128+N from a shell or ``timeout``
    in between), if any."""
    for number in numbers:
        if returncode in (-number, 128 + number):
            return int(number)
    return None


def _line_with(error: str, words: Sequence[str]) -> Optional[str]:
    """The first line of ``error`` that holds one of ``words`` (to quote), or None."""
    for line in error.splitlines():
        if any(word in line for word in words):
            return line.strip()[:200]
    return None


def _unreadable(entry: Mapping[str, object]) -> str:
    """The one reason no next decision reads a record of this strategy."""
    return str(entry.get("unread") or "no next decision reads a record of it")


def judge(
    ended: Ended,
    launch: _rundir.Launch,
    recorded: Callable[[Place, str, Optional[str]], Optional[Stall]],
) -> Verdict:
    """The row of API.md's table this launch falls in. ``recorded(place, backend, cache)``:
    the record there now (the watchdog's, for an exit 75). Pure but for that look-up."""
    code = exit_code(ended.returncode)
    if ended.signalled is not None:
        name = _signal_name(ended.signalled)
        return Verdict(False, 128 + ended.signalled, f"stopped by {name}", "your own signal")
    if not ended.starved and ended.returncode == 0:
        return Verdict(False, 0, "exit 0", "the training finished")
    if ended.hung:
        why = "the training finished, then hung at exit (teardown): ended after --grace s"
        return Verdict(False, code, "hung at exit", why)
    ending = f"silent {ended.seconds:.0f} s" if ended.starved else f"exit {code}"
    if not launch.decisions:
        why = f"it ended ({ending}) before any factory built a strategy: {NOT_CURABLE}"
        return Verdict(False, EXIT_STALL if ended.starved else code, ending, why)
    chosen = {
        (d.get("backend"), tuple(d.get("devices") or ()), d.get("task")) for d in launch.decisions
    }
    if len(chosen) > 1:
        why = "the launch built several strategies whose decisions differ: which one failed "
        why += "is not known"
        return Verdict(False, EXIT_STALL if ended.starved else code, ending, why)
    entry = launch.decisions[-1]
    backend, place = str(entry.get("backend")), records.place_of(entry)
    cache = entry.get("cache") if isinstance(entry.get("cache"), str) else None
    remedy = dict(entry.get("remedy") or {})  # type: ignore[call-overload]
    readable = place is not None and place.read
    then = records.next_step(place, backend, remedy, entry.get("next_remedies"))
    beat = launch.beat(entry.get("pid")) or ""
    broken = next((s for s in launch.stalls if s.get("kind") == CORRUPT), None)
    if broken is not None:
        stall = recorded(place, backend, cache) if readable else None  # type: ignore[arg-type]
        return _mirror_broke(broken, code, backend, then, stall, _unreadable(entry))
    if ended.starved:
        if not _rundir.in_collectives(beat):
            why = f"training went silent on {backend} {OWN_WORK}: nothing recorded, and "
            why += "another backend would wait the same way"
            return Verdict(False, EXIT_STALL, ending, why)
        if not readable:
            why = f"training went silent on {backend}, and no record can help "
            why += f"({_unreadable(entry)})"
            return Verdict(False, EXIT_STALL, ending, why)
        record = Record(place, backend, ended.seconds, remedy, "stall", "", cache)  # type: ignore[arg-type]
        why = f"training went silent on {backend} (recorded); {then}"
        return Verdict(True, EXIT_STALL, f"silent on {backend}", why, record)
    peers = next((s for s in launch.stalls if s.get("verdict") in A_WORKERS_DOING), None)
    if peers is not None and peers.get("verdict") == STOPPED:
        why = f"{peers.get('line')}: nothing recorded, and a relaunch would wait for it"
        return Verdict(False, code, "a peer was stopped", why)
    held = peers is not None and peers.get("verdict") == HELD
    if peers is not None and (ended.returncode == EXIT_STALL or held):  # a worker's cause
        line = str(peers.get("line"))
        if not held:
            return Verdict(True, code, "peer gone", f"{line}: a peer is gone; nothing recorded")
        why = f"{line}: nothing recorded on any worker, and a relaunch would wait for it "
        why += "the same way"
        return Verdict(False, code, "held back by a peer", why)
    outside = next((s for s in launch.stalls if s.get("outside")), None)
    if ended.returncode == EXIT_STALL and outside is not None:
        where = WHERE_OUTSIDE.get(str(outside.get("where")), "outside the all-reduce")
        why = f"training stalled {where}, outside the all-reduce: nothing recorded, and "
        why += "another backend would wait the same way"
        return Verdict(False, code, "stalled outside the all-reduce", why)
    unproven = next((s for s in launch.stalls if s.get("canary") in UNPROVEN), None)
    if ended.returncode == EXIT_STALL and unproven is not None:
        said = str(unproven.get("canary_said"))
        why = f"training stalled on {backend}, but {said}: nothing recorded, and "
        why += UNPROVEN[str(unproven.get("canary"))]
        return Verdict(False, code, "stalled in the program", why)
    if ended.returncode == EXIT_STALL:
        stall = recorded(place, backend, cache) if readable else None  # type: ignore[arg-type]
        if stall is None:
            reason = (
                _unreadable(entry)
                if not readable
                else "the watchdog could not tell which strategy stalled"
            )
            why = f"training stalled on {backend}, and no record the next decision reads "
            why += f"was written ({reason})"
            return Verdict(False, code, f"stalled on {backend}", why)
        why = f"training stalled on {backend} after {stall.seconds:g} s (recorded); "
        why += then
        return Verdict(True, code, f"stalled on {backend}", why)
    crash = _signal_of(ended.returncode, CRASH_SIGNALS)
    # the first step's crash, before any heartbeat: the fault dump's stack is all there is
    inside = _rundir.in_collectives(beat) or (not beat and in_tf_call(launch.fault))
    peer = _line_with(launch.error, PEER_GONE) if entry.get("task") is not None else None
    if peer is not None:
        return Verdict(True, code, "peer gone", f"a peer is gone ({peer}); nothing recorded")
    if crash is not None and inside:
        cause: Optional[str] = f"killed by {_signal_name(crash)}"
    elif crash is not None and _rundir.in_call(beat):
        why = f"killed by {_signal_name(crash)} {OWN_WORK}: {NOT_CURABLE}"
        return Verdict(False, code, ending, why)
    else:
        cause = _line_with(launch.error, ALLREDUCE_ERRORS)
    if cause is None:
        return Verdict(False, code, ending, _not_curable(ended.returncode, launch.error))
    if not readable:
        why = f"training crashed on {backend} ({cause}), and no record can help "
        why += f"({_unreadable(entry)})"
        return Verdict(False, code, f"crashed on {backend}", why)
    record = Record(place, backend, ended.seconds, remedy, "crash", cause, cache)  # type: ignore[arg-type]
    why = f"training crashed on {backend} ({cause}) (recorded); {then}"
    return Verdict(True, code, f"crashed on {backend}", why, record)


def _mirror_broke(
    said: Mapping[str, object],
    code: int,
    backend: str,
    then: str,
    stall: Optional[Stall],
    unreadable: str,
) -> Verdict:
    """A launch whose check of the mirror caught wrong numbers (its run-directory entry
    ``said``): relaunched on the next backend when its ``corrupt`` record (``stall``) is
    there for the next decision, and a next backend there is."""
    line = f"training's all-reduce returned wrong numbers on {said.get('where')}"
    ended = f"wrong numbers on {backend}"
    if said.get("last_resort"):
        why = f"{line}, and no other backend passes on these devices: {said['last_resort']}"
        return Verdict(False, code, ended, why)
    if stall is None or stall.kind != CORRUPT:
        why = f"{line}, and no record the next decision reads was written ({unreadable})"
        return Verdict(False, code, ended, why)
    return Verdict(True, code, ended, f"{line} (recorded); {then}")


#: What the canary showed of a stall it did not convict (the watchdog's ``canary``), and
#: why that is no reason to relaunch.
UNPROVEN = {
    "answered": "another backend would wait the same way",
    "none": "a relaunch on another backend would only be a guess",
}

#: Where the watchdog placed a stall outside the all-reduce, as ``run`` says it.
WHERE_OUTSIDE = {
    "input": "waiting for input data (an iterator's get_next, outside a step)",
    "op": "in an eager op outside any step",
}


def _not_curable(returncode: int, error: str) -> str:
    """Why a launch that failed some other way is not relaunched: a signal from outside
    (a user's Ctrl-C or kill, a scheduler, the OOM killer), else not an all-reduce's."""
    number = _signal_of(returncode, OUTSIDE_SIGNALS)
    if number is not None:
        return f"the training was ended by {_signal_name(number)}, a signal from outside"
    if error.splitlines()[-1:] == ["KeyboardInterrupt"]:
        return "the training was interrupted (KeyboardInterrupt)"
    return NOT_CURABLE
