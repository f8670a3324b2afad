"""How a launch ended, and what follows (safestrategy.run.judge): API.md's table, pure,
from hand-built run directories; no process is started."""

import signal

from safestrategy import _rundir, records
from safestrategy.report import Stall
from safestrategy.run import judge

PLACE = {
    "kind": records.KIND,
    "key": {"machine": "m", "devices": ["/device:CPU:0", "/device:CPU:1"]},
}
HERE = {"backend": "nccl", "devices": ["/device:GPU:0", "/device:GPU:1"], "mode": "auto"}


PID = 4242  #: the training's pid in the tables below


def decided(**fields):
    entry = {**HERE, "place": PLACE, "read": True, "remedy": {}, "pid": PID}
    return {**entry, "unread": None, "cache": "/the/trainings/cache", **fields}


def launch(decisions=(), beats=None, error="", fault="", stalled=()):
    beats = {PID: beats} if beats is not None else {}
    return _rundir.Launch(list(decisions), beats, error, fault, tuple(stalled))


def no_record(place, backend, cache):
    return None


def a_record(place, backend, cache):
    assert cache == "/the/trainings/cache"  # where the training reads, not run's own cache
    return Stall(backend, 600.0, "2026-12-02T10:00:00+00:00")


def test_a_recorded_stall_is_relaunched_and_an_unread_one_is_not():
    stalled = judge.Ended(75, 700.0)
    verdict = judge.judge(stalled, launch([decided()]), a_record)
    assert (verdict.relaunch, verdict.code, verdict.record) == (True, 75, None)
    assert verdict.why == (
        "training stalled on nccl after 600 s (recorded); the next decision tries nccl with "
        "NCCL_P2P_DISABLE=1, then with NCCL_SHM_DISABLE=1, then the next backend"
    )
    for why in ("a forced backend is used whatever its records say", "one device has no"):
        entry = decided(read=False, place=None, unread=why)
        verdict = judge.judge(stalled, launch([entry]), a_record)
        assert not verdict.relaunch and verdict.code == 75 and f"({why})" in verdict.why
    unknown = judge.judge(stalled, launch([decided()]), no_record)  # the watchdog could not tell
    assert not unknown.relaunch and "could not tell which strategy" in unknown.why


P2P, SHM = {"NCCL_P2P_DISABLE": "1"}, {"NCCL_SHM_DISABLE": "1"}
WORKER = {"kind": records.MULTIWORKER_KIND, "key": {"task": "worker:1"}}


def test_the_relaunch_line_says_what_the_next_decision_does():
    """Not "avoids it" where the next decision tries the same backend with another remedy."""
    crashed = judge.Ended(-6, 42.0)

    def why(**entry):
        return judge.judge(crashed, launch([decided(**entry)], "3 collectives"), no_record).why

    tail = "(killed by SIGABRT) (recorded); the next decision "
    after_p2p = why(task="worker:1", place=WORKER, remedy=P2P, next_remedies=[SHM])
    assert after_p2p.endswith(
        tail + "tries nccl with NCCL_SHM_DISABLE=1 on every worker, then ring"
    )
    after_shm = why(task="worker:1", place=WORKER, remedy=SHM, next_remedies=[])
    assert after_shm.endswith(tail + "takes ring on every worker")
    assert why(remedy=P2P).endswith(  # an entry of 0.4.0, without next_remedies
        tail + "tries nccl with NCCL_SHM_DISABLE=1, then the next backend"
    )
    assert why(backend="hierarchical_copy").endswith(
        tail + "avoids hierarchical_copy while another backend passes without a record"
    )


def test_a_decision_entry_lists_the_remedies_a_next_decision_retries(monkeypatch):
    from safestrategy.report import CandidateResult, Report

    def entry(backend, reason="", remedy=None):
        chosen = CandidateResult(backend, "ok", reason, remedy=remedy or {})
        report = Report(
            backend, "default", "auto", ("/gpu:0", "/gpu:1"), "Linux", "2.21.0", "tf2", (chosen,)
        )
        return records.decision_entry(report, None, 600.0)["next_remedies"]

    assert entry("nccl") == [P2P, SHM] and entry("nccl", remedy=P2P) == [SHM]
    assert entry("collective", "all 2 replicas got the right sum (NCCL requested)") == [P2P, SHM]
    assert entry("collective", "all 2 replicas got the right sum (RING requested)") == []
    monkeypatch.setenv("NCCL_SHM_DISABLE", "0")  # the user's own: never tried
    assert entry("nccl") == [P2P]
    monkeypatch.setenv("SAFESTRATEGY_NCCL_REMEDIES", "off")
    assert entry("nccl") == []


def test_an_allreduce_death_inside_a_tf_call_is_a_crash_record_and_a_relaunch():
    for returncode in (-6, 134, -11, 135):  # SIGABRT, SIGSEGV: as a signal or from a shell
        verdict = judge.judge(
            judge.Ended(returncode, 42.0), launch([decided()], "17 collectives"), no_record
        )
        assert verdict.relaunch and verdict.record.kind == "crash"
        assert verdict.record.cause.startswith("killed by SIG") and verdict.record.seconds == 42.0
        assert verdict.code == judge.exit_code(returncode)
    error = "InternalError: ncclUnhandledCudaError: Call to CUDA function failed."
    verdict = judge.judge(judge.Ended(1, 9.0), launch([decided()], "3 inside", error), no_record)
    assert verdict.relaunch and verdict.record.cause == error and verdict.code == 1


def test_a_peer_its_user_stopped_ends_the_run_without_a_relaunch():
    worker = decided(
        task="worker:0", place={"kind": records.MULTIWORKER_KIND, "key": {}}, read=False
    )
    line = "worker:1 was stopped by its user"
    stopped = {"where": "step", "outside": False, "recorded": False, "verdict": "stopped",
               "culprit": "worker:1", "line": line}  # fmt: skip
    aborted = "UnavailableError: Collective ops is aborted by: Socket closed"
    verdict = judge.judge(
        judge.Ended(1, 30.0), launch([worker], "3 collectives", aborted, "", [stopped]), a_record
    )
    assert (verdict.relaunch, verdict.record, verdict.code) == (False, None, 1)
    assert verdict.why == f"{line}: nothing recorded, and a relaunch would wait for it"


def test_a_silence_or_a_crash_in_a_tf_call_of_its_own_is_not_the_allreduce():
    """The last heartbeat put the call in none of the strategy's collectives (an
    evaluation, a file read): neither recorded nor relaunched (0.5.2, 2b)."""
    silent = judge.judge(
        judge.Ended(-9, 30.0, starved=True), launch([decided()], "8 inside"), no_record
    )
    crashed = judge.judge(judge.Ended(-6, 5.0), launch([decided()], "9 inside"), no_record)
    for verdict in (silent, crashed):
        assert not verdict.relaunch and verdict.record is None
        assert judge.OWN_WORK in verdict.why
    assert silent.code == 75 and "another backend would wait the same way" in silent.why
    assert crashed.code == 134 and crashed.why.startswith("killed by SIGABRT in a TensorFlow")
    # the fault dump says more than no heartbeat, never more than the last heartbeat
    after = judge.judge(
        judge.Ended(-6, 5.0), launch([decided()], "9 inside", fault=FAULT), a_record
    )
    assert after.record is None


def test_what_no_record_can_cure_is_not_relaunched():
    cases = {
        "teardown": (judge.Ended(-6, 5.0), launch([decided()], _rundir.FINISHED)),
        "outside a call": (judge.Ended(-6, 5.0), launch([decided()], "9 outside")),
        "before any factory": (judge.Ended(1, 2.0), launch([], None, "ImportError: no tf")),
        "the user's error": (judge.Ended(1, 2.0), launch([decided()], "4 inside", "ValueError: x")),
        "ambiguous": (
            judge.Ended(-6, 5.0),
            launch([decided(), decided(backend="ring")], "2 inside"),
        ),
    }
    for what, (ended, left) in cases.items():
        verdict = judge.judge(ended, left, a_record)
        assert not verdict.relaunch and verdict.record is None, what
        assert verdict.code == judge.exit_code(ended.returncode), what
    assert judge.NOT_CURABLE in judge.judge(*cases["the user's error"], a_record).why


def test_a_signal_to_run_a_silent_child_and_a_gone_peer():
    signalled = judge.judge(
        judge.Ended(-15, 3.0, signalled=signal.SIGTERM), launch([decided()]), a_record
    )
    assert (signalled.relaunch, signalled.code) == (False, 143)
    silent = judge.judge(
        judge.Ended(-9, 30.0, starved=True), launch([decided()], "8 collectives"), no_record
    )
    assert silent.relaunch and silent.code == 75 and silent.record.kind == "stall"
    worker = decided(
        task="worker:1", place={"kind": records.MULTIWORKER_KIND, "key": {}}, read=False
    )
    for error, quoted in PEER_ERRORS:
        peer = judge.judge(judge.Ended(1, 9.0), launch([worker], "5 inside", error), no_record)
        assert (peer.relaunch, peer.record) == (True, None)
        assert peer.why == f"a peer is gone ({quoted}); nothing recorded"
    alone = judge.judge(judge.Ended(1, 9.0), launch([decided()], "5 inside", error), no_record)
    assert alone.record is not None  # one machine: no peer to blame, the all-reduce crashed


def test_a_stall_outside_the_allreduce_is_not_relaunched_and_run_says_where():
    outside = {"where": "input", "outside": True, "recorded": False}
    verdict = judge.judge(judge.Ended(75, 700.0), launch([decided()], stalled=[outside]), a_record)
    assert (verdict.relaunch, verdict.code, verdict.record) == (False, 75, None)
    assert verdict.why.startswith("training stalled waiting for input data (an iterator's")
    assert "outside the all-reduce: nothing recorded" in verdict.why


def test_a_multiworker_stall_follows_the_verdict_every_worker_drew():
    worker = decided(task="worker:0", place={"kind": records.MULTIWORKER_KIND, "key": {}})
    line = "worker:2 holds the others back: waiting for input data for 615 s (train.py:40)"
    held = {"where": "step", "outside": False, "recorded": False, "verdict": "held", "line": line}
    verdict = judge.judge(judge.Ended(75, 700.0), launch([worker], stalled=[held]), a_record)
    assert (verdict.relaunch, verdict.record, verdict.ended) == (False, None, "held back by a peer")
    assert verdict.why.startswith(line + ": nothing recorded on any worker")
    aborted = "UnavailableError: Collective ops is aborted by: Socket closed"  # TF ended it
    verdict = judge.judge(
        judge.Ended(1, 700.0), launch([worker], "3 inside", aborted, "", [held]), a_record
    )
    assert (verdict.relaunch, verdict.ended) == (False, "held back by a peer")
    gone = {**held, "verdict": "gone", "line": "worker:1 stopped answering 40 s ago"}
    verdict = judge.judge(judge.Ended(75, 700.0), launch([worker], stalled=[gone]), a_record)
    assert (verdict.relaunch, verdict.record) == (True, None)
    assert verdict.why == "worker:1 stopped answering 40 s ago: a peer is gone; nothing recorded"


#: faulthandler's dump of a SIGABRT in the first step, before any heartbeat (TF 2.21).
FAULT = """Fatal Python error: Aborted

Thread 0x00007f1 (most recent call first):
  File "/v/site-packages/tensorflow/python/eager/execute.py", line 53 in quick_execute
  File "/v/site-packages/tensorflow/python/eager/def_function.py", line 833 in __call__
  File "/home/me/train.py", line 40 in <module>
"""


def test_a_crash_in_the_first_step_is_told_by_the_fault_dump_before_any_heartbeat():
    first = judge.judge(judge.Ended(-6, 3.0), launch([decided()], None, fault=FAULT), no_record)
    assert first.relaunch and first.record.kind == "crash"
    assert first.record.where == "/the/trainings/cache"  # the training's cache, not run's
    python_only = FAULT.replace("/tensorflow/python/", "/mylib/")
    outside = judge.judge(
        judge.Ended(-6, 3.0), launch([decided()], None, fault=python_only), no_record
    )
    assert not outside.relaunch and outside.record is None


def test_the_users_own_signal_is_named_as_the_reason():
    for returncode, name in ((-2, "SIGINT"), (130, "SIGINT"), (131, "SIGQUIT"), (-9, "SIGKILL")):
        verdict = judge.judge(
            judge.Ended(returncode, 5.0), launch([decided()], "3 inside"), a_record
        )
        assert not verdict.relaunch
        assert verdict.why == f"the training was ended by {name}, a signal from outside"
    error = "Traceback (most recent call last):\n  ...\nKeyboardInterrupt"
    interrupted = judge.judge(judge.Ended(1, 5.0), launch([decided()], "3 inside", error), a_record)
    assert interrupted.why == "the training was interrupted (KeyboardInterrupt)"
    to_run = judge.judge(
        judge.Ended(-2, 5.0, signalled=signal.SIGINT), launch([decided()]), a_record
    )
    assert (to_run.code, to_run.ended, to_run.why) == (130, "stopped by SIGINT", "your own signal")


#: What TF 2.21 raised in the survivor when its peer aborted mid-step (the two-worker test
#: below): the non-leader gone (the coordination service), the leader gone (the transport).
PEER_ERRORS = [
    (
        "tensorflow.python.framework.errors_impl.UnavailableError: Graph execution error:\n\n"
        "Detected at node CollectiveReduceV2 defined at (most recent call last):\n"
        "Collective ops is aborted by: Error reported from /job:worker/task:1: The following "
        "tasks are unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1\n",
        "Collective ops is aborted by: Error reported from /job:worker/task:1: The following "
        "tasks are unhealthy (stopped sending heartbeats):",
    ),
    (
        "tensorflow.python.framework.errors_impl.UnavailableError: Graph execution error:\n\n"
        "Collective ops is aborted by: Socket closed\nAdditional GRPC error information from "
        "remote target /job:worker/replica:0/task:0 while calling "
        "/tensorflow.WorkerService/RecvBuf:\n",
        "Collective ops is aborted by: Socket closed",
    ),
    (
        "UnavailableError: Collective ops is aborted by: task /job:worker/task:0 is down",
        "UnavailableError: Collective ops is aborted by: task /job:worker/task:0 is down",
    ),
]


def test_a_stall_whose_allreduce_answered_is_not_relaunched_and_run_says_so():
    """The canary answered (the step is stuck in the program) or none could run: nothing
    was recorded, and another backend would not help."""
    for shown, said, because in (
        ("answered", "the all-reduce answered in 4 ms", "another backend would wait the same"),
        ("none", "no all-reduce could be run to check it (x)", "would only be a guess"),
    ):
        stall = {"where": "step", "outside": False, "recorded": False, "canary": shown}
        stall["canary_said"] = said
        verdict = judge.judge(
            judge.Ended(75, 700.0), launch([decided()], stalled=[stall]), a_record
        )
        assert (verdict.relaunch, verdict.code, verdict.record) == (False, 75, None)
        assert verdict.why.startswith(f"training stalled on nccl, but {said}: nothing recorded")
        assert because in verdict.why
    convicted = {"where": "step", "outside": False, "recorded": True, "canary": "hung"}
    verdict = judge.judge(
        judge.Ended(75, 700.0), launch([decided()], stalled=[convicted]), a_record
    )
    assert verdict.relaunch and "(recorded)" in verdict.why


def a_corrupt_record(place, backend, cache):
    return Stall(backend, 90.0, "2026-12-07T10:00:00+00:00", {}, "corrupt", "replica 2", "x")


def test_a_broken_mirror_is_relaunched_on_the_next_backend_unless_it_is_the_last():
    """The check's run-directory entry decides, whether the training ended by exit 75
    (SAFESTRATEGY_STALL_ACTION=exit) or by the uncaught MirrorBrokenError (exit 1)."""
    where = "replica 2 (/device:GPU:2) at step 18,400"
    broke = {"kind": "corrupt", "where": where, "recorded": True, "last_resort": None}
    entry = decided(backend="hierarchical_copy")
    for code in (75, 1):
        verdict = judge.judge(
            judge.Ended(code, 90.0), launch([entry], stalled=[broke]), a_corrupt_record
        )
        assert (verdict.relaunch, verdict.code, verdict.record) == (True, code, None)
        assert verdict.why == (
            f"training's all-reduce returned wrong numbers on {where} (recorded); the next "
            "decision avoids hierarchical_copy while another backend passes without a record"
        )
    last = {**broke, "last_resort": "take /device:GPU:2 out: CUDA_VISIBLE_DEVICES=0,1,3"}
    verdict = judge.judge(judge.Ended(75, 90.0), launch([entry], stalled=[last]), a_corrupt_record)
    assert not verdict.relaunch and verdict.code == 75
    assert verdict.why.endswith(
        "no other backend passes on these devices: take /device:GPU:2 out: "
        "CUDA_VISIBLE_DEVICES=0,1,3"
    )
    forced = decided(
        read=False, place=None, unread="a forced backend is used whatever its records say"
    )
    verdict = judge.judge(judge.Ended(1, 90.0), launch([forced], stalled=[broke]), a_corrupt_record)
    assert not verdict.relaunch and verdict.why.endswith(
        "(a forced backend is used whatever its records say)"
    )
    # a stall record of the backend is not the check's: no relaunch claims it
    verdict = judge.judge(judge.Ended(1, 90.0), launch([entry], stalled=[broke]), a_record)
    assert not verdict.relaunch
