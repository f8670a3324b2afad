"""The factory on real TensorFlow 1.x (1.12 contrib, 1.13, 1.15), graph mode.

Each replica trains a linear model on its slice of a fixed batch; gradients
are summed by the strategy's cross-device ops (``apply_gradients`` in replica
context), so a wrong or missing all-reduce shows up in the weights.
"""

import logging

import numpy as np
import pytest

import safestrategy
from safestrategy.choose import fastest

from .conftest import cpus, session_config

SEED_ERROR = "No OpKernel was registered to support Op 'NcclAllReduce'"
BATCH, STEPS = 6, 5
RNG = np.random.RandomState(0)
X = RNG.randn(BATCH, 3).astype(np.float32)
Y = (X.dot(np.array([[1.0], [-2.0], [0.5]], np.float32)) + 0.3).astype(np.float32)


def contrib(tf):
    return tf.__version__.startswith("1.12")


def mean_squared_loss(tf, x, y):
    w = tf.get_variable("w", [3, 1], initializer=tf.zeros_initializer())
    b = tf.get_variable("b", [1], initializer=tf.zeros_initializer())
    return tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))


def train(tf, make_strategy, n):
    """Weights after STEPS steps: each of ``n`` replicas sees BATCH / n rows."""
    per = BATCH // n
    with tf.Graph().as_default():
        strategy = make_strategy()

        def step():
            if contrib(tf):
                replica = tf.contrib.distribute.get_tower_context().tower_id
            else:
                replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            rows = slice(replica * per, (replica + 1) * per)
            loss = mean_squared_loss(tf, tf.constant(X)[rows], tf.constant(Y)[rows]) / n
            variables = tf.trainable_variables()
            optimizer = tf.train.GradientDescentOptimizer(0.1)
            return optimizer.apply_gradients(zip(tf.gradients(loss, variables), variables))

        with strategy.scope():
            if contrib(tf):
                train_op = tf.group(*strategy.unwrap(strategy.call_for_each_tower(step)))
            else:
                result = strategy.extended.call_for_each_replica(step)
                unwrap = getattr(strategy, "experimental_local_results", None) or strategy.unwrap
                train_op = tf.group(*unwrap(result))
        with tf.Session(config=session_config(tf, n)) as session:
            session.run(tf.global_variables_initializer())
            for _ in range(STEPS):
                session.run(train_op)
            return session.run(tf.trainable_variables())


@pytest.fixture(scope="module")
def single_device_weights(tf1):
    with tf1.Graph().as_default():
        loss = mean_squared_loss(tf1, tf1.constant(X), tf1.constant(Y))
        train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            for _ in range(STEPS):
                session.run(train_op)
            return session.run(tf1.trainable_variables())


def assert_trains_like_one_device(tf, make_strategy, n, expected):
    for got, want in zip(train(tf, make_strategy, n), expected):
        np.testing.assert_allclose(got, want, atol=1e-5)


def plain_nccl_strategy(tf, devices):
    """MirroredStrategy with NCCL, spelled as users of each TF 1.x release spell it."""
    if contrib(tf):
        ops = tf.contrib.distribute.AllReduceCrossTowerOps("nccl")
        return tf.contrib.distribute.MirroredStrategy(devices, cross_tower_ops=ops)
    if tf.__version__.startswith("1.13"):
        ops = tf.contrib.distribute.AllReduceCrossDeviceOps("nccl")
    else:
        ops = tf.distribute.NcclAllReduce()
    return tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)


def test_the_seed_error_is_real_with_plain_mirrored_strategy(tf1):
    with pytest.raises(tf1.errors.InvalidArgumentError, match=SEED_ERROR):
        train(tf1, lambda: plain_nccl_strategy(tf1, cpus(2)), 2)


@pytest.mark.parametrize("n", [2, 3])
def test_auto_trains_like_one_device(tf1, single_device_weights, n):
    reports = []

    def make():
        strategy = safestrategy.make_mirrored_strategy(cpus(n))
        reports.append(safestrategy.last_report())
        return strategy

    assert_trains_like_one_device(tf1, make, n, single_device_weights)
    (report,) = reports
    assert report.tf_api == ("tf1-contrib" if contrib(tf1) else "tf1")
    by_name = {c.name: c for c in report.candidates}
    assert "MirroredStrategy default is" in by_name["collective"].reason  # skipped on TF 1.x
    if n == 3:
        assert report.backend == "reduce_to_cpu"  # the only one that passed: not timed
        assert "expected 6 on each of 3 replicas, got [3.0" in by_name["hierarchical_copy"].reason
    else:  # both pass: the race decides, by the 3 % rule, with the report's words
        timed = [(c.name, c.ms) for c in report.candidates if c.ms is not None]
        assert len(timed) == 2 and (report.backend, report.reason) == fastest(timed)


def test_env_list_runs_the_real_nccl_check_and_falls_back(
    tf1, single_device_weights, monkeypatch, caplog
):
    monkeypatch.setenv("SAFESTRATEGY_BACKEND", "nccl,reduce_to_cpu")
    with caplog.at_level(logging.WARNING, logger="safestrategy"):
        assert_trains_like_one_device(
            tf1, lambda: safestrategy.make_mirrored_strategy(cpus(2)), 2, single_device_weights
        )
    report = safestrategy.last_report()
    assert (report.backend, report.candidates[0].status) == ("reduce_to_cpu", "failed")
    assert SEED_ERROR in report.candidates[0].reason
    (warning,) = [r for r in caplog.records if r.name == "safestrategy"]
    assert "nccl failed" in warning.getMessage()


def test_forced_hierarchical_copy_on_three_devices_is_refused(tf1):
    with pytest.raises(safestrategy.NoWorkingBackendError, match="expected 6"):
        safestrategy.make_mirrored_strategy(cpus(3), backend="hierarchical_copy")


def test_by_default_it_mirrors_over_what_stock_mirrored_strategy_does(tf1):
    # TF 1.x counts GPUs (none here), else takes /device:CPU:0 alone, even where the
    # session has two CPUs. Ours first: on 1.15 it counts before TF's runtime has started.
    module = tf1.contrib.distribute if contrib(tf1) else tf1.distribute

    def devices(strategy):
        return tuple(getattr(strategy, "extended", strategy).worker_devices)

    def replicas(strategy):
        return getattr(strategy, "num_replicas_in_sync", None) or strategy.num_towers

    with tf1.Graph().as_default(), tf1.Session(config=session_config(tf1, 2)):
        ours, stock = safestrategy.make_mirrored_strategy(), module.MirroredStrategy()
        assert (devices(ours), replicas(ours)) == (devices(stock), replicas(stock))
    assert safestrategy.last_report().devices == ("/device:CPU:0",)


def test_the_strategy_class_matches_the_tf_era(tf1):
    strategy = safestrategy.make_mirrored_strategy(cpus(2), backend="reduce_to_cpu")
    module = tf1.contrib.distribute if contrib(tf1) else tf1.distribute
    assert isinstance(strategy, module.MirroredStrategy)


def test_cpu_sets_are_checked_here_without_a_probe_process(tf1, monkeypatch):
    from safestrategy.checks import probe as _probe

    def refuse(*args, **kwargs):
        raise AssertionError("a probe process was started")

    monkeypatch.setattr(_probe, "ProbeProcess", refuse)
    assert safestrategy.probe(cpus(3)).backend == "reduce_to_cpu"


def test_gpu_sets_are_checked_in_the_probe_process_so_no_session_fixes_gpu_options(tf1, fake):
    # A tf.Session made here would fix the process-wide GPU options before the caller's.
    fake("ok")
    report = safestrategy.probe(["/gpu:0", "/gpu:1"], backend="hierarchical_copy,reduce_to_cpu")
    assert (report.backend, report.candidates[0].status) == ("hierarchical_copy", "ok")
    assert fake.starts() == ["start"]  # the fake probe process answered, not this process


def test_inside_another_strategys_scope_the_checks_run_and_sum_right(tf1):
    # TF2 eager failed here ("Mixing different tf.distribute.Strategy objects"); TF 1.12 and
    # 1.15 did not (each check builds a graph of its own). The checks, now in a thread of
    # their own, must still run and judge right here.
    module = tf1.contrib.distribute if contrib(tf1) else tf1.distribute
    with tf1.Graph().as_default(), module.MirroredStrategy(["/cpu:0"]).scope():
        report = safestrategy.probe(cpus(3))
    assert report.backend == "reduce_to_cpu"
    hierarchical = next(c for c in report.candidates if c.name == "hierarchical_copy")
    assert "expected 6 on each of 3 replicas, got [3.0" in hierarchical.reason
