"""Verdicts that last: the probe process's results, kept on disk between runs.

One small JSON file per key, named by the key's hash, holding the whole key
(a hash collision or a stale format reads as a miss) and when it was written.
Entries older than :data:`MAX_AGE` are misses. Writes go to a temporary file
in the same folder and are renamed into place, so concurrent writers never
leave a torn file. Anything unreadable, corrupt or unwritable is logged at
DEBUG and treated as a miss: the cache can make start-up faster, never fail it.
"""

import contextlib
import json
import logging
import os
import tempfile
import time
from typing import Any, Dict, Mapping, Optional

logger = logging.getLogger("safestrategy")

#: Seconds an entry is believed: 7 days.
MAX_AGE = 7 * 24 * 3600.0
#: Bumped when the entry format changes; older entries are then misses.
FORMAT = 1


def _path(directory: str, key: Mapping[str, Any]) -> str:
    import hashlib  # here: ~15 ms that `import safestrategy` should not pay for

    text = json.dumps(key, sort_keys=True, separators=(",", ":"))
    return os.path.join(directory, f"nccl-{hashlib.sha256(text.encode()).hexdigest()[:32]}.json")


def read(directory: str, key: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """The value stored under ``key`` if it is there, whole, and young enough; else None."""
    path = _path(directory, key)
    try:
        with open(path, encoding="utf-8") as stream:
            entry = json.load(stream)
        written = float(entry["written"])
        fresh = time.time() - MAX_AGE < written <= time.time() + 60
        if entry["format"] == FORMAT and entry["key"] == json.loads(json.dumps(key)) and fresh:
            return dict(entry["value"])
        logger.debug("cache entry %s is stale or for another key; ignored", path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.debug("cache entry %s is unreadable (%s); ignored", path, error)
    return None


def write(directory: str, key: Mapping[str, Any], value: Mapping[str, Any]) -> None:
    """Store ``value`` under ``key``, atomically; a failure is logged at DEBUG only."""
    entry = {"format": FORMAT, "written": time.time(), "key": key, "value": value}
    temporary = None
    try:
        os.makedirs(directory, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(prefix=".nccl-", suffix=".tmp", dir=directory)
        with os.fdopen(descriptor, "w", encoding="utf-8") as stream:
            json.dump(entry, stream, sort_keys=True)
        os.replace(temporary, _path(directory, key))
    except (OSError, TypeError, ValueError) as error:
        logger.debug("could not write the cache in %s (%s)", directory, error)
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.remove(temporary)
