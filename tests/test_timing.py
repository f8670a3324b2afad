"""auto's race: the payload, timing on real TensorFlow (TF2 eager, TF 1.x session), cached."""

import pytest

import safestrategy
from safestrategy import factory
from safestrategy.checks import allreduce, runner, timing
from safestrategy.choose import CACHED_TIMINGS

from .conftest import cpus


def test_the_payload_is_twenty_mixed_tensors_of_the_given_size():
    sizes = allreduce.payload_sizes(32)
    assert len(sizes) == 20 and sum(sizes) * 4 == 32 * 2**20
    assert sizes[0] < sizes[10] < sizes[-1]


def test_a_batch_all_reduce_is_timed_here(tf):
    from safestrategy._tf import era
    from safestrategy.checks.allreduce import graph_api, session_config

    graph = graph_api(tf)
    config = None if graph is None else session_config(graph, 3, gpus=False)
    ms = timing.median_ms(tf, era(tf.__version__), cpus(3), "reduce_to_cpu", 1.0, config)
    assert 0 < ms < 60_000


def _configs(tf):
    """The session configs to time with: a graph-mode one always, and None (eager) on TF2."""
    from safestrategy.checks.allreduce import session_config

    graph = tf if not tf.__version__.startswith("2.") else tf.compat.v1
    return [session_config(graph, 2, gpus=False)] + ([None] if graph is not tf else [])


def test_the_time_grows_with_the_payload_so_the_reduction_really_ran(tf):
    """A session that fetched only a tf.group of the results timed 32 MB in 0.3 ms on
    TF 1.15: the race compared nothing, and 128x the data took no longer. Done right,
    the fastest of 9 runs takes 16-50x as long in a session and 6.5-10x eager here, quiet
    or beside two busy loops. A machine's hiccups only slow runs down, so the fastest
    runs are compared, against a margin a race that does nothing (1x) cannot pass. (A 3x
    margin on medians failed once on a loaded CI machine: 6.8 vs 15.9 ms eager.)"""
    from safestrategy._tf import era

    small, large = allreduce.payload_sizes(0.5), allreduce.payload_sizes(64)
    for config in _configs(tf):
        times = timing.batches_ms(
            tf,
            era(tf.__version__),
            cpus(2),
            "reduce_to_cpu",
            [small, large],
            config,
            runs=9,
            summary=min,
        )
        assert times[1] > 2 * times[0], (config is None, times)


def test_auto_in_a_tf1_session_races_the_candidates_that_pass(tf1):
    report = safestrategy.probe(cpus(2))
    timed = {c.name: c.ms for c in report.candidates if c.ms is not None}
    assert set(timed) == {"hierarchical_copy", "reduce_to_cpu"}
    assert report.candidates[0].status == "skipped"  # collective: not TF 1.x's default
    assert "MirroredStrategy default is" in report.candidates[0].reason


def refuse_timing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("nothing may be timed here")

    monkeypatch.setattr(allreduce.Race, "times", refuse)


def races_built(monkeypatch):
    """The names of the payload races built from now on (each is tagged ``.name``)."""
    built = []
    real = allreduce.race

    def race(tf, era, devices, name, *args, **kwargs):
        ready = real(tf, era, devices, name, *args, **kwargs)
        ready.name = name
        built.append(name)
        return ready

    monkeypatch.setattr(allreduce, "race", race)
    return built


def test_a_cold_auto_traces_each_candidate_once_its_check_is_the_first_run(tf, monkeypatch):
    """The payload race's first run is the smoke check: no separate small check."""
    built = races_built(monkeypatch)

    def refuse(*args, **kwargs):
        raise AssertionError("a cold race needs no separate smoke check")

    monkeypatch.setattr(allreduce, "smoke_check", refuse)
    report, fresh = factory.decide(cpus(2), cache=False)
    passed = [c.name for c in report.candidates if c.status == "ok"]
    assert fresh and sorted(built) == sorted(passed) and len(passed) >= 2
    assert all(c.ms is not None for c in report.candidates if c.status == "ok")


def test_a_wrong_sum_in_the_payload_race_fails_the_candidate(tf):
    report, _ = factory.decide(cpus(3), cache=False)
    hierarchical = next(c for c in report.candidates if c.name == "hierarchical_copy")
    assert hierarchical.status == "failed" and hierarchical.ms is None
    assert "wrong sum: expected 6 on each of 3 replicas" in hierarchical.reason


def test_a_clear_loser_runs_once_and_the_contenders_run_in_full(tf, monkeypatch):
    """Only candidates within timing.SCREEN (2x) of the fastest first timed run are run
    timing.RUNS times; a clear loser's one run is its time."""
    fake = {"collective": 19.0, "hierarchical_copy": 25.0, "reduce_to_cpu": 10.0}
    races_built(monkeypatch)
    runs = []

    def times(self, count):
        runs.append((self.name, count))
        return [fake[self.name]] * count

    monkeypatch.setattr(allreduce.Race, "times", times)
    report, _ = factory.decide(cpus(2), cache=False)
    timed = {c.name: c.ms for c in report.candidates if c.ms is not None}
    assert timed == {name: ms for name, ms in fake.items() if name in timed}
    assert report.backend == "reduce_to_cpu" and "hierarchical_copy" in timed
    counts = {}
    for name, count in runs:
        counts.setdefault(name, []).append(count)
    assert counts.pop("hierarchical_copy") == [1] and "reduce_to_cpu" in counts
    assert all(each == [1] * timing.RUNS for each in counts.values())


def test_a_warm_launch_checks_only_the_cached_winner_and_times_nothing(tf2, monkeypatch):
    first = safestrategy.probe(cpus(2))
    assert not any(c.cached for c in first.candidates)
    factory._decisions.clear()  # a new process: only the disk remembers
    refuse_timing(monkeypatch)
    checked = []
    real = runner.Runner.__call__
    monkeypatch.setattr(
        runner.Runner, "__call__", lambda self, name: checked.append(name) or real(self, name)
    )
    warm = safestrategy.probe(cpus(2))
    assert checked == [first.backend]
    assert (warm.backend, warm.reason) == (first.backend, f"{first.reason} ({CACHED_TIMINGS})")
    assert [c.ms for c in warm.candidates] == [c.ms for c in first.candidates]
    assert {c.name for c in warm.candidates if c.cached} == {
        c.name for c in first.candidates if c.name != first.backend
    }


def test_a_cached_winner_that_fails_now_drops_the_timings_and_chooses_again(tf2, monkeypatch):
    first = safestrategy.probe(cpus(2))
    factory._decisions.clear()
    real = runner.Runner.__call__

    def winner_breaks(self, name):
        result = real(self, name)
        return (
            result._replace(status="failed", reason="broken now")
            if name == first.backend
            else result
        )

    monkeypatch.setattr(runner.Runner, "__call__", winner_breaks)
    again = safestrategy.probe(cpus(2))
    assert again.backend != first.backend
    assert not any(c.cached for c in again.candidates)


@pytest.mark.parametrize("switch", ["cache", "refresh"])
def test_cache_off_and_refresh_time_again(tf2, monkeypatch, switch):
    safestrategy.probe(cpus(2))
    factory._decisions.clear()
    if switch == "cache":
        monkeypatch.setenv("SAFESTRATEGY_CACHE", "off")
    timed = races_built(monkeypatch)
    report, fresh = factory.decide(cpus(2), refresh=switch == "refresh")
    assert fresh and len(timed) >= 2 and not any(c.cached for c in report.candidates)


def test_a_list_times_nothing(tf2, monkeypatch):
    refuse_timing(monkeypatch)
    report = safestrategy.probe(cpus(2), backend="hierarchical_copy,reduce_to_cpu")
    assert report.backend == "hierarchical_copy" and report.payload_mb is None


def test_the_candidates_take_turns_so_none_gains_from_running_first(tf, monkeypatch):
    """One run of each, then the next run of each, each round starting one later: a fixed
    back-to-back order gave the first 4-5 % on this machine, more than the 3 % margin."""
    fake = {"collective": 10.0, "hierarchical_copy": 10.4, "reduce_to_cpu": 10.2}
    races_built(monkeypatch)
    runs = []

    def times(self, count):
        runs.extend([self.name] * count)
        return [fake[self.name]] * count

    monkeypatch.setattr(allreduce.Race, "times", times)
    report, _ = factory.decide(cpus(2), cache=False)
    timed = [c.name for c in report.candidates if c.ms is not None]
    assert len(timed) >= 2 and len(runs) == len(timed) * timing.RUNS
    rounds = [runs[i : i + len(timed)] for i in range(0, len(runs), len(timed))]
    assert all(sorted(each) == sorted(timed) for each in rounds)  # everyone once per round
    assert len({each[0] for each in rounds}) == len(timed)  # and each leads a round in turn


GPUS = ["/gpu:0", "/gpu:1"]


def collective_on_gpus_or_skip(tf):
    from safestrategy._tf import release
    from safestrategy.backends import FIRST_VERSION

    if release(tf.__version__) < FIRST_VERSION:
        pytest.skip("two probe-process candidates on (fake) GPUs need collective: TF >= 2.13")


def test_nccl_is_timed_where_and_how_it_was_checked_with_its_remedy(fake, tf2):
    """NCCL (and collective on NCCL) pass only with NCCL_P2P_DISABLE=1: they are timed in a
    probe process started with it, not in one that hangs without it."""
    collective_on_gpus_or_skip(tf2)
    fake("hang-unless-NCCL_P2P_DISABLE")
    report = safestrategy.probe(GPUS, timeout=2)
    ms = {c.name: (c.ms, c.remedy) for c in report.candidates if c.status == "ok"}
    remedy = {"NCCL_P2P_DISABLE": "1"}
    assert ms == {"collective": (2.0, remedy), "nccl": (1.0, remedy)}
    assert report.backend == "nccl" and report.reason.startswith("fastest: 1.0 ms")


def test_a_candidate_that_passed_but_was_not_timed_is_named_and_not_cached(fake, tf2, tmp_path):
    """Its reason (which the INFO line shows) names it, and such a decision is not kept as
    timings: a next launch races again instead of trusting "none could be timed"."""
    collective_on_gpus_or_skip(tf2)
    fake("ok")
    fake.monkeypatch.setenv("FAKE_WORKER_MS", "collective=hang")
    report = safestrategy.probe(GPUS, timeout=2)
    assert report.backend == "nccl"
    assert "collective passed but could not be timed: no answer within 2 s" in report.reason
    assert list((tmp_path / "cache").glob("timing-*.json")) == []  # the next launch races again


def test_a_relaunch_after_a_record_takes_the_next_by_cached_timings_timing_nothing(tf, monkeypatch):
    """A relaunch is a warm start: the cached winner has a record now (it stalled or
    crashed), so the next candidate by the cached timings that passes its check wins."""
    from safestrategy import records

    first = safestrategy.probe(cpus(2))
    timed = sorted((c.ms, c.name) for c in first.candidates if c.ms is not None)
    assert len(timed) >= 2 and first.backend in {name for _, name in timed}
    records.record(records.on_machine(tf, first.devices), first.backend, 601.0, {})
    refuse_timing(monkeypatch)
    again = safestrategy.probe(cpus(2))
    expected = next(name for _, name in timed if name != first.backend)
    assert again.backend == expected
    assert again.reason.startswith("next fastest by the cached timings")
    assert f"after {first.backend} stalled during training" in again.reason
