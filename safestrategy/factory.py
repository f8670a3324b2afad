"""make_mirrored_strategy() and probe(): settings in, checks, decision, report out.

The request is validated first (:func:`decide`); then the devices are made
sure of, the candidates checked and timed where each belongs
(:mod:`safestrategy.checks.runner`), one is chosen (:mod:`safestrategy.choose`),
the report is logged, and the strategy is built (:mod:`safestrategy.backends`)
and watched (:mod:`safestrategy.training.watchdog`). The records of trouble during
training are asked once per decision (:mod:`safestrategy.records`). A process decides
once per device set and execution mode.
"""

import logging
import platform as _platform
import threading
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

from . import _env, _machine, _rundir, _tf, choose, records
from ._devices import Device, parse_devices, require_existing
from ._env import Setting, resolve_backend, resolve_stall
from .backends import build_cross_device_ops, build_strategy, check_kwargs
from .checks import nccl, runner
from .checks.allreduce import graph_api
from .choose import Decision, failure_message, override_hint
from .mirror import guard
from .report import (
    FAILED,
    TIMEOUT,
    XLA_NOTE,
    CandidateResult,
    NoWorkingBackendError,
    Report,
    set_last_report,
)
from .training import watchdog

logger = logging.getLogger("safestrategy")

# Decisions that found a backend, by request and execution mode: a process decides once
# per device set and mode.
_decisions: Dict[Any, Tuple[Tuple[Device, ...], Decision, Optional[int]]] = {}
_lock = threading.Lock()


class _Request(NamedTuple):
    """A validated request: nothing has been probed or imported yet."""

    devices: Optional[Tuple[Device, ...]]
    setting: Setting
    nccl: nccl.Options
    payload_mb: float  #: what ``auto`` times candidates on


def _request(
    devices: Optional[Sequence[str]],
    backend: Optional[str],
    timeout: Optional[float],
    cache: Optional[bool] = None,
    refresh: bool = False,
) -> _Request:
    """Validate every input (``ValueError``) before anything touches a device."""
    return _Request(
        parse_devices(devices) if devices is not None else None,
        resolve_backend(backend),
        nccl.options(timeout, cache, refresh),
        _env.resolve_payload_mb(),
    )


def _devices_for(tf: Any, requested: Optional[Tuple[Device, ...]]) -> Tuple[Device, ...]:
    """The devices to mirror over: the requested ones, every one of them real in this process
    (``ValueError``), else those TensorFlow's own ``MirroredStrategy()`` would pick."""
    if requested is None:
        return _tf.default_devices(tf)
    require_existing(requested, _tf.visible_devices(tf))
    return requested


def decide(
    devices: Optional[Sequence[str]] = None,
    *,
    backend: Optional[str] = None,
    timeout: Optional[float] = None,
    cache: Optional[bool] = None,
    refresh: bool = False,
    on_result: Optional[Callable[[CandidateResult], None]] = None,
    on_start: Optional[Callable[[], None]] = None,
) -> Tuple[Report, bool]:
    """The report for a request, and whether it was decided afresh (False: remembered).

    The engine behind :func:`probe`, :func:`make_mirrored_strategy` and the CLI
    (internal: not part of the public API). ``cache=False`` neither reads nor
    writes cached NCCL verdicts, ``refresh=True`` ignores them (and what this
    process remembers); ``on_start`` is called once every input is valid and the
    checks are about to run, ``on_result`` with each candidate's result as it comes.
    Raises ``ValueError`` for bad input, ``NoWorkingBackendError`` when nothing works.
    """
    request = _request(devices, backend, timeout, cache, refresh)
    report, fresh, _ = _decide(request, on_result, on_start)
    return report, fresh


def _decide(
    request: _Request,
    on_result: Optional[Callable[[CandidateResult], None]],
    on_start: Optional[Callable[[], None]] = None,
) -> Tuple[Report, bool, records.Standing]:
    """:func:`decide`, with what the records said for it (asked once, here)."""
    if _tf.tf_version() is None:
        raise ImportError(_tf.INSTALL_HINT)
    tf = _tf.import_tf()
    devices = _devices_for(tf, request.devices)
    setting = request.setting
    graph = graph_api(tf)  # the caller's execution mode: graph-mode checks drive another path
    mode = "eager" if graph is None else "graph"
    opts = request.nccl
    names = [str(d) for d in devices]
    standing = records.standing(tf, names, opts.cache, opts.refresh, setting.mode == "forced")
    recorded = standing.stalls
    key = (
        devices,
        mode,
        setting.mode,
        setting.names,
        opts._replace(refresh=False),
        request.payload_mb,
        tuple((stall.backend, stall.when) for stall in recorded),
    )
    with _lock:
        remembered = None if opts.refresh else _decisions.get(key)
    if remembered is None:
        if on_start is not None:
            on_start()
        decision = _fresh(tf, request, devices, mode, graph, standing, on_result)
        kernels = _tf.nccl_kernel_count(tf)
    else:
        devices, decision, kernels = remembered
    raced = setting.mode == "auto" and len(devices) > 1
    report = Report(
        backend=decision.backend or "none",
        source=setting.source,
        mode=setting.mode,
        devices=tuple(str(d) for d in devices),
        platform=_machine.system(),
        tf_version=tf.__version__,
        tf_api=_tf.tf_api(tf.__version__),
        candidates=decision.results,
        reason=decision.reason,
        wsl=_machine.is_wsl(),
        nccl_kernels=kernels,
        python=_platform.python_version(),
        stalls=recorded,
        payload_mb=request.payload_mb if raced else None,
        xla=_tf.xla_auto_jit(tf, _env.xla_auto_jit_flag()),
    )
    if decision.backend is None:
        message = failure_message(devices, decision.results, setting)
        message += "".join(
            f"\n{r.name}: {nccl.cached_note(devices, request.nccl.timeout, r.name)}."
            for r in decision.results
            if r.cached and r.status in (FAILED, TIMEOUT)
        )
        raise NoWorkingBackendError(message, report)
    with _lock:
        _decisions[key] = devices, decision, kernels
    return report, remembered is None, standing


def _fresh(
    tf: Any,
    request: _Request,
    devices: Tuple[Device, ...],
    mode: str,
    graph: Optional[Any],
    standing: records.Standing,
    on_result: Optional[Callable[[CandidateResult], None]],
) -> Decision:
    """A decision made now: checked (and timed) by a runner for these devices."""
    setting = request.setting
    if len(devices) < 2:
        return choose.single_device(setting, devices[0])
    checks = runner.Runner(tf, devices, request.nccl, request.payload_mb, graph, standing)

    def check(name: str) -> CandidateResult:
        result = checks(name)
        logger.debug("smoke check %s: %s %s", name, result.status, result.reason)
        if on_result is not None:
            on_result(result)
        return result

    try:
        return runner.decide(tf, setting, request.nccl, request.payload_mb, mode, checks, check)
    finally:
        checks.close()


def _log(report: Report, setting: Setting, fresh: bool, timeout: float) -> None:
    """One WARNING per fallback when freshly decided; DEBUG when remembered. A failure
    read from the cache says so, and gives the command that re-checks it (``timeout``:
    the NCCL check's, part of the verdict's key)."""
    stalled = {stall.backend for stall in report.stalls}  # their reasons say how to re-allow

    def note(failed: CandidateResult) -> str:
        if failed.cached and failed.name not in stalled:
            return f" ({nccl.cached_note(report.devices, timeout, failed.name)})"
        return ""

    where = f"on {', '.join(report.devices)}"
    level = logging.WARNING if fresh else logging.DEBUG
    if records.last_resort(report):  # one WARNING names every record (records.warn)
        kept = tuple(c for c in report.candidates if c.name not in stalled)
        report = report._replace(candidates=kept)
    choose.log_fallbacks(report, level, "all-reduce backend", where, override_hint(setting), note)
    logger.log(
        logging.INFO if fresh else logging.DEBUG,
        "using all-reduce backend %s on %s: %s%s",
        report.backend,
        ", ".join(report.devices),
        report.reason,
        f" (XLA is on: {XLA_NOTE})" if report.xla else "",
    )


def probe(
    devices: Optional[Sequence[str]] = None,
    *,
    backend: Optional[str] = None,
    timeout: Optional[float] = None,
) -> Report:
    """Decide which backend would be used, building nothing.

    Runs the same smoke checks as :func:`make_mirrored_strategy` and returns
    the :class:`Report`; raises :class:`NoWorkingBackendError` (with
    ``.report``) when no candidate works and ``ValueError`` for bad settings
    or devices TensorFlow does not have.
    """
    return decide(devices, backend=backend, timeout=timeout)[0]


def make_mirrored_strategy(
    devices: Optional[Sequence[str]] = None, *, backend: Optional[str] = None, **kwargs: Any
) -> Any:
    """A ``MirroredStrategy`` whose all-reduce was run and checked on ``devices``.

    Drop-in for ``tf.distribute.MirroredStrategy(devices)``. The backend is
    ``backend=``, else ``$SAFESTRATEGY_BACKEND``, else the fastest of collective,
    nccl, hierarchical_copy, reduce_to_gpu, reduce_to_cpu that sums correctly
    across the devices (timed on a gradient-like payload; within 3 % the
    earlier in that order). Other keyword arguments go to MirroredStrategy unchanged; a
    ``cross_device_ops`` (or TF 1.12 ``cross_tower_ops``) of your own is used
    as given, with no probing. With ``devices=None`` the devices are exactly those the
    installed TensorFlow's own ``MirroredStrategy()`` picks (every logical GPU, else every
    logical CPU on TF 2.1+ and ``/device:CPU:0`` on 1.12-2.0).
    """
    own_ops = kwargs.get("cross_device_ops", kwargs.get("cross_tower_ops"))
    if own_ops is not None and backend is not None:
        raise ValueError("pass either backend= or your own cross_device_ops, not both")
    request = None if own_ops is not None else _request(devices, backend, None)
    stall_settings = resolve_stall()
    every = _env.resolve_verify_every()
    tf = _tf.import_tf()
    era = _tf.era(tf.__version__)
    mirrored = tf.contrib.distribute if era == "contrib-tower" else tf.distribute
    check_kwargs("make_mirrored_strategy", mirrored.MirroredStrategy, kwargs)
    place = None  # where a stall of it is recorded: only where a next decision reads it
    if request is None:
        strategy = build_strategy(tf, era, devices, **kwargs)
        report = _own_ops_report(tf.__version__, strategy, own_ops)
    else:
        report, fresh, standing = _decide(request, None)
        _log(report, request.setting, fresh, request.nccl.timeout)
        records.warn(report, request.setting, fresh)
        chosen = next((c for c in report.candidates if c.name == report.backend), None)
        if chosen is not None and chosen.remedy:
            nccl.apply_remedy(chosen.remedy, report.devices)
        ops = build_cross_device_ops(tf, era, report.backend, report.devices)
        strategy = build_strategy(tf, era, list(report.devices), ops, **kwargs)
        place = standing.place_for(report)
    set_last_report(report)
    watchdog.watch(stall_settings, report, strategy, place)
    guard.guard(tf, strategy, report, place, stall_settings.action, every)
    _rundir.decision(records.decision_entry(report, place, stall_settings.timeout))
    return strategy


def _own_ops_report(version: str, strategy: Any, ops: Any) -> Report:
    extended = getattr(strategy, "extended", strategy)
    return Report(
        backend=type(ops).__name__,
        source="argument",
        mode="forced",
        devices=tuple(getattr(extended, "worker_devices", ())),
        platform=_machine.system(),
        tf_version=version,
        tf_api=_tf.tf_api(version),
        candidates=(),
        reason="cross-device ops given by the caller: used as given, not probed",
        wsl=_machine.is_wsl(),
        python=_platform.python_version(),
    )
