"""The run directory: what a training under ``python -m safestrategy run`` leaves for it.

``run`` names a fresh directory for each launch in ``SAFESTRATEGY_RUN_DIR``.
Every process that builds a strategy while it is set writes there, each file
named with its pid, so the training may be any descendant of the command
(``./train.sh``, ``bash -c``, ``env``, ``timeout``, ``nice``); a process that
built none writes nothing, and safestrategy's probe processes are started
without the variable:

- ``decision-<pid>.json``: each factory call that built a strategy (backend,
  devices, mode, where a record of it goes, whether a next decision reads it and
  if not why, the cache directory the training reads);
- ``heartbeat-<pid>``: rewritten by the watchdog thread at each sample, a counter
  and whether some thread is inside a TensorFlow call, and whether that call runs the
  strategy's collectives; ``finished`` at a normal exit;
- ``stall-<pid>.json``: a stall the watchdog reported (where it was, whether it
  was recorded against a backend), or wrong numbers the mirror's check caught
  (``kind`` "corrupt": where, whether recorded, the last resort's device to take out);
- ``error-<pid>``: the last lines of an uncaught exception (its type and message, as
  Python prints them last);
- ``fault-<pid>``: ``faulthandler``'s dump of every thread on a fatal signal.

Without ``SAFESTRATEGY_RUN_DIR`` nothing here does anything. Writes are atomic
(a temporary file renamed into place) and never raise: the run directory may
make a relaunch possible, never break a training. Standard library only, so the
supervisor reads it without TensorFlow.
"""

import atexit
import contextlib
import faulthandler
import json
import os
import sys
import tempfile
import threading
import traceback
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

from ._env import ENV_RUN_DIR

FINISHED = "finished"

_installed = False
_lock = threading.Lock()
_fault_file: Any = None  # kept open for faulthandler for the life of the process
_decisions: List[Dict[str, Any]] = []  # every strategy this process built


def directory(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """This launch's run directory, when ``run`` is above this process; else None."""
    environ = os.environ if environ is None else environ
    return environ.get(ENV_RUN_DIR, "").strip() or None


def _write(name: str, text: str, suffix: str = "") -> None:
    where = directory()
    if where is None or not _decisions:  # only a process that built a strategy writes
        return
    temporary = None
    try:
        descriptor, temporary = tempfile.mkstemp(prefix=f".{name}-", dir=where)
        with os.fdopen(descriptor, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.replace(temporary, os.path.join(where, f"{name}-{os.getpid()}{suffix}"))
    except OSError:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.remove(temporary)


def decision(entry: Mapping[str, Any]) -> None:
    """Record that a factory built a strategy: ``decision-<pid>.json`` holds the list of
    every one this process built (a launch whose decisions differ is not relaunched)."""
    if directory() is None:
        return
    with _lock:
        _decisions.append({**entry, "pid": os.getpid()})
        _write("decision", json.dumps(_decisions) + "\n", ".json")
    install()


#: Where a heartbeat puts the training: in no TF call; in a TF call of its own work (an
#: evaluation, a file read); in a call that runs the strategy's collectives.
OUTSIDE, INSIDE, COLLECTIVES = "outside", "inside", "collectives"


def heartbeat(counter: int, where: str) -> None:
    """The watchdog's sample number, and where it found the training
    (:data:`OUTSIDE`, :data:`INSIDE`, :data:`COLLECTIVES`)."""
    _write("heartbeat", f"{counter} {where}\n")


def in_call(beat: str) -> bool:
    """Whether heartbeat ``beat`` puts some thread inside a TF call (of any kind)."""
    return beat.endswith((f" {INSIDE}", f" {COLLECTIVES}"))


def in_collectives(beat: str) -> bool:
    """Whether heartbeat ``beat`` puts the call in the strategy's collectives: only then
    is a silent launch or a crash inside it the all-reduce's (API.md, 0.5.2)."""
    return beat.endswith(f" {COLLECTIVES}")


def stalled(entry: Mapping[str, Any]) -> None:
    """A stall the watchdog reported: where it was, and whether it was recorded."""
    _write("stall", json.dumps(dict(entry)) + "\n", ".json")


def install() -> None:
    """Once, where ``run`` started this process: the excepthook (chaining the one there),
    faulthandler (unless the user enabled it already) and the ``finished`` heartbeat."""
    global _installed, _fault_file
    where = directory()
    if where is None or _installed:
        return
    _installed = True
    before = sys.excepthook

    def hook(kind: Any, error: BaseException, trace: Any) -> None:
        with contextlib.suppress(Exception):
            text = "".join(traceback.format_exception_only(kind, error))
            _write("error", text[-8192:])
        before(kind, error, trace)

    sys.excepthook = hook
    if not faulthandler.is_enabled():
        with contextlib.suppress(OSError):
            _fault_file = open(os.path.join(where, f"fault-{os.getpid()}"), "w")  # noqa: SIM115
            faulthandler.enable(file=_fault_file, all_threads=True)
    atexit.register(_finished)


def _finished() -> None:
    """At a normal exit: the ``finished`` heartbeat, and no empty ``fault-<pid>`` left
    behind (``run`` ignores a finished process's dump: nothing is lost)."""
    _write("heartbeat", f"{FINISHED}\n")
    if _fault_file is not None and os.fstat(_fault_file.fileno()).st_size == 0:
        with contextlib.suppress(OSError, ValueError):
            faulthandler.disable()
            _fault_file.close()
            os.remove(_fault_file.name)


class Launch(NamedTuple):
    """What one launch's processes left in its run directory (see the module docstring)."""

    decisions: List[Dict[str, Any]]  #: every strategy built, each with its process's "pid"
    beats: Dict[int, str]  #: each process's last heartbeat ("12 inside", "finished"), by pid
    error: str  #: the last line of an uncaught exception, or ""
    fault: str  #: faulthandler's dump, or ""
    stalls: Tuple[Dict[str, Any], ...] = ()  #: the stalls the watchdog reported

    def beat(self, pid: Any) -> Optional[str]:
        """The heartbeat of process ``pid``, or None."""
        return self.beats.get(pid) if isinstance(pid, int) else None


def _pid(name: str) -> Optional[int]:
    digits = name.split("-", 1)[-1].split(".", 1)[0]
    return int(digits) if digits.isdigit() else None


def read(where: str) -> Launch:
    """Everything the processes of one launch wrote in ``where`` (the supervisor's side)."""
    texts: Dict[str, Dict[int, str]] = {}
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(where)):
            kind, pid = name.split("-", 1)[0], _pid(name)
            if pid is None or name.startswith("."):
                continue
            with contextlib.suppress(OSError), open(os.path.join(where, name)) as stream:
                texts.setdefault(kind, {})[pid] = stream.read(65536)

    def each(kind: str) -> List[Any]:
        found = []
        for text in texts.get(kind, {}).values():
            with contextlib.suppress(ValueError):
                value = json.loads(text)
                found.extend(value if isinstance(value, list) else [value])
        return [entry for entry in found if isinstance(entry, dict)]

    beats = {pid: text.strip() for pid, text in texts.get("heartbeat", {}).items()}
    error = "".join(texts.get("error", {}).values()).strip()
    fault = "".join(texts.get("fault", {}).values()).strip()
    return Launch(each("decision"), beats, error, fault, tuple(each("stall")))


def heartbeats(where: str) -> Dict[int, str]:
    """Each process's last heartbeat in ``where``, by pid (what ``run`` polls)."""
    beats = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(where):
            pid = _pid(name) if name.startswith("heartbeat-") else None
            if pid is not None:
                with contextlib.suppress(OSError), open(os.path.join(where, name)) as stream:
                    beats[pid] = stream.read(256).strip()
    return beats
