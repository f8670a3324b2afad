"""make_mirrored_strategy() and probe(): settings in, smoke checks, decision, report out.

Where each check runs: NCCL through :mod:`safestrategy._nccl` (kernel count,
cache, probe process); every other backend here, in the caller's process (in a
helper thread, outside the caller's strategy scope, in the caller's execution
mode), on the caller's own devices, except on TF 1.x GPU device sets, where a
``tf.Session`` would fix the process-wide GPU options before the caller's own
session could, so they run in one probe process too.
"""

import logging
import platform as _platform
import threading
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from . import _cache, _collective, _env, _nccl, _probe, _stalls, _tf, _timing, _watchdog, choose
from ._allreduce import graph_api, in_fresh_thread, judge, session_config, smoke_check
from ._devices import Device, parse_devices, require_existing
from ._env import Setting, resolve_backend, resolve_stall
from .backends import build_cross_device_ops, build_strategy, check_kwargs, get_backend
from .choose import Decision, failure_message, override_hint
from .report import FAILED, OK, TIMEOUT, XLA_NOTE, CandidateResult, Report, Stall

logger = logging.getLogger("safestrategy")

NO_GPU = "no GPU among the devices"

_last_report: Optional[Report] = None
# Decisions that found a backend, by request and execution mode: a process decides once
# per device set and mode.
_decisions: Dict[Any, Tuple[Tuple[Device, ...], Decision, Optional[int]]] = {}
_lock = threading.Lock()


class NoWorkingBackendError(RuntimeError):
    """No candidate backend passed its smoke check; ``report`` says why for each.

    (``report`` is None when ``safestrategy.nccl_ops`` raises it: there is no strategy.)
    """

    def __init__(self, message: str, report: Optional[Report]) -> None:
        super().__init__(message)
        self.report = report


class _Request(NamedTuple):
    """A validated request: nothing has been probed or imported yet."""

    devices: Optional[Tuple[Device, ...]]
    setting: Setting
    nccl: _nccl.Options
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
        _nccl.options(timeout, cache, refresh),
        _env.resolve_payload_mb(),
    )


class _Checks:
    """Runs the candidates' smoke checks and timings for one device set, each where it
    belongs: what may hang (NCCL, a collective on NCCL) in a probe process.

    While ``racing`` (a cold ``auto`` decision), an in-process check is the first run of
    the candidate's payload race (:class:`~safestrategy._timing.Race`), judged like a
    smoke check and kept for :meth:`time_all`: each candidate is traced once.
    """

    def __init__(
        self,
        tf: Any,
        devices: Tuple[Device, ...],
        opts: _nccl.Options,
        payload_mb: float,
        graph: Optional[Any],
        mode: str = "auto",
        stalls: Tuple[Stall, ...] = (),
    ) -> None:
        """``graph``: the caller's :func:`~safestrategy._allreduce.graph_api` (None: eager),
        asked in the caller's thread: the checks run in threads of their own. ``mode``: the
        setting's; ``stalls``: the backends that stalled in an earlier training here."""
        self.tf, self.devices, self.opts, self.payload_mb = tf, devices, opts, payload_mb
        # A backend that stalled in an earlier training fails, unless forced (the watchdog).
        self.stalled = {s.backend: s for s in stalls} if mode != "forced" else {}
        self.collective = _collective.live(tf, devices)
        self.era = _tf.era(tf.__version__)
        self.names = [str(device) for device in devices]
        self.gpu = any(device.kind == "GPU" for device in devices)
        self.config = None  # eager; in graph mode, the config of the checks' own sessions
        if graph is not None:
            cpus = max([d.index + 1 for d in devices if d.kind == "CPU"] or [1])
            self.config = session_config(graph, cpus, gpus=False)
        self.process: Optional[_probe.ProbeProcess] = None
        self.start_failure = ""  #: why the probe process could not start, once it could not
        self.racing = False  #: check in-process candidates on the payload (see the class)
        self.races: Dict[str, _timing.Race] = {}  #: checked on the payload, to be timed
        self.sizes = _timing.payload_sizes(payload_mb)
        self._inputs: Optional[Any] = None

    def unavailable(self) -> Dict[str, str]:
        """Candidates that cannot apply to these devices here, and why (``auto`` skips them)."""
        if self.collective.implementation is None:
            return {_collective.NAME: self.collective.reason}
        return {}

    def _may_hang(self, name: str) -> bool:
        return name == _nccl.NCCL or (
            name == _collective.NAME and self.collective.implementation == _collective.NCCL
        )

    def __call__(self, name: str) -> CandidateResult:
        if name in self.stalled:
            return _stalls.verdict(self.stalled[name], self.devices, self.opts)
        if name == _nccl.NCCL:
            return _nccl.verdict(self.tf, self.devices, self.opts)
        if name == _collective.NAME:
            if self.collective.implementation is None:
                return CandidateResult(name, FAILED, self.collective.reason)
            requested = f" ({self.collective.implementation} requested)"
            if self._may_hang(name):
                result = _nccl.verdict(self.tf, self.devices, self.opts, name)
            else:  # RING on CPUs: in-process, each op bounded by the timeout
                result = self._here(name, self.opts.timeout)
            return result._replace(reason=result.reason + requested)
        if get_backend(name).needs_gpu and not self.gpu:
            return CandidateResult(name, FAILED, NO_GPU)
        if self._elsewhere(name):
            return self._in_probe_process(name)
        return self._here(name)

    def _elsewhere(self, name: str) -> bool:
        """Checked and timed in the probe process (what may hang; TF 1.x sessions on GPUs)."""
        return self._may_hang(name) or (self.config is not None and self.gpu)

    def _here(self, name: str, timeout: Optional[float] = None) -> CandidateResult:
        """An in-process check: the payload race's first run while racing, else (or when the
        race could not be built or run, e.g. no memory for the payload) the small one."""
        if self.racing:
            started = time.monotonic()
            try:
                checked = self._race(name, timeout)
            except Exception as error:
                logger.debug("%s's payload race failed (%s): the smoke check decides", name, error)
            else:
                seconds = time.monotonic() - started
                result = judge(name, checked.values, len(self.devices), seconds)
                if result.status == OK:
                    self.races[name] = checked.race
                else:
                    checked.race.close()
                return result
        return smoke_check(self.tf, self.era, self.names, name, self.config, timeout)

    def _race(self, name: str, timeout: Optional[float]) -> "_timing.Checked":
        """``name``'s payload race after its first run (``PlacementError``: misplaced)."""
        if self.config is None and self._inputs is None:  # eager: one payload for all
            self._inputs = in_fresh_thread(lambda: _timing.payload(self.tf, self.names, self.sizes))
        ready = _timing.race(
            self.tf, self.era, self.names, name, self.sizes, self.config, timeout, self._inputs
        )
        try:
            return _timing.Checked(ready, _timing.checked(ready, self.names, self.config is None))
        except BaseException:
            ready.close()
            raise

    def time_all(self, names: Sequence[str]) -> Dict[str, Optional[float]]:
        """Median ms of each passing candidate's payload all-reduce (None: it could not be
        timed). In-process candidates run once each first; only those within
        :data:`~safestrategy.choose.SCREEN` of the fastest of these runs are run
        :data:`~safestrategy._timing.RUNS` times: a clear loser's time is its one run."""
        timings: Dict[str, Optional[float]] = {}
        firsts: Dict[str, float] = {}
        for name in names:
            if self._elsewhere(name):
                timings[name] = self._probe_ms(name)
                continue
            try:
                if name not in self.races:  # checked small (a warm winner failed): warm up
                    self.races[name] = self._race(name, self.opts.timeout).race
                firsts[name] = _timing.timed_ms(self.races[name], 1)[0]
            except Exception as error:
                logger.debug("timing %s failed: %s", name, error)
                timings[name] = None
        contenders = choose.contenders(firsts)
        for name, first in firsts.items():
            more: List[float] = []
            try:
                if name in contenders:
                    more = _timing.timed_ms(self.races[name], _timing.RUNS - 1)
            except Exception as error:
                logger.debug("timing %s failed: %s", name, error)
            timings[name] = _timing.median([first, *more])
        self.close_races()
        return {name: timings[name] for name in names}

    def _probe_ms(self, name: str) -> Optional[float]:
        """``name``'s median ms, timed in the probe process (None: it could not be)."""
        process = self._process()
        if process is None:
            return None
        return _timing.in_probe_process(process, name, self.payload_mb, self.opts.timeout)

    def _process(self) -> Optional[_probe.ProbeProcess]:
        """The probe process for this device set, started on first use (None: it cannot)."""
        if self.process is None and not self.start_failure:
            try:
                self.process, _ = _probe.start(
                    {"job": "mirrored", "devices": self.names}, self.opts.timeout
                )
            except _probe.ProbeDied as error:
                self.start_failure = str(error)
        return self.process

    def _in_probe_process(self, name: str) -> CandidateResult:
        if self._process() is None:
            return CandidateResult(name, FAILED, self.start_failure)
        result = _probe.check(self.process, name, len(self.devices), self.opts.timeout)
        if result.status != OK:  # a fresh process for the next: CUDA may be poisoned
            self.close()
        return result

    def close_races(self) -> None:
        for ready in self.races.values():
            ready.close()
        self.races.clear()
        self._inputs = None

    def close(self) -> None:
        self.close_races()
        if self.process is not None:
            self.process.close()
            self.process = None


def _devices_for(tf: Any, requested: Optional[Tuple[Device, ...]]) -> Tuple[Device, ...]:
    """The devices to mirror over, every one of them real in this process (``ValueError``)."""
    visible = _tf.visible_devices(tf)
    if requested is None:
        return _tf.default_devices(tf, visible)
    require_existing(requested, visible)
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
    return _decide(request, on_result, on_start)


def _decide(
    request: _Request,
    on_result: Optional[Callable[[CandidateResult], None]],
    on_start: Optional[Callable[[], None]] = None,
) -> Tuple[Report, bool]:
    if _tf.tf_version() is None:
        raise ImportError(_tf.INSTALL_HINT)
    tf = _tf.import_tf()
    devices = _devices_for(tf, request.devices)
    setting = request.setting
    graph = graph_api(tf)  # the caller's execution mode: graph-mode checks drive another path
    mode = "eager" if graph is None else "graph"
    opts = request.nccl
    stalls = _stalls.recorded(tf, [str(d) for d in devices], opts.cache, opts.refresh)
    recorded = tuple((stall.backend, stall.when) for stall in stalls)
    key = (
        devices,
        mode,
        setting.mode,
        setting.names,
        opts._replace(refresh=False),
        request.payload_mb,
        recorded,
    )
    with _lock:
        remembered = None if opts.refresh else _decisions.get(key)
    if remembered is None:
        checks = _Checks(tf, devices, opts, request.payload_mb, graph, setting.mode, stalls)

        def check(name: str) -> CandidateResult:
            result = checks(name)
            logger.debug("smoke check %s: %s %s", name, result.status, result.reason)
            if on_result is not None:
                on_result(result)
            return result

        if on_start is not None:
            on_start()
        try:
            decision = _timed_decision(tf, request, devices, mode, checks, check)
        finally:
            checks.close()
        kernels = _tf.nccl_kernel_count(tf)
    else:
        devices, decision, kernels = remembered
    raced = setting.mode == "auto" and len(devices) > 1
    report = Report(
        backend=decision.backend or "none",
        source=setting.source,
        mode=setting.mode,
        devices=tuple(str(d) for d in devices),
        platform=_probe.system(),
        tf_version=tf.__version__,
        tf_api=_tf.tf_api(tf.__version__),
        candidates=decision.results,
        reason=decision.reason,
        wsl=_probe.is_wsl(),
        nccl_kernels=kernels,
        python=_platform.python_version(),
        stalls=stalls,
        payload_mb=request.payload_mb if raced else None,
        xla=_tf.xla_auto_jit(tf),
    )
    if decision.backend is None:
        message = failure_message(devices, decision.results, setting)
        message += "".join(
            f"\n{r.name}: {_nccl.cached_note(devices, request.nccl.timeout, r.name)}."
            for r in decision.results
            if r.cached and r.status in (FAILED, TIMEOUT)
        )
        raise NoWorkingBackendError(message, report)
    with _lock:
        _decisions[key] = devices, decision, kernels
    return report, remembered is None


def _timed_decision(
    tf: Any,
    request: _Request,
    devices: Tuple[Device, ...],
    mode: str,
    checks: _Checks,
    check: Callable[[str], CandidateResult],
) -> Decision:
    """``choose.decide`` with the timings kept on disk: an ``auto`` decision whose timings
    are cached checks only its winner and times nothing; fresh timings are written, and
    those of a cached winner that fails now are dropped."""
    setting, opts = request.setting, request.nccl
    directory = _env.cache_dir() if opts.cache and setting.mode == "auto" else None
    key: Dict[str, Any] = {}
    cached = None
    if directory is not None and len(devices) > 1:
        key = _timing.cache_key(tf, devices, mode, request.payload_mb)
        stored = None if opts.refresh else _cache.read(directory, "timing", key)
        cached = _remembered(stored)
    checks.racing = setting.mode == "auto" and cached is None
    decision = choose.decide(setting, devices, check, checks.time_all, checks.unavailable(), cached)
    if key and decision.timed and decision.backend is not None:
        _cache.write(directory, "timing", key, _stored(decision))
    elif key and cached is not None and not decision.warm:
        _cache.remove(directory, "timing", key)
    return decision


def _stored(decision: Decision) -> Dict[str, Any]:
    return {
        "backend": decision.backend,
        "reason": decision.reason,
        "results": [result.to_dict() for result in decision.results],
    }


def _remembered(stored: Optional[Dict[str, Any]]) -> Optional[Decision]:
    """A cached ``auto`` decision, or None when there is none or it is malformed."""
    if stored is None:
        return None
    try:
        results = tuple(CandidateResult(**result) for result in stored["results"])
        return Decision(str(stored["backend"]), str(stored["reason"]), results)
    except (KeyError, TypeError) as error:
        logger.debug("cached timings %r are malformed (%s); ignored", stored, error)
        return None


def _log(report: Report, setting: Setting, fresh: bool, timeout: float) -> None:
    """One WARNING per fallback when freshly decided; DEBUG when remembered. A failure
    read from the cache says so, and gives the command that re-checks it (``timeout``:
    the NCCL check's, part of the verdict's key)."""
    level = logging.WARNING if fresh else logging.DEBUG
    stalled = {stall.backend for stall in report.stalls}  # their reasons say how to re-allow
    for failed in (r for r in report.candidates if r.status in (FAILED, TIMEOUT)):
        cached = ""
        if failed.cached and failed.name not in stalled:
            cached = f" ({_nccl.cached_note(report.devices, timeout, failed.name)})"
        logger.log(
            level,
            "all-reduce backend %s %s on %s (%s)%s; using %s instead. To choose yourself, %s.",
            failed.name,
            "timed out" if failed.status == TIMEOUT else "failed",
            ", ".join(report.devices),
            failed.reason.strip().splitlines()[0] if failed.reason.strip() else "",
            cached,
            report.backend,
            override_hint(setting),
        )
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


def last_report() -> Optional[Report]:
    """The report of the last :func:`make_mirrored_strategy` (or
    ``make_multiworker_strategy``) call, or None."""
    return _last_report


def _set_last_report(report: Report) -> None:
    """Make ``report`` what :func:`last_report` returns (the multi-worker factory's too)."""
    global _last_report
    with _lock:
        _last_report = report


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
    as given, with no probing.
    """
    global _last_report
    own_ops = kwargs.get("cross_device_ops", kwargs.get("cross_tower_ops"))
    if own_ops is not None and backend is not None:
        raise ValueError("pass either backend= or your own cross_device_ops, not both")
    request = None if own_ops is not None else _request(devices, backend, None)
    stall_settings = resolve_stall()
    tf = _tf.import_tf()
    era = _tf.era(tf.__version__)
    mirrored = tf.contrib.distribute if era == "contrib-tower" else tf.distribute
    check_kwargs("make_mirrored_strategy", mirrored.MirroredStrategy, kwargs)
    if request is None:
        strategy = build_strategy(tf, era, devices, **kwargs)
        report = _own_ops_report(tf.__version__, strategy, own_ops)
    else:
        report, fresh = _decide(request, None)
        _log(report, request.setting, fresh, request.nccl.timeout)
        _stalls.warn_forced(report, request.setting)
        chosen = next((c for c in report.candidates if c.name == report.backend), None)
        if chosen is not None and chosen.remedy:
            _nccl.apply_remedy(chosen.remedy, report.devices)
        ops = build_cross_device_ops(tf, era, report.backend, report.devices)
        strategy = build_strategy(tf, era, list(report.devices), ops, **kwargs)
    with _lock:
        _last_report = report
    _watchdog.watch(stall_settings, report)
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
