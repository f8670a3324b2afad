"""The probe-process seam: hangs, crashes, garbage, dead starts and orphans, faked.

A real broken NCCL cannot be had on a CPU, so ``_probe.CHILD_COMMAND`` is
pointed at tests/fake_worker.py and TensorFlow is made to "have" GPUs and NCCL
kernels (the ``fake`` fixture in conftest.py). Everything on the caller's side
(starting, timeouts, killing, reaping, judging sums, reporting, caching) and
the probe process's own hygiene (``_worker.connect``) is the real code.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

import safestrategy
from safestrategy.checks import probe as _probe

from .conftest import FAKE_WORKER, GPUS, ROOT, read_line

NCCL_ONLY = {"backend": "nccl"}


def gone(pid, within=5.0):
    """True once process ``pid`` no longer exists (or is a zombie nobody reaps)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split(")")[-1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def nccl_result(fake, behaviour, **kwargs):
    """NCCL's candidate result from a forced probe with the fake probe process."""
    fake(behaviour)
    try:
        report = safestrategy.probe(GPUS, **{**NCCL_ONLY, **kwargs})
    except safestrategy.NoWorkingBackendError as error:
        report = error.report
    (result,) = report.candidates
    return result


def test_a_hanging_check_is_abandoned_at_the_timeout_and_its_process_is_gone(fake):
    started = time.monotonic()
    result = nccl_result(fake, "hang", timeout=1)
    assert (result.name, result.status) == ("nccl", "timeout"), result
    assert "no answer within 1 s" in result.reason
    assert time.monotonic() - started < 10
    assert gone(int(fake.pidfile.read_text()))


def test_a_crash_is_a_failure_with_the_signal_and_the_useful_line(fake):
    result = nccl_result(fake, "abort")
    assert result.status == "failed"
    assert "SIGABRT" in result.reason if os.name == "posix" else "exit status" in result.reason
    assert "last output: F external/nccl/src/init.cc: NCCL abort (fake)" in result.reason


def test_a_banner_on_stdout_does_not_break_the_protocol(fake):
    assert nccl_result(fake, "banner").status == "ok"


def test_a_reply_that_is_not_json_is_a_failure_not_an_exception(fake):
    result = nccl_result(fake, "garbage")
    assert result.status == "failed"
    assert "answered nonsense" in result.reason


def test_a_probe_process_that_cannot_start_fails_nccl_and_the_decision_goes_on(fake, caplog):
    fake("die-at-start")
    report = safestrategy.probe(["/cpu:0", "/cpu:1"], backend="nccl,reduce_to_cpu")
    nccl, _ = report.candidates
    assert (nccl.status, report.backend) == ("failed", "reduce_to_cpu")
    assert nccl.reason.startswith("the probe process could not start: it died: exit status 3")
    assert nccl.reason.endswith("; last output: fake: cannot load libcuda.so.1")
    assert fake.starts() == ["start"]  # not cached: the next run tries again
    safestrategy.factory._decisions.clear()
    safestrategy.probe(["/cpu:0", "/cpu:1"], backend="nccl,reduce_to_cpu")
    assert fake.starts() == ["start", "start"]


def test_a_forced_nccl_whose_probe_cannot_start_raises(fake):
    fake("die-at-start")
    with pytest.raises(safestrategy.NoWorkingBackendError, match="could not start"):
        safestrategy.probe(GPUS, backend="nccl")


@pytest.mark.parametrize(
    "command, why",
    [
        (["/nonexistent/python"], "FileNotFoundError"),
        ([os.devnull], "PermissionError"),
    ],
)
def test_an_unusable_interpreter_is_a_reason_not_a_raw_exception(fake, monkeypatch, command, why):
    monkeypatch.setattr(_probe, "CHILD_COMMAND", command)
    result = nccl_result(fake, "ok")
    assert result.status == "failed" and "could not start" in result.reason and why in result.reason


def test_an_interpreter_that_does_not_exist_is_a_reason(fake, monkeypatch):
    monkeypatch.setattr(_probe, "CHILD_COMMAND", None)
    monkeypatch.setattr(sys, "executable", "/nonexistent/bin/python3")
    result = nccl_result(fake, "ok")
    assert result.status == "failed" and "FileNotFoundError" in result.reason


def test_the_last_output_of_a_crash_skips_tensorflows_banner():
    stderr = [
        "Traceback (most recent call last):",
        "RuntimeError: CUDA driver version is insufficient for CUDA runtime version",
        "2026-11-30 10:00:00.123456: W tensorflow/stream_executor/platform/default/dso_loader.cc",
        "E0000 00:00:1796029686.266921 7134 cuda_dnn.cc:8579] Unable to register cuDNN factory",
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
        "",
    ]
    assert _probe.useful_last_line(stderr) == stderr[1]
    assert _probe.useful_last_line(stderr[2:]) == ""  # chatter only: nothing to quote
    assert _probe.useful_last_line([]) == ""
    fatal = "F0000 00:00:1796029686.266921 7134 nccl_ops.cc:42] Check failed: comm != nullptr"
    assert _probe.useful_last_line([fatal, *stderr[2:]]) == fatal


# TensorFlow 2.21's and 1.15's start-up lines, as they print them (real output).
BANNERS = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1733000000.123456   12345 port.cc:153] oneDNN custom operations are on. You "
    "may see slightly different numerical results due to floating-point round-off errors from "
    "different computation orders. To turn them off, set the environment variable "
    "`TF_ENABLE_ONEDNN_OPTS=0`.",
    "I0000 00:00:1796161170.542599   16550 cpu_feature_guard.cc:227] This TensorFlow binary is "
    "optimized to use available CPU instructions in performance-critical operations.",
    "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow "
    "with the appropriate compiler flags.",
    "2026-12-01 21:40:22.567481: I tensorflow/core/platform/cpu_feature_guard.cc:142] Your CPU "
    "supports instructions that this TensorFlow binary was not compiled to use: AVX2 FMA",
    "2026-12-01 21:40:22.592553: I tensorflow/core/util/port.cc:113] oneDNN custom operations "
    "are on.",
]


def test_a_death_after_only_tensorflows_banner_quotes_no_last_output(fake, monkeypatch):
    monkeypatch.setenv("FAKE_WORKER_STDERR", "\n".join(BANNERS))
    result = nccl_result(fake, "silent-death")
    assert result.reason == "the probe process could not start: it died: exit status 3 (0x3)"


def test_a_frozen_application_does_not_start_itself_again(fake, monkeypatch):
    monkeypatch.setattr(_probe, "CHILD_COMMAND", None)
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    result = nccl_result(fake, "ok")
    assert "frozen application" in result.reason


def test_out_of_memory_names_the_fix_and_is_not_cached(fake):
    result = nccl_result(fake, "oom")
    assert result.status == "failed"
    assert "TF_FORCE_GPU_ALLOW_GROWTH=true" in result.reason
    safestrategy.factory._decisions.clear()
    assert not nccl_result(fake, "oom").cached


def test_wrong_sums_are_rejected_with_expected_and_got(fake):
    fake("wrong")
    with pytest.raises(safestrategy.NoWorkingBackendError) as error:
        safestrategy.probe(["/gpu:0", "/gpu:1", "/gpu:2"], backend="nccl")
    (result,) = error.value.report.candidates
    assert result.reason.startswith(
        "wrong sum: expected 6 on each of 3 replicas, got [4.0, 4.0, 4.0]"
    )


CALLER = """
import signal, sys, time
# Ctrl-C must reach us even where SIGINT came in ignored (`cmd &` in a script, nohup, some CI
# runners): Python then installs no KeyboardInterrupt handler of its own.
signal.signal(signal.SIGINT, signal.default_int_handler)
import safestrategy
from safestrategy import _devices, _machine, _tf
from safestrategy.checks import probe as _probe
_probe.CHILD_COMMAND = [sys.executable, {fake!r}]
_tf.nccl_kernel_count = lambda tf: 1
gpus = (_devices.Device("GPU", 0), _devices.Device("GPU", 1))
_tf.visible_devices = lambda tf: _devices.Visible((_devices.Device("CPU", 0),) + gpus)
try:
    safestrategy.probe(["/gpu:0", "/gpu:1"], backend="nccl", timeout=600)
except KeyboardInterrupt:  # a notebook kernel lives on after Ctrl-C
    print("interrupted", flush=True)
    time.sleep(600)
"""


#: Starts the command after it with SIGINT ignored, as ``cmd &`` in a script or ``nohup``
#: leave it (an ignored signal stays ignored across exec; no ``preexec_fn`` in a process
#: with TensorFlow's threads).
IGNORING_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "os.execv(sys.executable, [sys.executable] + sys.argv[1:])"
)


@pytest.mark.skipif(os.name != "posix", reason="sends POSIX signals")
@pytest.mark.parametrize(
    "behaviour, sig, sigint",
    [
        pytest.param("hang", signal.SIGTERM, "default", id="hang-SIGTERM"),  # a cancelled job
        pytest.param("hang", signal.SIGKILL, "default", id="hang-SIGKILL"),
        pytest.param("hang", signal.SIGINT, "default", id="hang-SIGINT"),  # Ctrl-C while it hangs
        # Ctrl-C while the probe process starts
        pytest.param("slow-start", signal.SIGINT, "default", id="slow-start-SIGINT"),
        # the caller started with SIGINT ignored: its own handler still takes the Ctrl-C
        pytest.param("hang", signal.SIGINT, "ignored", id="hang-SIGINT-ignored"),
        pytest.param("slow-start", signal.SIGINT, "ignored", id="slow-start-SIGINT-ignored"),
    ],
)
def test_the_probe_process_never_outlives_its_caller(tf, tmp_path, behaviour, sig, sigint):
    pidfile = tmp_path / "pid"
    env = dict(os.environ, FAKE_WORKER=behaviour, FAKE_WORKER_PIDFILE=str(pidfile))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["SAFESTRATEGY_CACHE"] = "off"
    start = [sys.executable] + (["-c", IGNORING_SIGINT] if sigint == "ignored" else [])
    if sigint == "ignored":  # the start really leaves SIGINT ignored, or this case proves nothing
        asks = "import signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"
        shown = subprocess.run([*start, "-c", asks], stdout=subprocess.PIPE, timeout=60)
        assert shown.stdout == b"True\n"
    caller = subprocess.Popen(
        [*start, "-c", CALLER.format(fake=FAKE_WORKER)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not pidfile.exists() or not pidfile.read_text():
            assert caller.poll() is None, caller.communicate(timeout=30)
            assert time.monotonic() < deadline, "the probe process never started"
            time.sleep(0.05)
        child = int(pidfile.read_text())
        time.sleep(0.5)  # let it reach the hang (or stay in its slow start)
        caller.send_signal(sig)
        if sig == signal.SIGINT:
            line = read_line(caller.stdout, 30, "'interrupted' after SIGINT")
            assert line == b"interrupted\n"
            assert gone(child), f"probe process {child} outlived the interrupted probe"
            assert caller.poll() is None
        else:
            caller.wait(timeout=30)
            assert gone(child), f"probe process {child} outlived its caller ({sig!r})"
    finally:
        caller.kill()
        caller.wait(timeout=30)
