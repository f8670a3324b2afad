"""NCCL verdicts that last, and NCCL's remedies, through the probe-process seam.

The fake probe process (tests/fake_worker.py) logs each start with the NCCL_*
variables it was given, so a test can tell a cached verdict (no start) from a
fresh one, and a remedy tried from one skipped.
"""

import json
import logging
import os
import re
import shlex
import sys
import time

import pytest

import safestrategy
from safestrategy import _cache, _env, factory
from safestrategy.checks import nccl as _nccl
from safestrategy.report import CandidateResult

from .conftest import GPUS

#: Real devices (the conftest ``tf`` fixture makes 3 logical CPUs), so that the fallback
#: candidates can run for real beside the faked NCCL.
CPUS = ["/cpu:0", "/cpu:1"]
P2P = "NCCL_P2P_DISABLE"
SHM = "NCCL_SHM_DISABLE"


def decide_again(**kwargs):
    """A decision as a new process would make it (nothing remembered in this one)."""
    factory._decisions.clear()
    try:
        return safestrategy.probe(CPUS, **{"backend": "nccl,reduce_to_cpu", **kwargs})
    except safestrategy.NoWorkingBackendError as error:
        return error.report


def new_process(monkeypatch):
    """What a new launch starts from: nothing remembered, no remedy set by an earlier one."""
    monkeypatch.delenv(P2P, raising=False)
    monkeypatch.setattr(_env, "_applied", {})
    factory._decisions.clear()


def cache_files(tmp_path):
    return sorted((tmp_path / "cache").glob("nccl-*.json"))


# --- the cache ----------------------------------------------------------------------------


def test_a_verdict_is_probed_once_then_read_from_the_cache(fake, tmp_path):
    fake("ok")
    first = decide_again().candidates[0]
    second = decide_again().candidates[0]
    assert (first.status, first.cached) == ("ok", False)
    assert (second.status, second.cached) == ("ok", True)
    assert fake.starts() == ["start"]
    assert len(cache_files(tmp_path)) == 1


def test_failures_and_timeouts_are_cached_too(fake, monkeypatch):
    monkeypatch.setenv("SAFESTRATEGY_NCCL_REMEDIES", "off")
    fake("hang")
    assert decide_again(timeout=0.5).candidates[0].status == "timeout"
    again = decide_again(timeout=0.5)
    assert (again.candidates[0].status, again.candidates[0].cached) == ("timeout", True)
    assert again.backend == "reduce_to_cpu"
    assert len(fake.starts()) == 1  # a hang costs its timeout once, not at every launch


def test_the_cache_key_holds_what_can_change_the_verdict(fake, monkeypatch):
    fake("ok")
    decide_again()
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    decide_again()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    decide_again()
    decide_again(timeout=7)
    assert len(fake.starts()) == 4
    decide_again(timeout=7)
    assert len(fake.starts()) == 4


@pytest.fixture
def machine(monkeypatch):
    """Sets what this machine's probes read (GPU UUIDs, host name, /dev/shm size), as on
    another node of a cluster sharing the cache directory."""
    from safestrategy import _machine

    def be(uuids=(), host="node-a", shm=64 << 20):
        monkeypatch.setattr(_machine, "_uuids_from_proc", lambda: list(uuids))
        monkeypatch.setattr(_machine, "_uuids_from_nvidia_smi", lambda: [])
        monkeypatch.setattr("socket.gethostname", lambda: host)
        monkeypatch.setattr(_machine, "shm_bytes", lambda: shm)
        _machine._identity.cache_clear()  # read once per process: this is a new one

    yield be
    _machine._identity.cache_clear()


A, B = "GPU-0c1d2e3f-aaaa-bbbb-cccc-000000000001", "GPU-0c1d2e3f-aaaa-bbbb-cccc-000000000002"


@pytest.mark.parametrize(
    "node_a, node_b, same",
    [
        ({"uuids": [A]}, {"uuids": [B]}, False),  # a shared home: another node's GPUs
        ({"host": "node-a"}, {"host": "node-b"}, False),  # no UUIDs readable: the host name
        ({"shm": 64 << 20}, {"shm": 8 << 30}, False),  # NCCL's SHM transport differs
        ({"uuids": [A], "host": "c1"}, {"uuids": [A], "host": "c2"}, True),  # a new container
    ],
)
def test_a_verdict_holds_on_the_machine_that_measured_it_only(fake, machine, node_a, node_b, same):
    fake("error")
    machine(**node_a)
    assert decide_again().candidates[0].cached is False
    machine(**node_b)
    assert decide_again().candidates[0].cached is same
    assert len(fake.starts()) == (1 if same else 2)


def test_refresh_and_cache_off(fake, monkeypatch, tmp_path, run_cli):
    fake("ok")
    decide_again()
    factory._decisions.clear()
    report, _ = factory.decide(CPUS, backend="nccl", refresh=True)
    assert not report.candidates[0].cached
    assert len(fake.starts()) == 2
    monkeypatch.setenv("SAFESTRATEGY_CACHE", "off")
    (tmp_path / "cache").rename(tmp_path / "elsewhere")
    assert not decide_again().candidates[0].cached
    assert len(fake.starts()) == 3
    assert not (tmp_path / "cache").exists()  # off: not written either


def test_entries_expire_after_seven_days(fake, tmp_path):
    fake("ok")
    decide_again()
    (path,) = cache_files(tmp_path)
    entry = json.loads(path.read_text())
    entry["written"] = time.time() - _cache.MAX_AGE - 1
    path.write_text(json.dumps(entry))
    assert not decide_again().candidates[0].cached
    assert len(fake.starts()) == 2


@pytest.mark.parametrize("damage", ["", "{", '{"format": 1}', "[]", "\x00\xff"])
def test_a_corrupt_entry_is_a_miss_and_is_rewritten(fake, tmp_path, damage):
    fake("ok")
    decide_again()
    (path,) = cache_files(tmp_path)
    path.write_text(damage)
    assert not decide_again().candidates[0].cached
    assert decide_again().candidates[0].cached
    assert len(fake.starts()) == 2


def test_an_unusable_cache_directory_is_no_error(fake, monkeypatch, tmp_path):
    fake("ok")
    blocker = tmp_path / "a file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SAFESTRATEGY_CACHE_DIR", str(blocker / "cache"))
    assert decide_again().candidates[0].status == "ok"
    assert decide_again().candidates[0].status == "ok"
    assert len(fake.starts()) == 2


def test_concurrent_writers_never_leave_a_torn_file(tmp_path):
    key = {"devices": ["/device:GPU:0", "/device:GPU:1"]}
    value = {"name": "nccl", "status": "ok", "reason": "x" * 100000}
    for _ in range(20):
        _cache.write(str(tmp_path), "nccl", key, value)
    assert _cache.read(str(tmp_path), "nccl", key) == value
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


def quoted_command(message):
    """The command a message quotes between backticks, as the argv ``cli.main`` takes."""
    (command,) = re.findall(r"`([^`]*--refresh)`", message)
    argv = shlex.split(command)
    assert argv[1:3] == ["-m", "safestrategy"]
    assert argv[0] == "python" or argv[0] == sys.executable  # the cache key's interpreter
    return command.split(" -m safestrategy ")[1], argv[3:]


def test_a_fallback_resting_on_a_cached_verdict_says_how_to_check_again(fake, caplog):
    from safestrategy import cli

    fake("error")
    decide_again()
    factory._decisions.clear()
    with caplog.at_level(logging.WARNING, logger="safestrategy"):
        safestrategy.make_mirrored_strategy(CPUS, backend="nccl,reduce_to_cpu")
    (warning,) = [r for r in caplog.records if r.name == "safestrategy"]
    assert "cached from an earlier run" in warning.getMessage()
    # auto skips NCCL on CPUs: the command names it so that it is checked
    args, argv = quoted_command(warning.getMessage())
    assert args == "--devices /cpu:0 /cpu:1 --timeout 60 --backend nccl --refresh"
    fake("ok")
    assert cli.main(argv) == 0
    (nccl, _) = decide_again().candidates
    assert (nccl.status, nccl.cached) == ("ok", True)  # the entry the training reads, rewritten
    assert len(fake.starts()) == 2


def test_a_forced_nccl_failing_on_a_cached_verdict_says_so_and_its_command_rechecks_it(
    fake, monkeypatch
):
    from safestrategy import cli

    monkeypatch.setenv("SAFESTRATEGY_PROBE_TIMEOUT", "7.5")  # not the default: in the key
    fake("error")
    with pytest.raises(safestrategy.NoWorkingBackendError):
        safestrategy.make_mirrored_strategy(GPUS, backend="nccl")
    factory._decisions.clear()
    with pytest.raises(safestrategy.NoWorkingBackendError) as raised:
        safestrategy.make_mirrored_strategy(GPUS, backend="nccl")
    assert "nccl: a verdict cached from an earlier run" in str(raised.value)
    args, argv = quoted_command(str(raised.value))
    assert args == "--devices /gpu:0 /gpu:1 --timeout 7.5 --backend nccl --refresh"
    monkeypatch.delenv("SAFESTRATEGY_PROBE_TIMEOUT")  # a shell without the training's setting
    fake("ok")
    assert cli.main(argv) == 0
    monkeypatch.setenv("SAFESTRATEGY_PROBE_TIMEOUT", "7.5")
    factory._decisions.clear()
    safestrategy.make_mirrored_strategy(GPUS, backend="nccl")
    (nccl,) = safestrategy.last_report().candidates
    assert (nccl.status, nccl.cached) == ("ok", True)
    assert len(fake.starts()) == 2


def test_nccl_ops_says_a_forced_nccl_failed_on_a_cached_verdict(fake, tf, monkeypatch, caplog):
    from safestrategy import nccl_ops

    from .test_nccl_ops import inputs, placed

    monkeypatch.setattr(nccl_ops, "_decisions", {})
    fake("error")
    with caplog.at_level(logging.WARNING, logger="safestrategy"), tf.Graph().as_default():
        nccl_ops.all_sum(placed(tf, inputs(2), GPUS))  # auto: falls back, fresh
        monkeypatch.setenv("SAFESTRATEGY_BACKEND", "nccl")
        with pytest.raises(safestrategy.NoWorkingBackendError) as raised:
            nccl_ops.all_sum(placed(tf, inputs(2), GPUS))
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "safestrategy"]
    assert "cached" not in warning
    recheck = "--devices /gpu:0 /gpu:1 --timeout 60 --backend nccl --refresh"
    assert quoted_command(warning)[0] == recheck
    assert "a verdict cached from an earlier run" in str(raised.value)
    assert quoted_command(str(raised.value))[0] == recheck
    assert len(fake.starts()) == 1


# --- remedies -----------------------------------------------------------------------------


@pytest.fixture
def short_timeout(monkeypatch):
    monkeypatch.setenv("SAFESTRATEGY_PROBE_TIMEOUT", "1")


def test_a_remedy_keeps_nccl_and_is_applied_named_and_recorded(fake, caplog, short_timeout):
    fake(f"hang-unless-{P2P}")
    with caplog.at_level(logging.WARNING, logger="safestrategy"):
        safestrategy.make_mirrored_strategy(GPUS, backend="nccl")
    report = safestrategy.last_report()
    (nccl,) = report.candidates
    assert (report.backend, nccl.status, nccl.remedy) == ("nccl", "ok", {P2P: "1"})
    assert nccl.reason.startswith(f"passed with {P2P}=1, after it timed out without")
    assert os.environ[P2P] == "1"
    (warning,) = [r for r in caplog.records if r.name == "safestrategy"]
    assert f"unless {P2P}=1" in warning.getMessage()
    assert fake.starts() == ["start", f"start {P2P}=1"]
    print(report)


def test_remedies_are_tried_in_order_until_one_passes(fake):
    fake(f"error-unless-{SHM}")
    (nccl,) = decide_again(backend="nccl").candidates
    assert nccl.remedy == {SHM: "1"}
    assert fake.starts() == ["start", f"start {P2P}=1", f"start {SHM}=1"]


def test_a_variable_the_user_set_is_kept_and_its_remedy_not_tried(fake, monkeypatch, short_timeout):
    monkeypatch.setenv(P2P, "0")
    fake(f"hang-unless-{SHM}")
    safestrategy.make_mirrored_strategy(GPUS, backend="nccl")
    assert os.environ[P2P] == "0" and os.environ[SHM] == "1"
    assert fake.starts() == [f"start {P2P}=0", f"start {P2P}=0 {SHM}=1"]


def test_a_failure_says_which_remedies_the_users_settings_kept_from_being_tried(fake, monkeypatch):
    monkeypatch.setenv(P2P, "0")
    fake("abort")
    (nccl, _) = decide_again().candidates
    assert nccl.reason.endswith(f"(also with {SHM}=1; {P2P}=1 not tried: you set {P2P}=0)")
    monkeypatch.setenv(SHM, "")
    (nccl, _) = decide_again().candidates
    assert nccl.reason.endswith(
        f"({P2P}=1 not tried: you set {P2P}=0; {SHM}=1 not tried: you set {SHM}=)"
    )
    assert len(fake.starts()) == 3


def test_the_multiworker_verdict_names_the_users_settings_too(monkeypatch):
    monkeypatch.setenv(P2P, "0")
    _nccl.apply_remedy({SHM: "1"}, GPUS)  # ours, not the user's: not named
    first = CandidateResult("nccl", "timeout", "worker:1: timeout: no answer within 1 s", 1.0)
    tried = [({SHM: "1"}, first)]
    reason = _nccl.after_remedies(first, tried, " on every worker").reason
    assert reason.endswith(f"(also with {SHM}=1; {P2P}=1 not tried: you set {P2P}=0)")


def test_remedies_can_be_switched_off(fake, monkeypatch):
    monkeypatch.setenv("SAFESTRATEGY_NCCL_REMEDIES", "off")
    fake(f"hang-unless-{P2P}")
    report = decide_again(timeout=0.5)
    assert (report.candidates[0].status, report.backend) == ("timeout", "reduce_to_cpu")
    assert fake.starts() == ["start"]
    assert P2P not in os.environ


def test_no_remedy_helps_a_missing_kernel(fake):
    fake("error")
    (nccl, _) = decide_again().candidates
    assert nccl.status == "failed" and "also with" not in nccl.reason
    assert fake.starts() == ["start"]


def test_every_remedy_failing_says_so(fake):
    fake("abort")
    (nccl, _) = decide_again().candidates
    assert nccl.status == "failed"
    assert nccl.reason.endswith(f"(also with {P2P}=1 and with {SHM}=1)")
    assert len(fake.starts()) == 3


def test_a_cached_remedy_is_applied_without_a_probe_process(fake, monkeypatch, short_timeout):
    fake(f"hang-unless-{P2P}")
    safestrategy.make_mirrored_strategy(GPUS, backend="nccl")
    new_process(monkeypatch)
    safestrategy.make_mirrored_strategy(GPUS, backend="nccl")
    (nccl,) = safestrategy.last_report().candidates
    assert (nccl.cached, nccl.remedy, os.environ[P2P]) == (True, {P2P: "1"}, "1")
    assert len(fake.starts()) == 2  # the first launch's two, none for the second


def test_a_remedy_for_one_device_set_does_not_pass_another(fake, monkeypatch, short_timeout):
    fake(f"hang-unless-{P2P}")
    safestrategy.make_mirrored_strategy(GPUS, backend="nccl")
    assert os.environ[P2P] == "1"  # set for GPUs 0,1
    safestrategy.make_mirrored_strategy([*GPUS, "/gpu:2"], backend="nccl")
    (nccl,) = safestrategy.last_report().candidates
    # GPUs 0,1,2 were checked in the user's environment, not with our remedy inherited
    assert fake.starts() == ["start", f"start {P2P}=1", "start", f"start {P2P}=1"]
    assert (nccl.status, nccl.remedy) == ("ok", {P2P: "1"})
    new_process(monkeypatch)
    safestrategy.make_mirrored_strategy([*GPUS, "/gpu:2"], backend="nccl")
    (nccl,) = safestrategy.last_report().candidates
    assert (nccl.cached, nccl.remedy, os.environ[P2P]) == (True, {P2P: "1"}, "1")
    assert len(fake.starts()) == 4


def test_a_remedy_we_set_is_not_the_users_setting(fake, short_timeout):
    fake(f"hang-unless-{SHM}")
    _nccl.apply_remedy({P2P: "1"}, GPUS)  # as an earlier device set's verdict would
    (nccl,) = decide_again(backend="nccl").candidates
    # P2P is ours, not the user's: its remedy is still tried, and in the user's environment
    assert fake.starts() == ["start", f"start {P2P}=1", f"start {SHM}=1"]
    assert nccl.remedy == {SHM: "1"}


def test_a_value_the_user_changed_is_theirs(fake, monkeypatch):
    fake("ok")
    _nccl.apply_remedy({P2P: "1"}, GPUS)
    monkeypatch.setenv(P2P, "0")
    decide_again()
    assert fake.starts() == [f"start {P2P}=0"]


def test_nccl_ops_applies_the_remedy_on_its_own_decision(fake, tf, short_timeout):
    from safestrategy import nccl_ops

    from .test_nccl_ops import inputs, placed

    fake(f"hang-unless-{P2P}")
    with tf.Graph().as_default():
        out = nccl_ops.all_sum(placed(tf, inputs(2), GPUS))
    assert [t.op.type for t in out] == ["NcclAllReduce"] * 2
    assert os.environ[P2P] == "1"


# --- timings hold only what their verdicts rest on (0.3.0) ---------------------------------


def collective_or_skip(tf):
    from safestrategy._tf import release
    from safestrategy.backends import FIRST_VERSION

    if release(tf.__version__) < FIRST_VERSION:
        pytest.skip("needs collective as MirroredStrategy's default: TF >= 2.13")


def test_a_warm_launch_does_not_replay_verdicts_whose_conditions_changed(fake, tf2, monkeypatch):
    """The timing entry holds every candidate's verdict: it is keyed by what they rest on
    (here the user's NCCL_* variables), so a change races again instead of replaying."""
    collective_or_skip(tf2)
    fake("collective-error-unless-NCCL_IB_DISABLE")
    fake.monkeypatch.setenv("FAKE_WORKER_MS", "nccl=1,collective=2")
    monkeypatch.setenv("NCCL_IB_DISABLE", "1")
    first = safestrategy.probe(GPUS)
    assert first.backend == "nccl" and [c.status for c in first.candidates[:2]] == ["ok", "ok"]
    monkeypatch.delenv("NCCL_IB_DISABLE")  # a launch without the user's variable
    factory._decisions.clear()
    again = safestrategy.probe(GPUS)
    collective = again.candidates[0]
    assert (collective.name, collective.status, collective.cached) == (
        "collective",
        "failed",
        False,
    )


def test_the_quoted_recheck_command_changes_what_the_next_launch_does(tf2, monkeypatch, caplog):
    """collective failed (a fault since fixed) and its failure sits in the cached timings: the
    WARNING's command re-checks it and drops those timings, so the next launch uses it."""
    collective_or_skip(tf2)
    from safestrategy import cli
    from safestrategy.checks import allreduce

    real, broken = allreduce.race, {"now": True}

    def race(tf, era, devices, name, *args, **kwargs):
        if name == "collective" and broken["now"]:
            raise RuntimeError("fake: broken now")
        return real(tf, era, devices, name, *args, **kwargs)

    monkeypatch.setattr(allreduce, "race", race)
    assert safestrategy.probe(CPUS).candidates[0].status == "failed"
    factory._decisions.clear()
    with caplog.at_level(logging.WARNING, logger="safestrategy"):
        warm = safestrategy.make_mirrored_strategy(CPUS)
    del warm
    (warning,) = [r.getMessage() for r in caplog.records if "collective failed" in r.getMessage()]
    args, argv = quoted_command(warning)
    assert args == "--devices /cpu:0 /cpu:1 --timeout 60 --backend collective --refresh"
    broken["now"] = False  # the machine is fixed; the user runs the quoted command
    assert cli.main(argv) == 0
    factory._decisions.clear()
    after = safestrategy.probe(CPUS)
    assert after.candidates[0][:2] == ("collective", "ok")
