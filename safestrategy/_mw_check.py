"""TensorFlow's side of multi-worker training: build the strategy; check NCCL across workers.

:func:`build_strategy` is the one place that constructs
``MultiWorkerMirroredStrategy``, for the factory and for the probe process.

:func:`job` is the probe process's ``"multiworker"`` job
(:data:`safestrategy._worker.JOBS`): it builds the strategy with NCCL on the
probe cluster its ``TF_CONFIG`` names (the workers' hosts, ports of the probe
processes' own), runs one all-reduce in which replica *r* (numbered across all
workers) contributes *r + 1*, and reports its local replicas' sums. It then
stays up until its parent closes it, because a peer may still be fetching its
part of the all-reduce. :func:`attempt` is the parent's side.
"""

import json
import queue
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from . import _probe
from ._allreduce import VECTOR_SIZE, first_line, from_reply, wrong_sums
from ._tf import import_tf, list_physical_devices
from .report import FAILED, OK, TIMEOUT, CandidateResult

NCCL = "nccl"


def build_strategy(tf: Any, communication: str, kwargs: Mapping[str, Any]) -> Any:
    """TensorFlow's own MultiWorkerMirroredStrategy with ``communication`` (nccl, ring).

    TF >= 2.4: ``tf.distribute.MultiWorkerMirroredStrategy(communication_options=
    CommunicationOptions(implementation=...))``, keeping the packing and timeout of a
    ``communication_options`` the caller passed; TF 2.0-2.3:
    ``tf.distribute.experimental.MultiWorkerMirroredStrategy(communication=...)``.
    """
    kwargs = dict(kwargs)
    experimental = tf.distribute.experimental
    if hasattr(tf.distribute, "MultiWorkerMirroredStrategy"):
        implementation = getattr(experimental.CommunicationImplementation, communication.upper())
        given = kwargs.pop("communication_options", None)
        options = experimental.CommunicationOptions(
            bytes_per_pack=getattr(given, "bytes_per_pack", 0),
            timeout_seconds=getattr(given, "timeout_seconds", None),
            implementation=implementation,
        )
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options, **kwargs)
    collective = getattr(experimental.CollectiveCommunication, communication.upper())
    return experimental.MultiWorkerMirroredStrategy(communication=collective, **kwargs)


def all_reduce(tf: Any, strategy: Any) -> Tuple[List[Any], int]:
    """One sum all-reduce across every replica of every worker: (local values, replicas)."""

    def step() -> Any:
        context = tf.distribute.get_replica_context()
        value = tf.cast(context.replica_id_in_sync_group + 1, tf.float32)
        return context.all_reduce(tf.distribute.ReduceOp.SUM, tf.fill([VECTOR_SIZE], value))

    run = getattr(strategy, "run", None) or strategy.experimental_run_v2  # TF 2.0/2.1
    result = run(tf.function(step))
    values = [
        [str(tensor.device), [float(x) for x in tensor.numpy()]]
        for tensor in strategy.experimental_local_results(result)
    ]
    return values, int(strategy.num_replicas_in_sync)


Send = Callable[[Dict[str, Any]], None]


def job(request: Dict[str, Any], send: Send, requests: "queue.Queue[str]") -> int:
    """The probe process's ``"multiworker"`` job (see the module docstring)."""
    tf = import_tf()
    gpus = list_physical_devices(tf, "GPU")
    for gpu in gpus:  # take only what the tiny all-reduce needs
        tf.config.experimental.set_memory_growth(gpu, True)
    send({"facts": {"tf_version": tf.__version__, "gpus": len(gpus)}})
    name = json.loads(requests.get())["check"]
    try:
        values, replicas = all_reduce(tf, build_strategy(tf, name, {}))
        send({"values": values, "replicas": replicas})
    except Exception as error:
        send({"error": list(first_line(error))})
    while True:  # until the parent closes stdin: the watchdog then ends the process
        requests.get()


def judge(reply: Mapping[str, Any], replicas: int, seconds: float) -> CandidateResult:
    """This worker's verdict on the probe process's reply, ``replicas`` being expected."""
    seconds = round(seconds, 3)
    if "values" not in reply:
        return from_reply(NCCL, reply, replicas, seconds)
    if reply.get("replicas") != replicas:
        reason = f"{reply.get('replicas')} replicas in sync, expected {replicas} (one per GPU)"
        return CandidateResult(NCCL, FAILED, reason, seconds)
    local = len(reply["values"])
    wrong = wrong_sums(reply["values"], replicas, local or 1)
    if wrong:
        return CandidateResult(NCCL, FAILED, wrong, seconds)
    expected = replicas * (replicas + 1) / 2
    return CandidateResult(NCCL, OK, f"{local} local replicas got {expected:g}", seconds)


def attempt(
    tf_config: Mapping[str, Any], replicas: int, timeout: float, env: Mapping[str, str]
) -> Tuple[CandidateResult, Optional[_probe.ProbeProcess]]:
    """Run NCCL's cross-worker check in a fresh probe process with ``env`` added.

    Returns this worker's verdict and, when the check answered, the process still
    running: the caller closes it once every worker has answered too.
    """
    full_env = {**env, "TF_CONFIG": json.dumps(tf_config)}
    try:
        process, _ = _probe.start({"job": "multiworker"}, timeout, full_env)
    except _probe.ProbeDied as error:
        return CandidateResult(NCCL, FAILED, str(error)), None
    started = time.monotonic()
    try:
        reply = process.ask({"check": NCCL}, timeout)
    except _probe.ProbeTimeout as error:
        return CandidateResult(NCCL, TIMEOUT, str(error), timeout), None
    except _probe.ProbeDied as error:
        process.close()
        return CandidateResult(NCCL, FAILED, str(error), round(time.monotonic() - started, 3)), None
    except BaseException:
        process.close()
        raise
    return judge(reply, replicas, time.monotonic() - started), process
