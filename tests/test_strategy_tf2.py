"""The factory on real TensorFlow 2, over logical CPU devices.

The seed error is real here: NcclAllReduce has no kernel for CPU devices, so
plain MirroredStrategy with NCCL dies exactly as on a GPU box without NCCL.
"""

import logging

import numpy as np
import pytest
from packaging.version import Version

import safestrategy
from safestrategy import backends
from safestrategy._devices import parse_devices
from safestrategy.checks import probe as _probe
from safestrategy.checks import runner
from safestrategy.choose import fastest

from .conftest import LOGICAL_CPUS, cpus, run_python

SEED_ERROR = "No OpKernel was registered to support Op 'NcclAllReduce'"
LOGGER = "safestrategy"

X = np.linspace(-1.0, 1.0, 48 * 4, dtype=np.float32).reshape(48, 4)
Y = (X @ np.array([[0.5], [-1.0], [2.0], [0.25]], dtype=np.float32) + 0.3).astype(np.float32)


def keras_weights(tf, strategy):
    """Train a tiny model for 8 steps (global batch 6) under ``strategy``; its weights."""
    with strategy.scope():
        model = tf.keras.Sequential(
            [tf.keras.layers.Dense(1, kernel_initializer="ones", bias_initializer="zeros")]
        )
        model.build((None, 4))
        model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
    model.fit(X, Y, batch_size=6, epochs=1, shuffle=False, verbose=0)
    return [np.asarray(w) for w in model.get_weights()]


@pytest.fixture(scope="module")
def single_device_weights(tf2):
    return keras_weights(tf2, tf2.distribute.OneDeviceStrategy("/cpu:0"))


def assert_trains_like_one_device(tf, strategy, expected):
    for got, want in zip(keras_weights(tf, strategy), expected):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_the_seed_error_is_real_with_plain_mirrored_strategy(tf2):
    strategy = tf2.distribute.MirroredStrategy(
        cpus(2), cross_device_ops=tf2.distribute.NcclAllReduce()
    )
    with pytest.raises(tf2.errors.InvalidArgumentError, match=SEED_ERROR):
        keras_weights(tf2, strategy)


def test_tensorflows_own_nccl_guard_is_truthy_with_zero_kernels(tf2):
    from tensorflow.python.framework import kernels

    registered = kernels.get_registered_kernels_for_op("NcclAllReduce")
    assert len(registered.kernel) == 0
    assert bool(registered)  # why TF's "no NCCL kernel" fallback never runs


@pytest.mark.parametrize("n", [2, 3])
def test_auto_trains_like_one_device(tf2, single_device_weights, n):
    strategy = safestrategy.make_mirrored_strategy(cpus(n))
    assert isinstance(strategy, tf2.distribute.MirroredStrategy)
    report = safestrategy.last_report()
    assert report.devices == tuple(f"/device:CPU:{i}" for i in range(n))
    assert (report.mode, report.source, report.tf_api) == ("auto", "default", "tf2")
    by_name = {c.name: c for c in report.candidates}
    assert by_name["nccl"].status == by_name["reduce_to_gpu"].status == "skipped"
    if n == 3:  # HierarchicalCopyAllReduce drops a replica on odd counts
        assert by_name["hierarchical_copy"].status == "failed"
        assert "expected 6 on each of 3 replicas" in by_name["hierarchical_copy"].reason
    # the fastest that passed, by the 3 % rule, with the report's words
    timed = [(c.name, c.ms) for c in report.candidates if c.ms is not None]
    assert all(c.status == "ok" for c in report.candidates if c.ms is not None)
    if len(timed) > 1:
        assert (report.backend, report.reason) == fastest(timed)
    else:  # TF < 2.13 on 3 CPUs: collective skipped, hierarchical_copy wrong: nothing to race
        assert (report.backend, timed) == ("reduce_to_cpu", [])
        assert report.reason.startswith("the only candidate that passed")
    assert report.payload_mb == 1.0  # conftest's SAFESTRATEGY_PAYLOAD_MB
    assert_trains_like_one_device(tf2, strategy, single_device_weights)


def test_a_listed_order_skips_wrong_sums(tf2):
    safestrategy.make_mirrored_strategy(cpus(3), backend="hierarchical_copy,reduce_to_cpu")
    report = safestrategy.last_report()
    assert (report.backend, report.mode, report.source) == ("reduce_to_cpu", "list", "argument")


def test_env_list_runs_the_real_nccl_check_and_falls_back(
    tf2, single_device_weights, monkeypatch, caplog
):
    monkeypatch.setenv("SAFESTRATEGY_BACKEND", "nccl,reduce_to_cpu")
    with caplog.at_level(logging.INFO, logger="safestrategy"):
        strategy = safestrategy.make_mirrored_strategy(cpus(2))
    report = safestrategy.last_report()
    nccl = report.candidates[0]
    assert (nccl.status, report.backend, report.source) == ("failed", "reduce_to_cpu", "env")
    assert SEED_ERROR in nccl.reason
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == LOGGER]
    message = warning.getMessage()
    for part in ("nccl failed", SEED_ERROR, "using reduce_to_cpu", "set SAFESTRATEGY_BACKEND"):
        assert part in message
    assert any(
        r.levelno == logging.INFO and "reduce_to_cpu" in r.getMessage() for r in caplog.records
    )
    assert_trains_like_one_device(tf2, strategy, single_device_weights)


def test_forced_hierarchical_copy_on_three_devices_is_refused(tf2):
    with pytest.raises(safestrategy.NoWorkingBackendError, match="expected 6") as error:
        safestrategy.make_mirrored_strategy(cpus(3), backend="hierarchical_copy")
    assert error.value.report.mode == "forced"


@pytest.mark.parametrize("name", safestrategy.BACKEND_NAMES)
def test_every_backend_can_be_forced_on_two_devices(tf2, name):
    if name == "collective" and backends.collective_live(tf2, parse_devices(cpus(2))).reason:
        with pytest.raises(safestrategy.NoWorkingBackendError, match="default is Reduction"):
            safestrategy.make_mirrored_strategy(cpus(2), backend=name)  # TF < 2.13
        return
    if name in ("nccl", "reduce_to_gpu"):  # neither can work without a GPU
        why = SEED_ERROR if name == "nccl" else "reduce_to_gpu: failed: no GPU among the devices"
        with pytest.raises(safestrategy.NoWorkingBackendError, match=why):
            safestrategy.make_mirrored_strategy(cpus(2), backend=name)
        return
    strategy = safestrategy.make_mirrored_strategy(cpus(2), backend=name)
    assert strategy.num_replicas_in_sync == 2
    assert safestrategy.last_report().backend == name


def no_checks(monkeypatch):
    """Make any smoke check, in this process or a probe process, fail the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("nothing may be checked here")

    monkeypatch.setattr(runner.Runner, "__call__", refuse)


def test_your_own_cross_device_ops_are_used_as_given(tf2, monkeypatch):
    no_checks(monkeypatch)
    ops = tf2.distribute.ReductionToOneDevice()
    strategy = safestrategy.make_mirrored_strategy(cpus(2), cross_device_ops=ops)
    assert strategy.extended._cross_device_ops is ops
    assert safestrategy.last_report().reason.startswith("cross-device ops given by the caller")


def test_bad_settings_fail_before_any_probe(tf2, monkeypatch):
    no_checks(monkeypatch)
    monkeypatch.setenv("SAFESTRATEGY_BACKEND", "nccl;reduce_to_cpu")
    with pytest.raises(ValueError, match="SAFESTRATEGY_BACKEND"):
        safestrategy.make_mirrored_strategy(cpus(2))
    with pytest.raises(ValueError, match="devices"):
        safestrategy.make_mirrored_strategy(["/cpu:0", "/cpu:0"], backend="reduce_to_cpu")


def test_one_device_needs_no_probe(tf2, monkeypatch):
    no_checks(monkeypatch)
    strategy = safestrategy.make_mirrored_strategy(["/cpu:0"])
    assert strategy.num_replicas_in_sync == 1
    assert {c.status for c in safestrategy.last_report().candidates} == {"not_tried"}


def test_by_default_it_mirrors_over_what_stock_mirrored_strategy_does(tf2):
    # no GPU here: every logical CPU on TF 2.1+ (the fixture's 3), CPU:0 alone on 2.0
    # (ReductionToOneDevice: no collective of TF 2.13+'s default beside ours in this process)
    stock = tf2.distribute.MirroredStrategy(cross_device_ops=tf2.distribute.ReductionToOneDevice())
    ours = safestrategy.make_mirrored_strategy()
    assert ours.extended.worker_devices == stock.extended.worker_devices
    assert ours.num_replicas_in_sync == stock.num_replicas_in_sync
    replicas = LOGICAL_CPUS if Version(tf2.__version__).release[:2] >= (2, 1) else 1
    assert stock.num_replicas_in_sync == replicas
    assert safestrategy.last_report().devices == tuple(f"/device:CPU:{i}" for i in range(replicas))


BESIDE_YOUR_DEFAULT_STRATEGY = """
import tensorflow as tf
import safestrategy
from safestrategy._tf import configure_logical_cpus
from tests.conftest import all_reduced, cpus

configure_logical_cpus(tf, 3)
yours = tf.distribute.MirroredStrategy(cpus(2))  # TF's own default cross-device ops
extended = yours.extended
default = extended._cross_device_ops or getattr(extended, "_inferred_cross_device_ops", None)
print("default", type(default).__name__)
print("yours", all_reduced(tf, yours)[0][1][0])
ours = safestrategy.make_mirrored_strategy(cpus(3))
print("ours", safestrategy.last_report().backend, all_reduced(tf, ours)[0][1][0])
print("yours", all_reduced(tf, yours)[0][1][0])
"""


def test_your_own_default_strategy_still_works_beside_ours(tf2):
    # TF 2.13+ defaults to CollectiveAllReduce, and two such strategies of different
    # sizes in one process fail with "InternalError ... group_key": the probe must
    # never build a throw-away default strategy in the caller's process.
    done = run_python("-c", BESIDE_YOUR_DEFAULT_STRATEGY)
    assert done.returncode == 0, done.stderr[-3000:]
    collective = Version(tf2.__version__).release[:2] >= (2, 13)
    default = "CollectiveAllReduce" if collective else "ReductionToOneDevice"
    assert done.stdout.splitlines()[-4:] == [
        f"default {default}",
        "yours 3.0",
        "ours reduce_to_cpu 6.0",
        "yours 3.0",
    ]


# --- checks in the caller's process, honest about devices (0.2) --------------------------


def test_only_nccl_may_start_a_probe_process(tf2, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a probe process was started")

    monkeypatch.setattr(_probe, "ProbeProcess", refuse)
    safestrategy.make_mirrored_strategy(cpus(3))
    assert safestrategy.last_report().backend == "reduce_to_cpu"


def test_a_probe_process_that_cannot_start_costs_nothing_without_nccl(tf2, monkeypatch):
    monkeypatch.setattr(_probe, "CHILD_COMMAND", ["/nonexistent/python"])
    strategy = safestrategy.make_mirrored_strategy(cpus(2), backend="nccl,reduce_to_cpu")
    assert strategy.num_replicas_in_sync == 2


@pytest.mark.parametrize(
    "devices, missing",
    [
        (["/gpu:0", "/gpu:1"], "devices /device:GPU:0, /device:GPU:1 do not exist"),
        (["/cpu:0", "/cpu:5"], "device /device:CPU:5 does not exist"),
    ],
)
def test_devices_tensorflow_does_not_have_are_an_error_before_any_check(
    tf2, monkeypatch, devices, missing
):
    no_checks(monkeypatch)
    with pytest.raises(ValueError, match=missing) as error:
        safestrategy.probe(devices)
    assert "TensorFlow has /device:CPU:0, /device:CPU:1, /device:CPU:2" in str(error.value)
    if "GPU" in missing:
        assert "list_physical_devices('GPU')" in str(error.value)


def test_checks_leave_the_callers_settings_as_they_were(tf2):
    tf2.config.set_soft_device_placement(True)
    before = tf2.config.list_logical_devices()
    safestrategy.make_mirrored_strategy(cpus(3), backend="hierarchical_copy,reduce_to_cpu")
    assert tf2.config.get_soft_device_placement() is True
    assert tf2.config.list_logical_devices() == before


def test_reduce_to_gpu_without_a_gpu_fails_in_every_mode(tf2):
    report = safestrategy.probe(cpus(2), backend="reduce_to_gpu,reduce_to_cpu")
    assert report.candidates[0][:3] == ("reduce_to_gpu", "failed", "no GPU among the devices")
    assert report.backend == "reduce_to_cpu"


def test_one_warning_per_decision_and_quiet_when_remembered(tf2, monkeypatch, caplog):
    monkeypatch.setenv("SAFESTRATEGY_BACKEND", "nccl,reduce_to_cpu")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        safestrategy.make_mirrored_strategy(cpus(2))
        safestrategy.make_mirrored_strategy(cpus(2))
    fallback = "all-reduce backend nccl failed"
    ours = [r for r in caplog.records if r.name == LOGGER and fallback in r.getMessage()]
    assert [r.levelno for r in ours] == [logging.WARNING, logging.DEBUG]


def test_unknown_keyword_arguments_are_refused_before_any_check(tf2, monkeypatch):
    no_checks(monkeypatch)
    with pytest.raises(TypeError, match=r"unexpected keyword argument.*cross_devices_ops"):
        safestrategy.make_mirrored_strategy(cpus(2), cross_devices_ops=None)
