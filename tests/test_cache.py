"""The on-disk cache and the machine identity in its keys: no TensorFlow needed."""

import os
import sys
import threading

import pytest

from safestrategy import _cache, _machine

KEY = {"devices": ["/gpu:0", "/gpu:1"], "tf": "2.21.0"}
VALUE = {"name": "nccl", "status": "ok"}
posix_only = pytest.mark.skipif(sys.platform == "win32", reason="no FIFOs or /dev/zero")


def test_entries_of_each_kind_are_apart(tmp_path):
    _cache.write(str(tmp_path), "nccl", KEY, VALUE)
    assert _cache.read(str(tmp_path), "nccl", KEY) == VALUE
    assert _cache.read(str(tmp_path), "timing", KEY) is None
    assert list(_cache.entries(str(tmp_path), "nccl")) == [(KEY, VALUE)]
    _cache.remove(str(tmp_path), "nccl", KEY)
    assert _cache.read(str(tmp_path), "nccl", KEY) is None


def _entry_path(tmp_path):
    _cache.write(str(tmp_path), "nccl", KEY, VALUE)
    (path,) = tmp_path.glob("nccl-*.json")
    path.unlink()
    return path


@posix_only
def test_a_symlink_to_a_device_is_a_miss_not_an_endless_read(tmp_path):
    _entry_path(tmp_path).symlink_to("/dev/zero")
    assert _cache.read(str(tmp_path), "nccl", KEY) is None
    assert list(_cache.entries(str(tmp_path), "nccl")) == []


@posix_only
def test_a_fifo_is_a_miss_not_a_hang(tmp_path):
    os.mkfifo(str(_entry_path(tmp_path)))
    found = []
    reader = threading.Thread(target=lambda: found.append(_cache.read(str(tmp_path), "nccl", KEY)))
    reader.daemon = True
    reader.start()
    reader.join(10)
    assert found == [None]


def test_an_oversized_entry_is_a_miss(tmp_path):
    _entry_path(tmp_path).write_text(" " * (_cache.MAX_BYTES + 1) + "{}")
    assert _cache.read(str(tmp_path), "nccl", KEY) is None


def test_the_machine_is_its_gpus_when_readable_else_its_host(monkeypatch):
    monkeypatch.setattr(_machine, "_uuids_from_proc", lambda: ["GPU-bbbbbbbb-1", "GPU-aaaaaaaa-0"])
    _machine._identity.cache_clear()
    try:
        with_gpus = _machine.identity()
        monkeypatch.setattr(_machine, "_uuids_from_proc", lambda: [])
        monkeypatch.setattr(_machine, "_uuids_from_nvidia_smi", lambda: [])
        _machine._identity.cache_clear()
        without = _machine.identity()
    finally:
        _machine._identity.cache_clear()
    assert with_gpus["gpu_uuids"] == ["GPU-aaaaaaaa-0", "GPU-bbbbbbbb-1"]
    assert with_gpus["host"] is None  # a container's changing host name keeps its verdicts
    assert without["gpu_uuids"] is None and without["host"]
    if sys.platform.startswith("linux"):
        assert without["shm_bytes"] > 0


def test_nvidia_smi_listing_is_parsed(monkeypatch, tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\necho 'GPU 0: Tesla V100 (UUID: GPU-0a1b2c3d-aaaa-bbbb-cccc-000000000000)'\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path), prepend=os.pathsep)
    if sys.platform == "win32":
        pytest.skip("a shell script stands in for nvidia-smi")
    assert _machine._uuids_from_nvidia_smi() == ["GPU-0a1b2c3d-aaaa-bbbb-cccc-000000000000"]
