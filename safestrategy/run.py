"""``python -m safestrategy run -- COMMAND``: relaunch a training an all-reduce stalled or killed.

The watchdog can end a stuck process (exit 75) and the next launch avoids the
backend that stalled, but someone has to launch it again, and a scheduler
relaunches with the same broken configuration. ``run`` starts the command as a
child, reads what it left in its run directory (:mod:`safestrategy._rundir`:
its decisions, its heartbeat, an uncaught error, a fault), and relaunches it
when a different all-reduce can cure the failure *and* a record was written
that the child's own next decision reads, so that it trains on the next backend.

How a launch ended and what follows is one pure function, :func:`judge`
(API.md's table); :func:`supervise` runs one launch (a process group of its
own, the terminal's foreground group when stdin is a terminal, heartbeat
watched on ``run``'s own monotonic clock, signals forwarded); :func:`main` is
the loop. POSIX only in 0.4. ``run`` never imports TensorFlow.
"""

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from . import _env, _machine, _rundir
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
#: Multi-worker: the collectives were aborted because a peer is gone: TF's health check
#: ("is down"), the coordination service (a peer "stopped sending heartbeats"), or the
#: transport to a peer that died ("Socket closed" from a remote target, the coordination
#: service's leader among them).
PEER_GONE = (
    "is down",
    "check alive failed",
    "heartbeat",
    "coordination service",
    "Socket closed",
    "Connection reset by peer",
    "failed to connect to all addresses",
)
#: Signals forwarded to the child's group (SIGINT as SIGINT, the others as SIGTERM).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
NOT_CURABLE = "not an all-reduce failure: a relaunch would fail the same way"


class Ended(NamedTuple):
    """How one launch ended, as ``run`` saw it."""

    returncode: int  #: the child's (negative: killed by that signal)
    seconds: float  #: how long it ran
    starved: bool = False  #: ``run`` killed it: its heartbeat stopped inside a TF call
    signalled: Optional[int] = None  #: a signal ``run`` itself got (forwarded to the child)


class Record(NamedTuple):
    """A record ``run`` writes for a launch (a crash, or a stall the watchdog could not)."""

    place: Place
    backend: str
    seconds: float
    remedy: Mapping[str, str]
    kind: str  #: "stall" or "crash"
    cause: str = ""


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


def _crash_signal(returncode: int) -> Optional[int]:
    """The crash signal a child died of (-N, or 128+N from a shell in between), if any."""
    for number in CRASH_SIGNALS:
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
    """Why no next decision reads a record of this strategy."""
    if entry.get("mode") == "forced":
        return "a forced backend"
    if len(entry.get("devices") or ()) < 2:  # type: ignore[arg-type]
        return "one device"
    return "your own cross_device_ops, or the cache off"


def judge(
    ended: Ended,
    launch: _rundir.Launch,
    recorded: Callable[[Place, str], Optional[Stall]],
) -> Verdict:
    """The row of API.md's table this launch falls in. ``recorded(place, backend)``: the
    record there now (the watchdog's, for an exit 75). Pure but for that look-up."""
    code = exit_code(ended.returncode)
    if ended.signalled is not None:
        name = _signal_name(ended.signalled)
        return Verdict(False, 128 + ended.signalled, f"stopped ({name} to run)", f"run got {name}")
    if not ended.starved and ended.returncode == 0:
        return Verdict(False, 0, "exit 0", "the training finished")
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
    remedy = dict(entry.get("remedy") or {})  # type: ignore[call-overload]
    readable = place is not None and place.read
    then = stalls.next_step(place, backend, remedy, entry.get("next_remedies"))
    if ended.starved:
        if not readable:
            why = (
                f"training went silent on {backend}, and no record can help ({_unreadable(entry)})"
            )
            return Verdict(False, EXIT_STALL, ending, why)
        record = Record(place, backend, ended.seconds, remedy, "stall")  # type: ignore[arg-type]
        why = f"training went silent on {backend} (recorded); {then}"
        return Verdict(True, EXIT_STALL, f"silent on {backend}", why, record)
    if ended.returncode == EXIT_STALL:
        stall = recorded(place, backend) if readable else None  # type: ignore[arg-type]
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
    crash = _crash_signal(ended.returncode)
    inside = launch.beats is not None and launch.beats.endswith("inside")
    peer = _line_with(launch.error, PEER_GONE) if entry.get("task") is not None else None
    if peer is not None:
        return Verdict(True, code, "peer gone", f"a peer is gone ({peer}); nothing recorded")
    if crash is not None and inside:
        cause: Optional[str] = f"killed by {_signal_name(crash)}"
    else:
        cause = _line_with(launch.error, ALLREDUCE_ERRORS)
    if cause is None:
        return Verdict(False, code, ending, NOT_CURABLE)
    if not readable:
        why = f"training crashed on {backend} ({cause}), and no record can help "
        why += f"({_unreadable(entry)})"
        return Verdict(False, code, f"crashed on {backend}", why)
    record = Record(place, backend, ended.seconds, remedy, "crash", cause)  # type: ignore[arg-type]
    why = f"training crashed on {backend} ({cause}) (recorded); {then}"
    return Verdict(True, code, f"crashed on {backend}", why, record)


def _child_setup() -> None:
    """In the child, before exec: lead a new process group; on Linux die with ``run``."""
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


def _beat(where: str, pid: int) -> Optional[str]:
    with contextlib.suppress(OSError), open(os.path.join(where, f"heartbeat-{pid}")) as stream:
        return stream.read().strip()
    return None


def _timeout_in_force(where: str, default: Optional[float]) -> Optional[float]:
    """The stall timeout the child's latest decision says is in force (the child may set
    its own), else ``default`` (``run``'s environment)."""
    decisions = _rundir.read(where).decisions
    if decisions and "stall_timeout" in decisions[-1]:
        value = decisions[-1]["stall_timeout"]
        return float(value) if isinstance(value, (int, float)) else None
    return default


def _kill_group(pgid: int, number: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pgid, number)


def supervise(
    command: Sequence[str],
    env: Mapping[str, str],
    where: str,
    stall_timeout: Optional[float],
    grace: float,
    poll: float = 0.25,
) -> Ended:
    """Run one launch of ``command`` to its end. Its heartbeat's counter is judged on
    ``run``'s own clock: silent for longer than ``stall_timeout + grace`` while inside a TF
    call, its group gets SIGTERM, then SIGKILL after ``grace``. A signal to ``run`` is
    forwarded to the group (SIGKILL after ``grace``; a second SIGINT kills at once). The
    stall timeout is the one the child's latest decision says is in force, else
    ``stall_timeout``."""
    started = time.monotonic()
    got: List[int] = []
    previous = {}

    def forward(number: int, frame: object) -> None:
        again = number == signal.SIGINT and signal.SIGINT in got
        got.append(number)
        _kill_group(
            child.pid,
            signal.SIGKILL
            if again
            else (signal.SIGINT if number == signal.SIGINT else signal.SIGTERM),
        )

    child = subprocess.Popen(list(command), env=dict(env), preexec_fn=_child_setup)
    terminal = _foreground(child.pid)
    for number in FORWARDED:
        previous[number] = signal.signal(number, forward)
    last_beat, changed, kill_at, starved = None, time.monotonic(), None, False
    timeout = stall_timeout
    try:
        ended = _waiter(child)
        while not ended.wait(poll):
            now = time.monotonic()
            beat = _beat(where, child.pid)
            if beat != last_beat:
                last_beat, changed = beat, now
                timeout = _timeout_in_force(where, stall_timeout)
            silent = now - changed
            inside = beat is not None and beat.endswith("inside")
            if kill_at is None and got:
                kill_at = now + grace
            if kill_at is None and timeout is not None and inside and silent > timeout + grace:
                starved, kill_at = True, now + grace
                _kill_group(child.pid, signal.SIGTERM)
            if kill_at is not None and now > kill_at:
                _kill_group(child.pid, signal.SIGKILL)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        _kill_group(child.pid, signal.SIGKILL)  # whatever of the group is left (grandchildren)
        _background(terminal)
    return Ended(child.returncode, time.monotonic() - started, starved, got[0] if got else None)


def _waiter(child: "subprocess.Popen[bytes]") -> threading.Event:
    """An event set the moment ``child`` ends (a thread blocked in its wait): the loop sees
    an exit at once, so a relaunch follows with no polling delay, and wakes only to read
    the heartbeat (``Popen.wait(timeout)`` would poll every 50 ms beside the training)."""
    ended = threading.Event()

    def wait() -> None:
        child.wait()
        ended.set()

    threading.Thread(target=wait, name="safestrategy-run-wait", daemon=True).start()
    return ended


def _foreground(pgid: int) -> Optional[int]:
    """Make ``pgid`` the terminal's foreground group, as a shell does; the group it was."""
    try:
        if not os.isatty(0):
            return None
        before = os.tcgetpgrp(0)
        with _ttou_ignored():
            os.tcsetpgrp(0, pgid)
        return before
    except OSError:
        return None


def _background(before: Optional[int]) -> None:
    """Take the terminal back for ``run``'s group."""
    if before is not None:
        with contextlib.suppress(OSError), _ttou_ignored():
            os.tcsetpgrp(0, before)


@contextlib.contextmanager
def _ttou_ignored():  # type: ignore[no-untyped-def]
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTTOU, previous)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="safestrategy run",
        description="Run a training and relaunch it when an all-reduce stalled or crashed "
        "it, so that its own next decision trains on the next backend (POSIX only).",
        epilog="example: python -m safestrategy run --max-restarts 3 -- python train.py",
    )
    parser.add_argument(
        "--max-restarts", type=int, default=3, metavar="N", help="relaunches after the first"
    )
    parser.add_argument(
        "--grace", type=float, default=30.0, metavar="S", help="seconds between SIGTERM and SIGKILL"
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
    base = _runs_directory(cache)
    env = dict(os.environ)
    if not user_action:
        env[_env.ENV_STALL_ACTION] = "exit"
    launches = args.max_restarts + 1
    rows: List[Tuple[int, str, str, float]] = []
    verdict = None
    for number in range(launches):
        where = os.path.join(base, f"launch-{number}")
        os.makedirs(where, exist_ok=True)
        env.update(
            {
                _env.ENV_RESTART: str(number),
                _env.ENV_RUN_DIR: where,
                _env.ENV_RUN_PARENT: str(os.getpid()),
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


def _runs_directory(cache: bool) -> str:
    """A fresh directory for this run's launches: under the cache, else a temporary one."""
    if cache:
        base = os.path.join(_env.cache_dir(), "runs")
        with contextlib.suppress(OSError):
            os.makedirs(base, exist_ok=True)
            return tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=base)
    return tempfile.mkdtemp(prefix="safestrategy-run-")


def _table(rows: Sequence[Tuple[int, str, str, float]]) -> str:
    lines = [f"  {'launch':>6}  {'backend':<18} {'ended':<28} {'seconds':>8}"]
    lines.extend(f"  {n:>6}  {b:<18} {e:<28} {s:>8.1f}" for n, b, e, s in rows)
    return "\n".join(lines)
