"""The checks hold where the strategy is used (TF 2.x, 3 logical CPUs).

- Graph mode, in each of its forms, is checked through the path graph-mode
  training takes (``batch_reduce_to``), and remembered apart from eager mode.
- No check changes what another thread sees (soft placement included).
- A check runs outside the caller's strategy scope.
"""

import json
import threading
import time

import pytest

import safestrategy
from safestrategy import factory
from safestrategy._devices import parse_device
from safestrategy.checks import allreduce as _allreduce

from .conftest import all_reduced, cpus, run_python

LISTED = "hierarchical_copy,reduce_to_cpu"
LEARNING_RATE = 0.1


def graph_training(tf, strategy):
    """Training's own graph-mode paths, in a graph and v1 Session of their own.

    Replica *i* contributes *i + 1* to ``ReplicaContext.all_reduce`` and as the
    gradient of a mirrored weight starting at 0 in one SGD step. Returns every
    replica's sum and the weight after the step (``-LEARNING_RATE * sum``).
    """
    v1 = tf.compat.v1
    with tf.Graph().as_default():
        with strategy.scope():
            weight = v1.get_variable("w", [], initializer=v1.zeros_initializer())

            def step():
                context = tf.distribute.get_replica_context()
                contribution = tf.cast(context.replica_id_in_sync_group, tf.float32) + 1.0
                summed = context.all_reduce(tf.distribute.ReduceOp.SUM, contribution)
                optimizer = v1.train.GradientDescentOptimizer(LEARNING_RATE)
                return summed, optimizer.apply_gradients([(contribution, weight)])

            summed, train = strategy.extended.call_for_each_replica(step)
            sums = strategy.experimental_local_results(summed)
            train_op = tf.group(*strategy.experimental_local_results(train))
        config = v1.ConfigProto(device_count={"CPU": 3}, allow_soft_placement=False)
        with v1.Session(config=config) as session:
            session.run(v1.global_variables_initializer())
            got = session.run(list(sums))
            session.run(train_op)
            return [float(x) for x in got], float(session.run(weight))


def statuses(report):
    return {c.name: (c.status, c.reason) for c in report.candidates}


def assert_hierarchical_copy_refused(report):
    status, reason = statuses(report)["hierarchical_copy"]
    assert (status, report.backend) == ("failed", "reduce_to_cpu"), report
    assert "expected 6 on each of 3 replicas, got [3.0" in reason


# --- graph mode drives batch_reduce_to (issue 13, item 2) ----------------------------------


def test_graph_mode_training_really_sums_wrong_with_hierarchical_copy(tf2):
    # What the checks must catch: TF's own strategy, in graph mode, drops a replica.
    ops = tf2.distribute.HierarchicalCopyAllReduce()
    plain = tf2.distribute.MirroredStrategy(cpus(3), cross_device_ops=ops)
    assert graph_training(tf2, plain) == ([3.0] * 3, pytest.approx(-0.3))


def test_inside_a_graph_hierarchical_copy_is_refused_and_the_strategy_sums_right(tf2):
    with tf2.Graph().as_default():
        strategy = safestrategy.make_mirrored_strategy(cpus(3), backend=LISTED)
        assert_hierarchical_copy_refused(safestrategy.last_report())
        sums, weight = graph_training(tf2, strategy)
    assert sums == [6.0] * 3
    assert weight == pytest.approx(-LEARNING_RATE * 6)


def test_while_a_tf_function_is_traced_hierarchical_copy_is_refused(tf2):
    made = []

    @tf2.function(autograph=False)
    def traced():
        made.append(safestrategy.make_mirrored_strategy(cpus(3), backend=LISTED))
        return tf2.constant(0.0)

    traced()
    assert_hierarchical_copy_refused(safestrategy.last_report())
    (strategy,) = made
    assert [numbers[0] for _, numbers in all_reduced(tf2, strategy)] == [6.0] * 3
    assert graph_training(tf2, strategy)[0] == [6.0] * 3


EAGER_DISABLED = """
import json
import tensorflow as tf
import safestrategy
from safestrategy._tf import configure_logical_cpus
from tests.conftest import cpus
from tests.test_modes import graph_training

configure_logical_cpus(tf, 3)
tf.compat.v1.disable_eager_execution()  # TF1-style code on TF2: process-wide
strategy = safestrategy.make_mirrored_strategy(cpus(3), backend={backend!r})
report = safestrategy.last_report()
sums, weight = graph_training(tf, strategy)
print(json.dumps([report.backend, [[c.name, c.status, c.reason] for c in report.candidates],
                  sums, weight]))
"""


@pytest.mark.parametrize("backend", [LISTED, "auto"])
def test_with_eager_execution_disabled_hierarchical_copy_is_refused(tf2, backend):
    done = run_python("-c", EAGER_DISABLED.format(backend=backend))
    assert done.returncode == 0, done.stderr[-3000:]
    chosen, candidates, sums, weight = json.loads(done.stdout.splitlines()[-1])
    (hierarchical,) = [c for c in candidates if c[0] == "hierarchical_copy"]
    assert (chosen, hierarchical[1]) == ("reduce_to_cpu", "failed")
    assert "expected 6 on each of 3 replicas, got [3.0" in hierarchical[2]
    assert sums == [6.0] * 3
    assert weight == pytest.approx(-LEARNING_RATE * 6)


def test_graph_and_eager_decisions_are_remembered_apart(tf2):
    def fresh():
        return factory.decide(cpus(2), backend=LISTED)[1]

    with tf2.Graph().as_default():
        assert fresh()
    assert fresh()  # an eager caller does not reuse the graph-mode decision...
    with tf2.Graph().as_default():
        assert not fresh()  # ...and each mode keeps its own
    assert not fresh()


# --- no check touches another thread's settings (issue 13, item 4) -------------------------


def test_a_result_elsewhere_than_asked_fails_with_the_reason():
    host = "/job:localhost/replica:0/task:0/device:CPU:0"
    # TF reports a tf.function's results in host memory on the host CPU, whichever CPU
    _allreduce.check_placement([(host, [3.0]), (host, [3.0])], ["/cpu:0", "/cpu:1"])
    gpu1 = "/job:localhost/replica:0/task:0/device:GPU:1"
    _allreduce.check_placement([(gpu1, [3.0])], ["/gpu:1"])
    for placed, asked in [(host, "/gpu:0"), (gpu1, "/gpu:0"), ("", "/cpu:0"), (gpu1, "/cpu:1")]:
        with pytest.raises(_allreduce.PlacementError, match="placed on") as error:
            _allreduce.check_placement([(placed, [3.0])], [asked])
        assert str(parse_device(asked)) in str(error.value)


def test_a_check_soft_placed_elsewhere_fails_and_leaves_soft_placement_alone(tf2):
    # No GPU here: with TF's default soft placement both "GPU" replicas run on the CPU
    # and sum right; only where the results were placed shows it.
    assert tf2.config.get_soft_device_placement() is True
    result = _allreduce.smoke_check(tf2, "distribute", ["/gpu:0", "/gpu:1"], "reduce_to_cpu")
    assert result.status == "failed"
    assert result.reason.startswith("PlacementError: the result for /device:GPU:0 was placed on")
    assert tf2.config.get_soft_device_placement() is True


def test_two_factories_at_once_beside_a_training_thread_change_nothing_it_sees(tf2):
    assert tf2.config.get_soft_device_placement() is True  # TF's default
    weight = tf2.Variable(1.0)
    stop, seen, errors, steps = threading.Event(), set(), [], []

    def training():  # code written for a GPU box, running on CPUs by soft placement
        while not stop.is_set():
            seen.add(tf2.config.get_soft_device_placement())
            try:
                with tf2.device("/gpu:0"):
                    weight.assign_sub(0.0 * tf2.reduce_sum(weight))
                steps.append(1)
            except Exception as error:
                errors.append(f"{type(error).__name__}: {error}"[:200])

    def factory_call(n, made):
        made[n] = safestrategy.make_mirrored_strategy(cpus(n))

    trainer = threading.Thread(target=training)
    trainer.start()
    try:
        for _ in range(3):
            factory._decisions.clear()  # check again: a remembered decision checks nothing
            made = {}
            calls = [threading.Thread(target=factory_call, args=(n, made)) for n in (2, 3)]
            for call in calls:
                call.start()
            for call in calls:
                call.join()
            for n, total in ((2, 3.0), (3, 6.0)):
                values = all_reduced(tf2, made[n])
                assert [numbers[0] for _, numbers in values] == [total] * n
    finally:
        stop.set()
        trainer.join()
    assert errors == []
    assert seen == {True} and steps
    assert tf2.config.get_soft_device_placement() is True


# --- inside another strategy's scope (issue 13, item 7) ------------------------------------


@pytest.mark.parametrize("outer", ["MirroredStrategy", "OneDeviceStrategy"])
def test_inside_another_strategys_scope_the_checks_run_and_the_scope_stays(tf2, outer):
    yours = getattr(tf2.distribute, outer)(["/cpu:0"] if outer == "MirroredStrategy" else "/cpu:0")
    with yours.scope(), tf2.device("/cpu:1"):
        strategy = safestrategy.make_mirrored_strategy(cpus(3))
        assert tf2.distribute.get_strategy() is yours
    report = safestrategy.last_report()
    assert_hierarchical_copy_refused(report)
    assert "Mixing" not in str(report)
    values = all_reduced(tf2, strategy)
    assert [numbers[0] for _, numbers in values] == [6.0] * 3


def test_a_check_runs_in_a_thread_of_its_own_and_hands_back_its_exception():
    callers = threading.get_ident()
    assert _allreduce.in_fresh_thread(threading.get_ident) != callers

    def fail():
        raise KeyError("from the check")

    with pytest.raises(KeyError, match="from the check"):
        _allreduce.in_fresh_thread(fail)


def test_a_bounded_check_is_abandoned_at_its_bound_and_ticks_while_it_waits():
    never, ticks = threading.Event(), []
    started = time.monotonic()
    with pytest.raises(_allreduce.Abandoned, match=r"no answer in 0\.5 s"):
        _allreduce.in_fresh_thread(never.wait, 0.5, lambda: ticks.append(1), every=0.1)
    never.set()
    assert 0.5 <= time.monotonic() - started < 2.0
    assert 3 <= len(ticks) <= 5  # a tick each tenth of a second it waited
    assert _allreduce.in_fresh_thread(lambda: 7, 0.5, ticks.clear, every=0.1) == 7
