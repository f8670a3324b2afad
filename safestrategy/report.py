"""The frozen report: one record that serves the API, the logs and the CLI.

Also what every factory shares about its outcome, so that none imports another
for it: :class:`NoWorkingBackendError` and :func:`last_report`; and
:func:`refresh_command`, the command the report's text (and every message resting on
something cached) quotes to check a device set again.
"""

import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
from typing import Any, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple

from ._devices import parse_device

OK = "ok"
FAILED = "failed"
TIMEOUT = "timeout"
SKIPPED = "skipped"
NOT_TRIED = "not_tried"
STATUSES = (OK, FAILED, TIMEOUT, SKIPPED, NOT_TRIED)

XLA_NOTE = (
    "TensorFlow uses its collective all-reduce in XLA-compiled steps whatever backend was chosen"
)


def refresh_command(
    devices: Sequence[Any], timeout: Optional[float] = None, backend: Optional[str] = None
) -> str:
    """The command line that checks ``devices`` again, ignoring and rewriting what is
    cached for them (``--refresh``: verdicts, timings, stall records), with ``timeout``
    and ``--backend`` where given.

    The interpreter is this one (a verdict's key holds it): ``python`` where that is what
    ``PATH`` runs, else its full path.
    """
    parsed = [parse_device(str(device)) for device in devices]
    python = "python" if shutil.which("python") == sys.executable else sys.executable
    args = [python, "-m", "safestrategy", "--devices"]
    args += [f"/{device.kind.lower()}:{device.index}" for device in parsed]
    if timeout is not None:
        args += ["--timeout", str(int(timeout)) if float(timeout).is_integer() else repr(timeout)]
    if backend is not None:
        args += ["--backend", backend]
    args.append("--refresh")
    if os.name == "nt":
        return subprocess.list2cmdline(args)
    return " ".join(shlex.quote(arg) for arg in args)


class CandidateResult(NamedTuple):
    """What happened to one candidate backend."""

    name: str
    status: str  #: one of :data:`STATUSES`
    reason: str = ""
    seconds: float = 0.0
    #: the verdict (and its timing, when timed) was read from the on-disk cache, not run now
    cached: bool = False
    #: Environment variables that made it pass (an NCCL remedy); empty when none.
    remedy: Mapping[str, str] = {}
    #: Median milliseconds of the timed all-reduce payload (of one run for a candidate
    #: over 2x the fastest after one: it cannot win); None when not timed.
    ms: Optional[float] = None

    def line(self, timed: bool = False) -> str:
        """One human-readable line, as the CLI prints it while probing; ``timed``: leave
        room for the median ms column (some candidate of the table was timed)."""
        if self.cached:
            timing = " cached"
        elif self.status in (OK, FAILED, TIMEOUT):
            timing = f"{self.seconds:6.2f}s"
        else:
            timing = " " * 7
        speed = f" {self.ms:8.1f} ms" if self.ms is not None else " " * 12 if timed else ""
        return f"  {self.name:<18} {self.status:<9} {timing}{speed}  {self.reason}".rstrip()

    def to_dict(self) -> Dict[str, Any]:
        data = self._asdict()
        data["remedy"] = dict(self.remedy)
        return data


#: The kind of record the mirror's check writes: training's all-reduce returned wrong numbers.
CORRUPT = "corrupt"


class Stall(NamedTuple):
    """Trouble recorded during an earlier training on these devices: a stall (the
    watchdog, or ``run`` killing a silent child) or a crash (``run``: an all-reduce death)."""

    backend: str
    #: a stall: how long the stuck call had run when it was called one; a crash: how long
    #: that launch trained
    seconds: float
    when: str  #: ISO 8601 local time it was recorded
    #: The NCCL remedy in use then (``{}``: none), so the next one is tried next.
    remedy: Mapping[str, str] = {}
    kind: str = "stall"  #: "stall", "crash" or "corrupt" (:data:`CORRUPT`)
    #: a crash: what ended it (a signal, the error's first line); a multi-worker stall: the
    #: verdict every worker drew ("every worker is inside the same step: ...")
    cause: str = ""
    #: what showed the all-reduce stuck: "canary" (0.5.2: a known-sum all-reduce run during
    #: the stall hung, failed or summed wrong); "" for records of 0.3-0.5.1 and of ``run``;
    #: a corrupt record: the check that caught it
    evidence: str = ""

    def happened(self) -> str:
        """What happened, as reasons say it (without the date's time of day: ``when[:10]``)."""
        if self.kind == "crash":
            return f"crashed during training on {self.when[:10]} ({self.cause})"
        if self.kind == CORRUPT:
            return f"returned wrong numbers during training on {self.when[:10]} ({self.cause})"
        because = f" ({self.cause})" if self.cause else ""
        return f"stalled during training on {self.when[:10]} after {self.seconds:g} s{because}"

    def line(self) -> str:
        """One human-readable line, as the CLI prints it."""
        remedy = "".join(f", with {name}={value}" for name, value in self.remedy.items())
        if self.kind == "crash":
            what = f"crashed during training on {self.when} ({self.cause})"
        elif self.kind == CORRUPT:
            what = f"returned wrong numbers during training on {self.when} ({self.cause}; "
            what += f"check: {self.evidence})"
        else:
            what = f"stalled during training on {self.when} after {self.seconds:g} s"
            what += f" ({self.cause})" if self.cause else ""
            what += "" if self.evidence else " (no canary)"
        return f"  {self.backend:<18} {what}{remedy}"

    def to_dict(self) -> Dict[str, Any]:
        data = self._asdict()
        data["remedy"] = dict(self.remedy)
        return data


class Report(NamedTuple):
    """What was probed and decided. Immutable; ``to_dict()`` is JSON-ready."""

    backend: str  #: the chosen backend name (or the user's own cross-device-ops class)
    source: str  #: who chose: "default", "argument" or "env"
    mode: str  #: "auto", "list" or "forced"
    devices: Tuple[str, ...]
    platform: str  #: platform.system(): "Linux", "Windows", "Darwin", ...
    tf_version: str
    tf_api: str  #: "tf1-contrib", "tf1" or "tf2"
    candidates: Tuple[CandidateResult, ...]
    reason: str = ""  #: why ``backend`` was chosen
    wsl: bool = False  #: Linux running under Windows Subsystem for Linux
    nccl_kernels: Optional[int] = None  #: registered NcclAllReduce kernels; None if unknown
    python: str = ""
    workers: Optional[int] = None  #: multi-worker: how many workers; None for one machine
    task: Optional[str] = None  #: multi-worker: this process's task, e.g. "worker:0"
    #: Stalls recorded for this machine and device set by the watchdog in earlier runs.
    stalls: Tuple[Stall, ...] = ()
    #: Megabytes of the payload ``auto`` times candidates on; None when nothing is raced.
    payload_mb: Optional[float] = None
    #: XLA auto-clustering is known to be on: TF then all-reduces with its collective ops
    #: whatever was chosen (``cross_device_ops`` is ignored under XLA).
    xla: bool = False
    #: multi-worker: where the cluster came from: "resolver", "TF_CONFIG" or "slurm"
    cluster_source: Optional[str] = None
    #: multi-worker: that place as a line says it: "Slurm job 412 step 0", "TF_CONFIG",
    #: "cluster_resolver=SlurmClusterResolver"
    cluster_origin: Optional[str] = None
    #: auto_strategy(): the branch it took ("multi-worker", "mirrored", "one device") and why
    branch: Optional[str] = None
    branch_reason: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        data = self._asdict()
        data["devices"] = list(self.devices)
        data["candidates"] = [candidate.to_dict() for candidate in self.candidates]
        data["stalls"] = [stall.to_dict() for stall in self.stalls]
        return data

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        def known(value: Any) -> str:
            return "unknown" if value is None else str(value)

        platform = self.platform + (" (WSL)" if self.wsl else "")
        lines = [] if self.branch is None else [f"branch       {self.branch}: {self.branch_reason}"]
        lines += [
            f"backend      {self.backend}  ({self.mode}, chosen by {self.source})",
            f"why          {self.reason}",
            f"devices      {', '.join(self.devices)}",
            f"platform     {platform}, Python {known(self.python or None)}",
            f"tensorflow   {self.tf_version} ({self.tf_api})",
            f"nccl kernels {known(self.nccl_kernels)}",
        ]
        if self.payload_mb is not None:
            lines.append(f"payload      {self.payload_mb:g} MB (timed candidates: median ms)")
        if self.xla:
            lines.append(f"xla          on: {XLA_NOTE}")
        if self.workers is not None:
            lines.append(f"workers      {self.workers} (this is {known(self.task)})")
        if self.cluster_source is not None:
            lines.append(f"cluster      from {self.cluster_origin or self.cluster_source}")
        lines.append("candidates")
        timed = any(candidate.ms is not None for candidate in self.candidates)
        lines.extend(candidate.line(timed) for candidate in self.candidates)
        if self.stalls:
            forget = refresh_command(self.devices)
            lines.append(f"stalls recorded (`{forget}` forgets them)")
            lines.extend(stall.line() for stall in self.stalls)
        return "\n".join(lines)


class NoWorkingBackendError(RuntimeError):
    """No candidate backend passed its smoke check; ``report`` says why for each.

    (``report`` is None when ``safestrategy.nccl_ops`` raises it: there is no strategy.)
    """

    def __init__(self, message: str, report: Optional[Report]) -> None:
        super().__init__(message)
        self.report = report


_last_report: Optional[Report] = None
_last_report_lock = threading.Lock()


def last_report() -> Optional[Report]:
    """The report of the last ``make_mirrored_strategy`` (or ``make_multiworker_strategy``)
    call, or None."""
    return _last_report


def set_last_report(report: Report) -> None:
    """Make ``report`` what :func:`last_report` returns (each factory calls this)."""
    global _last_report
    with _last_report_lock:
        _last_report = report
