"""The processes ``run`` is responsible for: its descendants, and which of them are stopped.

``run`` shares its process group with the training (for the shell and the
terminal they are one job, as with ``nice`` or ``timeout --foreground``), so it
cannot signal "the training's group" without signalling itself. It finds what
the training started by walking the process tree instead, and on Linux it is a
child subreaper (``PR_SET_CHILD_SUBREAPER``): a grandchild whose parent exited
(a wrapper script that started the training in the background, a double fork)
is re-parented to ``run`` and still found. Linux reads ``/proc``; other POSIX
systems ask ``ps``. Standard library only; never raises for a process that is
gone meanwhile.
"""

import contextlib
import os
import subprocess
import sys
from typing import Dict, Iterable, List, Optional, Tuple

#: Process states of a stopped process: by a signal (``T``), or by a debugger (``t``).
STOPPED = ("T", "t")


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux); whether it is."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _stat(pid: int) -> Optional[Tuple[int, str]]:
    """(parent pid, state letter) of ``pid`` from ``/proc``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stream:
            text = stream.read().decode(errors="replace")
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = text[text.rindex(")") + 2 :].split()
        return int(fields[1]), fields[0]
    except (OSError, ValueError, IndexError):
        return None


def _table(pids: Optional[Iterable[int]] = None) -> Dict[int, Tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process (of ``pids`` only, when given)."""
    found: Dict[int, Tuple[int, str]] = {}
    if os.path.isdir("/proc/self"):
        names = pids if pids is not None else (int(n) for n in os.listdir("/proc") if n.isdigit())
        for pid in names:
            facts = _stat(pid)
            if facts is not None:
                found[pid] = facts
        return found
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        listing = subprocess.run(
            ["ps", "-A", "-o", "pid=,ppid=,stat="],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            universal_newlines=True,
            timeout=10,
        ).stdout
        for line in listing.splitlines():
            with contextlib.suppress(ValueError):
                pid, parent, state = line.split()[:3]
                found[int(pid)] = (int(parent), state[:1])
    return found if pids is None else {p: found[p] for p in pids if p in found}


def descendants(root: int) -> List[int]:
    """Every living descendant of ``root`` (not ``root`` itself), parents before children."""
    table = _table()
    children: Dict[int, List[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, queue = [], list(children.get(root, ()))
    while queue:
        pid = queue.pop(0)
        found.append(pid)
        queue.extend(children.get(pid, ()))
    return found


def stopped(pids: Iterable[int]) -> List[int]:
    """Those of ``pids`` that are stopped now (Ctrl-Z, SIGSTOP, a debugger)."""
    wanted = set(pids)
    if not wanted:
        return []
    return [pid for pid, (_, state) in _table(wanted).items() if state in STOPPED]


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, ended but not yet reaped, does not)."""
    facts = _table([pid]).get(pid)
    return facts is not None and facts[1] != "Z"


def signal_all(pids: Iterable[int], number: int) -> None:
    """Send ``number`` to each of ``pids`` that still exists."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, number)


def reap_orphans(keep: int) -> None:
    """Collect the exit status of re-parented orphans that ended (not of ``keep``, the
    child whose status ``subprocess`` waits for), so none is left a zombie."""
    for pid, (parent, state) in _table().items():
        if parent == os.getpid() and pid != keep and state == "Z":
            with contextlib.suppress(OSError):
                os.waitpid(pid, os.WNOHANG)
