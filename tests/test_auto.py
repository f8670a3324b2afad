"""auto_strategy(): the branch for wherever it runs, on real TensorFlow (the cluster
branch over a real Slurm: tests/test_slurm.py)."""

import json

import pytest

import safestrategy
from safestrategy import auto
from safestrategy.multiworker import cluster

from .conftest import needs_tf, tf_configs


def test_the_branch_rule():
    two = cluster.parse_tf_config(tf_configs(2)[0])
    one = cluster.parse_tf_config(tf_configs(1)[0])
    assert auto.branch(two, False, ())[0] == auto.MULTIWORKER
    assert auto.branch(two, False, ())[1].startswith("a cluster of 2 workers from TF_CONFIG")
    assert auto.branch(one, True, ())[0] == auto.MULTIWORKER  # a resolver is a cluster
    assert auto.branch(one, False, ("/cpu:0", "/cpu:1"))[0] == auto.MIRRORED  # TF_CONFIG of 1
    assert auto.branch(None, False, ("/cpu:0",)) == (
        auto.ONE_DEVICE,
        "one device: nothing to all-reduce",
    )


@needs_tf
def test_logical_cpus_mirror_as_stock_mirrored_strategy_does(tf2):
    strategy = safestrategy.auto_strategy()
    report = safestrategy.last_report()
    assert type(strategy).__name__ == "MirroredStrategy"
    assert report.branch == auto.MIRRORED
    assert report.branch_reason.startswith("3 devices, as MirroredStrategy() mirrors")
    assert report.candidates  # the factory's report: every candidate checked
    assert str(report).startswith("branch       mirrored: 3 devices")
    with pytest.raises(TypeError, match=r"took the mirrored branch \(3 devices.*communication"):
        safestrategy.auto_strategy(communication="ring")


@needs_tf
def test_one_device_is_one_device_strategy_and_takes_no_keywords(tf):
    strategy = safestrategy.auto_strategy(devices=["/cpu:0"])
    report = safestrategy.last_report()
    assert type(strategy).__name__.startswith("OneDeviceStrategy")  # TF 1.15: ...V1
    assert (report.branch, report.branch_reason) == (
        auto.ONE_DEVICE,
        "one device: nothing to all-reduce",
    )
    assert (report.backend, report.devices, report.candidates) == ("none", ("/cpu:0",), ())
    with pytest.raises(TypeError, match=r"one device branch .* takes no keyword.*backend"):
        safestrategy.auto_strategy(devices=["/cpu:0"], backend="nccl")


@needs_tf
def test_parameter_servers_are_refused_naming_tensorflows_strategy(tf, monkeypatch):
    config = json.loads(tf_configs(2)[0])
    config["cluster"]["ps"] = ["127.0.0.1:1"]
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    with pytest.raises(ValueError, match="ParameterServerStrategy"):
        safestrategy.auto_strategy()
