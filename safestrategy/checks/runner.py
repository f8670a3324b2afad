"""Where each candidate is checked and timed, for one device set, and its timings kept.

What may hang (NCCL, a ``collective`` on NCCL) runs in a probe process: NCCL's
verdicts through :mod:`safestrategy.checks.nccl`, the rest of what must run
there (TF 1.x sessions on GPU sets, the timing of what may hang) in one shared
probe process (:class:`~safestrategy.checks.probe.Shared`). A backend with a
record of trouble during training gets what the records say of it
(:mod:`safestrategy.records`), NCCL's untried remedies first.
Everything else runs here, in the caller's process (in a helper thread,
outside the caller's strategy scope, in the caller's execution mode), on the
caller's own devices.

While racing (a cold ``auto`` decision), an in-process check is the first run
of the candidate's payload race (:class:`Races`), judged like a smoke check
and kept to be timed: each candidate is traced once. :func:`decide` wraps the
chooser with the timing cache: a warm ``auto`` checks only its cached winner.
"""

import logging
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .. import _cache, _env, _tf, choose, records
from .._devices import Device, cpu_count
from .._env import Setting
from ..backends import (
    COLLECTIVE,
    NCCL,
    NCCL_IMPLEMENTATION,
    NO_GPU,
    collective_live,
    get_backend,
    unavailable,
)
from ..choose import Decision
from ..report import FAILED, OK, CandidateResult
from . import allreduce, nccl, probe, timing

logger = logging.getLogger("safestrategy")

#: The least bound on an in-process ``collective`` check or timing (seconds; the probe
#: timeout when larger): a collective that times out aborts *every* collective of the
#: process (TF's StartAbort), so only a real hang may reach it, never ordinary load.
COLLECTIVE_BOUND = 30.0

#: What a failed in-process ``collective`` says when TF aborted the process's collectives.
ABORTED = (
    "TensorFlow's collective ops are now unusable in this process: a stock "
    "MirroredStrategy or MultiWorkerMirroredStrategy created later in it will fail; "
    "restart to use them"
)
_ABORT_SIGNS = ("DeadlineExceededError", "Collective ops is aborted", "aborted by")


def _why(error: BaseException) -> str:
    """An error as a reason: its type and first line."""
    return ": ".join(part for part in allreduce.first_line(error) if part)


class Races:
    """The in-process candidates' payload races for one device set: each built once, its
    first run judged as its check, then timed (screened, then in full)."""

    def __init__(self, tf: Any, names: Sequence[str], config: Any, payload_mb: float) -> None:
        self.tf, self.names, self.config = tf, list(names), config
        self.era = _tf.era(tf.__version__)
        self.sizes = allreduce.payload_sizes(payload_mb)
        self.ready: Dict[str, allreduce.Race] = {}  #: checked on the payload, to be timed
        self._inputs: Optional[Any] = None

    def check(self, name: str, timeout: Optional[float]) -> Optional[CandidateResult]:
        """``name``'s check as its race's first run; None when the race could not be built or
        run (e.g. no memory for the payload): the small smoke check decides then."""
        started = time.monotonic()
        try:
            checked = self._checked(name, timeout)
        except Exception as error:
            logger.debug("%s's payload race failed (%s): the smoke check decides", name, error)
            return None
        seconds = time.monotonic() - started
        result = allreduce.judge(name, checked.values, len(self.names), seconds)
        if result.status == OK:
            self.ready[name] = checked.race
        else:
            checked.race.close()
        return result

    def _checked(self, name: str, timeout: Optional[float]) -> allreduce.Checked:
        """``name``'s payload race after its first run (``PlacementError``: misplaced)."""
        eager = self.config is None
        if eager and self._inputs is None:  # eager: one payload for all
            self._inputs = allreduce.in_fresh_thread(
                lambda: allreduce.payload(self.tf, self.names, self.sizes)
            )
        ready = allreduce.race(
            self.tf, self.era, self.names, name, self.sizes, self.config, timeout, self._inputs
        )
        try:
            return allreduce.Checked(ready, allreduce.checked(ready, self.names, eager))
        except BaseException:
            ready.close()
            raise

    def time(self, names: Sequence[str], timeout: float) -> Dict[str, Union[float, str]]:
        """Median ms of each candidate's payload all-reduce, or why it could not be timed.

        The candidates take turns (one run of each, then the next run of each, each round
        starting one candidate later), so none gains from running first. After the first
        round only those within :data:`~safestrategy.checks.timing.SCREEN` of the fastest
        run go on to :data:`~safestrategy.checks.timing.RUNS` runs: a clear loser's time
        is its one run."""
        failed: Dict[str, str] = {}
        runs: Dict[str, List[float]] = {}
        for name in names:
            try:
                if name not in self.ready:  # checked small (a warm winner failed): warm up
                    self.ready[name] = self._checked(name, timeout).race
            except Exception as error:
                failed[name] = _why(error)
        order = [name for name in names if name not in failed]
        for round_number in range(timing.RUNS):
            if round_number == 1:
                firsts = {name: ms[0] for name, ms in runs.items()}
                order = [name for name in order if name in timing.contenders(firsts)]
            shift = round_number % len(order) if order else 0
            for name in order[shift:] + order[:shift]:
                if name in failed:
                    continue
                try:
                    runs.setdefault(name, []).extend(timing.timed_ms(self.ready[name], 1))
                except Exception as error:
                    if name not in runs:
                        failed[name] = _why(error)
        self.close()
        timings: Dict[str, Union[float, str]] = {n: timing.median(ms) for n, ms in runs.items()}
        timings.update(failed)
        return timings

    def close(self) -> None:
        for ready in self.ready.values():
            ready.close()
        self.ready.clear()
        self._inputs = None


class Runner:
    """Checks and times the candidates for one device set, each where it belongs (see the
    module docstring); a callable ``check(name)`` for :func:`safestrategy.choose.decide`."""

    def __init__(
        self,
        tf: Any,
        devices: Tuple[Device, ...],
        opts: nccl.Options,
        payload_mb: float,
        graph: Optional[Any],
        standing: Optional[records.Standing] = None,
    ) -> None:
        """``graph``: the caller's :func:`~safestrategy.checks.allreduce.graph_api` (None:
        eager), asked in the caller's thread: the checks run in threads of their own.
        ``standing``: what the records of trouble during training say for these devices
        (read once by the factory; a forced setting's are reported, not obeyed)."""
        self.tf, self.devices, self.opts, self.payload_mb = tf, devices, opts, payload_mb
        self.standing = standing or records.Standing((), None)
        self.stalled = self.standing.obeyed
        self.collective = collective_live(tf, devices)
        self.era = _tf.era(tf.__version__)
        self.names = [str(device) for device in devices]
        self.gpu = any(device.kind == "GPU" for device in devices)
        self.config = None  # eager; in graph mode, the config of the checks' own sessions
        if graph is not None:
            self.config = allreduce.session_config(graph, cpu_count(devices), gpus=False)
        #: Probe processes by the remedy they run with: a candidate is timed where and how it
        #: was checked (one that passed only with NCCL_P2P_DISABLE=1 is timed with it).
        self.probes: Dict[Tuple[Tuple[str, str], ...], probe.Shared] = {}
        self.remedies: Dict[str, Mapping[str, str]] = {}  #: each passing candidate's remedy
        self.racing = False  #: check in-process candidates on the payload (see the module)
        self.races = Races(tf, self.names, self.config, payload_mb)
        #: An in-process collective failed as TF's abort does: this process's collectives
        #: are unusable, so nothing learnt here is kept (it was this process's, not the machine's)
        self.aborted = False

    def unavailable(self) -> Dict[str, str]:
        """Candidates that cannot apply to these devices here, and why (``auto`` skips them)."""
        return unavailable(self.devices, self.collective)

    def _may_hang(self, name: str) -> bool:
        return name == NCCL or (
            name == COLLECTIVE and self.collective.implementation == NCCL_IMPLEMENTATION
        )

    def _elsewhere(self, name: str) -> bool:
        """Checked and timed in the probe process (what may hang; TF 1.x sessions on GPUs)."""
        return self._may_hang(name) or (self.config is not None and self.gpu)

    def __call__(self, name: str) -> CandidateResult:
        result = self._check(name)
        if result.status == OK:
            self.remedies[name] = result.remedy
        return result

    def anyway(self, name: str) -> CandidateResult:
        """``name``'s check with its record set aside: the last resort, when every candidate
        that passed had a record (:func:`safestrategy.choose.decide`)."""
        result = self._unrecorded(name)
        if result.status == OK:
            self.remedies[name] = result.remedy
        return records.anyway(result, self.stalled[name])

    def _check(self, name: str) -> CandidateResult:
        demotion = self.standing.demotion(name, self._may_hang(name), self.opts.remedies)
        if demotion is not None:
            return nccl.after_record(self.tf, self.devices, self.opts, demotion)
        return self._unrecorded(name)

    def _unrecorded(self, name: str) -> CandidateResult:
        if name == NCCL:
            return nccl.verdict(self.tf, self.devices, self.opts)
        if name == COLLECTIVE:
            if self.collective.implementation is None:
                return CandidateResult(name, FAILED, self.collective.reason)
            requested = f" ({self.collective.implementation} requested)"
            if self._may_hang(name):
                result = nccl.verdict(self.tf, self.devices, self.opts, name)
            else:  # RING on CPUs: in-process, each op bounded (see COLLECTIVE_BOUND)
                result = self._aborted(self._here(name, self._collective_bound()))
            return result._replace(reason=result.reason + requested)
        if get_backend(name).needs_gpu and not self.gpu:
            return CandidateResult(name, FAILED, NO_GPU)
        if self._elsewhere(name):
            return self._probe({}).check(name, len(self.devices))
        return self._here(name)

    def _probe(self, remedy: Mapping[str, str]) -> probe.Shared:
        """The shared probe process that runs with ``remedy`` set (started on first use)."""
        key = tuple(sorted(remedy.items()))
        if key not in self.probes:
            request = {"job": "mirrored", "devices": self.names}
            self.probes[key] = probe.Shared(request, self.opts.timeout, remedy)
        return self.probes[key]

    def _collective_bound(self) -> float:
        return max(COLLECTIVE_BOUND, self.opts.timeout)

    def _aborted(self, result: CandidateResult) -> CandidateResult:
        """``result``, saying so plainly when it is TF's abort of every collective here."""
        if result.status == OK or not any(sign in result.reason for sign in _ABORT_SIGNS):
            return result
        self.aborted = True
        return result._replace(reason=f"{ABORTED} ({choose.first_line(result.reason)})")

    def _here(self, name: str, timeout: Optional[float] = None) -> CandidateResult:
        """An in-process check: the payload race's first run while racing, else (or when the
        race could not be built or run) the small one."""
        raced = self.races.check(name, timeout) if self.racing else None
        if raced is not None:
            return raced
        return allreduce.smoke_check(self.tf, self.era, self.names, name, self.config, timeout)

    def time_all(self, names: Sequence[str]) -> Dict[str, Union[float, str]]:
        """Median ms of each passing candidate's payload all-reduce, or why it could not be
        timed: in a probe process with the candidate's remedy for what was checked there
        (each gives its own median), else here, taking turns (:class:`Races`)."""
        timings: Dict[str, Union[float, str]] = {}
        for name in (name for name in names if self._elsewhere(name)):
            timings[name] = self._probe(self.remedies.get(name, {})).time(name, self.payload_mb)
        here = [name for name in names if name not in timings]
        timings.update(self.races.time(here, self._collective_bound()))
        failed = timings.get(COLLECTIVE)
        if isinstance(failed, str) and any(sign in failed for sign in _ABORT_SIGNS):
            self.aborted = True
        return {name: timings[name] for name in names}

    def close(self) -> None:
        self.races.close()
        for shared in self.probes.values():
            shared.close()


def decide(
    tf: Any,
    setting: Setting,
    opts: nccl.Options,
    payload_mb: float,
    mode: str,
    runner: Runner,
    check: Callable[[str], CandidateResult],
) -> Decision:
    """:func:`safestrategy.choose.decide` with the timings kept on disk: an ``auto`` decision
    whose timings are cached checks only its winner and times nothing; fresh timings are
    written, and those of a cached winner that fails now are dropped."""
    directory = _env.cache_dir() if opts.cache else None
    if directory is not None and opts.refresh and setting.mode != "auto":
        for name in setting.names:  # re-checked now: timings resting on the old verdict go
            timing.forget(directory, tf, runner.devices, name)
    if setting.mode != "auto":
        directory = None
    key: Dict[str, Any] = {}
    cached = None
    if directory is not None:
        key = timing.cache_key(tf, runner.devices, mode, payload_mb, opts)
        stored = None if opts.refresh else _cache.read(directory, timing.KIND, key)
        cached = timing.remembered(stored)
    runner.racing = setting.mode == "auto" and cached is None
    decision = choose.decide(
        setting,
        check,
        runner.time_all,
        runner.unavailable(),
        cached,
        recorded=set(runner.stalled),
        anyway=runner.anyway,
    )
    if runner.aborted:
        logger.debug("this process's collectives were aborted: nothing of it is cached")
    elif key and decision.timed and decision.backend is not None:
        _cache.write(directory, timing.KIND, key, timing.stored(decision))
    elif key and cached is not None and not decision.warm:
        _cache.remove(directory, timing.KIND, key)
    return decision
