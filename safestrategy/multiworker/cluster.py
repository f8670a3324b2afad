"""Which workers take part in multi-worker training, and which one this is.

From, in this order (:func:`find`): a ``cluster_resolver=`` (any TensorFlow
``ClusterResolver``: its ``cluster_spec()``, ``task_type``, ``task_id``), else
``TF_CONFIG``, else a Slurm job step of several tasks (:mod:`.slurm`). Each is read
as TensorFlow's ``TFConfigClusterResolver`` reads TF_CONFIG, for the tasks
``MultiWorkerMirroredStrategy`` all-reduces across: the ``chief`` (if any) and every
``worker``, in that order (the order TensorFlow numbers the replicas in). Bad values
are a ``ValueError`` that quotes them, before anything touches a device or the
network. ``TF_CONFIG`` is read here and nowhere else in safestrategy (the
``SAFESTRATEGY_*`` settings live in :mod:`safestrategy._env`; this one is
TensorFlow's own).
"""

import json
import os
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple

from .._env import ENV_TF_CONFIG, resolve_port_base
from . import slurm

#: Where a cluster came from, as the report's ``cluster_source`` says it.
RESOLVER, TF_CONFIG, SLURM = "resolver", "TF_CONFIG", "slurm"

#: The task types that take part in the all-reduce, in TensorFlow's order.
WORKER_TYPES = ("chief", "worker")


class Address(NamedTuple):
    """One worker: its task name ("worker:0") and where TF_CONFIG says it listens."""

    task: str
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


class Cluster(NamedTuple):
    """Every worker (chief first, then the workers by index) and this process's task."""

    workers: Tuple[Address, ...]
    task: str  #: e.g. "worker:0"
    source: str = TF_CONFIG  #: :data:`RESOLVER`, :data:`TF_CONFIG` or :data:`SLURM`
    #: where it came from, as a line says it: "TF_CONFIG", "Slurm job 412 step 0", ...
    origin: str = "TF_CONFIG"
    #: where the ports came from, as an error about one names it
    ports: str = "TF_CONFIG"

    @property
    def index(self) -> int:
        """This task's position in :attr:`workers`."""
        return [address.task for address in self.workers].index(self.task)

    @property
    def me(self) -> Address:
        return self.workers[self.index]

    @property
    def peers(self) -> Tuple[Address, ...]:
        return tuple(address for address in self.workers if address.task != self.task)


def _problem(text: str, what: str) -> ValueError:
    return ValueError(
        f"{what} in {ENV_TF_CONFIG}={text!r}; it must be JSON like "
        '{"cluster": {"worker": ["host1:12345", "host2:12345"]}, '
        '"task": {"type": "worker", "index": 0}} (see docs/multiworker.md)'
    )


Problem = Callable[[str], ValueError]


def parse_address(task: str, value: Any, problem: Problem) -> Address:
    """``"host:port"`` (IPv6: ``"[::1]:port"``) of ``task``; ``ValueError`` when malformed."""
    host, _, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise problem(f"{task}'s address {value!r} is not host:port (a port 1-65535)")
    return Address(task, host, int(port))


def parse_tf_config(text: str) -> Cluster:
    """The cluster and this task, from TF_CONFIG's JSON text (``ValueError`` when bad)."""

    def problem(what: str) -> ValueError:
        return _problem(text, what)

    try:
        config = json.loads(text)
    except ValueError as error:
        raise problem(f"not JSON ({error})") from None
    if not isinstance(config, dict):
        raise problem("not a JSON object")
    task = config.get("task")
    if not isinstance(task, dict) or "type" not in task:
        raise problem('no "task" with a "type" and an "index"')
    return _cluster(config.get("cluster"), task.get("type"), task.get("index", 0), problem)


def _cluster(spec: Any, kind: Any, index: Any, problem: Problem) -> Cluster:
    """The workers of ``spec`` (``{"worker": [...], "chief": [...]}``) and task
    ``kind:index``; ``problem(what)`` is the ``ValueError`` that quotes the source."""
    if not isinstance(spec, dict) or not any(spec.get(name) for name in WORKER_TYPES):
        raise problem('no "cluster" with "chief" or "worker" addresses')
    workers = []
    for name in WORKER_TYPES:
        addresses = spec.get(name) or []
        if not isinstance(addresses, list):
            raise problem(f'"cluster"/"{name}" is not a list of addresses')
        if name == "chief" and len(addresses) > 1:
            raise problem("more than one chief")
        workers.extend(
            parse_address(f"{name}:{i}", value, problem) for i, value in enumerate(addresses)
        )
    if kind not in WORKER_TYPES:
        raise problem(
            f"task type {kind!r} does not take part in MultiWorkerMirroredStrategy's all-reduce "
            f"(only {' and '.join(WORKER_TYPES)} do)"
        )
    task = f"{kind}:{index}"
    if isinstance(index, bool) or task not in [address.task for address in workers]:
        raise problem(f"task {task} is not in the cluster")
    hosts = [(address.host, address.port) for address in workers]
    if len(set(hosts)) < len(hosts):
        raise problem("two workers have the same host:port")
    return Cluster(tuple(workers), task)


def from_resolver(resolver: Any) -> Cluster:
    """The cluster a TensorFlow ``ClusterResolver`` resolves (``cluster_spec()``,
    ``task_type``, ``task_id``); ``ValueError`` naming what it returned when that is no
    cluster of workers with this task in it."""
    name = f"cluster_resolver={type(resolver).__name__}"
    try:
        spec = resolver.cluster_spec().as_dict()
        kind, index = resolver.task_type, resolver.task_id
    except Exception as error:
        raise ValueError(f"{name} could not resolve the cluster: {error!r}") from error

    def problem(what: str) -> ValueError:
        return ValueError(
            f"{what}: {name} returned cluster_spec {spec!r}, task_type {kind!r}, "
            f"task_id {index!r} (every worker must resolve the same cluster of chief/worker "
            "tasks, this process one of them)"
        )

    dense = {
        job: [tasks[i] for i in sorted(tasks)] if isinstance(tasks, dict) else tasks
        for job, tasks in spec.items()
    }  # a sparse job (a dict by task index) as a list, in index order
    found = _cluster(dense, kind, index, problem)
    return found._replace(source=RESOLVER, origin=name, ports=name)


def from_slurm(step: slurm.Step) -> Cluster:
    """A Slurm step's tasks as workers ``worker:0``... by task id."""
    workers = tuple(Address(f"worker:{i}", host, port) for i, (host, port) in enumerate(step.tasks))
    return Cluster(workers, f"worker:{step.procid}", SLURM, step.describe(), step.ports)


def find(resolver: Any = None, environ: Optional[Mapping[str, str]] = None) -> Optional[Cluster]:
    """The cluster from ``resolver``, else ``TF_CONFIG``, else a Slurm step of several
    tasks; None when none names one. ``ValueError`` when the one found is bad."""
    environ = os.environ if environ is None else environ
    if resolver is not None:
        return from_resolver(resolver)
    found = read(environ)
    if found is not None:
        return found
    step = slurm.read(environ, resolve_port_base(environ))
    return None if step is None else from_slurm(step)


def parameter_servers(resolver: Any = None, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the cluster (``resolver``'s, else TF_CONFIG's) has ``ps`` tasks: a
    parameter-server cluster, which no all-reduce strategy trains."""
    if resolver is not None:
        return bool(resolver.cluster_spec().as_dict().get("ps"))
    text = (os.environ if environ is None else environ).get(ENV_TF_CONFIG) or "{}"
    try:
        config = json.loads(text)
    except ValueError:
        return False  # the factory says what is wrong with it
    return isinstance(config, dict) and bool((config.get("cluster") or {}).get("ps"))


def read(environ: Optional[Mapping[str, str]] = None) -> Optional[Cluster]:
    """The cluster from ``TF_CONFIG``; None when it is unset or blank."""
    text = (os.environ if environ is None else environ).get(ENV_TF_CONFIG)
    if text is None or not text.strip():
        return None
    return parse_tf_config(text)


def probe_config(cluster: Cluster, ports: Sequence[int]) -> Dict[str, Any]:
    """TF_CONFIG for this worker's probe process: the same hosts, the given ports.

    All tasks become plain workers (worker 0 then plays the chief), so the
    probe processes form a cluster of their own that never touches a port
    the real training will use.
    """
    addresses = [str(address._replace(port=port)) for address, port in zip(cluster.workers, ports)]
    return {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": cluster.index}}
