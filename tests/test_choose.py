"""The pure decision: hand-built devices and fake check results, no TensorFlow."""

from safestrategy._devices import parse_devices
from safestrategy._env import resolve_backend
from safestrategy.choose import SINGLE_DEVICE_REASON, Planned, decide, failure_message, plan
from safestrategy.report import CandidateResult

GPUS = parse_devices(["/gpu:0", "/gpu:1"])
CPUS = parse_devices(["/cpu:0", "/cpu:1", "/cpu:2"])


def checker(outcomes):
    """A fake smoke check: ``outcomes[name]`` is the status; records the call order."""
    calls = []

    def check(name):
        calls.append(name)
        return CandidateResult(name, outcomes.get(name, "ok"), "fake", 0.1)

    return check, calls


def test_auto_skips_gpu_only_backends_without_a_gpu():
    assert plan(resolve_backend("auto", {}), CPUS) == (
        Planned("nccl", "no GPU among the devices"),
        Planned("hierarchical_copy"),
        Planned("reduce_to_gpu", "no GPU among the devices"),
        Planned("reduce_to_cpu"),
    )
    assert all(p.skip is None for p in plan(resolve_backend("auto", {}), GPUS))


def test_a_list_skips_nothing_and_keeps_its_order():
    setting = resolve_backend("reduce_to_gpu,nccl", {})
    assert plan(setting, CPUS) == (Planned("reduce_to_gpu"), Planned("nccl"))


def test_auto_takes_the_first_that_passes_and_tries_nothing_after():
    check, calls = checker({"nccl": "failed"})
    decision = decide(resolve_backend(None, {}), GPUS, check)
    assert decision.backend == "hierarchical_copy"
    assert calls == ["nccl", "hierarchical_copy"]
    assert [r.status for r in decision.results] == ["failed", "ok", "not_tried", "not_tried"]
    assert [r.name for r in decision.fallbacks] == ["nccl"]
    assert "after nccl failed" in decision.reason


def test_auto_on_cpus_lands_on_reduce_to_cpu_when_hierarchical_copy_is_wrong():
    check, calls = checker({"hierarchical_copy": "failed"})
    decision = decide(resolve_backend(None, {}), CPUS, check)
    assert (decision.backend, calls) == ("reduce_to_cpu", ["hierarchical_copy", "reduce_to_cpu"])
    assert [r.status for r in decision.results] == ["skipped", "failed", "skipped", "ok"]


def test_forced_failure_chooses_nothing():
    check, _ = checker({"reduce_to_cpu": "timeout"})
    decision = decide(resolve_backend("reduce_to_cpu", {}), CPUS, check)
    assert decision.backend is None
    message = failure_message(CPUS, decision.results, resolve_backend("reduce_to_cpu", {}))
    assert "reduce_to_cpu: timeout: fake" in message
    assert "pass another backend=" in message and "SAFESTRATEGY_BACKEND" not in message


def test_the_failure_message_names_the_override_the_caller_can_use():
    from_env = resolve_backend(None, {"SAFESTRATEGY_BACKEND": "reduce_to_cpu"})
    message = failure_message(CPUS, (), from_env)
    assert "set SAFESTRATEGY_BACKEND" in message


def test_one_device_checks_nothing_and_never_picks_nccl():
    check, calls = checker({})
    one_gpu = decide(resolve_backend(None, {}), GPUS[:1], check)
    one_cpu = decide(resolve_backend(None, {}), CPUS[:1], check)
    forced = decide(resolve_backend("nccl", {}), GPUS[:1], check)
    assert (one_gpu.backend, one_cpu.backend, forced.backend) == (
        "reduce_to_gpu",
        "reduce_to_cpu",
        "nccl",
    )
    assert calls == []
    assert {r.status for r in one_gpu.results} == {"not_tried"}
    assert one_gpu.reason == SINGLE_DEVICE_REASON
