"""Reading and validating the ``SAFESTRATEGY_*`` settings, in one place.

Every setting can come from an argument or from the environment; the argument
wins, and a blank environment value means unset. Bad values raise
``ValueError`` that quotes the value, names where it came from, and lists what
is valid, before anything touches a device.
"""

import math
import os
from typing import Mapping, NamedTuple, Optional, Tuple

from .backends import BACKEND_NAMES

ENV_BACKEND = "SAFESTRATEGY_BACKEND"
ENV_TIMEOUT = "SAFESTRATEGY_PROBE_TIMEOUT"

#: Seconds one smoke check may take before it is abandoned.
DEFAULT_TIMEOUT = 60.0

AUTO = "auto"


class Setting(NamedTuple):
    """Which backends to try, in which order, and who asked for that."""

    mode: str  #: "auto", "list" or "forced"
    names: Tuple[str, ...]  #: the candidates, in the order to try them
    source: str  #: "default", "argument" or "env"


def _source_text(source: str, variable: str) -> str:
    return "the argument" if source == "argument" else f"the environment variable {variable}"


def parse_backend(value: str, source: str) -> Setting:
    """Parse a backend setting: ``auto``, one name, or a comma-separated list."""
    text = value.strip().lower()
    if text == AUTO:
        return Setting(AUTO, BACKEND_NAMES, source)
    names = tuple(item.strip() for item in text.split(","))
    valid = (AUTO, *BACKEND_NAMES)
    bad = [name for name in names if name not in BACKEND_NAMES]
    duplicated = sorted({name for name in names if names.count(name) > 1})
    if bad or duplicated:
        where = _source_text(source, ENV_BACKEND)
        problem = (
            f"unknown backend {bad[0]!r}" if bad else f"backend {duplicated[0]!r} listed twice"
        )
        raise ValueError(
            f"{problem} in {value!r} from {where}; valid values are {', '.join(valid)}, "
            "or a comma-separated list of backend names (e.g. 'nccl,reduce_to_cpu')"
        )
    return Setting("forced" if len(names) == 1 else "list", names, source)


def _from_env(environ: Mapping[str, str], variable: str) -> Optional[str]:
    value = environ.get(variable)
    return value if value is not None and value.strip() else None


def resolve_backend(
    argument: Optional[str], environ: Optional[Mapping[str, str]] = None
) -> Setting:
    """The backend setting by precedence: argument, then environment, then auto."""
    environ = os.environ if environ is None else environ
    if argument is not None:
        if not isinstance(argument, str):
            raise TypeError(f"backend must be a str, not {type(argument).__name__}")
        return parse_backend(argument, "argument")
    value = _from_env(environ, ENV_BACKEND)
    if value is not None:
        return parse_backend(value, "env")
    return Setting(AUTO, BACKEND_NAMES, "default")


def resolve_timeout(
    argument: Optional[float], environ: Optional[Mapping[str, str]] = None
) -> float:
    """Seconds each smoke check may take: argument, then environment, then 60."""
    environ = os.environ if environ is None else environ
    if argument is not None:
        value, source = argument, "argument"
    else:
        value, source = _from_env(environ, ENV_TIMEOUT), "env"
        if value is None:
            return DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(
            f"probe timeout {value!r} from {_source_text(source, ENV_TIMEOUT)} is not valid; "
            "give a positive number of seconds, e.g. 60"
        )
    return seconds
