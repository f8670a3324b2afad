"""The probe process itself (the child): imports TensorFlow, reports facts, runs all-reduces.

Run by :mod:`safestrategy.checks.probe` as a fresh interpreter with one JSON
argument, never imported by the library itself. A broken NCCL may hang or
abort this process; the parent survives, kills it at the timeout and starts a
new one.

Protocol, one JSON object per line on stdout, each behind ``_probe.PREFIX``
(anything else there is ignored): the argument is ``{"job": "mirrored",
"devices": [...], "parent": pid}``; the child first writes
``{"facts": {...}}``, then answers each ``{"check": NAME}`` read from stdin
with ``{"values": [[device, [floats]], ...]}`` (every replica's all-reduced
value) or ``{"error": [type, first line]}``, each ``{"time": NAME,
"payload_mb": MB}`` with ``{"ms": median}`` (see :mod:`safestrategy.checks.timing`), and
each ``{"sweep": NAME, "sizes": [counts], "runs": N}`` (``--benchmark``) with ``{"ms":
[median per size]}``: one float32 tensor per replica of each element count, the median of
N timed runs after a warm-up. A request that fails is answered ``{"error": [type, first
line]}``.
Whatever else is printed to stdout after start-up goes to stderr.

The ``"multiworker"`` job builds ``MultiWorkerMirroredStrategy`` with NCCL on the
probe cluster its ``TF_CONFIG`` names (the workers' hosts, ports of the probe
processes' own), runs one all-reduce in which replica *r* (numbered across all
workers) contributes *r + 1*, and reports its local replicas' sums
(``{"values": [...], "replicas": n}``). It then stays up until its parent closes
it, because a peer may still be fetching its part of the all-reduce.

The process ends with its parent: on Linux the kernel kills it when the parent
dies (``PR_SET_PDEATHSIG``), and everywhere a watchdog thread exits it when
stdin closes, which happens however the parent ends.
"""

import json
import os
import queue
import signal
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .._devices import Device, cpu_count, parse_devices
from .._tf import configure_logical_cpus, era, import_tf, list_physical_devices
from ..backends import build_multiworker_strategy
from .allreduce import VECTOR_SIZE, check_values, first_line, session_config
from .probe import PREFIX
from .timing import batches_ms, median_ms

Send = Callable[[Dict[str, Any]], None]


def die_with_parent(parent: Optional[int]) -> None:
    """Linux: be killed when ``parent`` dies; exit now if it already has."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # the stdin watchdog still covers it
    if parent is not None and os.getppid() != parent:
        os._exit(1)  # the parent died before prctl took effect


def _watch_stdin() -> "queue.Queue[str]":
    """Lines from stdin as they come; the process exits when stdin closes."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            lines.put(line)
        os._exit(0)  # the parent has gone (or is done with us)

    threading.Thread(target=read, daemon=True).start()
    return lines


def connect(request: Dict[str, Any]) -> Tuple[Send, "queue.Queue[str]"]:
    """Set the process up as a probe process: dies with its parent, protocol on stdout.

    Returns the function that sends a protocol message, and the queue of requests.
    """
    die_with_parent(request.get("parent"))
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints (TensorFlow's) go to stderr, not into the protocol
    sys.stdout = sys.stderr

    def send(message: Dict[str, Any]) -> None:
        protocol.write(PREFIX + json.dumps(message) + "\n")
        protocol.flush()

    return send, _watch_stdin()


def _configure_tf2(tf: Any, cpus: int) -> None:
    """Logical CPUs as the device names need, and GPU memory growth."""
    for gpu in list_physical_devices(tf, "GPU"):
        # take only what the tiny all-reduce needs, and give it back on exit
        tf.config.experimental.set_memory_growth(gpu, True)
    if cpus > 1:
        configure_logical_cpus(tf, cpus)


class Checker:
    """Holds TensorFlow and the devices; runs one smoke all-reduce per request."""

    def __init__(self, devices: Sequence[Device]) -> None:
        self.tf = import_tf()
        self.era = era(self.tf.__version__)
        cpus = cpu_count(devices)
        if self.tf.__version__.startswith("2."):
            self.config = None
            _configure_tf2(self.tf, cpus)
        else:
            self.config = session_config(self.tf, cpus, gpus=True)
        self.devices = [str(d) for d in devices]
        self.facts = {"tf_version": self.tf.__version__}  # the handshake: started and ready

    def all_reduce(self, name: str) -> Any:
        return check_values(self.tf, self.era, self.devices, name, self.config)

    def time(self, name: str, payload_mb: float) -> float:
        return median_ms(self.tf, self.era, self.devices, name, payload_mb, self.config)

    def sweep(self, name: str, counts: Sequence[int], runs: int) -> List[float]:
        """Median ms of one tensor per replica of each element count (``--benchmark``)."""
        batches = [[count] for count in counts]
        return batches_ms(self.tf, self.era, self.devices, name, batches, self.config, None, runs)


def _mirrored(request: Dict[str, Any], send: Send, requests: "queue.Queue[str]") -> int:
    checker = Checker(parse_devices(request["devices"]))
    send({"facts": checker.facts})
    while True:  # until the parent closes stdin: the watchdog then ends the process
        message = json.loads(requests.get())
        try:
            if "sweep" in message:
                counts = [int(count) for count in message["sizes"]]
                send({"ms": checker.sweep(message["sweep"], counts, int(message["runs"]))})
            elif "time" in message:
                send({"ms": checker.time(message["time"], float(message["payload_mb"]))})
            else:
                send({"values": checker.all_reduce(message["check"])})
        except Exception as error:
            send({"error": first_line(error)})


def multiworker_all_reduce(tf: Any, strategy: Any) -> Tuple[List[Any], int]:
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


def _multiworker(request: Dict[str, Any], send: Send, requests: "queue.Queue[str]") -> int:
    """The ``"multiworker"`` job (see the module docstring)."""
    tf = import_tf()
    gpus = list_physical_devices(tf, "GPU")
    for gpu in gpus:  # take only what the tiny all-reduce needs
        tf.config.experimental.set_memory_growth(gpu, True)
    send({"facts": {"tf_version": tf.__version__, "gpus": len(gpus)}})
    name = json.loads(requests.get())["check"]
    try:
        values, replicas = multiworker_all_reduce(tf, build_multiworker_strategy(tf, name, {}))
        send({"values": values, "replicas": replicas})
    except Exception as error:
        send({"error": list(first_line(error))})
    while True:  # until the parent closes stdin: the watchdog then ends the process
        requests.get()


#: What a probe process can be asked to do, by the request's "job".
JOBS = {"mirrored": _mirrored, "multiworker": _multiworker}


def main(argv: Sequence[str]) -> int:
    request = json.loads(argv[0])
    send, requests = connect(request)
    return JOBS[request.get("job", "mirrored")](request, send, requests)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
