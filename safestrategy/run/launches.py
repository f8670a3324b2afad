"""Where a run's launches live: a fresh directory per run under ``<cache>/runs/``, pruned."""

import contextlib
import os
import shutil
import tempfile
import time
from typing import Optional, Tuple

from .. import _env

#: How many launches' directories ``<cache>/runs/`` keeps.
KEEP_LAUNCHES = 20


def runs_directory(cache: bool) -> Tuple[str, Optional[str]]:
    """A fresh directory for this run's launches, under the cache's ``runs/`` (returned
    too: it is pruned), else a temporary one (and None)."""
    if cache:
        runs = os.path.join(_env.cache_dir(), "runs")
        with contextlib.suppress(OSError):
            os.makedirs(runs, exist_ok=True)
            prefix = time.strftime("%Y%m%d-%H%M%S-")
            return tempfile.mkdtemp(prefix=prefix, dir=runs), runs
    return tempfile.mkdtemp(prefix="safestrategy-run-"), None


def prune(runs: str, keep: int) -> None:
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
