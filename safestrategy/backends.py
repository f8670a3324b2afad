"""The backend table: our names and how each is built on each TensorFlow era.

This is the one place that knows TensorFlow's cross-device-ops class names.
It is data plus two small builders; everything else refers to backends by name.
``collective`` has no public class: :mod:`safestrategy._collective` builds it.
"""

import inspect
from typing import Any, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple

#: The CPU a ``reduce_to_cpu`` backend reduces on.
CPU_DEVICE = "/device:CPU:0"

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
            "NcclAllReduce" if allreduce_kind == "nccl" else "HierarchicalCopyAllReduce"
        ),
    }


BACKENDS: Tuple[Backend, ...] = (
    Backend(
        "collective",
        False,
        "TensorFlow's own default since 2.13: CollectiveAllReduce (NCCL on GPUs, else RING)",
        {},
    ),
    Backend("nccl", True, "NCCL all-reduce between GPUs", _per_era("nccl", None)),
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
    if name == "collective":
        from . import _collective
        from ._devices import parse_devices

        applicable = _collective.live(tf, parse_devices(devices))
        if applicable.implementation is None:
            raise ValueError(applicable.reason)
        return _collective.build(tf, devices, applicable.implementation, timeout)
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
