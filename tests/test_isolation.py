"""The probe process seam: hangs, crashes, wrong sums and dead starts, faked.

A real broken NCCL cannot be had on a CPU, so ``_probe.WORKER_COMMAND`` is
pointed at tests/fake_worker.py (the ``fake`` fixture in conftest.py), which
speaks the worker protocol; everything on the parent's side (timeouts,
killing, reaping, judging sums, restarting, reporting) is the real code.
"""

import os
import time

import pytest

import safestrategy

GPUS = ["/gpu:0", "/gpu:1"]


def gone(pid):
    try:
        os.kill(pid, 0)
    except OSError:
        return True
    return False


def test_a_hanging_check_is_abandoned_at_the_timeout_and_its_process_is_gone(fake):
    pidfile = fake("hang")
    started = time.monotonic()
    with pytest.raises(safestrategy.NoWorkingBackendError) as error:
        safestrategy.probe(GPUS, backend="nccl", timeout=1)
    elapsed = time.monotonic() - started
    (result,) = error.value.report.candidates
    assert (result.name, result.status) == ("nccl", "timeout")
    assert "no answer within 1 s" in result.reason
    assert 1 <= result.seconds < 4, result.seconds
    assert elapsed < 10
    assert gone(int(pidfile.read_text()))


def test_a_crashing_check_is_a_failure_with_the_signal(fake):
    fake("abort")
    with pytest.raises(safestrategy.NoWorkingBackendError) as error:
        safestrategy.probe(GPUS, backend="nccl")
    (result,) = error.value.report.candidates
    assert result.status == "failed"
    assert "SIGABRT" in result.reason if os.name == "posix" else "exit status" in result.reason
    assert "nccl: failed: the probe process died" in str(error.value)


def test_wrong_sums_are_rejected_with_expected_and_got(fake):
    fake("wrong")
    with pytest.raises(safestrategy.NoWorkingBackendError) as error:
        safestrategy.probe(["/gpu:0", "/gpu:1", "/gpu:2"], backend="hierarchical_copy")
    (result,) = error.value.report.candidates
    assert result.status == "failed"
    assert result.reason == "wrong sum: expected 6 on each of 3 replicas, got [4.0, 4.0, 4.0]"


def test_every_candidate_fails_and_the_error_lists_each(fake):
    fake("error")
    with pytest.raises(safestrategy.NoWorkingBackendError) as error:
        safestrategy.probe(GPUS)
    assert isinstance(error.value, RuntimeError)
    assert [c.status for c in error.value.report.candidates] == ["failed"] * 4
    for name in safestrategy.BACKEND_NAMES:
        assert f"{name}: failed: InvalidArgumentError: No OpKernel" in str(error.value)


def test_a_probe_process_that_cannot_start_is_a_clear_error(fake):
    fake("die-at-start")
    with pytest.raises(RuntimeError, match=r"could not start.*exit status 3.*libcuda"):
        safestrategy.probe()


def test_devices_default_to_what_the_probe_process_found(fake):
    fake("ok")
    report = safestrategy.probe()
    assert report.devices == ("/device:GPU:0", "/device:GPU:1")
    assert report.backend == "nccl"
    assert report.nccl_kernels == 0
    assert report.tf_version == "2.99.0"
