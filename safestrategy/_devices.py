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
