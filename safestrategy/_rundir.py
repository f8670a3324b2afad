"""The run directory: what a child of ``python -m safestrategy run`` leaves for it to read.

``run`` names a fresh directory for each launch in ``SAFESTRATEGY_RUN_DIR`` and
its own pid in ``SAFESTRATEGY_RUN_PARENT``. Only the process ``run`` started
writes there (its parent is ``run``; a grandchild that inherits the variables
writes nothing), each file named with its pid:

- ``decision-<pid>.json``: each factory call that built a strategy (backend,
  devices, mode, where a record of it goes and whether a next decision reads it);
- ``heartbeat-<pid>``: rewritten by the watchdog thread at each sample, a counter
  and whether some thread is inside a TensorFlow call; ``finished`` at a normal exit;
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
from typing import Any, Dict, List, Mapping, NamedTuple, Optional

from ._env import ENV_RUN_DIR, ENV_RUN_PARENT

FINISHED = "finished"

_installed = False
_lock = threading.Lock()
_fault_file: Any = None  # kept open for faulthandler for the life of the process
_decisions: List[Dict[str, Any]] = []  # every strategy this process built


def directory(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """This launch's run directory, if ``run`` started this very process; else None."""
    environ = os.environ if environ is None else environ
    where, parent = environ.get(ENV_RUN_DIR, "").strip(), environ.get(ENV_RUN_PARENT, "")
    if not where or not parent.strip().isdigit() or int(parent) != os.getppid():
        return None
    return where


def _write(name: str, text: str, suffix: str = "") -> None:
    where = directory()
    if where is None:
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
        _decisions.append(dict(entry))
        _write("decision", json.dumps(_decisions) + "\n", ".json")
    install()


def heartbeat(counter: int, inside: bool) -> None:
    """The watchdog's sample number, and whether some thread is inside a TF call."""
    _write("heartbeat", f"{counter} {'inside' if inside else 'outside'}\n")


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
    atexit.register(lambda: _write("heartbeat", f"{FINISHED}\n"))


class Launch(NamedTuple):
    """What one launch's child left in its run directory (see the module docstring)."""

    decisions: List[Dict[str, Any]]
    beats: Optional[str]  #: the heartbeat's last text ("12 inside", "finished"), or None
    error: str  #: the last line of an uncaught exception, or ""
    fault: str  #: faulthandler's dump, or ""


def read(where: str) -> Launch:
    """Everything the children of one launch wrote in ``where`` (the supervisor's side)."""

    def text(prefix: str) -> str:
        parts = []
        with contextlib.suppress(OSError):
            for name in sorted(os.listdir(where)):
                if name.startswith(f"{prefix}-"):
                    with contextlib.suppress(OSError), open(os.path.join(where, name)) as stream:
                        parts.append(stream.read(65536))
        return "".join(parts)

    decisions: List[Dict[str, Any]] = []
    with contextlib.suppress(ValueError):
        for line in text("decision").splitlines():
            decisions.extend(json.loads(line) if line.strip() else [])
    beats = text("heartbeat").strip() or None
    return Launch(decisions, beats, text("error").strip(), text("fault").strip())
