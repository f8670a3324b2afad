"""The backend table: our names and how each is built on each TensorFlow era.

This is the one place that knows TensorFlow's cross-device-ops class names and
builds its strategies: the table, the builders, ``collective`` (which has no
public class) and the multi-worker strategy. Everything else refers to
backends by name.

``collective``: since TF 2.13, ``MirroredStrategy(devices)`` with no
``cross_device_ops`` builds a ``CollectiveAllReduce``
(``MirroredExtended._make_collective_ops_with_fallbacks``): the NCCL
implementation when every device is a physical GPU, RING on CPUs or virtual
GPUs, and ``ReductionToOneDevice`` instead in TF2 graph mode with any non-GPU
device or on a set that mixes CPUs and GPUs. :func:`collective_applies` is that
rule, pure; :func:`build_collective` constructs the same object.

Collective keys: every ``MirroredStrategy`` numbers its collective groups from
1 (``_collective_key_base`` is 0 outside TF's own tests), so two strategies on
different device counts in one process join the same group and fail
(tensorflow#61314: "joining a group with size 2, but that group has size 3").
Each ``CollectiveAllReduce`` built here gets its own group keys from a range
no stock strategy reaches, so neither our checks nor a returned ``collective``
strategy ever share a group with the caller's own strategies.

TensorFlow has no public way to build it: ``cross_device_ops.
CollectiveAllReduce``, ``cross_device_utils.CollectiveKeys`` and
``device_util`` are private modules, used only on TF >= 2.13 (where this is
the default) and tested on every TF 2.x leg.
"""

import inspect
import itertools
import threading
from typing import Any, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple

from packaging.version import Version

from ._devices import Device, parse_devices
from ._tf import era, release, virtual_gpus

#: The CPU a ``reduce_to_cpu`` backend reduces on.
CPU_DEVICE = "/device:CPU:0"

#: Backend names the code refers to (the table below holds them all).
COLLECTIVE = "collective"
NCCL = "nccl"

#: Why a backend that needs a GPU cannot apply (``auto`` skips it, a list fails it).
NO_GPU = "no GPU among the devices"

#: ``MultiWorkerMirroredStrategy`` communications, in ``auto`` order.
RING = "ring"
COMMUNICATION_NAMES: Tuple[str, ...] = (NCCL, RING)

# TensorFlow eras, by where the cross-device-ops classes live:
#   "contrib-tower"  TF < 1.13  tf.contrib.distribute.*CrossTowerOps, cross_tower_ops=
#   "contrib-device" TF 1.13    tf.contrib.distribute.*CrossDeviceOps, cross_device_ops=
#   "distribute"     TF >= 1.14 tf.distribute.{NcclAllReduce, ...}, cross_device_ops=
ERAS = ("contrib-tower", "contrib-device", "distribute")


class OpsSpec(NamedTuple):
    """A constructor call: ``<module>.<cls>(*args, **kwargs)``."""

    cls: str
    args: Tuple[Any, ...] = ()
    kwargs: Tuple[Tuple[str, Any], ...] = ()


class Backend(NamedTuple):
    """One way of all-reducing across devices."""

    name: str
    needs_gpu: bool  #: inapplicable (skipped by ``auto``) when no GPU is among the devices
    summary: str
    specs: Dict[str, OpsSpec]  #: era -> constructor (empty: built by its own module)


def _per_era(allreduce_kind: Optional[str], reduce_to: Optional[str]) -> Dict[str, OpsSpec]:
    kwargs = (("reduce_to_device", reduce_to),) if reduce_to else ()
    if allreduce_kind is None:
        return {
            "contrib-tower": OpsSpec("ReductionToOneDeviceCrossTowerOps", (), kwargs),
            "contrib-device": OpsSpec("ReductionToOneDeviceCrossDeviceOps", (), kwargs),
            "distribute": OpsSpec("ReductionToOneDevice", (), kwargs),
        }
    return {
        "contrib-tower": OpsSpec("AllReduceCrossTowerOps", (allreduce_kind,)),
        "contrib-device": OpsSpec("AllReduceCrossDeviceOps", (allreduce_kind,)),
        "distribute": OpsSpec(
            "NcclAllReduce" if allreduce_kind == NCCL else "HierarchicalCopyAllReduce"
        ),
    }


BACKENDS: Tuple[Backend, ...] = (
    Backend(
        COLLECTIVE,
        False,
        "TensorFlow's own default since 2.13: CollectiveAllReduce (NCCL on GPUs, else RING)",
        {},
    ),
    Backend(NCCL, True, "NCCL all-reduce between GPUs", _per_era(NCCL, None)),
    Backend(
        "hierarchical_copy",
        False,
        "hierarchical copy all-reduce (DGX-1 style)",
        _per_era("hierarchical_copy", None),
    ),
    Backend("reduce_to_gpu", True, "reduce on the first GPU, copy back", _per_era(None, None)),
    Backend("reduce_to_cpu", False, "reduce on the CPU, copy back", _per_era(None, CPU_DEVICE)),
)

#: Backend names in the documented order (``auto``'s order for ties and display).
BACKEND_NAMES: Tuple[str, ...] = tuple(backend.name for backend in BACKENDS)

_BY_NAME = {backend.name: backend for backend in BACKENDS}


def get_backend(name: str) -> Backend:
    """The backend called ``name`` (``KeyError`` if there is none)."""
    return _BY_NAME[name]


#: The implementations a ``CollectiveAllReduce`` can request.
NCCL_IMPLEMENTATION = "NCCL"
RING_IMPLEMENTATION = "RING"

#: The first TensorFlow whose MirroredStrategy default is CollectiveAllReduce.
FIRST_VERSION = Version("2.13")

#: Our group keys start here and step by :data:`_KEYS_PER_BUILD` per build: far above the
#: few keys a stock strategy takes (1, 2, ...), below int32's limit (group keys are int32).
_KEY_BASE = 1_500_000_000
_KEYS_PER_BUILD = 1000
_builds = itertools.count()
_builds_lock = threading.Lock()


class Applicability(NamedTuple):
    """Whether TF's default for a device set is CollectiveAllReduce, and which kind."""

    implementation: Optional[str]  #: "NCCL" or "RING"; None: not TF's default here
    reason: str  #: why not (when ``implementation`` is None)


def _legacy_default(version: str, era: str, devices: Sequence[Device]) -> str:
    """The class TF < 2.13's ``select_cross_device_ops`` (TF 1.x: its contrib forms) picks."""
    all_gpus = all(device.kind == "GPU" for device in devices)
    spec = get_backend(NCCL if all_gpus else "reduce_to_gpu").specs[era]
    return spec.cls + (f"({spec.args[0]!r})" if spec.args else "")


def collective_applies(
    version: str, era: str, devices: Sequence[Device], eager: bool, virtual_gpus: bool
) -> Applicability:
    """Whether ``MirroredStrategy(devices)`` on TF ``version`` defaults to
    ``CollectiveAllReduce`` (and with which implementation), as TF decides it.

    ``eager``: the caller builds its strategy eagerly (False: TF1-style graph
    mode); ``virtual_gpus``: TF has more logical GPUs than physical ones.
    """
    if release(version) < FIRST_VERSION:
        default = _legacy_default(version, era, devices)
        return Applicability(None, f"TF {version}'s MirroredStrategy default is {default}")
    kinds = {device.kind for device in devices}
    if not eager and kinds != {"GPU"}:
        return Applicability(
            None, "in TF2 graph mode on CPUs MirroredStrategy's default is ReductionToOneDevice"
        )
    if kinds == {"CPU", "GPU"}:
        return Applicability(
            None,
            "on a set that mixes CPUs and GPUs MirroredStrategy's default is ReductionToOneDevice",
        )
    if kinds == {"CPU"} or virtual_gpus:
        return Applicability(RING_IMPLEMENTATION, "")
    return Applicability(NCCL_IMPLEMENTATION, "")


def collective_live(tf: Any, devices: Sequence[Device]) -> Applicability:
    """:func:`collective_applies` for this process: its TensorFlow, execution mode and GPUs."""
    eager = tf.__version__.startswith("2.") and tf.executing_eagerly()
    gpus = any(device.kind == "GPU" for device in devices)
    return collective_applies(
        tf.__version__, era(tf.__version__), devices, eager, gpus and virtual_gpus(tf)
    )


def _next_key_base() -> int:
    with _builds_lock:
        return _KEY_BASE + _KEYS_PER_BUILD * next(_builds)


def fresh_group_key() -> int:
    """A collective group key no strategy uses, ours or the caller's (the canary's)."""
    return _next_key_base()


def build_collective(
    tf: Any, devices: Sequence[str], implementation: str, timeout: Optional[float] = None
) -> Any:
    """The ``CollectiveAllReduce`` TF's default would build for ``devices``, on group keys
    of its own. ``timeout`` (seconds) bounds each collective op (checks only: TF documents
    it as a debugging aid, and training keeps TF's default of none)."""
    from tensorflow.python.distribute import cross_device_ops, cross_device_utils, device_util

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=getattr(
            tf.distribute.experimental.CommunicationImplementation, implementation
        ),
        timeout_seconds=timeout,
    )
    canonical = tuple(device_util.canonicalize(device_util.resolve(d)) for d in devices)
    return cross_device_ops.CollectiveAllReduce(
        devices=canonical,
        group_size=len(canonical),
        options=options,
        collective_keys=cross_device_utils.CollectiveKeys(group_key_start=_next_key_base()),
    )


def unavailable(devices: Sequence[Device], collective: Applicability) -> Dict[str, str]:
    """The backends that cannot apply to ``devices`` here, and why (``auto`` skips them; a
    list or a forced name tries them and they fail): those that need a GPU where there is
    none, and ``collective`` where it is not TF's default (``collective``:
    :func:`collective_live` for these devices)."""
    gpu = any(device.kind == "GPU" for device in devices)
    skipped = {backend.name: NO_GPU for backend in BACKENDS if backend.needs_gpu and not gpu}
    if collective.implementation is None:
        skipped[COLLECTIVE] = collective.reason
    return skipped


def ops_module(tf: Any, era: str) -> Any:
    """The module that holds the cross-device-ops classes in ``era``."""
    return tf.distribute if era == "distribute" else tf.contrib.distribute


def build_cross_device_ops(
    tf: Any, era: str, name: str, devices: Sequence[str] = (), timeout: Optional[float] = None
) -> Any:
    """Construct backend ``name``'s cross-device-ops object for TensorFlow ``tf``.

    ``collective`` is built for ``devices`` (``ValueError`` with the reason where it is
    not TF's default), its ops bounded by ``timeout`` seconds when given (checks only).
    """
    if name == COLLECTIVE:
        applicable = collective_live(tf, parse_devices(devices))
        if applicable.implementation is None:
            raise ValueError(applicable.reason)
        return build_collective(tf, devices, applicable.implementation, timeout)
    spec = get_backend(name).specs[era]
    return getattr(ops_module(tf, era), spec.cls)(*spec.args, **dict(spec.kwargs))


def build_strategy(
    tf: Any, era: str, devices: Optional[Sequence[str]], ops: Any = None, **kwargs: Any
) -> Any:
    """A real MirroredStrategy over ``devices``, all-reducing with ``ops`` when given."""
    if era == "contrib-tower":
        if ops is not None:
            kwargs["cross_tower_ops"] = ops
        return tf.contrib.distribute.MirroredStrategy(devices, **kwargs)
    if ops is not None:
        kwargs["cross_device_ops"] = ops
    return tf.distribute.MirroredStrategy(devices, **kwargs)


def build_multiworker_strategy(tf: Any, communication: str, kwargs: Mapping[str, Any]) -> Any:
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


def check_kwargs(function: str, cls: Any, kwargs: Mapping[str, Any]) -> None:
    """``TypeError`` for keyword arguments ``cls`` does not take, before anything is probed."""
    parameters = inspect.signature(cls.__init__).parameters
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    unknown = sorted(set(kwargs) - set(parameters) - {"self"})
    if unknown:
        takes = ", ".join(name for name in parameters if name != "self")
        raise TypeError(
            f"{function}() got unexpected keyword argument(s) {', '.join(unknown)}: "
            f"this TensorFlow's {cls.__name__} takes {takes}"
        )
