"""Parsing device names ("/gpu:0", "GPU:1", "/device:CPU:0", ...) without TensorFlow."""

import re
from typing import NamedTuple, Sequence, Tuple

_DEVICE = re.compile(
    r"^(?:/job:localhost)?(?:/replica:0)?(?:/task:0)?/?(?:device:)?([a-z_]+):(\d+)$", re.IGNORECASE
)


class Device(NamedTuple):
    """A local device: its kind ("CPU", "GPU", ...) and index."""

    kind: str
    index: int

    def __str__(self) -> str:
        return f"/device:{self.kind}:{self.index}"


def parse_device(name: str) -> Device:
    """Parse one local device name; ``ValueError`` names the bad value and the form."""
    match = _DEVICE.match(name.strip()) if isinstance(name, str) else None
    if match is None:
        raise ValueError(
            f"device {name!r} is not a local device name; use e.g. '/gpu:0' or '/device:CPU:1'"
        )
    return Device(match.group(1).upper(), int(match.group(2)))


def parse_devices(names: Sequence[str]) -> Tuple[Device, ...]:
    """Parse the devices to mirror over: at least one, no repeats."""
    if isinstance(names, str):
        raise ValueError(f"devices must be a list of device names, not the string {names!r}")
    devices = tuple(parse_device(name) for name in names)
    if not devices:
        raise ValueError("devices is empty; give at least one device, or None for all of them")
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices {list(names)!r} name the same device twice")
    return devices


def cpu_count(devices: Sequence[Device]) -> int:
    """How many CPU devices a set needs configured: its highest CPU index + 1, at least 1
    (TF2's logical CPUs, a TF 1.x session's ``device_count``)."""
    return max([device.index + 1 for device in devices if device.kind == "CPU"] or [1])


def mirrored_default(
    gpus: Sequence[Device], cpus: Sequence[Device], every_cpu: bool
) -> Tuple[Device, ...]:
    """What TensorFlow's own ``MirroredStrategy()`` mirrors over, from its logical devices.

    Every logical GPU; else, where that release falls back to every logical CPU
    (TF 2.1+), every one of them; else (TF 1.12-2.0) ``/device:CPU:0`` alone.
    """
    if gpus:
        return tuple(gpus)
    return tuple(cpus) if every_cpu and cpus else (Device("CPU", 0),)


class Visible(NamedTuple):
    """The devices TensorFlow has in the caller's process (see ``_tf.visible_devices``)."""

    devices: Tuple[Device, ...]
    #: TF 1.x: every session chooses its CPU count (``device_count``), so any CPU index is real.
    any_cpu: bool = False
    #: TF 1.12/1.13 with CUDA: the GPUs cannot be listed without initialising them.
    gpus_known: bool = True


GPU_SETUP_CHECK = (
    "python -c \"import tensorflow as tf; print(tf.config.list_physical_devices('GPU'))\""
)


def require_existing(requested: Sequence[Device], visible: Visible) -> None:
    """``ValueError`` naming the requested devices TensorFlow does not have, and those it has."""
    have = set(visible.devices)
    missing = [
        device
        for device in requested
        if device not in have
        and not (device.kind == "CPU" and visible.any_cpu)
        and not (device.kind == "GPU" and not visible.gpus_known)
    ]
    if not missing:
        return
    message = (
        f"{'device' if len(missing) == 1 else 'devices'} {', '.join(map(str, missing))} "
        f"{'does' if len(missing) == 1 else 'do'} not exist in this process; TensorFlow has "
        f"{', '.join(map(str, visible.devices))}"
    )
    if any(device.kind == "GPU" for device in missing):
        gpus = sum(1 for device in visible.devices if device.kind == "GPU")
        message += (
            f". TensorFlow sees {gpus} GPU{'' if gpus == 1 else 's'} here: check its GPU "
            f"set-up with {GPU_SETUP_CHECK} (CUDA and cuDNN versions, drivers, "
            "CUDA_VISIBLE_DEVICES)"
        )
    raise ValueError(message)
