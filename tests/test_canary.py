"""The canary (safestrategy.training.canary): its bound, what it says, when none can run,
and its all-reduce on real TensorFlow (a step stuck elsewhere, one stuck in the
all-reduce are tests/test_watchdog.py's)."""

import threading

import pytest

from safestrategy.training import canary

from .conftest import needs_tf, report, result


def test_the_bound_is_five_seconds_and_two_samples_up_to_a_tenth_of_the_timeout_at_most_60():
    assert canary.bound(3.0) == pytest.approx(5 + 2 * 0.6)
    assert canary.bound(60.0) == pytest.approx(15.0)  # 5 + 2 samples of 5 s
    assert canary.bound(600.0) == pytest.approx(60.0)  # a tenth
    assert canary.bound(6000.0) == 60.0


def test_only_a_canary_that_hangs_fails_or_sums_wrong_convicts():
    said = {kind: canary.Answer(kind, 0.004, "why") for kind in canary.KINDS}
    assert [kind for kind, answer in said.items() if answer.convicts] == [
        canary.HUNG,
        canary.FAILED,
        canary.WRONG,
    ]
    assert said[canary.ANSWERED].said() == "the all-reduce answered in 4 ms"
    assert canary.Answer(canary.HUNG, 6.2).said() == "the all-reduce itself did not answer in 6.2 s"
    assert said[canary.NONE].said() == "no all-reduce could be run to check it (why)"


def checked(**fields):
    return report(candidates=(result("nccl", "ok"),), **fields)


@pytest.mark.parametrize(
    "fields, strategy, why",
    [
        ({}, None, "the strategy is gone"),
        ({"tf_version": "1.15.5"}, object(), "TensorFlow 1.x"),
        ({"candidates": (), "backend": "MyOps"}, object(), "your own cross_device_ops (MyOps)"),
        ({"task": "worker:0", "workers": 2}, object(), "multi-worker"),
        ({"devices": ("/device:GPU:0",)}, object(), "one device"),
    ],
)
def test_where_no_canary_can_run_it_says_why_and_runs_nothing(fields, strategy, why):
    built = checked(**fields) if "candidates" not in fields else report(**fields)
    assert why in canary.unavailable(built, strategy)
    answer = canary.run(None, built, strategy, 1.0)  # tf None: nothing may touch it
    assert answer.kind == canary.NONE and not answer.convicts and why in answer.detail


CPUS = ("/device:CPU:0", "/device:CPU:1")


@needs_tf
@pytest.mark.parametrize("backend", ["hierarchical_copy", "reduce_to_cpu", "collective"])
def test_the_canary_answers_through_a_live_strategy_on_two_cpus(tf2, backend):
    import safestrategy

    try:
        strategy = safestrategy.make_mirrored_strategy(list(CPUS), backend=backend)
    except safestrategy.NoWorkingBackendError as error:  # collective before TF 2.13
        pytest.skip(f"{backend} does not apply on this TensorFlow: {error}")
    built = safestrategy.last_report()
    answer = canary.run(tf2, built, strategy, 10.0)
    assert answer.kind == canary.ANSWERED, answer
    assert answer.seconds < 1.0  # answers within a second on 2 logical CPUs
    again = canary.run(tf2, built, strategy, 10.0)  # a second round: its own keys again
    assert again.kind == canary.ANSWERED, again


@needs_tf
def test_a_canary_that_does_not_answer_in_its_bound_is_abandoned_and_convicts(tf2, monkeypatch):
    import safestrategy

    strategy = safestrategy.make_mirrored_strategy(list(CPUS), backend="reduce_to_cpu")
    never = threading.Event()
    monkeypatch.setattr(canary, "_allreduce", lambda tf, built, strategy: never.wait(60))
    answer = canary.run(tf2, safestrategy.last_report(), strategy, 0.5)
    never.set()
    assert (answer.kind, answer.seconds, answer.convicts) == (canary.HUNG, 0.5, True)


@needs_tf
def test_a_wrong_sum_or_an_error_convicts(tf2, monkeypatch):
    import safestrategy

    strategy = safestrategy.make_mirrored_strategy(list(CPUS), backend="reduce_to_cpu")
    built = safestrategy.last_report()
    dropped = [(d, [1.0] * 4) for d in CPUS]  # replica 2's share lost: 1 instead of 3
    monkeypatch.setattr(canary, "_allreduce", lambda tf, b, s: dropped)
    wrong = canary.run(tf2, built, strategy, 5.0)
    assert wrong.kind == canary.WRONG and "expected 3 on each of 2 replicas" in wrong.detail

    def fails(tf, b, s):
        raise RuntimeError("Collective ops is aborted by: peer gone\nmore")

    monkeypatch.setattr(canary, "_allreduce", fails)
    failed = canary.run(tf2, built, strategy, 5.0)
    assert failed.kind == canary.FAILED
    assert failed.detail == "RuntimeError: Collective ops is aborted by: peer gone"
