"""Windows behaviour, checked on every OS by faking the platform at its one seam.

``safestrategy._machine.system()`` is the only place that asks which OS this is.
What Windows does differently for us is covered by facts the code handles on
every OS, each exercised here on Linux too (and for real on windows-latest in
CI): there is no fork, so the probe process is a fresh interpreter started by
``subprocess`` (never a fork, never multiprocessing's spawn that re-runs the
caller's ``__main__``); interpreter and script paths have spaces; the locale
codec is not UTF-8; a crash is an NTSTATUS exit code, not a signal.
"""

import os
import shutil
import signal
import sys

import pytest

import safestrategy
from safestrategy import _machine
from safestrategy._devices import parse_devices
from safestrategy.checks import probe as _probe

from .conftest import FAKE_WORKER, ROOT, needs_tf, run_python

GPUS = ["/gpu:0", "/gpu:1"]


@pytest.fixture
def windows(monkeypatch):
    """Pretend to be Windows at the one seam; reading Linux's /proc would be a bug."""
    monkeypatch.setattr(_machine, "system", lambda: "Windows")

    def no_proc():
        raise AssertionError("read /proc/sys/kernel/osrelease on Windows")

    monkeypatch.setattr(_machine, "_kernel_release", no_proc)


def test_the_report_says_windows_and_never_wsl(fake, windows):
    fake("ok")
    report = safestrategy.probe(GPUS)
    assert (report.platform, report.wsl, report.backend) == ("Windows", False, "nccl")
    assert "platform     Windows, Python" in str(report)
    assert report.to_dict()["platform"] == "Windows"


@pytest.mark.parametrize(
    "system, release, wsl",
    [
        ("Linux", "5.15.153.1-microsoft-standard-WSL2\n", True),
        ("Linux", "4.4.0-19041-Microsoft\n", True),  # WSL 1
        ("Linux", "6.8.0-45-generic\n", False),
        ("Linux", None, False),  # no /proc to read
        ("Darwin", None, False),
    ],
)
def test_wsl_is_linux_with_a_microsoft_kernel(fake, monkeypatch, system, release, wsl):
    monkeypatch.setattr(_machine, "system", lambda: system)
    monkeypatch.setattr(_machine, "_kernel_release", lambda: release)
    fake("ok")
    report = safestrategy.probe(GPUS)
    assert (report.platform, report.wsl) == (system, wsl)
    assert (f"{system} (WSL)" in str(report)) is wsl


def test_the_probe_process_is_started_without_fork(fake, windows, monkeypatch):
    for name in ("fork", "forkpty", "register_at_fork"):  # none of them exist on Windows
        monkeypatch.delattr(os, name, raising=False)
    fake("ok")
    assert safestrategy.probe(GPUS).backend == "nccl"


TRAIN_SCRIPT = """
import sys
with open("runs.txt", "a") as runs:  # no `if __name__ == "__main__":` guard, on purpose
    runs.write("ran\\n")
import safestrategy
from safestrategy import _devices, _machine, _tf
from safestrategy.checks import probe as _probe
_machine.system = lambda: "Windows"
_probe.CHILD_COMMAND = [sys.executable, {fake!r}]
_tf.nccl_kernel_count = lambda tf: 1
gpus = (_devices.Device("GPU", 0), _devices.Device("GPU", 1))
_tf.visible_devices = lambda tf: _devices.Visible((_devices.Device("CPU", 0),) + gpus)
report = safestrategy.probe(["/gpu:0", "/gpu:1"], backend="nccl")
print(report.backend, report.platform)
"""


@needs_tf
def test_a_script_without_a_main_guard_runs_once(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_WORKER", "ok")
    folder = tmp_path / "my project (v2)"
    folder.mkdir()
    script = folder / "train.py"
    script.write_text(TRAIN_SCRIPT.format(fake=FAKE_WORKER))
    path = [str(ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    env = {"PYTHONPATH": os.pathsep.join(p for p in path if p), "SAFESTRATEGY_CACHE": "off"}
    done = run_python(str(script), env=env, cwd=folder)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["nccl", "Windows"]
    # multiprocessing's spawn would have run it once more per process
    assert (folder / "runs.txt").read_text().splitlines() == ["ran"]


VENDORED_SCRIPT = """
import os, sys
sys.path.insert(0, os.path.join({vendor!r}))
import safestrategy
from safestrategy._devices import parse_devices
from safestrategy.checks import probe as _probe
process, facts = _probe.start({{"job": "mirrored", "devices": ["/cpu:0", "/cpu:1"]}}, 300)
with process:
    result = _probe.check(process, "reduce_to_cpu", 2, 300)
print(facts["tf_version"], result.status, result.reason)
"""


@needs_tf
def test_the_real_probe_process_imports_the_callers_own_copy(tmp_path):
    """A copy vendored beside the script, run from a directory whose own ``safestrategy``
    (and one on PYTHONPATH) is a decoy: the probe process must import the caller's."""
    vendor = tmp_path / "app folder" / "third_party"
    shutil.copytree(str(ROOT / "safestrategy"), str(vendor / "safestrategy"))
    decoy = tmp_path / "decoy"
    (decoy / "safestrategy").mkdir(parents=True)
    (decoy / "safestrategy" / "__init__.py").write_text("raise ImportError('the decoy')\n")
    script = tmp_path / "app folder" / "train.py"
    script.write_text(VENDORED_SCRIPT.format(vendor=str(vendor)))
    env = {"PYTHONPATH": str(decoy), "PYTHONSAFEPATH": ""}
    done = run_python(str(script), env=env, cwd=decoy)
    assert done.returncode == 0, done.stderr[-3000:]
    _, status, reason = done.stdout.split(maxsplit=2)
    assert (status, reason.strip()) == ("ok", "all 2 replicas got the right sum")


def test_a_worker_path_with_spaces_and_accents(fake, windows, monkeypatch, tmp_path):
    folder = tmp_path / "Program Files" / "café worker"
    folder.mkdir(parents=True)
    script = folder / "fake worker.py"
    shutil.copyfile(FAKE_WORKER, str(script))
    monkeypatch.setattr(_probe, "CHILD_COMMAND", [sys.executable, str(script)])
    fake("ok")
    report = safestrategy.probe(["/gpu:0", "/gpu:1", "/gpu:2"])
    assert report.devices == ("/device:GPU:0", "/device:GPU:1", "/device:GPU:2")
    assert report.backend == "nccl"


def test_output_in_another_codec_cannot_stall_the_probe(fake, windows):
    # 256 KiB of undecodable stderr before the first answer: with the locale's codec
    # the reader thread would die, the pipe fill up, and the start time out.
    fake("noisy")
    report = safestrategy.probe(GPUS, backend="nccl", timeout=30)
    (result,) = report.candidates
    assert (result.status, report.backend) == ("ok", "nccl")


@pytest.mark.parametrize(
    "returncode, text",
    [
        (3, "exit status 3 (0x3)"),  # abort() on Windows
        (0xC0000005, "exit status 3221225477 (0xc0000005, access violation)"),
        (0xC000001D, "(0xc000001d, illegal instruction (a TensorFlow build for a newer CPU"),
        (0xC0000409, "(0xc0000409, fail-fast abort)"),
        (-signal.SIGABRT, f"killed by signal SIGABRT ({int(signal.SIGABRT)})"),  # POSIX
    ],
)
def test_crash_statuses_are_named(returncode, text):
    assert text in _probe._exit_text(returncode)


def test_collective_on_gpus_is_checked_and_timed_in_the_probe_process(fake, tmp_path):
    """On physical GPUs collective requests NCCL: like nccl, it may hang, so it never runs
    here; its verdict is cached under its own name."""
    from safestrategy import _tf, backends

    fake("ok")
    if backends.collective_live(_tf.import_tf(), parse_devices(GPUS)).implementation is None:
        pytest.skip("TF < 2.13: collective is not MirroredStrategy's default")
    fake.monkeypatch.setenv("FAKE_WORKER_MS", "nccl=5,collective=1")
    report = safestrategy.probe(GPUS)
    collective = report.candidates[0]
    assert (report.backend, collective.status, collective.ms) == ("collective", "ok", 1.0)
    assert collective.reason.endswith("(NCCL requested)")
    assert report.reason.startswith("fastest: 1.0 ms; nccl 5.0 ms")
    assert list((tmp_path / "cache").glob("collective-*.json"))
