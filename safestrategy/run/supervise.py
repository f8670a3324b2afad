"""One launch, supervised: the training and everything it starts, its heartbeats, the signals.

For the shell and the terminal ``run`` and its training are one job (one
process group, as with ``nice`` or ``timeout --foreground``), so Ctrl-C reaches
both, Ctrl-Z stops both and ``run ... &`` is an ordinary background job; what
the training started is found through the process tree
(:mod:`safestrategy._procs`), heartbeats are judged on ``run``'s own monotonic
clock, and time stopped never counts as silence. POSIX only.
"""

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .. import _procs, _rundir
from .judge import Ended

logger = logging.getLogger("safestrategy")

#: Signals ``run`` passes on to the training (SIGINT as SIGINT, the others as SIGTERM).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


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
            _rundir.in_call(beat) and now - self.changed[pid] > limit
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
    wake = _Wake()
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
    kill_at, starved, hung, said = None, False, False, False
    ended, waiter = _waiter(child, wake)
    try:
        while not ended.is_set():
            wake.wait(poll)
            now = time.monotonic()
            beats.sample(now)
            if got and not said:
                said = True
                say(
                    f"stopping: the training ends within {grace:g} s (--grace); "
                    "Ctrl-C again to kill it now"
                )
            if kill_at is None and got:
                kill_at = now + grace
            if kill_at is None and beats.starved(now):
                starved, kill_at = True, now + grace
                _procs.signal_all(_procs.descendants(me), signal.SIGTERM)
            for pid in beats.hung_at_exit(now):
                say(
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
        waiter.join()  # its last act writes to ``wake``: closed only after it
        wake.close()
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


class _Wake:
    """What the loop sleeps on: a pipe a signal handler or a thread writes a byte to. Not a
    ``threading.Event``: its ``set`` takes a lock, and a handler runs in the main thread,
    which may hold that lock inside ``wait`` when the signal lands, so ``run`` deadlocked
    (a second Ctrl-C never killed the training). ``os.write`` takes none."""

    def __init__(self) -> None:
        self.reader, self.writer = os.pipe()
        for end in (self.reader, self.writer):
            os.set_blocking(end, False)

    def set(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: the loop wakes anyway
            os.write(self.writer, b"!")

    def wait(self, timeout: float) -> None:
        """Until woken (which it forgets) or ``timeout`` s."""
        if select.select([self.reader], [], [], timeout)[0]:
            with contextlib.suppress(BlockingIOError):
                os.read(self.reader, 4096)

    def close(self) -> None:
        os.close(self.reader)
        os.close(self.writer)


def _waiter(
    child: "subprocess.Popen[bytes]", wake: _Wake
) -> Tuple[threading.Event, threading.Thread]:
    """An event set the moment ``child`` ends, and the thread blocked in its wait that sets
    it (and ``wake``): the loop sees an exit at once, so a relaunch follows with no polling
    delay, and wakes only to read the heartbeat (``Popen.wait(timeout)`` would poll every
    50 ms beside the training)."""
    ended = threading.Event()

    def wait() -> None:
        child.wait()
        ended.set()
        wake.set()

    thread = threading.Thread(target=wait, name="safestrategy-run-wait", daemon=True)
    thread.start()
    return ended, thread


def say(text: str) -> None:
    """One line from ``run`` on stderr and the ``safestrategy`` logger."""
    print(f"safestrategy run: {text}", file=sys.stderr, flush=True)
    logger.info("safestrategy run: %s", text)
