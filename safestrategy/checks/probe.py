"""The probe process, parent side: where a check that can hang or abort (NCCL) runs.

A probe process is a fresh interpreter running :mod:`safestrategy.checks.child`,
started with ``subprocess`` (never forked, and no re-import of the caller's
``__main__`` as ``multiprocessing``'s spawn would do). It imports the very
``safestrategy`` the caller imported, whatever the current directory or
``PYTHONPATH`` holds. It talks in JSON lines marked with :data:`PREFIX`, so a
banner that a ``sitecustomize`` or TensorFlow prints to stdout cannot break
the conversation.

It never outlives the caller: it dies with its parent (Linux:
``PR_SET_PDEATHSIG``), and on every OS a watchdog in it exits when its stdin
closes, which the OS does when the caller ends in any way. The caller kills
and reaps it on every exit path of its own (timeout, error, Ctrl-C).
Everything that goes wrong on the way becomes :class:`ProbeDied` or
:class:`ProbeTimeout` with a reason, never a raw exception. :class:`Shared` is
the one owner of a probe process that serves several candidates: started on
first use, reused only while it is healthy, closed.
"""

import collections
import contextlib
import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .. import _env
from ..report import FAILED, OK, TIMEOUT, CandidateResult
from .allreduce import from_reply

logger = logging.getLogger("safestrategy")

#: Marks the probe process's protocol lines on its stdout.
PREFIX = "@safestrategy@ "

#: How the probe process is started; None: this interpreter running the bootstrap
#: below. The one seam tests replace with a fake.
CHILD_COMMAND: Optional[List[str]] = None

#: Seconds the probe process may take to import TensorFlow and report its facts.
STARTUP_TIMEOUT = 120.0

_BOOTSTRAP = (
    "import sys; sys.path.insert(0, {root!r}); "
    "from safestrategy.checks.child import main; sys.exit(main(sys.argv[1:]))"
)


class ProbeTimeout(TimeoutError):
    """The probe process did not answer in time (it has been killed)."""


class ProbeDied(RuntimeError):
    """The probe process could not start, exited or crashed, or answered nonsense; the
    message is a reason as reports show it ("the probe process died: ...")."""


_SUBJECT = "the probe process "
_COULD_NOT_START = f"{_SUBJECT}could not start: "


#: Windows exit statuses of a crashed process (NTSTATUS), as the probe process reports them.
_NTSTATUS = {
    0xC0000005: "access violation",
    0xC000001D: "illegal instruction (a TensorFlow build for a newer CPU, e.g. AVX)",
    0xC0000135: "a DLL was not found",
    0xC0000409: "fail-fast abort",
}


def _exit_text(returncode: int) -> str:
    if returncode < 0:  # POSIX: killed by a signal
        try:
            return f"killed by signal {signal.Signals(-returncode).name} ({-returncode})"
        except ValueError:
            return f"killed by signal {-returncode}"
    code = returncode & 0xFFFFFFFF
    crash = _NTSTATUS.get(code)
    return f"exit status {returncode} ({code:#x}{', ' + crash if crash else ''})"


# TensorFlow's own log lines: its start-up banner, never why a process died. TF 1.x and 2.x
# before absl ("2026-01-01 10:00:00.123456: I tensorflow/core/util/port.cc:113] oneDNN custom
# operations are on..."), absl since TF 2.16 ("I0000 00:00:1733000000.123456   12345
# port.cc:153] oneDNN custom operations are on...", "E0000 ...", "WARNING: All log messages
# before absl::InitializeLog()..."), and the CPU guard's second line ("To enable the following
# instructions: AVX2 FMA, in other operations, rebuild TensorFlow ..."). Fatal "F" lines are
# not chatter: they say why.
_TF_LOG = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWE] "
    r"|[IWE]\d{4} \d\d:\d\d:\d+\.\d+ "
    r"|WARNING: All log messages before absl::InitializeLog\(\)"
    r"|To enable the following instructions: .* rebuild TensorFlow)"
)


def useful_last_line(lines: Any) -> str:
    """The line of a dying process's stderr most likely to say why: the last one that is
    not TensorFlow's INFO/WARNING/ERROR chatter (a traceback's last line, a fatal "F"
    log, "Check failed"); "" when there is none (chatter says nothing about why)."""
    stripped = (line.strip() for line in reversed(list(lines)))
    return next((line for line in stripped if line and not _TF_LOG.match(line)), "")


def _command(request: Mapping[str, Any]) -> List[str]:
    if CHILD_COMMAND is not None:
        return [*CHILD_COMMAND, json.dumps(request)]
    if getattr(sys, "frozen", False):
        raise ProbeDied(
            f"{_COULD_NOT_START}this is a frozen application, whose executable cannot run it"
        )
    if not sys.executable:
        raise ProbeDied(f"{_COULD_NOT_START}this interpreter does not know its executable")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return [sys.executable, "-c", _BOOTSTRAP.format(root=root), json.dumps(request)]


#: Probe processes not closed yet, so that an ending process can leave none behind.
_open: "weakref.WeakSet[ProbeProcess]" = weakref.WeakSet()


def close_all() -> None:
    """Kill and reap every probe process still open (a process about to ``os._exit``)."""
    for process in list(_open):
        process.close()


class ProbeProcess:
    """One probe process and its line-based JSON conversation; a context manager that
    kills and reaps it however the block ends."""

    def __init__(self, request: Mapping[str, Any], env: Optional[Mapping[str, str]] = None):
        # The user's environment, not ours: a remedy set for another device set would make
        # this check pass without it, and its verdict say "no remedy needed".
        full_env = _env.user_environ()
        full_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        full_env.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
        full_env.update(env or {})
        full_env.pop(_env.ENV_RUN_DIR, None)  # a probe process is never the training
        request = {**request, "parent": os.getpid()}
        try:
            self.process = subprocess.Popen(
                _command(request),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                # Not the locale's codec (cp1252 on Windows, ASCII under LANG=C on 3.6): one
                # undecodable byte from TensorFlow would end a reader thread, the pipe would
                # fill, and a working candidate would time out.
                encoding="utf-8",
                errors="replace",
                env=full_env,
            )
        except (OSError, ValueError) as error:
            raise ProbeDied(f"{_COULD_NOT_START}{type(error).__name__}: {error}") from None
        _open.add(self)
        self.replies: queue.Queue = queue.Queue()
        self.stderr: Deque[str] = collections.deque(maxlen=40)
        self._stderr_reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._stderr_reader.start()
        threading.Thread(target=self._read_stdout, daemon=True).start()

    def __enter__(self) -> "ProbeProcess":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _read_stdout(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            for line in self.process.stdout:
                if line.startswith(PREFIX):
                    self.replies.put(line[len(PREFIX) :])
                else:
                    logger.debug("probe process (stdout): %s", line.rstrip())
        self.replies.put(None)

    def _read_stderr(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            for line in self.process.stderr:
                self.stderr.append(line.rstrip())
                logger.debug("probe process: %s", line.rstrip())

    def receive(self, timeout: float) -> Dict[str, Any]:
        """The next reply; ``ProbeTimeout`` or ``ProbeDied`` when there is none."""
        try:
            line = self.replies.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise ProbeTimeout(
                f"no answer within {timeout:g} s; the probe process was killed"
            ) from None
        if line is None:
            try:
                returncode = self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:  # stdout closed, process still there
                self.close()
                returncode = self.process.returncode
            self._stderr_reader.join(5)  # its last words may still be in the pipe (busy machine)
            last = useful_last_line(self.stderr)
            detail = f"; last output: {last}" if last else ""
            raise ProbeDied(f"{_SUBJECT}died: {_exit_text(returncode)}{detail}")
        try:
            reply = json.loads(line)
            if not isinstance(reply, dict):
                raise ValueError("not a JSON object")
        except ValueError as error:
            self.close()
            raise ProbeDied(f"{_SUBJECT}answered nonsense ({error}): {line[:200]!r}") from None
        return reply

    def send(self, message: Mapping[str, Any]) -> None:
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
        except (OSError, ValueError):
            pass  # it died; receive() reports how

    def ask(self, message: Mapping[str, Any], timeout: float) -> Dict[str, Any]:
        self.send(message)
        return self.receive(timeout)

    @property
    def alive(self) -> bool:
        """Still running (not killed at a timeout, not dead, not closed)."""
        return self.process.poll() is None

    def close(self) -> None:
        """Kill the process if it still runs, and reap it."""
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.close()


def start(
    request: Mapping[str, Any], timeout: float, env: Optional[Mapping[str, str]] = None
) -> Tuple[ProbeProcess, Dict[str, Any]]:
    """A started probe process and the facts it reported first.

    Raises ``ProbeDied`` ("the probe process could not start: ...") when it cannot
    start, dies or does not report within ``max(STARTUP_TIMEOUT, timeout)``; nothing
    is left running.
    """
    process = ProbeProcess(request, env)
    try:
        reply = process.receive(max(STARTUP_TIMEOUT, timeout))
        if "facts" not in reply:
            raise ProbeDied(f"{_SUBJECT}answered nonsense: {reply!r}"[:300])
    except (ProbeTimeout, ProbeDied) as error:
        process.close()
        why = str(error)  # "the probe process died: ..." -> "it died: ..."
        why = "it " + why[len(_SUBJECT) :] if why.startswith(_SUBJECT) else why
        raise ProbeDied(f"{_COULD_NOT_START}{why}") from None
    except BaseException:
        process.close()
        raise
    return process, reply["facts"]


def check(process: ProbeProcess, name: str, replicas: int, timeout: float) -> CandidateResult:
    """Ask a started probe process for backend ``name``'s smoke check, and judge the reply.

    A timeout or a death is that candidate's result (the process is then gone).
    """
    started = time.monotonic()
    try:
        reply = process.ask({"check": name}, timeout)
    except ProbeTimeout as error:
        return CandidateResult(name, TIMEOUT, str(error), timeout)
    except ProbeDied as error:
        return CandidateResult(name, FAILED, str(error), round(time.monotonic() - started, 3))
    return from_reply(name, reply, replicas, time.monotonic() - started)


def median_ms(
    process: ProbeProcess, name: str, payload_mb: float, timeout: float
) -> Union[float, str]:
    """Backend ``name``'s median ms on the payload, timed in a started probe process, or
    why it could not be (a timeout or a death: the process is then gone)."""
    try:
        reply = process.ask({"time": name, "payload_mb": payload_mb}, timeout)
    except (ProbeTimeout, ProbeDied) as error:
        return str(error)
    ms = reply.get("ms")
    if isinstance(ms, (int, float)):
        return float(ms)
    return ": ".join(str(part) for part in reply.get("error") or ["no time in the reply"])


def sweep_ms(
    process: ProbeProcess, name: str, counts: Sequence[int], runs: int, timeout: float
) -> List[float]:
    """Backend ``name``'s median ms (of ``runs``, after a warm-up) on one float32 tensor per
    replica of each element count in ``counts``, in a started probe process (``--benchmark``).

    Raises ``ProbeTimeout`` or ``ProbeDied`` when there is no answer within ``timeout`` (the
    process is then gone), ``RuntimeError`` ("Type: message") when the sweep failed there.
    """
    reply = process.ask({"sweep": name, "sizes": list(counts), "runs": runs}, timeout)
    ms = reply.get("ms")
    numbers = isinstance(ms, list) and all(isinstance(value, (int, float)) for value in ms)
    if numbers and len(ms) == len(counts):
        return [float(value) for value in ms]
    if reply.get("error"):
        raise RuntimeError(": ".join(str(part) for part in reply["error"]))
    raise RuntimeError(f"{_SUBJECT}answered no times: {reply!r}"[:300])


class Shared:
    """One probe process that serves several candidates of one device set: started on
    first use, reused only while it is healthy (never after a timeout, a death or a failed
    check: CUDA may be poisoned), closed at the end. It cannot start: each use says why."""

    def __init__(
        self, request: Mapping[str, Any], timeout: float, env: Optional[Mapping[str, str]] = None
    ) -> None:
        """``env``: variables the process runs with, added to the user's (a remedy)."""
        self.request, self.timeout, self.env = request, timeout, dict(env or {})
        self.process: Optional[ProbeProcess] = None
        self.start_failure = ""  #: why it could not start, once it could not

    def _running(self) -> Optional[ProbeProcess]:
        if self.process is not None and not self.process.alive:
            self.close()
        if self.process is None and not self.start_failure:
            try:
                self.process, _ = start(self.request, self.timeout, self.env)
            except ProbeDied as error:
                self.start_failure = str(error)
        return self.process

    def check(self, name: str, replicas: int) -> CandidateResult:
        """Backend ``name``'s smoke check in the probe process."""
        process = self._running()
        if process is None:
            return CandidateResult(name, FAILED, self.start_failure)
        result = check(process, name, replicas, self.timeout)
        if result.status != OK:  # a fresh process for the next
            self.close()
        return result

    def time(self, name: str, payload_mb: float) -> Union[float, str]:
        """Backend ``name``'s median ms in the probe process, or why it could not be timed."""
        process = self._running()
        if process is None:
            return self.start_failure
        ms = median_ms(process, name, payload_mb, self.timeout)
        if isinstance(ms, str):
            self.close()
        return ms

    def close(self) -> None:
        if self.process is not None:
            self.process.close()
            self.process = None
