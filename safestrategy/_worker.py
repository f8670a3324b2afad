"""The probe process: imports TensorFlow, reports facts, runs smoke all-reduces.

Run as ``python -m safestrategy._worker '<json>'`` by :mod:`safestrategy._probe`,
never imported by the library itself. A broken NCCL may hang or abort this
process; the parent survives, kills it at the timeout and starts a new one.

Protocol, one JSON object per line: the argument is ``{"devices": [...] or
null}``; the worker first writes ``{"facts": {...}}``, then answers each
``{"check": NAME}`` read from stdin with ``{"values": [[device, [floats]], ...]}``
(every replica's all-reduced value) or ``{"error": [type, first line]}``.
Anything TensorFlow prints goes to stderr, never into the protocol stream.
"""

import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._devices import Device, parse_devices
from ._tf import configure_logical_cpus, era, import_tf, list_physical_devices
from .backends import build_cross_device_ops, build_strategy

#: Replica i contributes a vector filled with i + 1; the expected sum is n(n+1)/2.
VECTOR_SIZE = 4


def _first_line(error: BaseException) -> Tuple[str, str]:
    text = str(error).strip()
    return type(error).__name__, text.splitlines()[0] if text else ""


def _configure_tf2(tf: Any, cpus: int) -> int:
    """Logical CPUs as the device names need, GPU memory growth; returns the GPU count."""
    gpus = list_physical_devices(tf, "GPU")
    for gpu in gpus:  # take only what the tiny all-reduce needs, and give it back on exit
        tf.config.experimental.set_memory_growth(gpu, True)
    if cpus > 1:
        configure_logical_cpus(tf, cpus)
    return len(gpus)


def _session_config(tf: Any, cpus: int) -> Any:
    config = tf.ConfigProto(device_count={"CPU": max(cpus, 1)}, allow_soft_placement=False)
    config.gpu_options.allow_growth = True
    return config


def _gpu_count_tf1(session_config: Any) -> int:
    from tensorflow.python.client import device_lib

    devices = device_lib.list_local_devices(session_config)
    return sum(1 for device in devices if device.device_type == "GPU")


def _nccl_kernels() -> Optional[int]:
    """How many NcclAllReduce kernels are registered: a count, never TF's truthy message."""
    try:
        from tensorflow.python.framework import kernels

        return len(kernels.get_registered_kernels_for_op("NcclAllReduce").kernel)
    except Exception:
        return None


def _eager_all_reduce(tf: Any, strategy: Any) -> List[Tuple[str, List[float]]]:
    """TF2: ``ReplicaContext.all_reduce`` inside a ``tf.function``."""

    def replica_fn() -> Any:
        context = tf.distribute.get_replica_context()
        replica = tf.cast(context.replica_id_in_sync_group, tf.float32)
        return context.all_reduce(tf.distribute.ReduceOp.SUM, tf.fill([VECTOR_SIZE], replica + 1.0))

    run = getattr(strategy, "run", None) or strategy.experimental_run_v2
    result = tf.function(lambda: run(replica_fn))()
    return [(t.device, t.numpy().tolist()) for t in strategy.experimental_local_results(result)]


def _graph_all_reduce(
    tf: Any, era: str, strategy: Any, config: Any
) -> List[Tuple[str, List[float]]]:
    """TF 1.x graph mode: merge_call into the strategy's own reduce, run in a Session.

    ``destinations=value`` makes it an all-reduce through the cross-device ops;
    TF 1.12 spells everything "tower" and passes merge_call arguments directly.
    """
    contrib = era == "contrib-tower"

    def merge_fn(distribution: Any, value: Any) -> Any:
        if contrib:
            return distribution.reduce(tf.VariableAggregation.SUM, value, destinations=value)
        return distribution.extended.reduce_to(
            tf.distribute.ReduceOp.SUM, value, destinations=value
        )

    def replica_fn() -> Any:
        if contrib:
            context = tf.contrib.distribute.get_tower_context()
            replica = context.tower_id
        else:
            context = tf.distribute.get_replica_context()
            replica = context.replica_id_in_sync_group
        value = tf.fill([VECTOR_SIZE], tf.cast(replica, tf.float32) + 1.0)
        if contrib:
            return context.merge_call(merge_fn, value)
        return context.merge_call(merge_fn, args=(value,))

    with strategy.scope():
        if contrib:
            result = strategy.call_for_each_tower(replica_fn)
        else:
            result = strategy.extended.call_for_each_replica(replica_fn)
        unwrap = getattr(strategy, "experimental_local_results", None) or strategy.unwrap
        tensors = list(unwrap(result))
    with tf.Session(config=config) as session:
        values = session.run(tensors)
    return [(t.device, v.tolist()) for t, v in zip(tensors, values)]


class Checker:
    """Holds TensorFlow and the devices; runs one smoke all-reduce per request."""

    def __init__(self, devices: Optional[Sequence[Device]]) -> None:
        self.tf = import_tf()
        self.era = era(self.tf.__version__)
        self.eager = self.tf.__version__.startswith("2.")
        cpus = max([d.index + 1 for d in devices or () if d.kind == "CPU"] or [1])
        if self.eager:
            self.session_config = None
            gpus = _configure_tf2(self.tf, cpus)
        else:
            self.session_config = _session_config(self.tf, cpus)
            gpus = _gpu_count_tf1(self.session_config)
        default = [f"/device:GPU:{i}" for i in range(gpus)] or ["/device:CPU:0"]
        self.devices = [str(d) for d in devices] if devices else default
        self.facts = {
            "tf_version": self.tf.__version__,
            "devices": self.devices,
            "gpus": gpus,
            "nccl_kernels": _nccl_kernels(),
        }

    def all_reduce(self, name: str) -> List[Tuple[str, List[float]]]:
        """Every replica's result of one sum all-reduce with backend ``name``."""
        if self.eager:
            return _eager_all_reduce(self.tf, self._strategy(name))
        with self.tf.Graph().as_default():  # TF1: the strategy's ops belong to this graph
            return _graph_all_reduce(self.tf, self.era, self._strategy(name), self.session_config)

    def _strategy(self, name: str) -> Any:
        ops = build_cross_device_ops(self.tf, self.era, name)
        return build_strategy(self.tf, self.era, self.devices, ops)


def main(argv: Sequence[str]) -> int:
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints from TensorFlow go to stderr
    sys.stdout = sys.stderr

    def send(message: Dict[str, Any]) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    request = json.loads(argv[0])
    devices = parse_devices(request["devices"]) if request["devices"] is not None else None
    checker = Checker(devices)
    send({"facts": checker.facts})
    for line in sys.stdin:
        name = json.loads(line)["check"]
        try:
            send({"values": checker.all_reduce(name)})
        except Exception as error:
            send({"error": _first_line(error)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
