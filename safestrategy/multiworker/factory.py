"""make_multiworker_strategy(): the same safety when training outgrows one machine.

Settings and TF_CONFIG in, then the workers agree (:mod:`.rendezvous`) on facts
gathered here without starting TensorFlow's runtime (GPU count, NCCL kernel
count), NCCL's cross-worker check runs in probe processes
(:func:`attempt`, the child's ``"multiworker"`` job) only when it can mean
something, through the one remedy loop (:mod:`safestrategy.checks.nccl`); the
one chooser (:mod:`safestrategy.choose`) decides with the pure multi-worker
rules (:mod:`.agree`) on what every worker reported, and TensorFlow's own
``MultiWorkerMirroredStrategy`` is built with it.
The design, and what happens when a worker disagrees, dies or never comes,
is in docs/multiworker.md.
"""

import itertools
import json
import logging
import os
import platform as _platform
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from .. import _env, _machine, _rundir, _tf, choose, records
from .._env import (
    ENV_NCCL_REMEDIES,
    Setting,
    StallSettings,
    resolve_communication,
    resolve_stall,
    resolve_switch,
    resolve_timeout,
)
from ..backends import NCCL, RING, build_multiworker_strategy, check_kwargs
from ..checks import nccl, probe
from ..report import (
    FAILED,
    OK,
    TIMEOUT,
    CandidateResult,
    NoWorkingBackendError,
    Report,
    set_last_report,
)
from ..training import hooks, publish, watchdog
from ..training.board import Board
from ..training.rounds import Rounds
from . import agree, cluster, slurm
from .cluster import Cluster
from .rendezvous import MissingWorkersError, Rendezvous

logger = logging.getLogger("safestrategy")

#: How many decisions each task has completed in this process; the next one's number is
#: the rendezvous session. A call that ended in MissingWorkersError does not count: every
#: worker that is up raised it too, so a retry on each meets the others' (and a restarted
#: worker's first call) again.
_sessions: Dict[str, int] = {}
_lock = threading.Lock()

#: Whether this process has logged :func:`keras3_warning`'s WARNING (once per process).
_keras_warned = False

#: The values of TF_USE_LEGACY_KERAS that make TensorFlow route ``tf.keras`` to ``tf_keras``:
#: exactly these, as TF 2.16-2.21 test them (``tensorflow/python/util/lazy_loader.py``).
LEGACY_KERAS = ("true", "True", "1")
#: Keras 3's ``fit`` with MultiWorkerMirroredStrategy (also tensorflow/tensorflow#72388).
KERAS3_ISSUE = "keras-team/keras#20585"

NO_CLUSTER = (
    "no cluster: make_multiworker_strategy() takes the workers from cluster_resolver= (any "
    "tf.distribute.cluster_resolver.ClusterResolver), else TF_CONFIG (e.g. "
    'TF_CONFIG=\'{"cluster": {"worker": ["host1:12345", "host2:12345"]}, '
    '"task": {"type": "worker", "index": 0}}\'), else a Slurm job step of several tasks '
    "(srun -n2 python train.py); none is here (see docs/multiworker.md)"
)
ONE_MACHINE = "On one machine, use make_mirrored_strategy() or auto_strategy()"


def no_cluster(environ: Mapping[str, str]) -> str:
    """Why there is no cluster, and what to use instead: under ``srun`` with one task,
    that this is one process."""
    if slurm.step_tasks(environ) == 1:
        return (
            f"{NO_CLUSTER}; this Slurm step has one task (SLURM_STEP_NUM_TASKS=1), so it is "
            f"one process on one machine: use make_mirrored_strategy() or auto_strategy(), "
            "or srun -n N for N workers"
        )
    return f"{NO_CLUSTER}. {ONE_MACHINE}"


class Request(NamedTuple):
    """A validated multi-worker request: nothing has been probed or imported yet."""

    cluster: Cluster
    setting: Setting
    timeout: float  #: seconds for each wait: the workers to start, one NCCL check
    remedies: bool  #: SAFESTRATEGY_NCCL_REMEDIES


def request(
    communication: Optional[str] = None, timeout: Optional[float] = None, resolver: Any = None
) -> Request:
    """Validate every input (``ValueError``) before anything touches a device or a port.
    The cluster: ``resolver``, else TF_CONFIG, else Slurm's step (:func:`cluster.find`)."""
    setting = resolve_communication(communication)
    seconds = resolve_timeout(timeout)
    remedies = resolve_switch(ENV_NCCL_REMEDIES)
    workers = cluster.find(resolver)
    if workers is None:
        raise ValueError(no_cluster(os.environ))
    return Request(workers, setting, seconds, remedies)


def require_tf2() -> str:
    """The TensorFlow version, if it has MultiWorkerMirroredStrategy for us; else raise."""
    version = _tf.tf_version()
    if version is None:
        raise ImportError(_tf.INSTALL_HINT)
    if _tf.tf_api(version) != "tf2":
        raise RuntimeError(
            f"make_multiworker_strategy() needs TensorFlow 2.x; this is {version}. TF 1.x "
            "has no MultiWorkerMirroredStrategy for eager training (1.14/1.15 have an "
            "experimental one that runs only through Estimator or a session the strategy "
            "configures). On one machine use make_mirrored_strategy(); see "
            "docs/multiworker.md"
        )
    return version


def local_facts(tf: Any) -> Dict[str, Any]:
    """This worker's facts, without starting TensorFlow's runtime (the strategy must be
    created before any op runs). The one seam tests replace for a GPU count."""
    return {
        "gpus": len(_tf.list_physical_devices(tf, "GPU")),
        "nccl_kernels": _tf.nccl_kernel_count(tf),
        "tf_version": tf.__version__,
    }


def _facts(tf: Any, workers: Cluster) -> Dict[str, Any]:
    """This worker's facts and the records it carries into the hello."""
    addresses = [str(address) for address in workers.workers]
    return {**local_facts(tf), "records": records.carried(tf, addresses, workers.task)}


def _free_port(host: str) -> int:
    """A port free on this machine now, for this worker's probe process."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def _hello_parts(request: Request) -> List[Tuple[str, float]]:
    """What the hello's wait for the peers is made of, each named as a user sets it: the
    probe timeout; under ``run`` after a relaunch also a peer's stall timeout and
    ``--grace``, so that the first worker back does not give up before its peers are freed
    by their watchdog and relaunched."""
    parts = [(_env.ENV_TIMEOUT, request.timeout)]
    restart = os.environ.get(_env.ENV_RESTART, "").strip()
    if not restart.isdigit() or restart == "0":
        return parts
    stall = resolve_stall().timeout or 0.0
    return [*parts, (_env.ENV_STALL_TIMEOUT, stall), ("run's --grace", _env.run_grace())]


def _hello_wait(request: Request) -> float:
    """How long the hello waits for the peers (:func:`_hello_parts`)."""
    return sum(seconds for _, seconds in _hello_parts(request))


def _hello_within(request: Request) -> Optional[str]:
    """How a ``MissingWorkersError`` of the hello says what it waited, when that is more
    than the probe timeout (None: the rendezvous's own words)."""
    parts = _hello_parts(request)
    if len(parts) == 1:
        return None
    each = " + ".join(f"{what} {seconds:g} s" for what, seconds in parts)
    return (
        f"{_hello_wait(request):g} s of each other (a worker relaunched by run waits for its "
        f"peers {each}; raise {_env.ENV_TIMEOUT} to wait longer)"
    )


def _hello(request: Request, facts: Mapping[str, Any]) -> Dict[str, Any]:
    """What this worker tells the others first."""
    return {
        "records": list(facts.get("records") or ()),
        "cluster": [f"{address.task}={address}" for address in request.cluster.workers],
        "setting": [request.setting.mode, list(request.setting.names)],
        "gpus": facts.get("gpus"),
        "nccl_kernels": facts.get("nccl_kernels"),
        "tf_version": facts.get("tf_version"),
        "user_nccl": list(_env.user_remedies()),
        "remedies": request.remedies,
        "probe_port": _free_port(request.cluster.me.host),
        "host": socket.gethostname(),  # tasks on one host that see the same GPUs: a WARNING
        "visible_gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "stall_timeout": resolve_stall().timeout,  # the rounds' bounds follow from it
    }


def attempt(
    tf_config: Mapping[str, Any], replicas: int, timeout: float, env: Mapping[str, str]
) -> Tuple[CandidateResult, Optional[probe.ProbeProcess]]:
    """Run NCCL's cross-worker check in a fresh probe process with ``env`` added.

    Returns this worker's verdict and, when the check answered, the process still
    running: the caller closes it once every worker has answered too.
    """
    full_env = {**env, "TF_CONFIG": json.dumps(tf_config)}
    try:
        process, _ = probe.start({"job": "multiworker"}, timeout, full_env)
    except probe.ProbeDied as error:
        return CandidateResult(NCCL, FAILED, str(error)), None
    started = time.monotonic()
    try:
        reply = process.ask({"check": NCCL}, timeout)
    except probe.ProbeTimeout as error:
        return CandidateResult(NCCL, TIMEOUT, str(error), timeout), None
    except probe.ProbeDied as error:
        process.close()
        return CandidateResult(NCCL, FAILED, str(error), round(time.monotonic() - started, 3)), None
    except BaseException:
        process.close()
        raise
    return agree.judge(reply, replicas, time.monotonic() - started), process


def _nccl_check(
    rendezvous: Rendezvous, request: Request, hellos: Mapping[str, Any]
) -> CandidateResult:
    """NCCL's verdict agreed by every worker: from the facts, or from checks run together,
    through the one remedy loop (each remedy an attempt on every worker at once)."""
    gated = agree.gate(request.setting, hellos)
    if gated is not None:
        return gated
    workers = request.cluster.workers
    config = cluster.probe_config(
        request.cluster, [hellos[address.task]["probe_port"] for address in workers]
    )
    replicas = agree.expected_replicas(hellos)
    # A peer's probe process may take its start-up time plus one check: wait for that.
    wait = max(probe.STARTUP_TIMEOUT, request.timeout) + request.timeout + 30
    rounds = itertools.count()

    def together(remedy: Mapping[str, str]) -> CandidateResult:
        mine, process = attempt(config, replicas, request.timeout, remedy)
        logger.debug("cross-worker NCCL check %s: %s %s", remedy, mine.status, mine.reason)
        try:  # keep a passing probe process up until every peer has its answer
            verdicts = rendezvous.exchange(
                f"nccl-{next(rounds)}",
                mine.to_dict(),
                wait,
                "waiting for the others' NCCL check",
            )
        finally:
            if process is not None:
                process.close()
        return agree.combine(verdicts, remedy)

    first, *remedies = agree.remedy_attempts(hellos)
    recorded = agree.recorded(hellos).get(NCCL)
    if recorded is not None:  # a worker's record: the remedies no record was made under, then RING
        failed = CandidateResult(NCCL, FAILED, recorded, cached=True)
        after = agree.after_records(hellos)
        return nccl.with_remedies(failed, after, together, " on every worker")
    result = together(first)
    if not agree.remediable(result):
        remedies = []
    return nccl.with_remedies(result, remedies, together, " on every worker")


def decide(
    request: Request,
    facts: Optional[Mapping[str, Any]] = None,
    on_result: Optional[Callable[[CandidateResult], None]] = None,
) -> Report:
    """Agree with every other worker on the communication; the report (nothing is built).

    Raises ``MissingWorkersError`` (a ``TimeoutError``) when a worker does not answer
    in time, ``ValueError`` when the workers' TF_CONFIG or settings differ, and
    ``NoWorkingBackendError`` when no communication passes. Every port and probe
    process this opened is closed when it returns or raises.
    """
    if facts is None:
        facts = _facts(_tf.import_tf(), request.cluster)
    workers, setting = request.cluster, request.setting
    with _lock:
        session = _sessions.get(workers.task, 0) + 1
    met = False
    try:
        with Rendezvous(workers.me, workers.peers, session, workers.ports) as rendezvous:
            hellos = rendezvous.exchange(
                "hello",
                _hello(request, facts),
                _hello_wait(request),
                "waiting for the other workers",
                _hello_within(request),
            )
            met = True
            problem = agree.disagreement(hellos)
            if problem is not None:
                raise ValueError(problem)
            shared = agree.shared_gpus(hellos, workers.task)
            if shared is not None:
                logger.warning("%s", shared)

            def check(name: str) -> CandidateResult:
                if name == RING:
                    result = CandidateResult(name, OK, agree.RING_REASON)
                else:
                    result = _nccl_check(rendezvous, request, hellos)
                if on_result is not None:
                    on_result(agree.shown(result))
                return result

            decision = choose.decide(setting, check, race=False, why=agree.why)
    except MissingWorkersError:
        met = False
        raise
    finally:
        if met:
            with _lock:
                _sessions[workers.task] = session
    gpus = int(facts.get("gpus") or 0)
    report = Report(
        backend=decision.backend or "none",
        source=setting.source,
        mode=setting.mode,
        devices=tuple(f"/device:GPU:{i}" for i in range(gpus)) or ("/device:CPU:0",),
        platform=_machine.system(),
        tf_version=str(facts.get("tf_version")),
        tf_api=_tf.tf_api(str(facts.get("tf_version"))),
        candidates=tuple(agree.shown(result) for result in decision.results),
        reason=decision.reason,
        wsl=_machine.is_wsl(),
        nccl_kernels=facts.get("nccl_kernels"),
        python=_platform.python_version(),
        workers=len(workers.workers),
        task=workers.task,
        cluster_source=workers.source,
        cluster_origin=workers.origin,
    )
    if decision.backend is None:
        tasks = [address.task for address in workers.workers]
        raise NoWorkingBackendError(agree.failure_message(tasks, decision.results, setting), report)
    return report


def keras3_warning(
    tf_version: str, environ: Mapping[str, str], keras_version: Optional[str]
) -> Optional[str]:
    """The WARNING for Keras 3's ``fit`` under this strategy; None where ``tf.keras`` is not
    Keras 3, or where that cannot be told. Pure: the factory gives it this process's facts.

    TensorFlow's own rule: from TF 2.16, ``tf.keras`` is Keras 3 unless ``TF_USE_LEGACY_KERAS``
    (in ``environ``) is ``true``, ``True`` or ``1`` (then ``tf_keras``) or the ``keras`` found
    is 2.x. ``keras_version`` is that of the ``keras`` module already imported, or None when
    none is (then TF 2.16+, which requires Keras 3, means Keras 3). An unparseable TF version
    gives None.
    """
    release = _tf.release(tf_version).release
    legacy = environ.get("TF_USE_LEGACY_KERAS")
    if len(release) < 2 or release[:2] < (2, 16) or legacy in LEGACY_KERAS:
        return None
    if keras_version is not None and not keras_version.startswith("3."):
        return None  # TensorFlow routes tf.keras to the Keras 2.x it finds
    keras = f"Keras {keras_version}" if keras_version else "Keras 3"
    if legacy is None:
        why = "without TF_USE_LEGACY_KERAS=1"
    else:
        accepted = ", ".join(LEGACY_KERAS)
        why = f"TF_USE_LEGACY_KERAS={legacy!r} is not one it accepts: {accepted}"
    return (
        f"tf.keras is {keras} (TensorFlow {tf_version}, {why}), whose Model.fit cannot train "
        "with MultiWorkerMirroredStrategy: the first fit fails with 'ValueError: Attempt to "
        f"convert a value (PerReplica:{{...}}) with an unsupported type' ({KERAS3_ISSUE}; "
        "stock TensorFlow fails the same way). To use fit, take TensorFlow's way back to "
        f"Keras 2: pip install --no-deps tf_keras~={release[0]}.{release[1]} (--no-deps: "
        "tf_keras requires the 'tensorflow' package, and would install a second TensorFlow "
        "over tensorflow-cpu) and set TF_USE_LEGACY_KERAS=1 before TensorFlow is imported. "
        "Custom training loops "
        "(strategy.run in a tf.function) are unaffected"
    )


def imported_keras_version() -> Optional[str]:
    """The version of the ``keras`` module if one is imported; None if not. Imports nothing."""
    version = getattr(sys.modules.get("keras"), "__version__", None)
    return version if isinstance(version, str) else None


_unseen_said = False


def _board(tf: Any, cluster: Cluster) -> Optional[Board]:
    """Where this worker's watchdog tells its peers where it is: TensorFlow's coordination
    service, up once the strategy is built. Where it cannot be used, said once (INFO): a
    stall's ERROR then names this worker only."""
    global _unseen_said
    kv, why = _tf.coordination_kv(tf)
    if kv is not None:
        workers = [address.task for address in cluster.workers]
        return Board(kv, [str(a) for a in cluster.workers], workers, cluster.task)
    with _lock:
        said, _unseen_said = _unseen_said, True
    if not said:
        logger.info("the workers cannot tell each other where they are: %s; a stall's "
                    "ERROR names this worker only", why)  # fmt: skip
    return None


def _rounds(
    tf: Any, board: Optional[Board], report: Report, strategy: Any, settings: StallSettings
) -> Optional[Rounds]:
    """The canary rounds that judge a stall (training/rounds.py), over the same service as
    ``board``; None where there is none (no board, or no eager raw collective)."""
    kv, _ = _tf.coordination_kv(tf)
    devices = list(getattr(strategy.extended, "worker_devices", ()))
    if board is None or kv is None or not devices:
        return None
    timeout = settings.timeout or watchdog.stall_timeout()
    hint = report.backend  # ring or nccl: the communication the step uses
    return Rounds(kv, board.cluster, board.tasks, board.me, devices, hint, publish.joining, timeout)


def _warn_keras3(tf_version: str) -> None:
    """:func:`keras3_warning` on this process, logged once per process."""
    global _keras_warned
    message = keras3_warning(tf_version, os.environ, imported_keras_version())
    with _lock:
        if message is None or _keras_warned:
            return
        _keras_warned = True
    logger.warning("%s", message)


def _log(report: Report, setting: Setting, workers: Sequence[str]) -> None:
    """One WARNING per fallback, then the choice at INFO."""
    where = f"across {', '.join(workers)}"
    hint = agree.override_hint(setting)
    choose.log_fallbacks(report, logging.WARNING, "multi-worker communication", where, hint)
    logger.info(
        "using multi-worker communication %s (%s of %d workers): %s",
        report.backend,
        report.task,
        report.workers,
        report.reason,
    )


def _simple_resolver(tf: Any, workers: Cluster, gpus: int) -> Any:
    """TensorFlow's ``SimpleClusterResolver`` of ``workers``, this task, and the GPUs TF
    sees here: TF's strategy takes a resolver's ``num_accelerators()`` as its GPU count,
    which ``SlurmClusterResolver`` reads from ``nvidia-smi`` (absent on a CPU node) per node,
    not per task (tensorflow#36094)."""
    jobs: Dict[str, List[str]] = {}
    for address in workers.workers:
        jobs.setdefault(address.task.split(":")[0], []).append(str(address))
    kind, index = workers.task.split(":")
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(jobs),
        task_type=kind,
        task_id=int(index),
        num_accelerators={"GPU": int(gpus or 0)},
        rpc_layer="grpc",
    )


def _check_kwargs(tf: Any, kwargs: Mapping[str, Any]) -> None:
    """``TypeError``/``ValueError`` for keyword arguments we cannot pass on, before probing."""
    options = kwargs.get("communication_options")
    implementation = getattr(options, "implementation", None)
    if implementation is not None and getattr(implementation, "name", "AUTO") != "AUTO":
        raise ValueError(
            "choose the implementation with communication= (or SAFESTRATEGY_COMMUNICATION), "
            "not CommunicationOptions(implementation=...); its other options are kept"
        )
    cls = getattr(tf.distribute, "MultiWorkerMirroredStrategy", None)
    cls = cls or tf.distribute.experimental.MultiWorkerMirroredStrategy
    check_kwargs("make_multiworker_strategy", cls, kwargs)


def make_multiworker_strategy(
    *, communication: Optional[str] = None, cluster_resolver: Any = None, **kwargs: Any
) -> Any:
    """TensorFlow's ``MultiWorkerMirroredStrategy``, with a communication every worker agreed on.

    The workers come from ``cluster_resolver=`` (any TensorFlow ``ClusterResolver``), else
    ``TF_CONFIG``, else the Slurm job step this task is one of (``srun -n2 python
    train.py``); ``ValueError`` when none names a cluster. A resolver's or Slurm's cluster
    is handed to TensorFlow as a ``SimpleClusterResolver`` with the GPUs TensorFlow sees
    here (never ``nvidia-smi``, never Slurm's GPU counts). The communication is
    ``communication=``, else ``$SAFESTRATEGY_COMMUNICATION``, else ``auto``: NCCL
    only when every worker has GPUs and a real cross-worker NCCL all-reduce summed
    right on every worker, else RING. Other keyword arguments go to the
    constructor. Every worker must call this (the same number of times); one that
    does not answer within ``SAFESTRATEGY_PROBE_TIMEOUT`` seconds makes it raise
    :class:`MissingWorkersError` (a ``TimeoutError``) naming it, on every worker.
    Such a call does not count: calling again on every worker (or restarting the
    missing one) meets again.

    Where ``tf.keras`` is Keras 3 (:func:`keras3_warning`), whose ``fit`` cannot train
    with this strategy, it logs one WARNING (once per process, not per call) with
    TensorFlow's way back to Keras 2; nothing is raised.
    """
    require_tf2()
    req = request(communication, resolver=cluster_resolver)
    stall_settings = resolve_stall()
    tf = _tf.import_tf()
    _check_kwargs(tf, kwargs)
    facts = _facts(tf, req.cluster)
    report = decide(req, facts)
    workers = [address.task for address in req.cluster.workers]
    _log(report, req.setting, workers)
    chosen = next(c for c in report.candidates if c.name == report.backend)
    if chosen.remedy:
        nccl.apply_remedy(chosen.remedy, workers)
    if req.cluster.source != cluster.TF_CONFIG:  # TF reads TF_CONFIG itself, nothing else
        kwargs = {**kwargs, "cluster_resolver": _simple_resolver(tf, req.cluster, facts["gpus"])}
    strategy = build_multiworker_strategy(tf, report.backend, kwargs)
    _warn_keras3(tf.__version__)
    set_last_report(report)
    addresses = [str(address) for address in req.cluster.workers]
    place = records.on_worker(tf, addresses, req.cluster.task, report.backend in records.READ)
    board = _board(tf, req.cluster)
    rounds = _rounds(tf, board, report, strategy, stall_settings)
    watchdog.watch(stall_settings, report, strategy, place, board, rounds)
    if board is not None:
        hooks.report_lost_peers()
    _rundir.decision(records.decision_entry(report, place, stall_settings.timeout))
    timeout = getattr(kwargs.get("communication_options"), "timeout_seconds", None)
    if timeout:
        hooks.report_collective_timeouts(timeout, report, strategy, place)
    return strategy
