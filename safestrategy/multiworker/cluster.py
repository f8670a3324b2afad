"""TF_CONFIG: which workers take part in multi-worker training, and which one this is.

Parsed exactly as TensorFlow's ``TFConfigClusterResolver`` reads it, for the
tasks ``MultiWorkerMirroredStrategy`` all-reduces across: the ``chief`` (if
any) and every ``worker``, in that order (the order TensorFlow numbers the
replicas in). Bad values are a ``ValueError`` that quotes them, before
anything touches a device or the network. ``TF_CONFIG`` is read here and
nowhere else in safestrategy (the ``SAFESTRATEGY_*`` settings live in
:mod:`safestrategy._env`; this one is TensorFlow's own).
"""

import json
import os
from typing import Any, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple

from .._env import ENV_TF_CONFIG

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


def parse_address(task: str, value: Any, text: str) -> Address:
    """``"host:port"`` (IPv6: ``"[::1]:port"``) of ``task``; ``ValueError`` when malformed."""
    host, _, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _problem(text, f"{task}'s address {value!r} is not host:port (a port 1-65535)")
    return Address(task, host, int(port))


def parse_tf_config(text: str) -> Cluster:
    """The cluster and this task, from TF_CONFIG's JSON text (``ValueError`` when bad)."""
    try:
        config = json.loads(text)
    except ValueError as error:
        raise _problem(text, f"not JSON ({error})") from None
    if not isinstance(config, dict):
        raise _problem(text, "not a JSON object")
    cluster, task = config.get("cluster"), config.get("task")
    if not isinstance(cluster, dict) or not any(cluster.get(kind) for kind in WORKER_TYPES):
        raise _problem(text, 'no "cluster" with "chief" or "worker" addresses')
    workers = []
    for kind in WORKER_TYPES:
        addresses = cluster.get(kind) or []
        if not isinstance(addresses, list):
            raise _problem(text, f'"cluster"/"{kind}" is not a list of addresses')
        if kind == "chief" and len(addresses) > 1:
            raise _problem(text, "more than one chief")
        workers.extend(
            parse_address(f"{kind}:{i}", value, text) for i, value in enumerate(addresses)
        )
    if not isinstance(task, dict) or "type" not in task:
        raise _problem(text, 'no "task" with a "type" and an "index"')
    kind, index = task.get("type"), task.get("index", 0)
    if kind not in WORKER_TYPES:
        raise _problem(
            text,
            f"task type {kind!r} does not take part in MultiWorkerMirroredStrategy's all-reduce "
            f"(only {' and '.join(WORKER_TYPES)} do)",
        )
    name = f"{kind}:{index}"
    if isinstance(index, bool) or name not in [address.task for address in workers]:
        raise _problem(text, f"task {name} is not in the cluster")
    hosts = [(address.host, address.port) for address in workers]
    if len(set(hosts)) < len(hosts):
        raise _problem(text, "two workers have the same host:port")
    return Cluster(tuple(workers), name)


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
