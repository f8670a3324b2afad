"""make_mirrored_strategy() and probe(): settings in, smoke checks, decision, report out."""

import logging
import platform as _platform
import threading
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

from . import _probe, _tf
from ._devices import Device, parse_devices
from ._env import ENV_BACKEND, Setting, resolve_backend, resolve_timeout
from .backends import build_cross_device_ops, build_strategy
from .choose import Decision, decide, failure_message
from .report import FAILED, TIMEOUT, CandidateResult, Report

logger = logging.getLogger("safestrategy")

_last_report: Optional[Report] = None
# Decisions that found a backend, by (devices, mode, names, timeout): probing costs seconds.
_decisions: Dict[Any, Tuple[Dict[str, Any], Tuple[Device, ...], Decision]] = {}
_lock = threading.Lock()


class NoWorkingBackendError(RuntimeError):
    """No candidate backend passed its smoke check; ``report`` says why for each."""

    def __init__(self, message: str, report: Report) -> None:
        super().__init__(message)
        self.report = report


class _Request(NamedTuple):
    """A validated request: nothing has been probed or imported yet."""

    devices: Optional[Tuple[Device, ...]]
    setting: Setting
    timeout: float


def _request(
    devices: Optional[Sequence[str]], backend: Optional[str], timeout: Optional[float]
) -> _Request:
    """Validate every input (``ValueError``) before anything touches a device."""
    return _Request(
        parse_devices(devices) if devices is not None else None,
        resolve_backend(backend),
        resolve_timeout(timeout),
    )


def _probe_devices(
    request: _Request, on_result: Optional[Callable[[CandidateResult], None]]
) -> Tuple[Dict[str, Any], Tuple[Device, ...], Decision]:
    """Start the probe process if needed, walk the candidates: (facts, devices, decision)."""
    requested = request.devices
    prober = _probe.Prober(requested, request.timeout)
    try:
        facts = prober.start() if requested is None or len(requested) > 1 else {}
        devices = requested or parse_devices(facts["devices"])

        def check(name: str) -> CandidateResult:
            result = prober.check(name, len(devices))
            logger.debug("smoke check %s: %s %s", name, result.status, result.reason)
            if on_result is not None:
                on_result(result)
            return result

        return facts, devices, decide(request.setting, devices, check)
    except _probe.ProbeDied as error:
        raise RuntimeError(f"safestrategy's probe process {error}") from None
    finally:
        prober.close()


def _decide(
    request: _Request, on_result: Optional[Callable[[CandidateResult], None]] = None
) -> Report:
    """The report for ``request``: probed once per device set and setting per process."""
    version = _tf.tf_version()
    if version is None:
        raise ImportError(_tf.INSTALL_HINT)
    setting = request.setting
    key = (request.devices, setting.mode, setting.names, request.timeout)
    with _lock:
        cached = _decisions.get(key)
    facts, devices, decision = cached or _probe_devices(request, on_result)
    version = facts.get("tf_version", version)
    report = Report(
        backend=decision.backend or "none",
        source=setting.source,
        mode=setting.mode,
        devices=tuple(str(d) for d in devices),
        platform=_probe.system(),
        tf_version=version,
        tf_api=_tf.tf_api(version),
        candidates=decision.results,
        reason=decision.reason,
        wsl=_probe.is_wsl(),
        nccl_kernels=facts.get("nccl_kernels"),
        python=_platform.python_version(),
    )
    if decision.backend is None:
        raise NoWorkingBackendError(failure_message(devices, decision.results), report)
    with _lock:
        _decisions[key] = facts, devices, decision
    return report


def _log(report: Report) -> None:
    for failed in (r for r in report.candidates if r.status in (FAILED, TIMEOUT)):
        logger.warning(
            "all-reduce backend %s %s on %s (%s); using %s instead. Set %s to override.",
            failed.name,
            "timed out" if failed.status == TIMEOUT else "failed",
            ", ".join(report.devices),
            failed.reason,
            report.backend,
            ENV_BACKEND,
        )
    logger.info(
        "using all-reduce backend %s on %s: %s",
        report.backend,
        ", ".join(report.devices),
        report.reason,
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
    ``.report``) when no candidate works and ``ValueError`` for bad settings.
    """
    return _decide(_request(devices, backend, timeout))


def last_report() -> Optional[Report]:
    """The report of the last :func:`make_mirrored_strategy` call, or None."""
    return _last_report


def make_mirrored_strategy(
    devices: Optional[Sequence[str]] = None, *, backend: Optional[str] = None, **kwargs: Any
) -> Any:
    """A ``MirroredStrategy`` whose all-reduce was run and checked on ``devices``.

    Drop-in for ``tf.distribute.MirroredStrategy(devices)``. The backend is
    ``backend=``, else ``$SAFESTRATEGY_BACKEND``, else the first of nccl,
    hierarchical_copy, reduce_to_gpu, reduce_to_cpu that sums correctly across
    the devices. Other keyword arguments go to MirroredStrategy unchanged; a
    ``cross_device_ops`` (or TF 1.12 ``cross_tower_ops``) of your own is used
    as given, with no probing.
    """
    global _last_report
    own_ops = kwargs.get("cross_device_ops", kwargs.get("cross_tower_ops"))
    if own_ops is not None and backend is not None:
        raise ValueError("pass either backend= or your own cross_device_ops, not both")
    request = None if own_ops is not None else _request(devices, backend, None)
    tf = _tf.import_tf()
    era = _tf.era(tf.__version__)
    if request is None:
        strategy = build_strategy(tf, era, devices, **kwargs)
        report = _own_ops_report(tf.__version__, strategy, own_ops)
    else:
        report = _decide(request)
        _log(report)
        ops = build_cross_device_ops(tf, era, report.backend)
        strategy = build_strategy(tf, era, list(report.devices), ops, **kwargs)
    with _lock:
        _last_report = report
    return strategy


def _own_ops_report(version: str, strategy: Any, ops: Any) -> Report:
    extended = getattr(strategy, "extended", strategy)
    return Report(
        backend=type(ops).__name__,
        source="argument",
        mode="forced",
        devices=tuple(getattr(extended, "worker_devices", ())),
        platform=_probe.system(),
        tf_version=version,
        tf_api=_tf.tf_api(version),
        candidates=(),
        reason="cross-device ops given by the caller: used as given, not probed",
        wsl=_probe.is_wsl(),
        python=_platform.python_version(),
    )
