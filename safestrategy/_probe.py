"""Gathering facts and running smoke checks, isolated in a child process.

Every smoke all-reduce runs in a fresh ``python -m safestrategy._worker``
process (started with ``subprocess``: never forked, and no re-import of the
caller's ``__main__`` as ``multiprocessing``'s spawn would do). A hanging NCCL
is killed at the timeout, a crashing one is reported with its exit status, and
the caller's process never initialises a GPU or builds a throw-away strategy.
After a check fails with an error, a timeout or a crash, the next check gets a
new process, so a poisoned CUDA context cannot fail an innocent candidate.
"""

import collections
import contextlib
import json
import logging
import os
import platform
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Deque, Dict, Optional, Sequence

from ._devices import Device
from .report import FAILED, OK, TIMEOUT, CandidateResult

logger = logging.getLogger("safestrategy")

#: How the probe process is started. The one seam tests replace with a fake.
WORKER_COMMAND = [sys.executable, "-m", "safestrategy._worker"]

#: Seconds the probe process may take to import TensorFlow and list devices.
STARTUP_TIMEOUT = 120.0


class ProbeTimeout(Exception):
    """The probe process did not answer in time (it has been killed)."""


class ProbeDied(Exception):
    """The probe process exited or crashed before answering."""


def system() -> str:
    """The OS name as ``platform.system()`` reports it ("Linux", "Windows", ...)."""
    return platform.system()


def _kernel_release() -> Optional[str]:
    """Linux's kernel release string, or None where there is none to read."""
    try:
        with open("/proc/sys/kernel/osrelease") as release:
            return release.read()
    except OSError:
        return None


def is_wsl() -> bool:
    """True on Linux under Windows Subsystem for Linux, where NCCL is often absent."""
    if system() != "Linux":
        return False
    release = _kernel_release()
    return release is not None and "microsoft" in release.lower()


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


class Worker:
    """One probe process and a line-based JSON conversation with it."""

    def __init__(self, devices: Optional[Sequence[Device]]) -> None:
        env = dict(os.environ)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        env.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
        request = {"devices": None if devices is None else [str(d) for d in devices]}
        self.process = subprocess.Popen(
            [*WORKER_COMMAND, json.dumps(request)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            # Not the locale's codec (cp1252 on Windows, ASCII under LANG=C on 3.6): one
            # undecodable byte from TensorFlow would end the reader thread, the pipe would
            # fill, and a working candidate would time out.
            encoding="utf-8",
            errors="replace",
            env=env,
        )
        self.replies: queue.Queue[Optional[str]] = queue.Queue()
        self.stderr: Deque[str] = collections.deque(maxlen=20)
        for target in (self._read_stdout, self._read_stderr):
            threading.Thread(target=target, daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.process.stdout:
            self.replies.put(line)
        self.replies.put(None)

    def _read_stderr(self) -> None:
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
            returncode = self.process.wait()
            last = next((text for text in reversed(self.stderr) if text.strip()), "")
            detail = f"; last output: {last}" if last else ""
            raise ProbeDied(f"the probe process died: {_exit_text(returncode)}{detail}")
        return json.loads(line)

    def ask(self, message: Dict[str, Any], timeout: float) -> Dict[str, Any]:
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
        except OSError:
            pass  # it died; receive() reports how
        return self.receive(timeout)

    def close(self) -> None:
        """Kill the process if it still runs, and reap it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            with contextlib.suppress(OSError):
                stream.close()


def wrong_sums(values: Sequence[Sequence[Any]], replicas: int) -> Optional[str]:
    """Why the all-reduced ``[device, numbers]`` pairs are wrong, or None if all are right."""
    expected = replicas * (replicas + 1) / 2
    got = [numbers for _, numbers in values]
    if len(got) == replicas and all(
        numbers and all(abs(x - expected) < 1e-6 for x in numbers) for numbers in got
    ):
        return None
    firsts = [numbers[0] if numbers else None for numbers in got]
    return f"wrong sum: expected {expected:g} on each of {replicas} replicas, got {firsts}"


class Prober:
    """Runs smoke checks for one device set, restarting the probe process as needed."""

    def __init__(self, devices: Optional[Sequence[Device]], timeout: float) -> None:
        self.requested = devices
        self.timeout = timeout
        self.worker: Optional[Worker] = None
        self.facts: Dict[str, Any] = {}

    def _start(self) -> Worker:
        worker = Worker(self.requested)
        try:
            self.facts = worker.receive(max(STARTUP_TIMEOUT, self.timeout))["facts"]
        except (ProbeTimeout, ProbeDied) as error:
            worker.close()
            raise ProbeDied(f"could not start: {error}") from None
        return worker

    def start(self) -> Dict[str, Any]:
        """Start the probe process and return its facts (raises ``ProbeDied``)."""
        if self.worker is None:
            self.worker = self._start()
        return self.facts

    def check(self, name: str, replicas: int) -> CandidateResult:
        """Run backend ``name``'s smoke all-reduce and judge it.

        ``seconds`` is the check alone, not the start of a fresh process.
        """
        status, reason, healthy = FAILED, "", False
        started = time.monotonic()
        try:
            if self.worker is None:
                self.worker = self._start()
                started = time.monotonic()
            reply = self.worker.ask({"check": name}, self.timeout)
        except ProbeTimeout as error:
            status, reason = TIMEOUT, str(error)
        except ProbeDied as error:
            reason = str(error)
        else:
            if "error" in reply:
                reason = ": ".join(part for part in reply["error"] if part)
            else:
                healthy = True
                reason = wrong_sums(reply["values"], replicas) or ""
                if not reason:
                    status = OK
                    reason = f"all {replicas} replicas got the right sum"
        if not healthy and self.worker is not None:
            self.worker.close()
            self.worker = None
        return CandidateResult(name, status, reason, round(time.monotonic() - started, 3))

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
