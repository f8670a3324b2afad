"""The pure decision: hand-built devices and fake check results, no TensorFlow."""

from safestrategy._devices import parse_devices
from safestrategy._env import resolve_backend
from safestrategy.backends import Applicability, unavailable
from safestrategy.choose import (
    CACHED_TIMINGS,
    SINGLE_DEVICE_REASON,
    Decision,
    Planned,
    decide,
    failure_message,
    fastest,
    plan,
    single_device,
)
from safestrategy.report import CandidateResult

GPUS = parse_devices(["/gpu:0", "/gpu:1"])
CPUS = parse_devices(["/cpu:0", "/cpu:1", "/cpu:2"])


AUTO = resolve_backend(None, {})
NOT_DEFAULT = {"collective": "TF 2.12's MirroredStrategy default is NcclAllReduce"}


def skips(devices, extra=None):
    """What cannot apply to ``devices`` where collective is TF's default (RING), and
    ``extra``: the chooser's ``unavailable``, as the factory passes it."""
    return {**unavailable(devices, Applicability("RING", "")), **(extra or {})}


def checker(outcomes):
    """A fake smoke check: ``outcomes[name]`` is the status; records the call order."""
    calls = []

    def check(name):
        calls.append(name)
        return CandidateResult(name, outcomes.get(name, "ok"), "fake", 0.1)

    return check, calls


def timer(ms):
    """A fake timer: ``ms[name]`` milliseconds (None: could not be timed); records calls."""
    calls = []

    def time(names):
        calls.extend(names)
        return {name: ms[name] for name in names}

    return time, calls


def test_auto_skips_gpu_only_backends_without_a_gpu():
    assert plan(resolve_backend("auto", {}), skips(CPUS)) == (
        Planned("collective"),
        Planned("nccl", "no GPU among the devices"),
        Planned("hierarchical_copy"),
        Planned("reduce_to_gpu", "no GPU among the devices"),
        Planned("reduce_to_cpu"),
    )
    assert all(p.skip is None for p in plan(resolve_backend("auto", {}), skips(GPUS)))


def test_a_list_skips_nothing_and_keeps_its_order():
    setting = resolve_backend("reduce_to_gpu,nccl", {})
    assert plan(setting, skips(CPUS)) == (Planned("reduce_to_gpu"), Planned("nccl"))


def test_auto_skips_collective_where_it_is_not_tfs_default_but_a_list_tries_it():
    assert plan(AUTO, skips(GPUS, NOT_DEFAULT))[0] == Planned(
        "collective", NOT_DEFAULT["collective"]
    )
    listed = resolve_backend("collective,reduce_to_cpu", {})
    assert plan(listed, skips(CPUS, NOT_DEFAULT))[0] == Planned("collective")


def test_auto_checks_every_candidate_and_takes_the_fastest_that_passed():
    check, calls = checker({"nccl": "failed"})
    time, timed = timer({"collective": 19.3, "hierarchical_copy": 11.6, "reduce_to_gpu": 5.7})
    decision = decide(AUTO, check, time, skips(GPUS, {"reduce_to_cpu": "not here (fake)"}))
    assert decision.backend == "reduce_to_gpu"
    assert calls == ["collective", "nccl", "hierarchical_copy", "reduce_to_gpu"]
    assert timed == ["collective", "hierarchical_copy", "reduce_to_gpu"]  # passed ones only
    assert decision.reason == "fastest: 5.7 ms; hierarchical_copy 11.6 ms, collective 19.3 ms"
    assert [r.ms for r in decision.results] == [19.3, None, 11.6, 5.7, None]
    assert [r.status for r in decision.results] == ["ok", "failed", "ok", "ok", "skipped"]
    assert decision.timed and [r.name for r in decision.fallbacks] == ["nccl"]


def test_within_3_percent_the_earlier_in_the_order_wins():
    assert fastest([("reduce_to_cpu", 5.6), ("hierarchical_copy", 5.7)]) == (
        "hierarchical_copy",
        "5.7 ms, within 3 % of reduce_to_cpu 5.6 ms, earlier in the order",
    )
    # 3 % of 5.6 is 0.168: 5.77 is out, so the fastest wins
    assert fastest([("reduce_to_cpu", 5.6), ("hierarchical_copy", 5.77)])[0] == "reduce_to_cpu"
    # the margin counts from the fastest, and among those within it the order decides
    three = [("reduce_to_cpu", 10.0), ("hierarchical_copy", 10.2), ("collective", 10.29)]
    assert fastest(three) == (
        "collective",
        "10.3 ms, within 3 % of reduce_to_cpu 10.0 ms, earlier in the order; "
        "hierarchical_copy 10.2 ms",
    )


def test_the_rule_is_deterministic_whatever_order_the_timings_come_in():
    pairs = [("reduce_to_cpu", 8.0), ("collective", 8.0), ("hierarchical_copy", 7.9)]
    assert {fastest(list(p))[0] for p in (pairs, pairs[::-1], pairs[1:] + pairs[:1])} == {
        "collective"
    }


def test_candidates_that_could_not_be_timed_rank_after_the_timed_ones():
    check, _ = checker({})
    time, _ = timer({"collective": None, "hierarchical_copy": 9.0, "reduce_to_cpu": 12.0})
    assert decide(AUTO, check, time, skips(CPUS)).backend == "hierarchical_copy"
    time, _ = timer({"collective": None, "hierarchical_copy": None, "reduce_to_cpu": None})
    untimed = decide(AUTO, check, time, skips(CPUS))
    assert untimed.backend == "collective" and "none could be timed" in untimed.reason


def test_one_passing_candidate_is_not_timed():
    check, _ = checker({"collective": "failed", "hierarchical_copy": "failed"})
    time, timed = timer({})
    decision = decide(AUTO, check, time, skips(CPUS))
    assert (decision.backend, timed, decision.timed) == ("reduce_to_cpu", [], False)
    assert decision.reason == (
        "the only candidate that passed its all-reduce smoke check "
        "(after collective, hierarchical_copy failed)"
    )


def test_a_list_takes_the_first_that_passes_in_its_order_and_times_nothing():
    check, calls = checker({"reduce_to_gpu": "failed"})
    time, timed = timer({})
    decision = decide(
        resolve_backend("reduce_to_gpu,nccl,collective", {}), check, time, skips(GPUS)
    )
    assert (decision.backend, calls, timed) == ("nccl", ["reduce_to_gpu", "nccl"], [])
    assert [r.status for r in decision.results] == ["failed", "ok", "not_tried"]
    assert (
        decision.reason == "first candidate that passed its all-reduce smoke check "
        "(after reduce_to_gpu failed)"
    )


def test_a_forced_collective_fails_with_the_reason_its_check_gives():
    check = lambda name: CandidateResult(name, "failed", NOT_DEFAULT[name])  # noqa: E731
    decision = decide(resolve_backend("collective", {}), check, None, skips(CPUS, NOT_DEFAULT))
    assert decision.backend is None
    assert decision.results[0].reason == NOT_DEFAULT["collective"]


def remembered():
    results = (
        CandidateResult("collective", "ok", "right", 0.2, ms=19.3),
        CandidateResult("hierarchical_copy", "ok", "right", 0.1, ms=11.6),
        CandidateResult("reduce_to_cpu", "ok", "right", 0.1, ms=5.7),
    )
    return Decision("reduce_to_cpu", "fastest: 5.7 ms; ...", results, timed=True)


def test_remembered_timings_check_only_the_winner_and_time_nothing():
    check, calls = checker({})
    time, timed = timer({})
    decision = decide(AUTO, check, time, skips(CPUS), remembered())
    assert (decision.backend, calls, timed) == ("reduce_to_cpu", ["reduce_to_cpu"], [])
    assert decision.warm and not decision.timed
    assert decision.reason == f"fastest: 5.7 ms; ... ({CACHED_TIMINGS})"  # not this run's
    assert [(r.cached, r.ms) for r in decision.results] == [
        (True, 19.3),
        (True, 11.6),
        (False, 5.7),  # its verdict is fresh: it was checked now
    ]


def test_a_remembered_winner_that_fails_now_makes_the_whole_choice_run_again():
    check, calls = checker({"reduce_to_cpu": "failed"})
    time, timed = timer({"collective": 19.0, "hierarchical_copy": 11.0})
    decision = decide(AUTO, check, time, skips(CPUS), remembered())
    assert decision.backend == "hierarchical_copy" and not decision.warm and decision.timed
    assert calls == ["reduce_to_cpu", "collective", "hierarchical_copy"]  # not re-checked
    assert timed == ["collective", "hierarchical_copy"]


def test_a_list_ignores_remembered_timings():
    check, calls = checker({})
    decision = decide(
        resolve_backend("hierarchical_copy", {}), check, None, skips(CPUS), remembered()
    )
    assert (decision.backend, calls) == ("hierarchical_copy", ["hierarchical_copy"])


def test_auto_on_cpus_lands_on_reduce_to_cpu_when_the_others_fail():
    check, calls = checker({"collective": "failed", "hierarchical_copy": "failed"})
    decision = decide(AUTO, check, None, skips(CPUS))
    assert decision.backend == "reduce_to_cpu"
    assert calls == ["collective", "hierarchical_copy", "reduce_to_cpu"]
    assert [r.status for r in decision.results] == ["failed", "skipped", "failed", "skipped", "ok"]


def test_forced_failure_chooses_nothing():
    check, _ = checker({"reduce_to_cpu": "timeout"})
    decision = decide(resolve_backend("reduce_to_cpu", {}), check, None, skips(CPUS))
    assert decision.backend is None
    message = failure_message(CPUS, decision.results, resolve_backend("reduce_to_cpu", {}))
    assert "reduce_to_cpu: timeout: fake" in message
    assert "pass another backend=" in message and "SAFESTRATEGY_BACKEND" not in message


def test_the_failure_message_names_the_override_the_caller_can_use():
    from_env = resolve_backend(None, {"SAFESTRATEGY_BACKEND": "reduce_to_cpu"})
    message = failure_message(CPUS, (), from_env)
    assert "set SAFESTRATEGY_BACKEND" in message


def test_one_device_checks_nothing_and_never_picks_nccl():
    one_gpu = single_device(resolve_backend(None, {}), GPUS[0])
    one_cpu = single_device(resolve_backend(None, {}), CPUS[0])
    forced = single_device(resolve_backend("nccl", {}), GPUS[0])
    assert (one_gpu.backend, one_cpu.backend, forced.backend) == (
        "reduce_to_gpu",
        "reduce_to_cpu",
        "nccl",
    )
    assert {r.status for r in one_gpu.results} == {"not_tried"}
    assert one_gpu.reason == SINGLE_DEVICE_REASON
