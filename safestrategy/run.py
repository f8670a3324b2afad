"""``python -m safestrategy run -- COMMAND``: relaunch a training an all-reduce stalled or killed.

The watchdog can end a stuck process (exit 75) and the next launch avoids the
backend that stalled, but someone has to launch it again, and a scheduler
relaunches with the same broken configuration. ``run`` starts the command as a
child, reads what it left in its run directory (:mod:`safestrategy._rundir`:
its decisions, its heartbeat, an uncaught error, a fault), and relaunches it
when a different all-reduce can cure the failure *and* a record was written
that the child's own next decision reads, so that it trains on the next backend.

How a launch ended and what follows is one pure function, :func:`judge`
(API.md's table); :func:`supervise` runs one launch: for the shell and the
terminal ``run`` and its training are one job (one process group, as with
``nice`` or ``timeout --foreground``), so Ctrl-C reaches both, Ctrl-Z stops both
and ``run ... &`` is an ordinary background job; what the training started is
found through the process tree (:mod:`safestrategy._procs`), heartbeats are
judged on ``run``'s own monotonic clock, and time stopped never counts as
silence. :func:`main` is the loop. POSIX only. ``run`` never imports TensorFlow.
"""

import argparse
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from . import _env, _machine, _procs, _rundir
from ._peers import PEER_GONE
from ._watchdog import in_tf_call
from .checks import stalls
from .checks.stalls import Place
from .report import Stall

logger = logging.getLogger("safestrategy")

#: The watchdog's exit code for a stall (``EX_TEMPFAIL``), and ``run``'s after it killed a
#: silent child.
EXIT_STALL = 75
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
#: Signals ``run`` passes on to the training (SIGINT as SIGINT, the others as SIGTERM).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
#: Signals that end a process from outside (a user, a scheduler, the OOM killer).
OUTSIDE_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGKILL)
NOT_CURABLE = "not an all-reduce failure: a relaunch would fail the same way"
#: How many launches' directories ``<cache>/runs/`` keeps.
KEEP_LAUNCHES = 20


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
    backend, place = str(entry.get("backend")), stalls.place_of(entry)
    cache = entry.get("cache") if isinstance(entry.get("cache"), str) else None
    remedy = dict(entry.get("remedy") or {})  # type: ignore[call-overload]
    readable = place is not None and place.read
    then = stalls.next_step(place, backend, remedy, entry.get("next_remedies"))
    if ended.starved:
        if not readable:
            why = f"training went silent on {backend}, and no record can help "
            why += f"({_unreadable(entry)})"
            return Verdict(False, EXIT_STALL, ending, why)
        record = Record(place, backend, ended.seconds, remedy, "stall", "", cache)  # type: ignore[arg-type]
        why = f"training went silent on {backend} (recorded); {then}"
        return Verdict(True, EXIT_STALL, f"silent on {backend}", why, record)
    peers = next((s for s in launch.stalls if s.get("verdict") in ("held", "gone")), None)
    held = peers is not None and peers.get("verdict") == "held"
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
    beat = launch.beat(entry.get("pid")) or ""
    inside = beat.endswith("inside") or (beat != _rundir.FINISHED and in_tf_call(launch.fault))
    peer = _line_with(launch.error, PEER_GONE) if entry.get("task") is not None else None
    if peer is not None:
        return Verdict(True, code, "peer gone", f"a peer is gone ({peer}); nothing recorded")
    if crash is not None and inside:
        cause: Optional[str] = f"killed by {_signal_name(crash)}"
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


def _child_setup() -> None:
    """In the child, before exec: on Linux, die with ``run`` (even a SIGKILLed one). It
    stays in ``run``'s process group: for the shell they are one job."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


def _timeout_in_force(where: str, default: Optional[float]) -> Optional[float]:
    """The stall timeout the training's latest decision says is in force (it may set its
    own), else ``default`` (``run``'s environment)."""
    decisions = _rundir.read(where).decisions
    if decisions and "stall_timeout" in decisions[-1]:
        value = decisions[-1]["stall_timeout"]
        return float(value) if isinstance(value, (int, float)) else None
    return default


def _in_the_foreground() -> bool:
    """Whether ``run``'s group is its terminal's foreground job: a Ctrl-C there reached the
    training as well, so ``run`` passes nothing on."""
    for descriptor in (0, 1, 2):
        with contextlib.suppress(OSError):
            if os.isatty(descriptor):
                return os.tcgetpgrp(descriptor) == os.getpgrp()
    return False


class _Beats:
    """The trainings' heartbeats, each judged by its counter changing on ``run``'s clock.
    Time stopped is no silence: not while ``run`` itself was stopped (its loop woke late:
    Ctrl-Z stops the whole job), nor while a training is stopped (SIGSTOP, a debugger)."""

    def __init__(self, where: str, timeout: Optional[float], grace: float, poll: float):
        self.where, self.default, self.grace, self.poll = where, timeout, grace, poll
        self.timeout = timeout
        self.last: Dict[int, str] = {}
        self.changed: Dict[int, float] = {}
        self.finished: Dict[int, float] = {}
        self.woke = time.monotonic()

    def sample(self, now: float) -> None:
        late = now - self.woke - self.poll
        self.woke = now
        if late > 1.0:  # run was stopped (or starved): that time is no one's silence
            self.changed = {pid: since + late for pid, since in self.changed.items()}
        for pid, beat in _rundir.heartbeats(self.where).items():
            if beat != self.last.get(pid):
                self.last[pid], self.changed[pid] = beat, now
                self.timeout = _timeout_in_force(self.where, self.default)
            if beat == _rundir.FINISHED:
                self.finished.setdefault(pid, now)
        quiet = [pid for pid, since in self.changed.items() if now - since > 1.0]
        for pid in _procs.stopped(quiet):  # a look only at those not heard for a second
            self.changed[pid] = now

    def starved(self, now: float) -> bool:
        """Some training has been silent inside a TF call for its stall timeout + grace."""
        if self.timeout is None:
            return False
        limit = self.timeout + self.grace
        return any(
            beat.endswith("inside") and now - self.changed[pid] > limit
            for pid, beat in self.last.items()
        )

    def hung_at_exit(self, now: float) -> List[int]:
        """Trainings that said ``finished`` over ``grace`` s ago and still run (teardown)."""
        late = [pid for pid, since in self.finished.items() if now - since > self.grace]
        return [pid for pid in late if _procs.alive(pid)]


def supervise(
    command: Sequence[str],
    env: Mapping[str, str],
    where: str,
    stall_timeout: Optional[float],
    grace: float,
    poll: float = 0.25,
) -> Ended:
    """Run one launch of ``command`` to its end, with everything it starts. A training
    silent for longer than its stall timeout + ``grace`` while inside a TF call gets
    SIGTERM, then SIGKILL after ``grace``, as do all of the launch's processes; one that said
    ``finished`` and has not exited after ``grace`` is ended. Ctrl-C (SIGINT) says so at
    once and ends the launch after ``grace`` (a second, at once); SIGTERM, SIGHUP and
    SIGQUIT pass on as SIGTERM. The stall timeout is the one the training's latest
    decision says is in force, else ``stall_timeout``."""
    started = time.monotonic()
    me = os.getpid()
    got: List[int] = []
    wake = threading.Event()
    previous = {}

    def on_signal(number: int, frame: object) -> None:
        again = number == signal.SIGINT and signal.SIGINT in got
        got.append(number)
        wake.set()
        if again:
            _procs.signal_all(_procs.descendants(me), signal.SIGKILL)
        elif number != signal.SIGINT:
            _procs.signal_all(_procs.descendants(me), signal.SIGTERM)
        elif not _in_the_foreground():  # a terminal's Ctrl-C reached the training already
            _procs.signal_all(_procs.descendants(me), signal.SIGINT)

    child = subprocess.Popen(list(command), env=dict(env), preexec_fn=_child_setup)
    for number in FORWARDED:
        previous[number] = signal.signal(number, on_signal)
    beats = _Beats(where, stall_timeout, grace, poll)
    kill_at, starved, hung, said, ended = None, False, False, False, _waiter(child, wake)
    try:
        while not ended.is_set():
            wake.wait(poll)
            wake.clear()
            now = time.monotonic()
            beats.sample(now)
            if got and not said:
                said = True
                _say(
                    f"stopping: the training ends within {grace:g} s (--grace); "
                    "Ctrl-C again to kill it now"
                )
            if kill_at is None and got:
                kill_at = now + grace
            if kill_at is None and beats.starved(now):
                starved, kill_at = True, now + grace
                _procs.signal_all(_procs.descendants(me), signal.SIGTERM)
            for pid in beats.hung_at_exit(now):
                _say(
                    f"the training (pid {pid}) said it finished over {grace:g} s ago and has "
                    "not exited (a hang in teardown): ending it"
                )
                _procs.signal_all([pid, *_procs.descendants(pid)], signal.SIGKILL)
                beats.finished.pop(pid)
                hung = True
            if kill_at is not None and now > kill_at:
                _procs.signal_all(_procs.descendants(me), signal.SIGKILL)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        _end_the_rest(me, child)
    seconds = time.monotonic() - started
    return Ended(child.returncode, seconds, starved, got[0] if got else None, hung)


def _end_the_rest(me: int, child: "subprocess.Popen[bytes]") -> None:
    """Whatever the launch started and left (a grandchild, a process that ignores SIGTERM)
    ends with it; the orphans re-parented to ``run`` are reaped."""
    left = _procs.descendants(me)
    _procs.signal_all(left, signal.SIGKILL)
    if child.poll() is None:
        child.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_procs.alive(pid) for pid in left):
        _procs.reap_orphans(child.pid)
        time.sleep(0.05)
    _procs.reap_orphans(child.pid)


def _waiter(child: "subprocess.Popen[bytes]", wake: threading.Event) -> threading.Event:
    """An event set the moment ``child`` ends (a thread blocked in its wait; ``wake`` too):
    the loop sees an exit at once, so a relaunch follows with no polling delay, and wakes
    only to read the heartbeat (``Popen.wait(timeout)`` would poll every 50 ms beside the
    training)."""
    ended = threading.Event()

    def wait() -> None:
        child.wait()
        ended.set()
        wake.set()

    threading.Thread(target=wait, name="safestrategy-run-wait", daemon=True).start()
    return ended


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="safestrategy run",
        description="Run a training and relaunch it when an all-reduce stalled or crashed "
        "it, so that its own next decision trains on the next backend (POSIX only).",
        epilog="example: python -m safestrategy run --max-restarts 3 -- python train.py",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="N",
        help="relaunches after the first launch (default: %(default)s)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds run gives a training to end by itself: after Ctrl-C, after the "
        "training says it finished (its heartbeat) but has not exited, and between SIGTERM "
        "and SIGKILL (default: %(default)g)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS ...]")
    return parser


def _say(text: str) -> None:
    print(f"safestrategy run: {text}", file=sys.stderr, flush=True)
    logger.info("safestrategy run: %s", text)


def _cannot(settings: _env.StallSettings, cache: bool, user_action: bool) -> List[str]:
    """What ``run`` cannot do under the user's settings."""
    notes = []
    if user_action and settings.action == "warn":
        notes.append(
            f"{_env.ENV_STALL_ACTION}=warn: a stalled training is not ended, so not relaunched"
        )
    if settings.timeout is None:
        notes.append(f"{_env.ENV_STALL_TIMEOUT}=off: no stall is seen and no heartbeat is judged")
    if not cache:
        notes.append(f"{_env.ENV_CACHE}=off: no record is kept, so no relaunch on the next backend")
    return notes


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if _machine.system() == "Windows":
        print(
            "safestrategy run: POSIX only in 0.4 (Windows would need Job Objects and console "
            "control events): run the training directly",
            file=sys.stderr,
        )
        return 2
    if not command:
        parser.error("give the command to run after --, e.g. -- python train.py")
    if args.max_restarts < 0 or not args.grace > 0:
        parser.error("--max-restarts takes a whole number >= 0, --grace a positive number")
    try:
        settings = _env.resolve_stall()
        cache = _env.resolve_switch(_env.ENV_CACHE)
    except ValueError as error:
        print(f"safestrategy run: error: {error}", file=sys.stderr)
        return 2
    user_action = bool(os.environ.get(_env.ENV_STALL_ACTION, "").strip())
    notes = _cannot(settings, cache, user_action)
    if notes:
        _say("; ".join(notes))
    base, runs = _runs_directory(cache)
    _procs.become_subreaper()  # a training a wrapper left behind is still found and ended
    env = dict(os.environ)
    if not user_action:
        env[_env.ENV_STALL_ACTION] = "exit"
    launches = args.max_restarts + 1
    rows: List[Tuple[int, str, str, float]] = []
    verdict = None
    for number in range(launches):
        where = os.path.join(base, f"launch-{number}")
        os.makedirs(where, exist_ok=True)
        if runs is not None:
            _prune(runs, KEEP_LAUNCHES)
        env.update(
            {
                _env.ENV_RESTART: str(number),
                _env.ENV_RUN_DIR: where,
                _env.ENV_RUN_GRACE: repr(args.grace),
            }
        )
        try:
            ended = supervise(command, env, where, settings.timeout, args.grace)
        except OSError as error:
            print(f"safestrategy run: cannot start {command[0]!r}: {error}", file=sys.stderr)
            return 127
        launch = _rundir.read(where)
        verdict = judge(ended, launch, stalls.read)
        if verdict.record is not None:
            record = verdict.record
            stalls.record(
                record.place,
                record.backend,
                record.seconds,
                record.remedy,
                record.kind,
                record.cause,
                record.where,
            )
        backend = str(launch.decisions[-1].get("backend")) if launch.decisions else "-"
        rows.append((number + 1, backend, verdict.ended, ended.seconds))
        if not verdict.relaunch:
            if verdict.code != 0:
                _say(f"launch {number + 1} ended ({verdict.ended}): {verdict.why}; not relaunched")
            break
        if number + 1 == launches:
            _say(f"launch {number + 1}: {verdict.why}; the {args.max_restarts} restarts are spent")
            break
        _say(f"launch {number + 2} of {launches}: {verdict.why}")
    _say("launches:\n" + _table(rows))
    return verdict.code if verdict is not None else 0


def _runs_directory(cache: bool) -> Tuple[str, Optional[str]]:
    """A fresh directory for this run's launches, under the cache's ``runs/`` (returned
    too: it is pruned), else a temporary one (and None)."""
    if cache:
        runs = os.path.join(_env.cache_dir(), "runs")
        with contextlib.suppress(OSError):
            os.makedirs(runs, exist_ok=True)
            prefix = time.strftime("%Y%m%d-%H%M%S-")
            return tempfile.mkdtemp(prefix=prefix, dir=runs), runs
    return tempfile.mkdtemp(prefix="safestrategy-run-"), None


def _prune(runs: str, keep: int) -> None:
    """Remove all but the newest ``keep`` launch directories under ``runs`` (and the run
    directories that are left empty): ``<cache>/runs/`` does not grow for ever."""
    launches = []
    with contextlib.suppress(OSError):
        for run_dir in os.listdir(runs):
            with contextlib.suppress(OSError):
                for name in os.listdir(os.path.join(runs, run_dir)):
                    path = os.path.join(runs, run_dir, name)
                    if name.startswith("launch-") and os.path.isdir(path):
                        launches.append((os.stat(path).st_mtime, path))
    for _, path in sorted(launches)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))  # only when it is empty


def _table(rows: Sequence[Tuple[int, str, str, float]]) -> str:
    lines = [f"  {'launch':>6}  {'backend':<18} {'ended':<28} {'seconds':>8}"]
    lines.extend(f"  {n:>6}  {b:<18} {e:<28} {s:>8.1f}" for n, b, e, s in rows)
    return "\n".join(lines)
