"""make_multiworker_strategy(): TF_CONFIG, the agreement, the cross-worker NCCL check.

Three layers, cheapest first: pure parsing and decisions from hand-built
facts; workers as threads of this process with the probe process faked
(tests/fake_mw_worker.py: hangs, crashes, remedies) and the GPU count given;
and, on TF2 legs, two real worker processes on 127.0.0.1 that train
(tests/mw_worker.py). Every thread, socket and process has a bound.
"""

import json
import os
import socket
import sys
import threading
import time
import types
from pathlib import Path

import pytest

import safestrategy
from safestrategy import choose, records
from safestrategy._env import Setting, resolve_communication
from safestrategy.checks import nccl as _nccl
from safestrategy.checks import probe as _probe
from safestrategy.multiworker import agree
from safestrategy.multiworker import cluster as _cluster
from safestrategy.multiworker import factory as multiworker
from safestrategy.multiworker.cluster import Address
from safestrategy.multiworker.rendezvous import PROTOCOL, MissingWorkersError, Rendezvous
from safestrategy.report import CandidateResult

from .conftest import ROOT, free_ports, run_python, tf_configs, workers_together

HERE = Path(__file__).resolve().parent
FAKE_MW = str(HERE / "fake_mw_worker.py")
GPU_FACTS = {"gpus": 2, "nccl_kernels": 1, "tf_version": "2.99.0"}


def no_children_left():
    """True when this process has no child process (no probe process outlived its check)."""
    if not hasattr(os, "WNOHANG"):  # Windows: no way to ask; the probe's own tests cover it
        return True
    try:
        os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


# --- TF_CONFIG --------------------------------------------------------------------------


def test_tf_config_lists_chief_then_workers_and_finds_this_task():
    cluster = _cluster.parse_tf_config(
        json.dumps(
            {
                "cluster": {"worker": ["b:2", "c:3"], "chief": ["a:1"], "evaluator": ["e:9"]},
                "task": {"type": "worker", "index": 1},
            }
        )
    )
    assert [a.task for a in cluster.workers] == ["chief:0", "worker:0", "worker:1"]
    assert cluster.me == Address("worker:1", "c", 3)
    assert [a.task for a in cluster.peers] == ["chief:0", "worker:0"]
    ipv6 = '{"cluster": {"worker": ["[::1]:5"]}, "task": {"type": "worker", "index": 0}}'
    assert str(_cluster.parse_tf_config(ipv6).me) == "[::1]:5"


@pytest.mark.parametrize(
    "text, problem",
    [
        ("{", "not JSON"),
        ("[]", "not a JSON object"),
        ('{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps"}}', 'no "cluster" with'),
        ('{"cluster": {"worker": ["a"]}, "task": {"type": "worker"}}', "not host:port"),
        ('{"cluster": {"worker": ["a:0"]}, "task": {"type": "worker"}}', "not host:port"),
        ('{"cluster": {"worker": ["a:1"]}}', 'no "task"'),
        ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}', "not in"),
        ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "evaluator"}}', "does not take part"),
        ('{"cluster": {"worker": ["a:1", "a:1"]}, "task": {"type": "worker"}}', "same host"),
    ],
)
def test_bad_tf_config_is_a_value_error_quoting_it(text, problem):
    with pytest.raises(ValueError, match=problem) as error:
        _cluster.parse_tf_config(text)
    assert "TF_CONFIG=" in str(error.value)


def test_settings_are_validated_before_anything_else(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_configs(1)[0])
    with pytest.raises(ValueError, match=r"'rng'.*the argument.*auto, nccl, ring"):
        multiworker.request("rng")
    monkeypatch.setenv("SAFESTRATEGY_COMMUNICATION", "ring,bogus")
    with pytest.raises(ValueError, match="SAFESTRATEGY_COMMUNICATION"):
        multiworker.request()
    monkeypatch.setenv("SAFESTRATEGY_COMMUNICATION", " RING ")
    assert multiworker.request().setting == Setting("forced", ("ring",), "env")
    monkeypatch.delenv("TF_CONFIG")
    with pytest.raises(ValueError, match=r"no cluster: .*cluster_resolver=.*TF_CONFIG.*Slurm"):
        multiworker.request()


# --- the pure decision ------------------------------------------------------------------


def hellos(*gpus, kernels=1, **extra):
    return {
        f"worker:{i}": {"gpus": n, "nccl_kernels": kernels, **extra} for i, n in enumerate(gpus)
    }


def test_nccl_needs_gpus_on_every_worker_and_kernels():
    auto, forced = resolve_communication("auto"), resolve_communication("nccl")
    skipped = agree.gate(auto, hellos(2, 0))
    assert (skipped.status, skipped.reason) == (
        "skipped",
        "no GPU among the devices (worker:1 has none)",
    )
    assert agree.gate(forced, hellos(0, 0)).status == "failed"
    assert agree.gate(resolve_communication("nccl,ring"), hellos(0, 1)).status == "failed"
    no_kernels = agree.gate(auto, hellos(1, 1, kernels=0))
    assert no_kernels.status == "failed" and "0 registered" in no_kernels.reason
    assert agree.gate(auto, hellos(1, 4)) is None
    assert agree.expected_replicas(hellos(1, 4)) == 5


def test_remedies_are_skipped_where_any_user_set_them_or_any_worker_turned_them_off():
    assert agree.remedy_attempts(hellos(1, 1, remedies=True, user_nccl=[])) == [
        {},
        {"NCCL_P2P_DISABLE": "1"},
        {"NCCL_SHM_DISABLE": "1"},
    ]
    some = hellos(1, 1, remedies=True, user_nccl=[])
    some["worker:1"]["user_nccl"] = ["NCCL_P2P_DISABLE"]
    assert agree.remedy_attempts(some) == [{}, {"NCCL_SHM_DISABLE": "1"}]
    off = hellos(1, 1, remedies=True)
    off["worker:0"]["remedies"] = False
    assert agree.remedy_attempts(off) == [{}]


def test_nccl_is_ok_only_when_every_worker_says_so():
    ok = CandidateResult("nccl", "ok", "fine", 1.0).to_dict()
    hung = CandidateResult("nccl", "timeout", "no answer within 5 s", 5.0).to_dict()
    assert agree.combine({"worker:0": ok, "worker:1": ok}, {}).status == "ok"
    result = agree.combine({"worker:0": ok, "worker:1": hung}, {})
    assert (result.status, result.reason) == ("timeout", "worker:1: timeout: no answer within 5 s")
    ring = CandidateResult("ring", "ok", "")
    decision = choose.decide(
        resolve_communication("auto"), {"nccl": result, "ring": ring}.get, race=False, why=agree.why
    )
    assert decision.backend == "ring" and decision.reason.startswith("nccl timeout: worker:1")


def test_workers_that_disagree_are_told_so():
    same = {"cluster": ["worker:0=a:1"], "setting": ["auto", ["nccl", "ring"]]}
    assert agree.disagreement({"worker:0": same, "worker:1": dict(same)}) is None
    other = {**same, "setting": ["forced", ["ring"]]}
    problem = agree.disagreement({"worker:0": same, "worker:1": other})
    assert "disagree on the communication setting" in problem and "worker:1: ['forced'" in problem
    late = {**same, "stall_timeout": 600.0}
    problem = agree.disagreement({"worker:0": {**same, "stall_timeout": 60.0}, "worker:1": late})
    assert "disagree on the stall timeout (SAFESTRATEGY_STALL_TIMEOUT" in problem
    assert "worker:0: 60.0; worker:1: 600.0" in problem  # both values, named


# --- the rendezvous, as threads ---------------------------------------------------------


def rendezvous_threads(n, rounds, timeout=10.0, delays=None, stop_after=None):
    """Run ``n`` workers' rounds as threads; {task: [round results] or the exception}."""
    addresses = [Address(f"worker:{i}", "127.0.0.1", p) for i, p in enumerate(free_ports(n))]
    results = {}

    def worker(i):
        time.sleep((delays or [0] * n)[i])
        me = addresses[i]
        try:
            with Rendezvous(me, [a for a in addresses if a != me], 1) as rendezvous:
                got = []
                for number, name in enumerate(rounds):
                    if stop_after is not None and stop_after[i] == number:
                        break  # this worker "dies" here
                    got.append(rendezvous.exchange(name, {"i": i, "r": name}, timeout, "(test)"))
                results[me.task] = got
        except Exception as error:
            results[me.task] = error

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout * len(rounds) + 30)
    assert not any(thread.is_alive() for thread in threads)
    for address in addresses:  # every port is free again
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", address.port))
    return results, time.monotonic() - started


def test_a_worker_done_first_builds_only_once_its_peers_stop_listening():
    """A peer still listening (here: 1 s longer) would reset TensorFlow's first
    connection when it closes; TF 2.10 then failed the worker, and the peer hung."""
    a, b = (Address(f"worker:{i}", "127.0.0.1", p) for i, p in enumerate(free_ports(2)))
    b_closing = []

    def late_peer():
        with Rendezvous(b, [a], 1) as rendezvous:
            rendezvous.exchange("hello", "b", 10, "(test)")
            time.sleep(1.0)
            b_closing.append(time.monotonic())

    thread = threading.Thread(target=late_peer, daemon=True)
    thread.start()
    with Rendezvous(a, [b], 1) as rendezvous:
        rendezvous.exchange("hello", "a", 10, "(test)")
    a_done = time.monotonic()
    with pytest.raises(ConnectionRefusedError):  # what TensorFlow would meet: it retries
        socket.create_connection((b.host, b.port), 1).close()
    thread.join(15)
    assert b_closing and a_done > b_closing[0]


def test_workers_starting_at_different_times_all_get_every_message():
    results, _ = rendezvous_threads(3, ["hello", "verdict"], delays=[0.6, 0, 0.3])
    for task in ("worker:0", "worker:1", "worker:2"):
        hello, verdict = results[task]
        assert hello == {f"worker:{i}": {"i": i, "r": "hello"} for i in range(3)}
        assert verdict == {f"worker:{i}": {"i": i, "r": "verdict"} for i in range(3)}


def test_a_worker_dying_half_way_makes_the_others_raise_naming_it_within_the_bound():
    results, elapsed = rendezvous_threads(
        3, ["hello", "verdict"], timeout=2.0, stop_after=[None, 1, None]
    )
    assert len(results["worker:1"]) == 1  # it finished the first round, then "died"
    for task in ("worker:0", "worker:2"):
        error = results[task]
        assert isinstance(error, MissingWorkersError) and isinstance(error, TimeoutError)
        assert error.missing == ("worker:1",) and error.task == task
        assert "worker:1 at 127.0.0.1:" in str(error)
    assert elapsed < 15


def test_foreign_traffic_and_stale_sessions_do_not_confuse_it():
    me, peer = (Address(f"worker:{i}", "127.0.0.1", p) for i, p in enumerate(free_ports(2)))
    with Rendezvous(me, [peer], session=2) as rendezvous:

        def talk(payload):
            with socket.create_connection(("127.0.0.1", me.port), 5) as s:
                s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
                return s.makefile("rb").read()

        assert talk(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") == b""  # a gRPC client: hung up on
        message = {
            "protocol": PROTOCOL,
            "attempt": ["elsewhere", 1],
            "from": "worker:1",
            "to": "worker:0",
            "round": "hello",
        }
        stale = talk((json.dumps({**message, "session": 1, "body": "old"}) + "\n").encode())
        early = talk((json.dumps({**message, "session": 3, "body": "new"}) + "\n").encode())
        wrong = talk((json.dumps({**message, "session": 2, "to": "worker:7"}) + "\n").encode())
        assert json.loads(stale) == {"ack": True, "attempt": "a later session"}
        assert json.loads(early)["ack"] is False
        assert "not worker:7's" in json.loads(wrong)["why"]
        assert rendezvous._mailbox == {}


# --- the factory's decision, workers as threads, the probe process faked ----------------


@pytest.fixture
def fake_mw(monkeypatch):
    """The fake cross-worker probe (tests/fake_mw_worker.py); returns a function that sets
    its behaviour."""
    monkeypatch.setattr(_probe, "CHILD_COMMAND", [sys.executable, FAKE_MW])
    monkeypatch.setattr(_probe, "STARTUP_TIMEOUT", 10.0)
    for name in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "SAFESTRATEGY_NCCL_REMEDIES"):
        monkeypatch.delenv(name, raising=False)
    return lambda behaviour: monkeypatch.setenv("FAKE_MW", behaviour)


def decide_threads(
    n, communication=None, timeout=3.0, facts=GPU_FACTS, absent=(), settings=None, facts_of=None
):
    """Every worker's ``multiworker.decide`` as a thread: {task: Report or exception}
    (``facts_of(i)``: worker i's own facts, else ``facts`` for all)."""
    configs = tf_configs(n)
    results = {}

    def worker(i):
        task = f"worker:{i}"
        try:
            request = multiworker.Request(
                _cluster.parse_tf_config(configs[i]),
                resolve_communication((settings or [communication] * n)[i]),
                timeout,
                True,
            )
            results[task] = multiworker.decide(request, facts_of(i) if facts_of else facts)
        except Exception as error:
            results[task] = error

    threads = [
        threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n) if i not in absent
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    assert no_children_left()
    return results


def test_a_record_on_one_worker_is_every_workers_and_ring_is_never_failed_by_one():
    stalled = {"backend": "nccl", "happened": "stalled during training on 2026-12-02 after 600 s"}
    ring = {"backend": "ring", "happened": "stalled during training on 2026-12-02 after 600 s"}
    hellos = {"worker:0": {"records": []}, "worker:1": {"records": [stalled, ring]}}
    assert agree.recorded(hellos) == {"nccl": f"worker:1 recorded it: {stalled['happened']}"}


P2P, SHM = {"NCCL_P2P_DISABLE": "1"}, {"NCCL_SHM_DISABLE": "1"}


def nccl_record(remedy=None):
    """An NCCL record as a hello carries it (``remedy`` None: a 0.4.0 hello, which has none)."""
    record = {"backend": "nccl", "happened": "stalled during training on 2026-12-02 after 600 s"}
    return record if remedy is None else {**record, "remedy": remedy}


def test_records_carry_their_remedy_and_every_worker_moves_on_to_the_next_untried_one():
    def after(*records, **extra):
        together = hellos(2, 2, **{"remedies": True, "user_nccl": [], **extra})
        for task, record in zip(sorted(together), records):
            together[task]["records"] = [record] if record else []
        return agree.after_records(together)

    assert after(nccl_record({})) == [P2P, SHM]
    assert after(nccl_record()) == [P2P, SHM]  # a 0.4.0 worker's hello: no remedy said
    assert after(nccl_record(P2P), nccl_record({})) == [SHM]  # the furthest any worker tried
    assert after(None, nccl_record(SHM)) == []  # every remedy failed: RING
    assert after(nccl_record(P2P), None, user_nccl=["NCCL_SHM_DISABLE"]) == []
    assert after(nccl_record({}), None, remedies=False) == []
    said = agree.recorded({"worker:0": {"records": [nccl_record(P2P)]}})
    assert said["nccl"].endswith("after 600 s with NCCL_P2P_DISABLE=1")


def test_the_hello_carries_the_remedy_a_record_was_made_under(tf, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_configs(2)[1])
    workers = _cluster.read()
    place = records.on_worker(tf, [str(a) for a in workers.workers], workers.task, read=True)
    records.record(place, "nccl", 600.0, P2P)
    records.record(place, "ring", 600.0, {})  # RING is never failed by a record: not carried
    request = multiworker.Request(workers, resolve_communication("auto"), 3.0, True)
    carried = records.carried(tf, [str(a) for a in workers.workers], workers.task)
    hello = multiworker._hello(request, {"records": carried})
    sent = json.loads(json.dumps(hello))  # as the rendezvous carries it
    assert [r["remedy"] for r in sent["records"]] == [P2P]
    assert sent["stall_timeout"] == 600.0  # the default: the workers compare it
    monkeypatch.setenv("SAFESTRATEGY_STALL_TIMEOUT", "off")
    assert multiworker._hello(request, {})["stall_timeout"] is None
    assert agree.after_records({"worker:0": {}, "worker:1": sent}) == [SHM]


def test_workers_agree_to_demote_a_communication_one_of_them_recorded(fake_mw):
    """Worker 1's hello carries its NCCL record, made under NCCL_P2P_DISABLE=1: both fail
    NCCL on it and retry together with the remedy not tried yet, never the one that stalled."""
    fake_mw("ok")
    results = decide_threads(
        2, facts_of=lambda i: {**GPU_FACTS, "records": [nccl_record(P2P)] if i == 1 else []}
    )
    for report in results.values():
        nccl = report.candidates[0]
        assert (report.backend, nccl.remedy) == ("nccl", SHM)
        assert "worker:1 recorded it: stalled during training" in nccl.reason


def test_nccl_passing_on_every_worker_is_chosen_by_every_worker(fake_mw):
    fake_mw("ok")
    results = decide_threads(2)
    for task, report in results.items():
        assert (report.backend, report.workers, report.task) == ("nccl", 2, task)
        assert (
            report.candidates[0].reason
            == "the cross-worker all-reduce summed right on all 2 workers"
        )


@pytest.mark.parametrize(
    "behaviour, setting, status",
    [("hang:1", "auto", "timeout"), ("abort:1", "nccl,ring", "failed")],
)
def test_nccl_hanging_or_crashing_on_one_worker_ends_in_ring_on_both(
    fake_mw, behaviour, setting, status
):
    fake_mw(behaviour)
    started = time.monotonic()
    results = decide_threads(2, setting, timeout=2.0)
    assert time.monotonic() - started < 60
    for report in results.values():
        nccl, ring = report.candidates
        assert report.backend == "ring" and ring.status == "not_tried"
        assert nccl.status == status and nccl.reason.startswith(f"worker:1: {status}: ")
        assert "also with NCCL_P2P_DISABLE=1 and with NCCL_SHM_DISABLE=1" in nccl.reason


def test_a_forced_nccl_that_hangs_is_a_bounded_error_on_both(fake_mw, monkeypatch):
    fake_mw("hang:0")
    monkeypatch.setenv("SAFESTRATEGY_NCCL_REMEDIES", "off")
    started = time.monotonic()
    results = decide_threads(2, "nccl", timeout=1.0)
    assert time.monotonic() - started < 30
    for error in results.values():
        assert isinstance(error, safestrategy.NoWorkingBackendError)
        assert "nccl: timeout: worker:0: timeout: no answer within 1 s" in str(error)
        assert error.report.backend == "none"


def test_a_remedy_that_works_is_agreed_by_every_worker(fake_mw):
    fake_mw("p2p")
    results = decide_threads(2, "nccl", timeout=1.0)
    for report in results.values():
        (nccl,) = report.candidates
        assert (report.backend, dict(nccl.remedy)) == ("nccl", {"NCCL_P2P_DISABLE": "1"})
        assert nccl.reason.startswith("passed with NCCL_P2P_DISABLE=1 on every worker")


def test_the_cross_worker_check_runs_in_the_users_environment_not_ours(fake_mw):
    # as if a single-machine decision had set it earlier in this process
    _nccl.apply_remedy({"NCCL_P2P_DISABLE": "1"}, ["/gpu:0", "/gpu:1"])
    fake_mw("p2p")
    results = decide_threads(2, "nccl,ring", timeout=1.0)
    for report in results.values():
        nccl = report.candidates[0]
        # inherited, the variable made NCCL pass as "no remedy needed"
        assert nccl.status != "ok" or dict(nccl.remedy) == {"NCCL_P2P_DISABLE": "1"}


def test_cpu_workers_skip_nccl_in_auto_and_fail_it_when_forced(fake_mw):
    cpu = {"gpus": 0, "nccl_kernels": 0, "tf_version": "2.99.0"}
    for report in decide_threads(2, facts=cpu).values():
        assert report.backend == "ring" and report.candidates[0].status == "skipped"
    for error in decide_threads(2, "nccl", facts=cpu).values():
        assert isinstance(error, safestrategy.NoWorkingBackendError)
        assert "nccl: failed: no GPU among the devices (worker:0, worker:1 have none)" in str(error)


def test_ring_taken_without_a_check_is_shown_so_not_as_ok_in_no_time(fake_mw):
    """RING is never run before it is used: the report and the CLI's progress line say
    not_tried and why, never ``ring ok 0.00s`` as if it had passed a check."""
    cpu = {"gpus": 0, "nccl_kernels": 0, "tf_version": "2.99.0"}
    for report in decide_threads(2, facts=cpu).values():
        ring = report.candidates[-1]
        assert (report.backend, ring.name, ring.status) == ("ring", "ring", "not_tried")
        assert ring.reason.startswith("used without a check: RING is TensorFlow's collective")
        (line,) = [line for line in str(report).splitlines() if line.startswith("  ring ")]
        assert "not_tried" in line and "0.00s" not in line and " ok " not in line


def test_workers_with_different_settings_raise_on_every_worker(fake_mw):
    results = decide_threads(2, settings=["ring", "auto"])
    for error in results.values():
        assert isinstance(error, ValueError) and "disagree on the communication" in str(error)


def test_a_worker_never_started_is_named_within_the_bound(fake_mw):
    started = time.monotonic()
    results = decide_threads(3, timeout=2.0, absent=(2,))
    assert time.monotonic() - started < 15
    for task in ("worker:0", "worker:1"):
        assert isinstance(results[task], MissingWorkersError)
        assert results[task].missing == ("worker:2",)
        assert "no answer from worker:2" in str(results[task])


def test_a_late_worker_and_a_retrying_one_meet_and_only_the_absent_one_is_named(fake_mw):
    """Worker 0 retries after MissingWorkersError (in-process, as a user's loop would);
    worker 1 starts after worker 0's first call gave up. They meet on worker 1's first
    call (before: worker 0 stayed one session ahead, and both named the other as silent)."""
    configs = tf_configs(2)
    outcomes = {"worker:0": [], "worker:1": []}
    cpu = {"gpus": 0, "nccl_kernels": 0, "tf_version": "2.99.0"}

    def worker(i, delay):
        time.sleep(delay)
        request = multiworker.Request(
            _cluster.parse_tf_config(configs[i]), resolve_communication(None), 2.0, True
        )
        for _ in range(4):
            try:
                outcomes[f"worker:{i}"].append(multiworker.decide(request, cpu))
                return
            except MissingWorkersError as error:
                outcomes[f"worker:{i}"].append(error)

    threads = [threading.Thread(target=worker, args=a, daemon=True) for a in ((0, 0), (1, 3))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    *errors, report = outcomes["worker:0"]
    assert errors and all(error.missing == ("worker:1",) for error in errors)
    assert report.backend == "ring"
    assert [type(o) for o in outcomes["worker:1"]] == [type(report)], outcomes["worker:1"]


def test_a_peer_that_leaves_a_later_round_stops_the_others_at_once_naming_its_culprit():
    """Three workers: worker 2 dies after "hello"; worker 1 gives up on it first and says so,
    so worker 0 stops at once naming worker 2 (not worker 1, which answered) and does not
    wait on the dead round."""
    addresses = [Address(f"worker:{i}", "127.0.0.1", p) for i, p in enumerate(free_ports(3))]
    results = {}

    def worker(i, timeout):
        me = addresses[i]
        try:
            with Rendezvous(me, [a for a in addresses if a != me], 1) as rendezvous:
                rendezvous.exchange("hello", i, 10.0, "(test)")
                if i == 2:
                    return  # "dies"
                started = time.monotonic()
                try:
                    rendezvous.exchange("verdict", i, timeout, "(test)")
                finally:
                    results[f"{me.task} seconds"] = time.monotonic() - started
        except Exception as error:
            results[me.task] = error

    threads = [
        threading.Thread(target=worker, args=a, daemon=True) for a in ((0, 30.0), (1, 1.0), (2, 1))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for task in ("worker:0", "worker:1"):
        assert isinstance(results[task], MissingWorkersError)
        assert results[task].missing == ("worker:2",)
    assert "worker:1 gave up verdict: no answer from worker:2 at 127.0.0.1:" in str(
        results["worker:0"]
    )
    assert results["worker:0 seconds"] < 10


# --- Keras 3 (keras-team/keras#20585) ----------------------------------------------------


@pytest.mark.parametrize(
    "tf_version, environ, keras_version, fix",
    [
        ("2.16.1", {}, None, "tf_keras~=2.16"),  # keras not imported yet: TF 2.16+ means 3
        ("2.21.0", {}, "3.15.1", "tf_keras~=2.21"),
        ("2.21.0rc1", {"TF_USE_LEGACY_KERAS": "0"}, None, "tf_keras~=2.21"),
        ("2.21.0", {"TF_USE_LEGACY_KERAS": "yes"}, None, "tf_keras~=2.21"),  # TF ignores it
    ],
)
def test_keras_3_under_tf_2_16_and_later_is_warned_with_tensorflows_way_back(
    tf_version, environ, keras_version, fix
):
    message = multiworker.keras3_warning(tf_version, environ, keras_version)
    assert "keras-team/keras#20585" in message
    assert f"pip install --no-deps {fix} (--no-deps: " in message  # not a second TF
    assert "and set TF_USE_LEGACY_KERAS=1" in message
    assert "PerReplica" in message and "Custom training loops" in message
    assert ("Keras " + keras_version if keras_version else "Keras 3") in message
    if "TF_USE_LEGACY_KERAS" in environ:  # set, but to a value TensorFlow does not accept
        assert f"TF_USE_LEGACY_KERAS={environ['TF_USE_LEGACY_KERAS']!r} is not one" in message


@pytest.mark.parametrize(
    "tf_version, environ, keras_version",
    [
        ("2.15.1", {}, None),  # tf.keras is Keras 2.15
        ("2.10.1", {}, "3.15.1"),  # a Keras 3 of the user's beside an old TF: not tf.keras
        ("2.21.0", {"TF_USE_LEGACY_KERAS": "1"}, "3.15.1"),  # TF routes tf.keras to tf_keras
        ("2.21.0", {"TF_USE_LEGACY_KERAS": "true"}, None),
        ("2.16.2", {"TF_USE_LEGACY_KERAS": "True"}, None),
        ("2.16.2", {}, "2.15.0"),  # a Keras 2 already imported: TF routes tf.keras to it
        ("a-vendor-build", {}, None),  # cannot tell
    ],
)
def test_no_keras_warning_where_tf_keras_is_not_keras_3(tf_version, environ, keras_version):
    assert multiworker.keras3_warning(tf_version, environ, keras_version) is None


def test_the_keras_version_is_read_without_importing_keras(monkeypatch):
    monkeypatch.delitem(sys.modules, "keras", raising=False)
    assert multiworker.imported_keras_version() is None
    assert "keras" not in sys.modules
    monkeypatch.setitem(sys.modules, "keras", types.SimpleNamespace(__version__="3.1.0"))
    assert multiworker.imported_keras_version() == "3.1.0"


def test_the_keras_warning_is_logged_once_per_process(monkeypatch, caplog):
    monkeypatch.setattr(multiworker, "_keras_warned", False)
    monkeypatch.setattr(multiworker, "imported_keras_version", lambda: None)
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    with caplog.at_level("WARNING", logger="safestrategy"):
        multiworker._warn_keras3("2.21.0")
        multiworker._warn_keras3("2.21.0")
    assert [r.getMessage() for r in caplog.records] == [
        multiworker.keras3_warning("2.21.0", {}, None)
    ]


def test_the_two_ways_the_keras_warning_names_do_train_with_two_workers(tf2):
    """What the Keras 3 WARNING points to, run: ``tf.keras``'s ``fit`` with
    ``TF_USE_LEGACY_KERAS=1`` (tf_keras, installed ``--no-deps`` in the TF 2.16+ legs as the
    WARNING says; on older TF, ``tf.keras`` is Keras 2 already), and a custom loop
    (``strategy.run`` in a ``tf.function``) under plain Keras 3. Both train two workers
    to one process's weights; the WARNING is said under Keras 3 alone."""
    from .mw_worker import WAIT, train

    keras3 = multiworker.keras3_warning(tf2.__version__, {}, None) is not None
    if keras3:
        pytest.importorskip("tf_keras", reason="the TF 2.16+ legs install tf_keras --no-deps")
    expected = train(tf2)
    worker = str(ROOT / "tests" / "cluster_worker.py")
    for how, legacy in (("fit", "1"), ("tf_config", None)):
        envs = [{"TF_CONFIG": config} for config in tf_configs(2)]
        if legacy:
            envs = [dict(env, TF_USE_LEGACY_KERAS=legacy) for env in envs]
        ended = workers_together([[sys.executable, worker, how]] * 2, envs, WAIT)
        for code, stdout, stderr in ended:
            lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
            assert code == 0 and lines, stderr[-3000:]
            result = json.loads(lines[0][len("RESULT ") :])
            assert result["weights"] == pytest.approx(expected, abs=1e-5), how
            assert (multiworker.KERAS3_ISSUE in stderr) == (keras3 and not legacy), how
            if legacy:
                assert not result["keras"].startswith("3."), result["keras"]


# --- the real thing: TensorFlow -----------------------------------------------------------


def test_tf1_is_a_clear_error(tf1, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_configs(2)[0])
    with pytest.raises(RuntimeError, match=r"needs TensorFlow 2\.x; this is 1"):
        safestrategy.make_multiworker_strategy()


def test_the_only_worker_up_raises_naming_the_missing_one(tf2, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_configs(2)[0])
    monkeypatch.setenv("SAFESTRATEGY_PROBE_TIMEOUT", "2")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="no answer from worker:1") as error:
        safestrategy.make_multiworker_strategy()
    assert time.monotonic() - started < 15
    assert error.value.missing == ("worker:1",)


def test_the_cli_shows_the_multiworker_view(tf2):
    result = run_python(
        "-m", "safestrategy", "--json", env={"TF_CONFIG": tf_configs(1)[0]}, timeout=120
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["backend"], report["workers"], report["task"]) == ("ring", 1, "worker:0")


def test_two_workers_agree_and_train_like_one_process(tf2):
    """Two real worker processes on 127.0.0.1 (see tests/mw_worker.py for the steps)."""
    from .mw_worker import WAIT, train

    configs = tf_configs(2)
    commands = [[sys.executable, str(HERE / "mw_worker.py")]] * len(configs)
    ended = workers_together(commands, [{"TF_CONFIG": c} for c in configs], WAIT)
    results = []
    for _, stdout, stderr in ended:
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        assert lines, stderr[-3000:]
        results.append(json.loads(lines[0][len("RESULT ") :]))
    expected = train(tf2)  # one process, the whole global batch
    for index, result in enumerate(results):
        assert "nccl: failed: no GPU among the devices" in result["forced_nccl"]
        assert result["seamed"]["backend"] == "nccl"  # the real cross-worker check ran
        assert result["seamed"]["candidates"][0]["status"] == "ok"
        assert result["children_left"] is False
        report = result["report"]
        assert (report["backend"], report["workers"], report["task"]) == (
            "ring",
            2,
            f"worker:{index}",
        )
        assert report["candidates"][0]["status"] == "skipped"
        assert result["weights"] == results[0]["weights"]  # identical on both workers
        assert result["weights"] == pytest.approx(expected, abs=1e-6)


def test_a_worker_judges_its_own_replicas_against_the_global_sum():
    from safestrategy.multiworker.agree import judge

    ok = judge({"values": [["/gpu:0", [10.0] * 4], ["/gpu:1", [10.0] * 4]], "replicas": 4}, 4, 1)
    assert (ok.status, ok.reason) == ("ok", "2 local replicas got 10")
    dropped = judge({"values": [["/gpu:0", [7.0] * 4]], "replicas": 4}, 4, 1)
    assert dropped.reason == "wrong sum: expected 10 on each of 4 replicas, got [7.0]"
    ring = judge({"values": [["/cpu:0", [3.0] * 4]], "replicas": 1}, 2, 1)
    assert ring.reason.startswith("1 replicas in sync, expected 2")
    error = judge({"error": ["InternalError", "NCCL failure"]}, 2, 1)
    assert (error.status, error.reason) == ("failed", "InternalError: NCCL failure")


#: One worker calls the real factory and prints what the ``safestrategy`` logger said.
KERAS_CALLER = """
import json, logging, os
import tensorflow as tf
import safestrategy
from safestrategy.multiworker import factory
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append([record.levelname, record.getMessage()])
logging.getLogger("safestrategy").addHandler(Keep())
logging.getLogger("safestrategy").setLevel(logging.INFO)
strategy = safestrategy.make_multiworker_strategy()
keras = factory.imported_keras_version()
print("RESULT " + json.dumps({"tf": tf.__version__, "keras": keras, "records": records}))
os._exit(0)  # skip TensorFlow's slow gRPC teardown
"""


def test_the_factory_warns_about_keras_3_where_tf_keras_is_keras_3(tf2, monkeypatch):
    """The real factory path, one worker in a fresh process (a process builds one strategy
    on its TF_CONFIG port): on TF 2.16+ with Keras 3 the WARNING, elsewhere none."""
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    env = {"TF_CONFIG": tf_configs(1)[0], "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = run_python("-c", KERAS_CALLER, env=env, timeout=120)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, result.stderr[-3000:]
    child = json.loads(lines[0][len("RESULT ") :])
    keras_warnings = [m for level, m in child["records"] if level == "WARNING" and "Keras" in m]
    expected = multiworker.keras3_warning(child["tf"], {}, child["keras"])
    assert keras_warnings == ([expected] if expected else [])
    major, minor = (int(part) for part in child["tf"].split(".")[:2])
    if (major, minor) >= (2, 16) and (child["keras"] or "3.").startswith("3."):
        assert f"tf_keras~={major}.{minor}" in keras_warnings[0]  # TF 2.21: tf_keras~=2.21


def test_under_run_a_relaunched_workers_hello_waits_for_peers_still_stuck(monkeypatch):
    """After a relaunch a peer may still be stuck until its watchdog (stall timeout) and its
    run (--grace) free it: the hello waits that long on top of the usual timeout."""
    request = multiworker.Request(
        _cluster.parse_tf_config(tf_configs(2)[0]), resolve_communication(None), 3.0, True
    )
    monkeypatch.setenv("SAFESTRATEGY_STALL_TIMEOUT", "10")
    monkeypatch.setenv("SAFESTRATEGY_RUN_GRACE", "5")
    monkeypatch.setenv("SAFESTRATEGY_RESTART", "0")
    assert multiworker._hello_wait(request) == 3.0  # the first launch: as ever
    monkeypatch.setenv("SAFESTRATEGY_RESTART", "1")
    assert multiworker._hello_wait(request) == 18.0


def test_under_run_a_relaunched_workers_missing_workers_error_says_what_it_waited(monkeypatch):
    """The error quotes the wait it really had (probe timeout + stall timeout + --grace),
    not the probe timeout alone; a first launch keeps the probe timeout's words."""
    request = multiworker.Request(
        _cluster.parse_tf_config(tf_configs(2)[0]), resolve_communication(None), 1.0, True
    )
    cpu = {"gpus": 0, "nccl_kernels": 0, "tf_version": "2.99.0"}
    monkeypatch.setenv("SAFESTRATEGY_STALL_TIMEOUT", "1.5")
    monkeypatch.setenv("SAFESTRATEGY_RUN_GRACE", "0.5")
    monkeypatch.setenv("SAFESTRATEGY_RESTART", "1")
    with pytest.raises(MissingWorkersError) as relaunched:
        multiworker.decide(request, cpu)
    message = str(relaunched.value)
    assert "gave up after 3 s" in message
    assert (
        "within 3 s of each other (a worker relaunched by run waits for its peers "
        "SAFESTRATEGY_PROBE_TIMEOUT 1 s + SAFESTRATEGY_STALL_TIMEOUT 1.5 s + run's --grace "
        "0.5 s; raise SAFESTRATEGY_PROBE_TIMEOUT to wait longer)"
    ) in message
    monkeypatch.setenv("SAFESTRATEGY_RESTART", "0")
    with pytest.raises(MissingWorkersError) as first:
        multiworker.decide(request, cpu)
    assert "gave up after 1 s" in str(first.value)
    assert "within SAFESTRATEGY_PROBE_TIMEOUT seconds of each other (or raise it)" in str(
        first.value
    )
