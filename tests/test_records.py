"""What the records say (safestrategy.records): the rules a decision is handed as data, from
hand-built records; then what a record does to a real next decision (TF, logical CPUs)."""

import logging
import re

import pytest

import safestrategy
from safestrategy import factory, records
from safestrategy._devices import parse_devices
from safestrategy.report import FAILED, OK, CandidateResult, Stall

from .conftest import CPUS, needs_tf, report, result

DEVICES = ("/device:CPU:0", "/device:CPU:1")
PLACE = records.Place(records.KIND, {"machine": "m", "devices": list(DEVICES)}, True, DEVICES)
P2P = {"NCCL_P2P_DISABLE": "1"}


def stall(backend, remedy=None):
    return Stall(backend, 600.0, "2026-12-01T10:00:00+00:00", dict(remedy or {}))


def test_a_record_fails_its_backend_and_says_how_to_re_allow_it(monkeypatch):
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    standing = records.Standing((stall("hierarchical_copy"),), PLACE)
    demotion = standing.demotion("hierarchical_copy", on_nccl=False, remedies=True)
    assert demotion.failed.status == FAILED and demotion.failed.cached
    assert "stalled during training on 2026-12-01 after 600 s" in demotion.failed.reason
    assert "--refresh" in demotion.failed.reason and "/cpu:0 /cpu:1" in demotion.failed.reason
    assert demotion.retries is None  # not NCCL: nothing is retried
    assert standing.demotion("reduce_to_cpu", on_nccl=False, remedies=True) is None


def test_nccls_untried_remedy_comes_first_and_never_the_users_own(monkeypatch):
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    monkeypatch.delenv("NCCL_SHM_DISABLE", raising=False)
    standing = records.Standing((stall("nccl", P2P),), PLACE)
    assert standing.demotion("nccl", True, True).retries == [{"NCCL_SHM_DISABLE": "1"}]
    assert standing.demotion("nccl", True, remedies=False).retries is None  # switched off
    monkeypatch.setenv("NCCL_SHM_DISABLE", "0")  # the user's: never overridden, never tried
    assert standing.demotion("nccl", True, True).retries == []


def test_a_forced_setting_reports_records_but_does_not_obey_them():
    forced = records.Standing((stall("nccl"),), PLACE, forced=True)
    assert forced.obeyed == {} and forced.demotion("nccl", True, True) is None
    assert (
        forced.place_for(report(mode="forced", devices=DEVICES)) is None
    )  # nor records its stalls


def test_a_stall_is_recorded_only_where_a_next_decision_reads_it():
    standing = records.Standing((), PLACE)
    assert standing.place_for(report(backend="reduce_to_cpu", devices=DEVICES)) == PLACE
    assert standing.place_for(report(devices=DEVICES[:1])) is None  # one device
    assert (
        records.Standing((), None).place_for(report(backend="reduce_to_cpu", devices=DEVICES))
        is None
    )  # the cache is off


def test_a_stall_outside_the_all_reduce_or_a_peers_doing_is_never_recorded():
    assert records.recordable(PLACE, outside=False) == PLACE
    assert records.recordable(PLACE, outside=True) is None
    assert records.recordable(PLACE, outside=False, peer=True) is None


def test_the_last_resort_is_the_last_recorded_candidate_in_the_order_that_failed_on_it():
    results = [
        CandidateResult("collective", FAILED, "stalled"),
        CandidateResult("hierarchical_copy", FAILED, "wrong sums"),
        CandidateResult("reduce_to_gpu", FAILED, "no GPU among the devices"),
        CandidateResult("reduce_to_cpu", FAILED, "stalled"),
    ]
    recorded = ["collective", "reduce_to_cpu"]
    assert records.set_aside(results, recorded) == ["reduce_to_cpu", "collective"]
    passed = [r._replace(status=OK) if r.name == "collective" else r for r in results]
    assert records.set_aside(passed, recorded) == ["reduce_to_cpu"]  # one that passed: no


def test_ring_the_multi_worker_last_resort_is_never_failed_by_a_record():
    assert records.READ == ("nccl",)
    place = records.Place(records.MULTIWORKER_KIND, {"task": "worker:0"}, True)
    said = records.next_step(place, "ring", {})
    assert said == "ring, the last resort, is never failed by a record: it is taken again"


# --- the next decision, from a stall record -------------------------------------------------


def recorded_stall(tf, backend, remedy=None, devices=CPUS):
    """A stall record as the watchdog writes it, for ``backend`` on ``devices``."""
    names = tuple(str(d) for d in parse_devices(devices))
    records.record(records.on_machine(tf, names), backend, 601.0, remedy or {})
    factory._decisions.clear()


@needs_tf
def test_auto_takes_the_next_backend_and_says_why(tf2, caplog):
    recorded_stall(tf2, "hierarchical_copy")
    with caplog.at_level(logging.WARNING, logger="safestrategy"):
        safestrategy.make_mirrored_strategy(CPUS)
    result = safestrategy.last_report()
    stalled = next(c for c in result.candidates if c.name == "hierarchical_copy")
    assert result.backend != "hierarchical_copy"
    assert re.match(r"stalled during training on \d{4}-\d\d-\d\d after 601 s", stalled.reason)
    assert [s.backend for s in result.stalls] == ["hierarchical_copy"]
    assert "--devices /cpu:0 /cpu:1 --refresh` re-allows it" in caplog.text
    assert caplog.text.count("--refresh") == 1


@needs_tf
def test_a_forced_backend_is_used_with_a_warning(tf, caplog):
    recorded_stall(tf, "reduce_to_cpu")
    with caplog.at_level(logging.WARNING, logger="safestrategy"):
        chosen = safestrategy.probe(CPUS, backend="reduce_to_cpu")
        factory._decisions.clear()
        if tf.__version__.startswith("2."):
            safestrategy.make_mirrored_strategy(CPUS, backend="reduce_to_cpu")
            assert "stalled during training" in caplog.text and "forced" in caplog.text
    assert chosen.backend == "reduce_to_cpu"


@needs_tf
def test_records_on_every_backend_that_passes_leave_the_last_in_use_with_one_warning(tf2, caplog):
    """No record leaves a machine without a backend: the last recorded one in the order
    that passes is used, one WARNING names the records, and its command forgets them."""
    from safestrategy import cli
    from safestrategy.backends import BACKEND_NAMES

    from .test_verdicts import quoted_command

    for name in BACKEND_NAMES:
        recorded_stall(tf2, name)
    with caplog.at_level(logging.WARNING, logger="safestrategy"):
        safestrategy.make_mirrored_strategy(CPUS)
    chosen = safestrategy.last_report()
    assert chosen.backend == "reduce_to_cpu" and "used anyway" in chosen.reason
    ours = [r for r in caplog.records if r.name == "safestrategy"]
    (warning,) = [r.getMessage() for r in ours if r.levelno >= logging.WARNING]
    assert "reduce_to_cpu, the last of them in the order, is used anyway" in warning
    for name in BACKEND_NAMES:
        assert f"{name} stalled during training on " in warning
    args, argv = quoted_command(warning)
    assert args == "--devices /cpu:0 /cpu:1 --refresh"
    assert cli.main(argv) == 0  # the user runs the quoted command: the records are gone
    factory._decisions.clear()
    assert safestrategy.probe(CPUS).stalls == ()


@needs_tf
def test_launch_after_launch_on_records_never_ends_without_a_backend(tf):
    """As under ``run``: each launch's backend stalls and is recorded, and the next launch
    still gets a backend, long after every one that passes has a record."""
    passing = {c.name for c in safestrategy.probe(CPUS).candidates if c.status == "ok"}
    used = []
    for _ in range(len(passing) + 2):
        factory._decisions.clear()
        used.append(safestrategy.probe(CPUS).backend)
        recorded_stall(tf, used[-1])
    assert set(used[: len(passing)]) == passing  # a new one each time while one is left
    assert used[len(passing) :] == ["reduce_to_cpu", "reduce_to_cpu"]


@needs_tf
def test_refresh_forgets_the_stalls_and_says_which(tf, caplog):
    recorded_stall(tf, "hierarchical_copy")
    recorded_stall(tf, "reduce_to_cpu")
    assert len(safestrategy.probe(CPUS).stalls) == 2
    factory._decisions.clear()
    assert factory.decide(CPUS, refresh=True)[0].stalls == ()
    said = [r.getMessage() for r in caplog.records if "--refresh forgot" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("--refresh forgot 2 records of these devices")
    assert "hierarchical_copy" in said[0] and "reduce_to_cpu" in said[0]  # each one named
    factory._decisions.clear()
    assert safestrategy.probe(CPUS).stalls == ()


@needs_tf
def test_the_cache_switch_covers_stall_records(tf, monkeypatch):
    recorded_stall(tf, "hierarchical_copy")
    monkeypatch.setenv("SAFESTRATEGY_CACHE", "off")
    assert safestrategy.probe(CPUS).stalls == ()


@pytest.mark.parametrize("backend", ["nccl", "collective"])
def test_nccl_that_stalled_gets_the_remedy_not_tried_yet(fake, tf, backend):
    """The one remedy loop serves a collective on NCCL as it serves nccl."""
    from safestrategy._tf import release
    from safestrategy.backends import FIRST_VERSION

    if backend == "collective" and release(tf.__version__) < FIRST_VERSION:
        pytest.skip("collective is MirroredStrategy's default from TF 2.13")
    fake("ok")
    recorded_stall(tf, backend, devices=["/gpu:0", "/gpu:1"])
    result = safestrategy.probe(["/gpu:0", "/gpu:1"], backend=f"{backend},reduce_to_gpu")
    stalled = result.candidates[0]
    assert (result.backend, stalled.remedy) == (backend, {"NCCL_P2P_DISABLE": "1"})
    assert "after it failed without: stalled during training" in stalled.reason
    assert fake.starts()[-1] == "start NCCL_P2P_DISABLE=1"


def test_a_stalled_nccls_remedy_retries_are_verdicts_cached_like_any_other(fake, tf):
    """After a stall, the retry costs its probe processes once, not at every launch."""
    fake("ok")
    recorded_stall(tf, "nccl", devices=["/gpu:0", "/gpu:1"])
    listed = {"backend": "nccl,reduce_to_gpu"}
    first = safestrategy.probe(["/gpu:0", "/gpu:1"], **listed).candidates[0]
    starts = len(fake.starts())
    factory._decisions.clear()  # a later launch
    again = safestrategy.probe(["/gpu:0", "/gpu:1"], **listed).candidates[0]
    assert (again.status, again.remedy, again.cached) == ("ok", first.remedy, True)
    assert len(fake.starts()) == starts  # no probe process this time


# --- real trainings, each in its own process (TF2: Keras fit on two logical CPUs) ----------


@pytest.mark.parametrize(
    "fields, place, said",
    [
        ({"mode": "forced"}, None, "your own cross_device_ops is used as given"),
        ({"candidates": (result("nccl", "ok"),), "mode": "forced"}, None, "a forced backend"),
        ({"candidates": (result("nccl", "ok"),), "devices": ("/gpu:0",)}, None, "one device"),
        ({"candidates": (result("ring", "ok"),), "task": "worker:0"}, "unread", "RING"),
        ({"candidates": (result("nccl", "ok"),)}, "read", None),
    ],
    ids=["own-ops", "forced", "one-device", "ring", "read"],
)
def test_the_decision_names_the_one_reason_no_record_is_read(fields, place, said):
    places = {
        "read": records.Place(records.KIND, {}, True),
        "unread": records.Place("x", {}, False),
    }
    why = records.unread(report(**fields), places.get(place))
    assert (why is None) if said is None else why.startswith(said)


def test_with_the_cache_off_the_reason_is_the_cache(monkeypatch):
    monkeypatch.setenv("SAFESTRATEGY_CACHE", "off")
    why = records.unread(report(candidates=(result("nccl", "ok"),)), None)
    assert why == "SAFESTRATEGY_CACHE=off keeps no record"


def test_a_record_no_decision_here_reads_says_why():
    machine = {"gpu_uuids": None, "host": "vm", "shm_bytes": 64}
    here = {"machine": machine, "devices": ["/device:CPU:0"], "tf": "2.21.0", "backend": "nccl"}
    assert records.unread_here(here, machine, "2.21.0") == ""
    old = {**here, "tf": "2.16.2"}
    assert records.unread_here(old, machine, "2.21.0") == "written on TF 2.16.2, this is 2.21.0"
    moved = {**here, "machine": {**machine, "shm_bytes": 65}}
    assert "another machine identity" in records.unread_here(moved, machine, "2.21.0")
    worker = {"cluster": ["a:1", "b:1"], "task": "worker:0", "tf": "2.21.0"}
    assert records.unread_here(worker, {}, "2.21.0") == ""  # multi-worker: no machine key
    assert records.unread_here(worker, {}, None) == "written on TF 2.21.0, this is no TensorFlow"


def test_wrong_numbers_are_a_record_that_fails_its_backend_and_a_last_resort_is_known():
    """A ``corrupt`` record (the mirror's check) reads as a failure like any record; a next
    decision has another backend while one without a record passed or was not tried."""
    wrong = Stall(
        "hierarchical_copy",
        90.0,
        "2026-12-07T10:00:00+00:00",
        {},
        "corrupt",
        "replica 1 (/device:CPU:1) at step 6",
        "copies agree",
    )
    demotion = records.Standing((wrong,), PLACE).demotion("hierarchical_copy", False, True)
    assert demotion.failed.reason.startswith(
        "returned wrong numbers during training on 2026-12-07 (replica 1 (/device:CPU:1) at step 6)"
    )
    assert wrong.line().strip() == (
        "hierarchical_copy  returned wrong numbers during training on "
        "2026-12-07T10:00:00+00:00 (replica 1 (/device:CPU:1) at step 6; check: copies agree)"
    )
    chosen = report(
        backend="hierarchical_copy",
        candidates=(result("hierarchical_copy", OK), result("reduce_to_cpu", OK)),
    )
    assert records.another(chosen)
    assert not records.another(chosen._replace(stalls=(stall("reduce_to_cpu"),)))
    untried = chosen._replace(
        candidates=(chosen.candidates[0], result("reduce_to_cpu", "not_tried"))
    )
    assert records.another(untried)
    failed = chosen._replace(candidates=(chosen.candidates[0], result("reduce_to_cpu", FAILED)))
    assert not records.another(failed)
