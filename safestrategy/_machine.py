"""Which machine this is: its OS (and WSL), and its identity for cache keys.

``system()`` is the one place that asks which OS this is (the Windows seam
tests patch it); ``is_wsl()`` reads the kernel release. The identity: a
verdict measured here must not be used elsewhere.

The GPUs' UUIDs name the hardware, so a home directory shared by a cluster
never carries node A's verdict to node B, and a container whose host name
changes at every start keeps its verdicts. Where no UUID can be read (no
NVIDIA driver: CPU-only machines, other vendors) the host name stands in.
PCI bus ids are not used: identical nodes have identical ones. The size of
``/dev/shm`` is part of it too: NCCL's shared-memory transport fails in a
container whose ``/dev/shm`` is tiny, and the same image gets another size
elsewhere.

Every probe here is total (a fact it cannot read is None) and read once per
process.
"""

import functools
import glob
import os
import platform
import re
import shutil
import subprocess
from typing import Any, Dict, List, Optional


def system() -> str:
    """The OS name as ``platform.system()`` reports it ("Linux", "Windows", ...)."""
    return platform.system()


def _kernel_release() -> Optional[str]:
    """Linux's kernel release string, or None where there is none to read."""
    try:
        with open("/proc/sys/kernel/osrelease") as release:
            return release.read()
    except OSError:
        return None


def is_wsl() -> bool:
    """True on Linux under Windows Subsystem for Linux, where NCCL is often absent."""
    if system() != "Linux":
        return False
    release = _kernel_release()
    return release is not None and "microsoft" in release.lower()


_UUID = re.compile(r"\b(GPU-[0-9a-fA-F-]{8,})")


def _uuids_from_proc() -> List[str]:
    """Linux with the NVIDIA driver: ``GPU UUID:`` in each GPU's information file."""
    uuids = []
    for path in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        try:
            with open(path, encoding="utf-8", errors="replace") as stream:
                uuids.extend(_UUID.findall(stream.read(8192)))
        except OSError:
            continue
    return uuids


def _uuids_from_nvidia_smi() -> List[str]:
    """Elsewhere (Windows, a /proc the container hides): ``nvidia-smi -L``, if it is there."""
    command = shutil.which("nvidia-smi")
    if command is None:
        return []
    try:
        listing = subprocess.run(
            [command, "-L"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            universal_newlines=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return _UUID.findall(listing)


def gpu_uuids() -> Optional[List[str]]:
    """The NVIDIA GPUs' UUIDs, sorted; None where none can be read."""
    uuids = _uuids_from_proc() or _uuids_from_nvidia_smi()
    return sorted(set(uuids)) or None


def shm_bytes() -> Optional[int]:
    """The size of ``/dev/shm`` in bytes; None where there is none (Windows)."""
    try:
        stats = os.statvfs("/dev/shm")
    except (OSError, AttributeError):
        return None
    return stats.f_blocks * stats.f_frsize


@functools.lru_cache(maxsize=None)
def _identity() -> Dict[str, Any]:
    import socket  # here: `import safestrategy` should not pay for it

    uuids = gpu_uuids()
    return {
        "gpu_uuids": uuids,
        "host": None if uuids else socket.gethostname(),
        "shm_bytes": shm_bytes(),
    }


def identity() -> Dict[str, Any]:
    """This machine, as cache keys hold it: the GPU UUIDs (else the host name) and the
    ``/dev/shm`` size. A fresh copy each call; probed once per process."""
    return dict(_identity())
