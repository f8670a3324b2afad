"""Reading and validating the ``SAFESTRATEGY_*`` settings, in one place.

Every setting can come from an argument or from the environment; the argument
wins, and a blank environment value means unset. Bad values raise
``ValueError`` that quotes the value, names where it came from, and lists what
is valid, before anything touches a device.
"""

import math
import os
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from .backends import BACKEND_NAMES, COMMUNICATION_NAMES

ENV_BACKEND = "SAFESTRATEGY_BACKEND"
ENV_TIMEOUT = "SAFESTRATEGY_PROBE_TIMEOUT"
ENV_CACHE = "SAFESTRATEGY_CACHE"
ENV_CACHE_DIR = "SAFESTRATEGY_CACHE_DIR"
ENV_NCCL_REMEDIES = "SAFESTRATEGY_NCCL_REMEDIES"
ENV_COMMUNICATION = "SAFESTRATEGY_COMMUNICATION"
ENV_STALL_TIMEOUT = "SAFESTRATEGY_STALL_TIMEOUT"
ENV_STALL_ACTION = "SAFESTRATEGY_STALL_ACTION"
ENV_PAYLOAD = "SAFESTRATEGY_PAYLOAD_MB"
ENV_VERIFY_EVERY = "SAFESTRATEGY_VERIFY_EVERY"
#: Set by ``python -m safestrategy run`` for its child (see :mod:`safestrategy._rundir`).
ENV_RUN_DIR = "SAFESTRATEGY_RUN_DIR"
ENV_RESTART = "SAFESTRATEGY_RESTART"
ENV_RUN_GRACE = "SAFESTRATEGY_RUN_GRACE"
#: TensorFlow's own variable naming the workers: read and validated by
#: :mod:`safestrategy.multiworker.cluster`; here only its name (its presence picks the CLI's view).
ENV_TF_CONFIG = "TF_CONFIG"
#: The first port of the tasks on one host under Slurm (the others: +1, +2, ...); unset,
#: :func:`safestrategy.multiworker.slurm.port_base`'s formula.
ENV_PORT_BASE = "SAFESTRATEGY_PORT_BASE"

#: Seconds one smoke check may take before it is abandoned.
DEFAULT_TIMEOUT = 60.0
#: The longest timeout accepted: a day (every platform can wait that long; a
#: larger number is far more likely a typo than a plan).
MAX_TIMEOUT = 86400.0

#: Megabytes of float32 ``auto`` all-reduces to time each candidate (one Keras step's
#: gradients of a mid-sized model), and the largest accepted (a typo guard).
DEFAULT_PAYLOAD_MB = 32.0
MAX_PAYLOAD_MB = 16384.0

AUTO = "auto"

#: Seconds one TensorFlow call may run before the watchdog calls it a stall.
DEFAULT_STALL_TIMEOUT = 600.0
#: What the watchdog does about a stall: log and keep waiting, or log and end the process.
STALL_ACTIONS: Tuple[str, ...] = ("warn", "exit")
#: The exit code of ``SAFESTRATEGY_STALL_ACTION=exit`` (``EX_TEMPFAIL``: a hung collective never
#: returns, so a scheduler's restart is the way out); ``run`` relaunches on it.
EXIT_STALL = 75
#: How often the mirror is checked during training: every this many all-reduce batches (one
#: per optimizer step). One check costs about what a quarter of an all-reduce does, so
#: every 100 steps keeps it far under 1 % of a step (benchmarks/mirror_cost.py).
DEFAULT_VERIFY_EVERY = 100
#: The largest accepted (a typo guard: beyond it a check would barely ever run).
MAX_VERIFY_EVERY = 1_000_000
#: Variables safestrategy itself set in ``os.environ`` (NCCL remedies), with the value it set:
#: the user's environment is ``os.environ`` without them (see :func:`user_environ`).
_applied: Dict[str, str] = {}


def set_variable(name: str, value: str) -> None:
    """Set ``name`` in ``os.environ`` for this process, remembering that safestrategy did."""
    os.environ[name] = value
    _applied[name] = value


def user_environ() -> Dict[str, str]:
    """``os.environ`` as the user gave it: without the variables safestrategy set itself,
    unless the user has changed one since (the value is then theirs).

    What a probe process starts from and what cache keys hold: a remedy found for one
    device set must not make another set's check pass, nor its verdict say "no remedy".
    """
    return {name: value for name, value in os.environ.items() if _applied.get(name) != value}


#: NCCL's troubleshooting fixes (variables safestrategy may set), in the order they are tried.
REMEDIES: Tuple[Tuple[str, str], ...] = (("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1"))


def user_remedies() -> Dict[str, str]:
    """The remedy variables the user set, with the user's values: never overridden, and
    their remedies never tried (one set by safestrategy for another device set is not
    the user's)."""
    user = user_environ()
    return {name: user[name] for name, _ in REMEDIES if name in user}


def untried(after: Mapping[str, str], taken: Mapping[str, str]) -> List[Dict[str, str]]:
    """NCCL's remedies not tried yet, in order: those after the one ``after`` names (``{}``:
    from the first), without any whose variable is ``taken`` (the user's own: name -> value)."""
    names = [name for name, _ in REMEDIES]
    tried = [names.index(name) for name in after if name in names]
    start = max(tried) + 1 if tried else 0
    return [{name: value} for name, value in REMEDIES[start:] if name not in taken]


class Setting(NamedTuple):
    """Which candidates to try, in which order, and who asked for that."""

    mode: str  #: "auto", "list" or "forced"
    names: Tuple[str, ...]  #: the candidates, in the order to try them
    source: str  #: "default", "argument" or "env"


def _source_text(source: str, variable: str) -> str:
    return "the argument" if source == "argument" else f"the environment variable {variable}"


def parse_choice(value: str, source: str, names: Sequence[str], variable: str) -> Setting:
    """Parse ``auto``, one of ``names``, or a comma-separated list of them."""
    text = value.strip().lower()
    if text == AUTO:
        return Setting(AUTO, tuple(names), source)
    items = tuple(item.strip() for item in text.split(","))
    if AUTO in items:
        problem = f"{AUTO!r} cannot be combined with other names"
    elif any(item not in names for item in items):
        problem = f"unknown name {next(i for i in items if i not in names)!r}"
    elif len(set(items)) < len(items):
        problem = f"{next(i for i in items if items.count(i) > 1)!r} listed twice"
    else:
        return Setting("forced" if len(items) == 1 else "list", items, source)
    example = ",".join(names[-2:])
    raise ValueError(
        f"{problem} in {value!r} from {_source_text(source, variable)}; valid values are "
        f"{', '.join((AUTO, *names))}, or a comma-separated list of names (e.g. {example!r})"
    )


def parse_backend(value: str, source: str) -> Setting:
    """Parse a backend setting: ``auto``, one name, or a comma-separated list."""
    return parse_choice(value, source, BACKEND_NAMES, ENV_BACKEND)


def _from_env(environ: Mapping[str, str], variable: str) -> Optional[str]:
    value = environ.get(variable)
    return value if value is not None and value.strip() else None


def _resolve_choice(
    argument: Optional[str],
    environ: Optional[Mapping[str, str]],
    names: Sequence[str],
    variable: str,
    what: str,
) -> Setting:
    environ = os.environ if environ is None else environ
    if argument is not None:
        if not isinstance(argument, str):
            raise TypeError(f"{what} must be a str, not {type(argument).__name__}")
        return parse_choice(argument, "argument", names, variable)
    value = _from_env(environ, variable)
    if value is not None:
        return parse_choice(value, "env", names, variable)
    return Setting(AUTO, tuple(names), "default")


def resolve_backend(
    argument: Optional[str], environ: Optional[Mapping[str, str]] = None
) -> Setting:
    """The backend setting by precedence: argument, then environment, then auto."""
    return _resolve_choice(argument, environ, BACKEND_NAMES, ENV_BACKEND, "backend")


def resolve_communication(
    argument: Optional[str], environ: Optional[Mapping[str, str]] = None
) -> Setting:
    """The multi-worker communication (nccl, ring) by the same rules as the backend."""
    return _resolve_choice(
        argument, environ, COMMUNICATION_NAMES, ENV_COMMUNICATION, "communication"
    )


def resolve_timeout(argument: Any, environ: Optional[Mapping[str, str]] = None) -> float:
    """Seconds each smoke check may take: argument, then environment, then 60."""
    environ = os.environ if environ is None else environ
    if argument is not None:
        value, source = argument, "argument"
    else:
        value, source = _from_env(environ, ENV_TIMEOUT), "env"
        if value is None:
            return DEFAULT_TIMEOUT
    where = _source_text(source, ENV_TIMEOUT)
    return _bounded(
        value, f"probe timeout {value!r} from {where}", "seconds", MAX_TIMEOUT, "e.g. 60"
    )


def resolve_port_base(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """``SAFESTRATEGY_PORT_BASE`` as a port (1024-65535), None when unset; else ``ValueError``."""
    value = _from_env(os.environ if environ is None else environ, ENV_PORT_BASE)
    if value is None:
        return None
    if not value.strip().isdigit() or not 1024 <= int(value) <= 65535:
        raise ValueError(
            f"{ENV_PORT_BASE}={value!r} is not a port; give a whole number from 1024 to 65535, "
            "the first port of the tasks on each host (e.g. 20000)"
        )
    return int(value)


def _bounded(value: Any, what: str, unit: str, maximum: float, hint: str) -> float:
    """``value`` as a number in (0, ``maximum``], else ``ValueError`` saying ``what`` is
    not valid and what is (bools and NaN are never numbers here)."""
    try:
        number = math.nan if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not 0 < number <= maximum:  # also false for NaN
        raise ValueError(
            f"{what} is not valid; give a positive number of {unit} up to {maximum:g}, {hint}"
        )
    return number


def resolve_payload_mb(environ: Optional[Mapping[str, str]] = None) -> float:
    """Megabytes ``auto`` times each candidate on: ``SAFESTRATEGY_PAYLOAD_MB``, else 32."""
    value = _from_env(os.environ if environ is None else environ, ENV_PAYLOAD)
    if value is None:
        return DEFAULT_PAYLOAD_MB
    what = f"payload {value!r} from the environment variable {ENV_PAYLOAD}"
    return _bounded(value, what, "megabytes", MAX_PAYLOAD_MB, "e.g. 32")


def resolve_switch(
    variable: str, argument: Optional[bool] = None, environ: Optional[Mapping[str, str]] = None
) -> bool:
    """An on/off setting (default on): the argument if given, else ``on`` or ``off``."""
    if argument is not None:
        return bool(argument)
    value = _from_env(os.environ if environ is None else environ, variable)
    if value is None:
        return True
    text = value.strip().lower()
    if text not in ("on", "off"):
        raise ValueError(
            f"{value!r} from the environment variable {variable} is not valid; "
            "valid values are on, off"
        )
    return text == "on"


def cache_dir(environ: Optional[Mapping[str, str]] = None) -> str:
    """Where verdicts are cached: ``SAFESTRATEGY_CACHE_DIR``, else the user cache directory."""
    value = _from_env(os.environ if environ is None else environ, ENV_CACHE_DIR)
    if value is not None:
        return os.path.expanduser(value.strip())
    import platformdirs  # here, not at import: only a probe that caches needs it

    return platformdirs.user_cache_dir("safestrategy", appauthor=False)


class StallSettings(NamedTuple):
    """The stall watchdog's settings: seconds before a call is a stall (None: off), and
    what to do then ("warn" or "exit")."""

    timeout: Optional[float]
    action: str


def resolve_stall(environ: Optional[Mapping[str, str]] = None) -> StallSettings:
    """``SAFESTRATEGY_STALL_TIMEOUT`` (seconds, default 600, ``off``) and
    ``SAFESTRATEGY_STALL_ACTION`` (``warn`` default, ``exit``); ``ValueError`` for bad values."""
    environ = os.environ if environ is None else environ
    value = _from_env(environ, ENV_STALL_TIMEOUT)
    timeout: Optional[float] = DEFAULT_STALL_TIMEOUT
    if value is not None and value.strip().lower() == "off":
        timeout = None
    elif value is not None:
        what = f"{value!r} from the environment variable {ENV_STALL_TIMEOUT}"
        hint = f"or off (default {DEFAULT_STALL_TIMEOUT:g})"
        timeout = _bounded(value, what, "seconds", MAX_TIMEOUT, hint)
    action = (_from_env(environ, ENV_STALL_ACTION) or STALL_ACTIONS[0]).strip().lower()
    if action not in STALL_ACTIONS:
        raise ValueError(
            f"{environ[ENV_STALL_ACTION]!r} from the environment variable {ENV_STALL_ACTION} "
            f"is not valid; valid values are {', '.join(STALL_ACTIONS)}"
        )
    return StallSettings(timeout, action)


def resolve_verify_every(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """``SAFESTRATEGY_VERIFY_EVERY``: check the mirror every this many all-reduce batches
    (a whole number from 1, default :data:`DEFAULT_VERIFY_EVERY`), or ``off`` (None)."""
    value = _from_env(os.environ if environ is None else environ, ENV_VERIFY_EVERY)
    if value is None:
        return DEFAULT_VERIFY_EVERY
    text = value.strip().lower()
    if text == "off":
        return None
    if not text.isdigit() or not 1 <= int(text) <= MAX_VERIFY_EVERY:
        raise ValueError(
            f"{value!r} from the environment variable {ENV_VERIFY_EVERY} is not valid; give a "
            f"whole number of steps from 1 to {MAX_VERIFY_EVERY:,}, or off "
            f"(default {DEFAULT_VERIFY_EVERY})"
        )
    return int(text)


def run_grace(environ: Optional[Mapping[str, str]] = None) -> float:
    """``run``'s ``--grace`` as it told its child (0 outside ``run`` or when unreadable)."""
    value = _from_env(os.environ if environ is None else environ, ENV_RUN_GRACE)
    try:
        return max(float(value), 0.0) if value is not None else 0.0
    except ValueError:
        return 0.0


def xla_auto_jit_flag(environ: Optional[Mapping[str, str]] = None) -> bool:
    """TensorFlow's own ``TF_XLA_FLAGS`` turns XLA auto-clustering on (``--tf_xla_auto_jit``
    other than -1 or 0); read here, never validated (it is TensorFlow's setting)."""
    flags = (os.environ if environ is None else environ).get("TF_XLA_FLAGS", "")
    for flag in flags.split():
        name, _, value = flag.partition("=")
        if name.lstrip("-") == "tf_xla_auto_jit":
            return value.strip() not in ("", "-1", "0")
    return False
