"""Where a run's launches live: a fresh directory per run under ``<cache>/runs/``, pruned.

Several ``run``s may share one cache (the tasks of a Slurm step on one node, each its own
``run``): a run holds an exclusive ``flock`` on its directory's ``.running`` for its
life, released by the kernel however it ends, and pruning passes over every directory
whose lock is held, so it never removes a launch that is still running.
"""

import contextlib
import os
import shutil
import tempfile
import time
from typing import IO, List, Optional, Tuple

from .. import _env

try:
    import fcntl
except ImportError:  # Windows, where run does not run (it says so and exits 2)
    fcntl = None  # type: ignore[assignment]

#: How many launches' directories ``<cache>/runs/`` keeps (of runs that have ended).
KEEP_LAUNCHES = 20
RUNNING = ".running"
#: The locks this process holds on its run directories: open until it exits.
_held: List[IO[bytes]] = []


def _hold(run_dir: str) -> None:
    """Mark ``run_dir`` as in use by this process until it exits."""
    if fcntl is None:
        return
    lock = open(os.path.join(run_dir, RUNNING), "wb")  # noqa: SIM115 (held for life)
    fcntl.flock(lock, fcntl.LOCK_EX)
    _held.append(lock)


def in_use(run_dir: str) -> bool:
    """Whether a living ``run`` holds ``run_dir`` (this one included)."""
    if fcntl is None:
        return False
    try:
        with open(os.path.join(run_dir, RUNNING), "rb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no lock file: a run of 0.5 or earlier, long over
        return False
    return False


def runs_directory(cache: bool) -> Tuple[str, Optional[str]]:
    """A fresh directory for this run's launches, under the cache's ``runs/`` (returned
    too: it is pruned), else a temporary one (and None)."""
    if cache:
        runs = os.path.join(_env.cache_dir(), "runs")
        with contextlib.suppress(OSError):
            os.makedirs(runs, exist_ok=True)
            prefix = time.strftime("%Y%m%d-%H%M%S-")
            run_dir = tempfile.mkdtemp(prefix=prefix, dir=runs)
            _hold(run_dir)
            return run_dir, runs
    return tempfile.mkdtemp(prefix="safestrategy-run-"), None


def prune(runs: str, keep: int) -> None:
    """Remove all but the newest ``keep`` launch directories under ``runs`` of runs that
    have ended (and the run directories that are left empty): ``<cache>/runs/`` does not
    grow for ever, and no running launch loses its directory."""
    launches = []
    with contextlib.suppress(OSError):
        for run_dir in os.listdir(runs):
            if in_use(os.path.join(runs, run_dir)):
                continue
            with contextlib.suppress(OSError):
                for name in os.listdir(os.path.join(runs, run_dir)):
                    path = os.path.join(runs, run_dir, name)
                    if name.startswith("launch-") and os.path.isdir(path):
                        launches.append((os.stat(path).st_mtime, path))
    for _, path in sorted(launches)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
        run_dir = os.path.dirname(path)
        with contextlib.suppress(OSError):  # its last launch gone: its lock file too
            if not any(name.startswith("launch-") for name in os.listdir(run_dir)):
                os.remove(os.path.join(run_dir, RUNNING))
        with contextlib.suppress(OSError):
            os.rmdir(run_dir)  # only when it is empty
