"""The ``collective`` candidate: TF's own default since 2.13, on keys no stock strategy uses."""

import textwrap

import pytest

from safestrategy._devices import parse_devices
from safestrategy.backends import collective_applies as applies

from .conftest import cpus, run_python

CPUS = parse_devices(["/cpu:0", "/cpu:1"])
GPUS = parse_devices(["/gpu:0", "/gpu:1"])
MIXED = parse_devices(["/cpu:0", "/gpu:0"])


def test_tfs_default_rule_as_tf_decides_it():
    assert applies("2.21.0", "distribute", CPUS, True, False).implementation == "RING"
    assert applies("2.13.0", "distribute", GPUS, True, False).implementation == "NCCL"
    assert applies("2.21.0", "distribute", GPUS, True, True).implementation == "RING"  # virtual
    assert applies("2.21.0", "distribute", GPUS, False, False).implementation == "NCCL"  # graph
    for devices, eager, why in (
        (
            CPUS,
            False,
            "in TF2 graph mode on CPUs MirroredStrategy's default is ReductionToOneDevice",
        ),
        (
            MIXED,
            True,
            "on a set that mixes CPUs and GPUs MirroredStrategy's default is ReductionToOneDevice",
        ),
    ):
        assert applies("2.21.0", "distribute", devices, eager, False) == (None, why)


def test_older_tensorflow_names_its_own_default():
    assert applies("2.12.1", "distribute", GPUS, True, False).reason == (
        "TF 2.12.1's MirroredStrategy default is NcclAllReduce"
    )
    assert applies("2.10.1", "distribute", CPUS, True, False).reason == (
        "TF 2.10.1's MirroredStrategy default is ReductionToOneDevice"
    )
    assert applies("1.12.0", "contrib-tower", GPUS, False, False).reason == (
        "TF 1.12.0's MirroredStrategy default is AllReduceCrossTowerOps('nccl')"
    )


def collective_or_skip_reason(tf):
    from safestrategy import backends

    return backends.collective_live(tf, parse_devices(cpus(2)))


def test_auto_races_collective_where_it_is_the_default_and_skips_it_elsewhere(tf2):
    import safestrategy

    report = safestrategy.probe(cpus(2))
    collective = report.candidates[0]
    assert collective.name == "collective"
    applicable = collective_or_skip_reason(tf2)
    if applicable.implementation is None:  # TF < 2.13
        assert (collective.status, collective.reason) == ("skipped", applicable.reason)
        assert "MirroredStrategy default is ReductionToOneDevice" in collective.reason
    else:
        assert collective.status == "ok"
        assert collective.reason == "all 2 replicas got the right sum (RING requested)"
        assert collective.ms is not None and collective.ms > 0


def test_a_forced_collective_fails_with_the_reason_where_it_is_not_the_default(tf2):
    import safestrategy

    applicable = collective_or_skip_reason(tf2)
    if applicable.implementation is not None:
        strategy = safestrategy.make_mirrored_strategy(cpus(2), backend="collective")
        ops = strategy.extended._cross_device_ops
        assert type(ops).__name__ == "CollectiveAllReduce"
        assert ops._options.implementation.name == "RING"
        assert ops._options.timeout_seconds is None  # training keeps TF's default: none
        return
    with pytest.raises(safestrategy.NoWorkingBackendError, match="default is Reduction"):
        safestrategy.make_mirrored_strategy(cpus(2), backend="collective")


#: Trains a tiny Keras-free step on a strategy and prints the summed gradient-like value.
_TRAIN = """
import sys
sys.path.insert(0, {root!r})
import tensorflow as tf
from safestrategy._tf import configure_logical_cpus
configure_logical_cpus(tf, 3)
import safestrategy

def step_sum(strategy):
    def replica_fn():
        context = tf.distribute.get_replica_context()
        value = tf.cast(context.replica_id_in_sync_group, tf.float32) + 1.0
        return context.all_reduce("sum", tf.fill([4], value))
    result = strategy.run(tf.function(replica_fn, autograph=False))
    return [float(t.numpy()[0]) for t in strategy.experimental_local_results(result)]
"""


def run_script(body, tmp_path):
    from .conftest import ROOT

    script = tmp_path / "script.py"
    script.write_text(_TRAIN.format(root=str(ROOT)) + textwrap.dedent(body))
    env = {"SAFESTRATEGY_CACHE_DIR": str(tmp_path / "cache"), "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = run_python(str(script), env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_after_the_factory_a_stock_strategy_on_another_count_trains_as_in_a_fresh_process(
    tf2, tmp_path
):
    out = run_script(
        """
        auto = safestrategy.make_mirrored_strategy(["/cpu:0", "/cpu:1"])
        print("auto", safestrategy.last_report().backend, step_sum(auto))
        try:
            forced = safestrategy.make_mirrored_strategy(["/cpu:0", "/cpu:1"],
                                                         backend="collective")
            print("forced", step_sum(forced))
        except safestrategy.NoWorkingBackendError:
            print("forced", "not the default here")
        stock = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
        print("stock", step_sum(stock))
        again = safestrategy.make_mirrored_strategy(["/cpu:0", "/cpu:1", "/cpu:2"])
        print("again", step_sum(again))
        """,
        tmp_path,
    )
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert lines["stock"] == "[6.0, 6.0, 6.0]"
    assert lines["again"] == "[6.0, 6.0, 6.0]"
    assert lines["auto"].endswith("[3.0, 3.0]")
    assert lines["forced"] in ("[3.0, 3.0]", "not the default here")


def test_stock_tensorflow_alone_collides_across_device_counts(tf2, tmp_path):
    """What the private keys avoid (tensorflow#61314): stock strategies share group keys."""
    from safestrategy._tf import release
    from safestrategy.backends import FIRST_VERSION

    if release(tf2.__version__) < FIRST_VERSION:
        pytest.skip("before TF 2.13 MirroredStrategy's default uses no collective keys")
    out = run_script(
        """
        print("two", step_sum(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])))
        try:
            three = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
            print("three", step_sum(three))
        except Exception as error:
            print("three", "collides" if "group with size" in str(error) else error)
        """,
        tmp_path,
    )
    assert "three collides" in out


def test_tf_honours_a_collective_timeout_locally_and_it_poisons_the_process(tf2, tmp_path):
    """Why a collective check is bounded but never run on a key training uses: TF raises
    at the timeout instead of waiting for a member that never comes, and after that every
    collective in the process is aborted (so a hung check costs the collective backend, not
    the caller's hang)."""
    out = run_script(
        """
        import time
        from safestrategy import backends
        ops = backends.build_collective(tf, ["/cpu:0", "/cpu:1"], "RING", timeout=2.0)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=ops)
        # only replica 0 joins: a group that waits for a member that never comes
        launcher = ops._launchers[0]
        started = time.monotonic()
        try:
            with tf.device("/cpu:0"):
                tf.function(lambda: launcher.all_reduce(tf.ones([4])), autograph=False)()
            print("lone", "returned")
        except Exception as error:
            print("lone", type(error).__name__, round(time.monotonic() - started))
        """,
        tmp_path,
    )
    kind, seconds = out.split("lone ", 1)[1].split()[:2]
    assert kind == "DeadlineExceededError" and int(seconds) < 30


def _collective_or_skip(tf2):
    from safestrategy._tf import release
    from safestrategy.backends import FIRST_VERSION

    if release(tf2.__version__) < FIRST_VERSION:
        pytest.skip("before TF 2.13 collective is not MirroredStrategy's default")


BOUNDED = """
import logging
logging.basicConfig(level=logging.WARNING, format="LOG %(levelname)s %(message)s")
from safestrategy import backends
if {abort!r}:  # a lone member times out: TF aborts every collective of the process
    ops = backends.build_collective(tf, ["/cpu:0", "/cpu:1"], "RING", timeout=1.0)
    try:
        with tf.device("/cpu:0"):
            tf.function(lambda: ops._launchers[0].all_reduce(tf.ones([4])), autograph=False)()
    except tf.errors.DeadlineExceededError:
        pass
report = safestrategy.probe(["/cpu:0", "/cpu:1"], timeout=0.001)
collective = next(c for c in report.candidates if c.name == "collective")
print("chosen", report.backend)
print("collective", collective.status, collective.reason)
print("timings", len(glob.glob(os.path.join(os.environ["SAFESTRATEGY_CACHE_DIR"], "timing-*"))))
print("stock", step_sum(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])))
"""


def test_a_short_probe_timeout_does_not_bound_an_in_process_collective(tf2, tmp_path):
    """Its bound is the larger of 30 s and the probe timeout: with a 1 ms timeout the
    collective still passes, and the caller's own stock strategy trains afterwards."""
    _collective_or_skip(tf2)
    out = run_script("import glob, os\n" + BOUNDED.format(abort=False), tmp_path)
    assert "collective ok all 2 replicas got the right sum" in out
    assert "stock [3.0, 3.0]" in out


def test_an_aborted_collective_says_so_is_not_chosen_and_nothing_is_cached(tf2, tmp_path):
    """If TF has aborted the process's collectives (here a lone member's timeout before the
    probe, deterministic: a 1 ms bound on the check itself was a race the check could win),
    the WARNING says what that means, collective is not chosen, and no timing is cached
    (it was this process's failure, not the machine's)."""
    _collective_or_skip(tf2)
    script = "import glob, os\n" + BOUNDED.format(abort=True).replace(
        'print("stock", step_sum(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])))', ""
    )
    out = run_script(script, tmp_path)
    assert "chosen reduce_to_cpu" in out or "chosen hierarchical_copy" in out
    assert "collective failed TensorFlow's collective ops are now unusable in this process" in out
    assert "timings 0" in out
