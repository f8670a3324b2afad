"""NCCL's verdict on a device set, and the one remedy loop every NCCL check goes through.

NCCL is the only backend that can hang or abort, so it is the only one checked
in a probe process, and only when it can possibly work:

1. zero registered ``NcclAllReduce`` kernels (counted in this process) fail it
   at once, with no probe process;
2. else a verdict cached on disk for the same machine, TensorFlow, devices and
   NCCL environment is used (:mod:`safestrategy._cache`);
3. else the smoke all-reduce runs in a probe process, and if it hangs, crashes
   or fails in NCCL, it is retried in fresh probe processes with NCCL's own
   environment fixes (:data:`REMEDIES`), skipping any the user has set. The
   first that passes keeps NCCL, and :func:`apply_remedy` sets it for this
   process. Each attempt costs at most one timeout.

:func:`with_remedies` is that retry loop, and the only one: NCCL's check, a
``collective`` on NCCL, a stalled NCCL's retries (:func:`after_record`)
and the multi-worker check all go through it.

Verdicts from a probe process that ran the check (pass, fail, timeout, crash)
are cached; one that could not start, or that ran out of GPU memory, is not.
"""

import logging
import os
import platform
import sys
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from .. import _cache, _env, _machine, _tf, records
from .._devices import Device
from .._env import REMEDIES, untried, user_remedies
from ..backends import NCCL
from ..report import FAILED, OK, TIMEOUT, CandidateResult, refresh_command
from . import probe

logger = logging.getLogger("safestrategy")


NO_KERNELS = (
    "this TensorFlow has no NCCL kernels (0 registered), so NcclAllReduce fails with "
    "\"No OpKernel was registered to support Op 'NcclAllReduce'\""
)

_GPU_MEMORY_TAKEN = (
    "; the GPU memory is taken, most likely by this process's own TensorFlow: set "
    "TF_FORCE_GPU_ALLOW_GROWTH=true, or call safestrategy before any GPU op"
)
_OUT_OF_MEMORY = ("out of memory", "outofmemory", "resourceexhausted", "oom when allocating")


class Options(NamedTuple):
    """How a verdict may be reached: the timeout per attempt and the cache and remedy switches."""

    timeout: float
    cache: bool = True
    refresh: bool = False  #: ignore cached verdicts (still write the new one)
    remedies: bool = True


def options(
    timeout: Optional[float] = None, cache: Optional[bool] = None, refresh: bool = False
) -> Options:
    """Options from the arguments and ``SAFESTRATEGY_*`` (``ValueError`` for bad values)."""
    return Options(
        _env.resolve_timeout(timeout),
        _env.resolve_switch(_env.ENV_CACHE, cache),
        refresh,
        _env.resolve_switch(_env.ENV_NCCL_REMEDIES),
    )


class _Attempt(NamedTuple):
    result: CandidateResult
    cacheable: bool  #: the check ran and said something about NCCL here


def _nvidia_driver() -> Optional[str]:
    try:
        with open("/proc/driver/nvidia/version") as version:
            return version.readline().strip()
    except OSError:
        return None


def _user_nccl_environment() -> Dict[str, str]:
    user = _env.user_environ()
    return {name: user[name] for name in sorted(user) if name.startswith("NCCL_")}


def conditions(opts: Options) -> Dict[str, Any]:
    """What a verdict rests on besides the machine, TensorFlow and the devices: the
    interpreter, ``CUDA_VISIBLE_DEVICES``, the user's ``NCCL_*`` variables, the timeout
    and the remedies switch. Part of every key that keeps a verdict (timings too)."""
    return {
        "python": sys.executable,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "nccl_env": _user_nccl_environment(),
        "timeout": opts.timeout,
        "remedies": opts.remedies,
    }


def cache_key(tf: Any, devices: Sequence[Device], opts: Options) -> Dict[str, Any]:
    """Everything that can change NCCL's verdict on ``devices``."""
    return {
        "tf": tf.__version__,
        "build": _tf.build_info(tf),
        "os": [platform.system(), platform.release()],
        "devices": [str(device) for device in devices],
        "gpus": _tf.gpu_names(tf),
        "driver": _nvidia_driver(),
        "machine": _machine.identity(),
        **conditions(opts),
    }


def _short(reason: str) -> str:
    return reason.strip().splitlines()[0] if reason.strip() else ""


def _attempt(
    devices: Sequence[Device], timeout: float, env: Mapping[str, str], name: str = NCCL
) -> _Attempt:
    """NCCL's smoke all-reduce (backend ``name``) in one fresh probe process, ``env`` added."""
    request = {"job": "mirrored", "devices": [str(device) for device in devices]}
    try:
        process, _ = probe.start(request, timeout, env)
    except probe.ProbeDied as error:
        reason = str(error)
        return _Attempt(CandidateResult(name, FAILED, reason, 0.0), False)
    with process:
        result = probe.check(process, name, len(devices), timeout)
        output = " ".join(process.stderr)
    text = (result.reason + output).lower().replace(" ", "")
    if result.status == FAILED and any(word in text for word in _OUT_OF_MEMORY):
        return _Attempt(result._replace(reason=result.reason + _GPU_MEMORY_TAKEN), False)
    return _Attempt(result, True)


#: TensorFlow's errors for NCCL failing at run time (as opposed to a kernel or device that
#: is not there: InvalidArgumentError, NotFoundError, which no environment variable fixes).
_RUNTIME_ERRORS = ("InternalError", "UnknownError", "UnavailableError", "AbortedError")


def _remediable(attempt: _Attempt) -> bool:
    """A hang, a crash, wrong sums or an NCCL run-time error: what NCCL's fixes address."""
    result = attempt.result
    if not attempt.cacheable or result.status == OK:
        return False
    return (
        result.status == TIMEOUT
        or result.reason.startswith(("the probe process died", "wrong sum"))
        or result.reason.split(":", 1)[0] in _RUNTIME_ERRORS
    )


def after_remedies(
    first: CandidateResult,
    later: Sequence[Tuple[Mapping[str, str], CandidateResult]],
    where: str = "",
    skipped: Optional[Mapping[str, str]] = None,
) -> CandidateResult:
    """The verdict once remedies were tried: ``later`` holds (remedy, result) pairs in
    order. The first that passed keeps NCCL (its ``remedy`` set); else the first failure,
    saying what was also tried, and which remedies were not because the user set their
    variable (``skipped``: name -> the user's value; default :func:`user_remedies`).
    ``where`` qualifies a pass (" on every worker")."""
    seconds = round(first.seconds + sum(result.seconds for _, result in later), 3)
    for env, result in later:
        if result.status == OK:
            failed = "timed out" if first.status == TIMEOUT else "failed"
            reason = f"passed with {_setting(env)}{where}, after it {failed} without: "
            reason += _short(first.reason)
            return result._replace(reason=reason, seconds=seconds, remedy=dict(env))
    if first.status == OK:
        return first
    notes = []
    if later:
        notes.append("also with " + " and with ".join(_setting(env) for env, _ in later))
    user = user_remedies() if skipped is None else skipped
    notes.extend(
        f"{name}={value} not tried: you set {name}={user[name]}"
        for name, value in REMEDIES
        if name in user
    )
    if not notes:
        return first
    return first._replace(reason=f"{first.reason} ({'; '.join(notes)})", seconds=seconds)


def _setting(env: Mapping[str, str]) -> str:
    return ", ".join(f"{name}={value}" for name, value in env.items())


def with_remedies(
    first: CandidateResult,
    remedies: Sequence[Mapping[str, str]],
    attempt: Callable[[Mapping[str, str]], CandidateResult],
    where: str = "",
    skipped: Optional[Mapping[str, str]] = None,
) -> CandidateResult:
    """The one remedy loop: after ``first`` (a result without remedy, or a stall record's),
    ``attempt(remedy)`` for each of ``remedies`` in order until one passes; the verdict as
    :func:`after_remedies` words it (``where``, ``skipped`` as there)."""
    later: List[Tuple[Mapping[str, str], CandidateResult]] = []
    for remedy in remedies:
        later.append((remedy, attempt(remedy)))
        if later[-1][1].status == OK:
            break
    return after_remedies(first, later, where, skipped)


def _run(devices: Sequence[Device], opts: Options, name: str) -> _Attempt:
    first = _attempt(devices, opts.timeout, {}, name)
    if not (opts.remedies and _remediable(first)):
        return first
    user = user_remedies()  # the user's own setting is never overridden, nor its remedy tried
    cacheable = [True]

    def attempt(remedy: Mapping[str, str]) -> CandidateResult:
        tried = _attempt(devices, opts.timeout, remedy, name)
        if tried.result.status == OK:
            cacheable[0] = tried.cacheable
        return tried.result

    result = with_remedies(first.result, untried({}, user), attempt, skipped=user)
    return _Attempt(result, cacheable[0])


def attempt(
    devices: Sequence[Device], timeout: float, remedy: Mapping[str, str], name: str = NCCL
) -> CandidateResult:
    """Backend ``name``'s smoke check on ``devices`` in one fresh probe process, with
    ``remedy`` set (a stalled NCCL's retries)."""
    return _attempt(devices, timeout, remedy, name).result


def verdict(tf: Any, devices: Sequence[Device], opts: Options, name: str = NCCL) -> CandidateResult:
    """NCCL's smoke-check result on ``devices``: from the kernel count, the cache, or a run.

    ``name``: the backend that all-reduces with NCCL (``nccl``, or ``collective`` on GPUs,
    which has no kernel short-cut: its runtime falls back to RING without NCCL); its
    verdicts are cached under that name.
    """
    if name == NCCL and _tf.nccl_kernel_count(tf) == 0:
        return CandidateResult(NCCL, FAILED, NO_KERNELS, 0.0)
    directory = _env.cache_dir() if opts.cache else None
    key = cache_key(tf, devices, opts) if directory is not None else {}
    cached = read_verdict(directory, name, key) if directory and not opts.refresh else None
    if cached is not None:
        return cached
    attempt = _run(devices, opts, name)
    if directory is not None and attempt.cacheable:
        _cache.write(directory, name, key, attempt.result.to_dict())
    return attempt.result


def read_verdict(directory: str, kind: str, key: Mapping[str, Any]) -> Optional[CandidateResult]:
    """A verdict cached under ``key`` (marked ``cached``); None when there is none or it
    has the wrong fields."""
    stored = _cache.read(directory, kind, key)
    if stored is None:
        return None
    try:
        return CandidateResult(**{**stored, "cached": True})
    except TypeError:
        logger.debug("cached %s verdict %r has the wrong fields; ignored", kind, stored)
        return None


def recheck_command(devices: Sequence[Any], timeout: float, name: str = NCCL) -> str:
    """The command that checks backend ``name`` again on ``devices`` and rewrites the cached
    verdict these give: the verdict's own key (devices, timeout), and ``--backend`` so that
    nothing else is checked or timed on the way."""
    return refresh_command(devices, timeout, name)


def cached_note(devices: Sequence[Any], timeout: float, name: str = NCCL) -> str:
    """What a message resting on a cached verdict adds: where it came from, how to re-check."""
    command = recheck_command(devices, timeout, name)
    return f"a verdict cached from an earlier run: `{command}` checks it again"


def apply_remedy(remedy: Mapping[str, str], devices: Sequence[Any]) -> None:
    """Set a remedy's variables in ``os.environ`` (never over the user's), loudly once."""
    for name, value in remedy.items():
        if name in os.environ:
            continue  # the user's, or set already for another device set
        _env.set_variable(name, value)
        logger.warning(
            "NCCL hangs or fails on %s unless %s=%s; safestrategy set it for this process "
            "(NCCL reads it when its first all-reduce starts). Set it yourself to make it "
            "permanent, or see docs/troubleshooting.md to fix the machine instead.",
            ", ".join(map(str, devices)),
            name,
            value,
        )


def after_record(
    tf: Any, devices: Sequence[Any], opts: Options, demotion: records.Demotion
) -> CandidateResult:
    """A backend with a record of trouble during training: what the records say
    (:meth:`safestrategy.records.Standing.demotion`), with NCCL's untried remedies tried
    first, each in a fresh probe process, through the one remedy loop. Those retries are
    verdicts: cached under NCCL's verdict key and the record (kind
    :data:`~safestrategy.records.RETRY_KIND`), so a stalled NCCL costs them once, not at
    every launch."""
    stall, failed = demotion.stall, demotion.failed
    if demotion.retries is None:
        return failed
    where = records.directory(opts.cache)
    key = {**cache_key(tf, devices, opts), "stall": stall.to_dict()} if where else {}
    kind = records.RETRY_KIND
    cached = read_verdict(where, kind, key) if where and not opts.refresh else None
    if cached is not None:
        return cached
    result = with_remedies(
        failed,
        demotion.retries,
        lambda remedy: attempt(devices, opts.timeout, remedy, stall.backend),
    )
    if where is not None:
        _cache.write(where, kind, key, result.to_dict())
    return result
