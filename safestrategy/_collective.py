"""The ``collective`` backend: TensorFlow's own MirroredStrategy default since TF 2.13.

Since TF 2.13, ``MirroredStrategy(devices)`` with no ``cross_device_ops``
builds a ``CollectiveAllReduce`` (``MirroredExtended._make_collective_ops_with
_fallbacks``): the NCCL implementation when every device is a physical GPU,
RING on CPUs or virtual GPUs, and ``ReductionToOneDevice`` instead in TF2
graph mode with any non-GPU device or on a set that mixes CPUs and GPUs.
:func:`applies` is that rule, pure; :func:`build` constructs the same object.

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

import itertools
import threading
from typing import Any, NamedTuple, Optional, Sequence

from packaging.version import Version

from ._devices import Device

NAME = "collective"
NCCL = "NCCL"
RING = "RING"

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


def _release(version: str) -> Version:
    from ._tf import _release as release

    return release(version)


def _legacy_default(version: str, era: str, devices: Sequence[Device]) -> str:
    """The class TF < 2.13's ``select_cross_device_ops`` (TF 1.x: its contrib forms) picks."""
    from .backends import get_backend  # the one table of class names

    all_gpus = all(device.kind == "GPU" for device in devices)
    spec = get_backend("nccl" if all_gpus else "reduce_to_gpu").specs[era]
    return spec.cls + (f"({spec.args[0]!r})" if spec.args else "")


def applies(
    version: str, era: str, devices: Sequence[Device], eager: bool, virtual_gpus: bool
) -> Applicability:
    """Whether ``MirroredStrategy(devices)`` on TF ``version`` defaults to
    ``CollectiveAllReduce`` (and with which implementation), as TF decides it.

    ``eager``: the caller builds its strategy eagerly (False: TF1-style graph
    mode); ``virtual_gpus``: TF has more logical GPUs than physical ones.
    """
    if _release(version) < FIRST_VERSION:
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
        return Applicability(RING, "")
    return Applicability(NCCL, "")


def live(tf: Any, devices: Sequence[Device]) -> Applicability:
    """:func:`applies` for this process: its TensorFlow, execution mode and GPUs."""
    from ._tf import era, virtual_gpus

    eager = tf.__version__.startswith("2.") and tf.executing_eagerly()
    gpus = any(device.kind == "GPU" for device in devices)
    return applies(tf.__version__, era(tf.__version__), devices, eager, gpus and virtual_gpus(tf))


def _next_key_base() -> int:
    with _builds_lock:
        return _KEY_BASE + _KEYS_PER_BUILD * next(_builds)


def build(
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
