"""auto_strategy(): one call for a laptop, a multi-GPU box and a cluster, every all-reduce checked.

In the shape of TensorFlow's nightly ``tf.distribute.experimental.auto_strategy()``
(TF_CONFIG: multi-worker; several GPUs: ``MirroredStrategy()``; else one device), which
checks nothing and inherits TensorFlow's always-true NCCL guard. Here each branch is a
factory that checks (:func:`branch` is the pure rule):

- a cluster (``cluster_resolver=``, TF_CONFIG of more than one worker, a Slurm step of
  more than one task) → :func:`make_multiworker_strategy`;
- more than one device where stock ``MirroredStrategy()`` would mirror (every logical
  GPU, else every logical CPU, by the installed release's rule) →
  :func:`make_mirrored_strategy`;
- else ``OneDeviceStrategy`` on that device: nothing to all-reduce, nothing to check;
  the watchdog still watches it, and its stalls are reported, never recorded.
"""

import platform as _platform
from typing import Any, Mapping, Sequence, Tuple

from . import _env, _machine, _rundir, _tf, records
from .backends import check_kwargs
from .factory import make_mirrored_strategy
from .report import Report, last_report, set_last_report
from .training import watchdog

MULTIWORKER, MIRRORED, ONE_DEVICE = "multi-worker", "mirrored", "one device"
#: The keywords each factory takes itself (the rest go to TensorFlow's strategy).
OWN_KEYWORDS = {MIRRORED: ("devices", "backend"), MULTIWORKER: ("communication",)}


def is_cluster(found: Any, resolver: bool) -> bool:
    """Whether the cluster found (a ``multiworker.cluster.Cluster``, or None) is one to
    train across: any a resolver gave, else one of more than one worker."""
    return found is not None and (resolver or len(found.workers) > 1)


def branch(found: Any, resolver: bool, devices: Sequence[str]) -> Tuple[str, str]:
    """Which factory, and why, from the cluster found (a ``multiworker.cluster.Cluster``,
    or None), whether the caller gave a resolver, and the devices stock
    ``MirroredStrategy()`` would mirror over."""
    if is_cluster(found, resolver):
        return MULTIWORKER, f"a cluster of {len(found.workers)} workers from {found.origin}"
    if len(devices) > 1:
        return MIRRORED, f"{len(devices)} devices, as MirroredStrategy() mirrors: " + ", ".join(
            devices
        )
    return ONE_DEVICE, "one device: nothing to all-reduce"


def _refuse_other_strategies(tf: Any, servers: bool) -> None:
    """``ValueError`` naming TensorFlow's own strategy for a cluster or device safestrategy
    does not build for: parameter servers (``servers``), TPUs."""
    if servers:
        raise ValueError(
            "the cluster has parameter servers ('ps' tasks): auto_strategy() builds "
            "all-reduce strategies only; use tf.distribute.ParameterServerStrategy"
        )
    if _tf.tf_api(tf.__version__) == "tf2" and _tf.list_physical_devices(tf, "TPU"):
        raise ValueError(
            "a TPU is visible: auto_strategy() builds GPU and CPU strategies only; use "
            "tf.distribute.TPUStrategy"
        )


def _check_kwargs(tf: Any, chosen: str, why: str, kwargs: Mapping[str, Any]) -> None:
    """``TypeError`` naming the branch for a keyword it cannot take, before it is built."""
    if chosen == ONE_DEVICE:
        kwargs = {k: v for k, v in kwargs.items() if k != "devices"}  # it is that device
        if kwargs:
            raise TypeError(
                f"auto_strategy() took the {chosen} branch ({why}), which takes no keyword "
                f"arguments: got {', '.join(sorted(kwargs))}"
            )
        return
    if chosen == MIRRORED:
        cls = tf.distribute.MirroredStrategy
    else:
        cls = getattr(tf.distribute, "MultiWorkerMirroredStrategy", None)
        cls = cls or tf.distribute.experimental.MultiWorkerMirroredStrategy
    others = {k: v for k, v in kwargs.items() if k not in OWN_KEYWORDS[chosen]}
    factory = "make_multiworker_strategy" if chosen == MULTIWORKER else "make_mirrored_strategy"
    try:
        check_kwargs(factory, cls, others)
    except TypeError as error:
        raise TypeError(f"auto_strategy() took the {chosen} branch ({why}): {error}") from None


def _one_device(tf: Any, device: str, why: str) -> Tuple[Any, Report]:
    """``OneDeviceStrategy`` on ``device``, and its report."""
    cls = getattr(getattr(tf, "distribute", None), "OneDeviceStrategy", None)
    strategy = (cls or tf.contrib.distribute.OneDeviceStrategy)(device)  # TF 1.12/1.13: contrib
    report = Report(
        backend="none",
        source="default",
        mode="auto",
        devices=(device,),
        platform=_machine.system(),
        tf_version=tf.__version__,
        tf_api=_tf.tf_api(tf.__version__),
        candidates=(),
        reason=why,
        wsl=_machine.is_wsl(),
        python=_platform.python_version(),
    )
    return strategy, report


def auto_strategy(**kwargs: Any) -> Any:
    """The strategy for wherever this runs, its all-reduce checked: a cluster (a
    ``cluster_resolver=``, TF_CONFIG of several workers, a Slurm step of several tasks) →
    :func:`make_multiworker_strategy`; several devices where ``MirroredStrategy()`` would
    mirror → :func:`make_mirrored_strategy`; else ``OneDeviceStrategy`` (watched, nothing
    to check). Keyword arguments go to the branch's factory (``TypeError`` naming the
    branch for one it cannot take); parameter servers or a TPU are a ``ValueError`` naming
    TensorFlow's own strategy for them. :func:`last_report` says the branch and why."""
    from .multiworker import cluster  # the multi-worker wing only when it is asked for

    resolver = kwargs.get("cluster_resolver")
    found = cluster.find(resolver)
    tf = _tf.import_tf()
    _refuse_other_strategies(tf, cluster.parameter_servers(resolver))
    if is_cluster(found, resolver is not None):
        devices: Tuple[str, ...] = ()  # the runtime must not start before the strategy
    elif kwargs.get("devices") is not None:
        devices = tuple(str(device) for device in kwargs["devices"])
    else:
        devices = tuple(str(device) for device in _tf.default_devices(tf))
    chosen, why = branch(found, resolver is not None, devices)
    _check_kwargs(tf, chosen, why, kwargs)
    if chosen == MULTIWORKER:
        from .multiworker import make_multiworker_strategy

        strategy = make_multiworker_strategy(**kwargs)
    elif chosen == MIRRORED:
        strategy = make_mirrored_strategy(**kwargs)
    else:
        settings = _env.resolve_stall()
        strategy, report = _one_device(tf, devices[0], why)
        set_last_report(report)
        watchdog.watch(settings, report, strategy)  # no place: its stalls are never recorded
        _rundir.decision(records.decision_entry(report, None, settings.timeout))
    made = last_report()
    if made is not None:
        set_last_report(made._replace(branch=chosen, branch_reason=why))
    return strategy
