"""Results that last: verdicts, timings and stall records, kept on disk between runs.

One small JSON file per key, named by its kind (``nccl``, ...) and the key's
hash (no kind may be another's followed by ``-``: :func:`entries` globs), holding
the whole key (a hash collision or a stale format reads as a miss) and when it
was written. Entries older than :data:`MAX_AGE` are misses.
Writes go to a temporary file in the same folder and are renamed into place,
so concurrent writers never leave a torn file. Only regular files of at most
:data:`MAX_BYTES` are read (a symlink, a FIFO or a device at an entry's path
is a miss, never a hang or a huge read). Anything unreadable, corrupt or
unwritable is logged at DEBUG and treated as a miss: the cache can make
start-up faster, never fail it.
"""

import contextlib
import glob
import json
import logging
import os
import stat
import tempfile
import time
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

logger = logging.getLogger("safestrategy")

#: Seconds an entry is believed: 7 days.
MAX_AGE = 7 * 24 * 3600.0
#: Bumped when the entry format changes; older entries are then misses.
FORMAT = 1
#: The largest entry read; a real one is a few kB.
MAX_BYTES = 256 * 1024

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def _path(directory: str, kind: str, key: Mapping[str, Any]) -> str:
    import hashlib  # here: ~15 ms that `import safestrategy` should not pay for

    text = json.dumps(key, sort_keys=True, separators=(",", ":"))
    return os.path.join(directory, f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:32]}.json")


def _load(path: str) -> Dict[str, Any]:
    """The entry at ``path`` if it is a regular file of at most MAX_BYTES (``OSError``,
    ``ValueError`` otherwise). Opened without following a symlink and without blocking
    on a FIFO, then checked on the open descriptor, so nothing can swap it in between."""
    descriptor = os.open(path, _OPEN_FLAGS)
    with os.fdopen(descriptor, "rb") as stream:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if info.st_size > MAX_BYTES:
            raise ValueError(f"{info.st_size} bytes, more than {MAX_BYTES}")
        entry = json.loads(stream.read(MAX_BYTES + 1).decode("utf-8"))
    if not isinstance(entry, dict):
        raise ValueError("not a JSON object")
    return entry


def _fresh(entry: Mapping[str, Any]) -> bool:
    now = time.time()
    return entry["format"] == FORMAT and now - MAX_AGE < float(entry["written"]) <= now + 60


def read(directory: str, kind: str, key: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """The value stored under ``key`` if it is there, whole, and young enough; else None."""
    path = _path(directory, kind, key)
    try:
        entry = _load(path)
        if _fresh(entry) and entry["key"] == json.loads(json.dumps(key)):
            return dict(entry["value"])
        logger.debug("cache entry %s is stale or for another key; ignored", path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.debug("cache entry %s is unreadable (%s); ignored", path, error)
    return None


def entries(directory: str, kind: str) -> Iterator[Tuple[Dict[str, Any], Dict[str, Any]]]:
    """Every fresh, readable ``(key, value)`` of ``kind`` (for listing and forgetting)."""
    for path in sorted(glob.glob(os.path.join(glob.escape(directory), f"{kind}-*.json"))):
        try:
            entry = _load(path)
            if _fresh(entry):
                yield dict(entry["key"]), dict(entry["value"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.debug("cache entry %s is unreadable (%s); ignored", path, error)


def write(directory: str, kind: str, key: Mapping[str, Any], value: Mapping[str, Any]) -> None:
    """Store ``value`` under ``key``, atomically; a failure is logged at DEBUG only."""
    entry = {"format": FORMAT, "written": time.time(), "key": key, "value": value}
    temporary = None
    try:
        os.makedirs(directory, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(prefix=f".{kind}-", suffix=".tmp", dir=directory)
        with os.fdopen(descriptor, "w", encoding="utf-8") as stream:
            json.dump(entry, stream, sort_keys=True)
        os.replace(temporary, _path(directory, kind, key))
    except (OSError, TypeError, ValueError) as error:
        logger.debug("could not write the cache in %s (%s)", directory, error)
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.remove(temporary)


def remove(directory: str, kind: str, key: Mapping[str, Any]) -> None:
    """Forget what is stored under ``key`` (nothing there is fine)."""
    with contextlib.suppress(OSError):
        os.remove(_path(directory, kind, key))
