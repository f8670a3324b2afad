"""Which worker holds the others back (safestrategy.training.peers and .board): the pure verdict and
whereabouts from hand-built inputs, the key-value board on a stand-in store, then real
workers on 127.0.0.1 (tests/peers_worker.py), one per verdict."""

import os
import re
import signal
import subprocess
import threading
import time
import types

import pytest

from safestrategy import records
from safestrategy.training import peers
from safestrategy.training.board import Board
from safestrategy.training.peers import GONE, HELD, STUCK, UNSEEN, Beat, Heard

from . import peers_worker
from .conftest import needs_tf

TASKS = ("worker:0", "worker:1", "worker:2")


def beat(task, where=peers.STEP, seconds=600.0, at="train.py:40", sample=9):
    return Beat(task, "host", sample, where, seconds, at)


def heard(*wheres, ago=1.0):
    """Every worker heard ``ago`` s ago (worker:0 is this one, heard now)."""
    return {
        task: Heard(beat(task, where), 0.0 if task == "worker:0" else ago)
        for task, where in zip(TASKS, wheres)
    }


def test_every_worker_inside_the_step_is_the_communication():
    for wheres in ((peers.STEP, peers.STEP, peers.STEP), (peers.PY_FUNCTION,) * 2):
        verdict = peers.verdict("worker:0", heard(*wheres), 5.0)
        assert (verdict.kind, verdict.task) == (STUCK, None)
        assert verdict.line.startswith("every worker is inside the same step")


@pytest.mark.parametrize("where", [peers.INPUT, peers.OUTSIDE, peers.CHECKPOINT])
def test_a_worker_away_from_the_allreduce_holds_the_others_back(where):
    verdict = peers.verdict("worker:0", heard(peers.STEP, where, peers.STEP), 5.0)
    assert (verdict.kind, verdict.task) == (HELD, "worker:1")
    assert verdict.line == (
        f"worker:1 holds the others back: {peers.WHERE[where]} for 600 s (train.py:40)"
    )
    # every worker draws the same verdict, the culprit too
    assert peers.verdict("worker:1", heard(peers.STEP, where, peers.STEP), 5.0) == verdict


def test_workers_between_steps_hold_no_one_back():
    moving = heard(peers.INPUT, peers.OUTSIDE)
    verdict = peers.verdict("worker:0", moving, 5.0, hold=3.0)  # away 600 s: both hold
    assert (verdict.kind, verdict.task) == (HELD, "worker:0")
    assert verdict.line.startswith("no worker is in the all-reduce: worker:0 is waiting")
    brief = {t: Heard(h.beat._replace(seconds=0.0), h.ago) for t, h in moving.items()}
    assert peers.verdict("worker:0", brief, 5.0, hold=3.0).kind == UNSEEN  # a moment each


def test_a_py_function_that_the_others_wait_for_holds_them_back():
    verdict = peers.verdict("worker:0", heard(peers.STEP, peers.PY_FUNCTION), 5.0)
    assert (verdict.kind, verdict.task) == (HELD, "worker:1")
    assert "running your Python in a py_function for 600 s" in verdict.line


def test_a_worker_unheard_for_more_than_two_samples_stopped_answering():
    stale = heard(peers.STEP, peers.STEP, peers.STEP)
    stale["worker:2"] = Heard(beat("worker:2"), 11.2)  # 2 samples of 5 s, and a second more
    verdict = peers.verdict("worker:0", stale, 5.0)
    assert (verdict.kind, verdict.task, verdict.line) == (
        GONE,
        "worker:2",
        "worker:2 stopped answering 11 s ago",
    )
    stale["worker:2"] = Heard(beat("worker:2"), 10.9)
    assert peers.verdict("worker:0", stale, 5.0).kind == STUCK  # not yet
    never = {**stale, "worker:2": Heard(None, None)}  # a worker without safestrategy
    assert "worker:2 was never heard from" in peers.verdict("worker:0", never, 5.0).line
    assert peers.verdict("worker:0", stale, 5.0, seen=False).kind == UNSEEN


def test_the_table_shows_every_worker():
    text = peers.table("worker:0", heard(peers.STEP, peers.INPUT, ago=2.4))
    lines = text.splitlines()
    assert lines[0].split() == ["task", "host", "where", "since", "last", "heard"]
    assert "this worker" in lines[1] and "waiting for input data (train.py:40)" in lines[2]
    assert lines[2].rstrip().endswith("2 s ago")


def fake_frame(filename, name, back=None, line=1):
    code = types.SimpleNamespace(co_filename=filename, co_name=name)
    return types.SimpleNamespace(f_code=code, f_back=back, f_lineno=line, f_locals={})


TF = "/v/site-packages/tensorflow/python"


def library(filename):
    return "site-packages" in filename


def test_whereabouts_reads_the_threads_as_the_watchdog_samples_them():
    main = fake_frame("/me/train.py", "<module>", line=88)
    assert peers.whereabouts({1: main}, {}, 1, library) == (peers.OUTSIDE, "train.py:88", None)
    step = fake_frame(f"{TF}/eager/def_function.py", "__call__", main)
    calls = {1: (step, "step")}
    assert peers.whereabouts({1: step}, calls, 1, library) == (peers.STEP, "train.py:88", step)
    assert peers.whereabouts({1: step}, {1: (step, "input")}, 1, library)[0] == peers.INPUT
    script = fake_frame(f"{TF}/ops/script_ops.py", "__call__")
    user = fake_frame("/me/layers.py", "sleepy", script)
    frames = {1: step, 2: user}
    assert peers.whereabouts(frames, calls, 1, library) == (
        peers.PY_FUNCTION,
        "layers.py:1",
        script,  # the py_function call: one object for as long as it runs
    )
    generator = fake_frame(
        "/me/data.py",
        "batches",
        fake_frame(
            f"{TF}/data/ops/from_generator_op.py",
            "generator_py_func",
            fake_frame(f"{TF}/ops/script_ops.py", "__call__"),
        ),
    )
    where = peers.whereabouts({1: step, 2: generator}, calls, 1, library)
    assert where[:2] == (peers.INPUT, "data.py:1")
    saving = fake_frame(f"{TF}/checkpoint/checkpoint.py", "save", main)
    assert peers.whereabouts({1: saving}, {}, 1, library)[0] == peers.CHECKPOINT


def test_the_line_named_is_the_users_not_pythons_own_or_safestrategys():
    """A py_function waiting on an Event sits in threading.py, called from the user's
    layer; a safestrategy frame is no one's line either."""
    import threading as threading_module

    script = fake_frame(f"{TF}/ops/script_ops.py", "__call__")
    user = fake_frame("/me/layers.py", "sleepy", script, line=40)
    waiting = fake_frame(threading_module.__file__, "wait", user, line=320)
    ours = fake_frame(peers.__file__, "publish", waiting)
    where = peers.whereabouts({2: ours}, {}, None, library)
    assert where[:2] == (peers.PY_FUNCTION, "layers.py:40")


def test_a_steady_worker_is_in_each_step_only_as_long_as_that_step(monkeypatch, caplog):
    """Two workers' watchdogs (their own ``_Here`` each) publish a sample a second with a
    stall timeout of 5 s. Stepping steadily, each sample in a new step, a worker is
    inside a step for no time, and one sampled in its ``get_next`` between steps says
    nothing of holding the other back (a healthy run had said it: its steps had added up
    to 135 s "inside a step"). A step that stays, against a ``get_next`` that stays, for
    the timeout: the one in ``get_next`` says once that it holds the other back."""
    from safestrategy import _env
    from safestrategy.training import publish

    settings, now = _env.StallSettings(5.0, "exit"), [100.0]
    store, me = Store(), threading.main_thread().ident
    boards = [Board(store.kv(), ["a", "b"], TASKS[:2], t, lambda: now[0]) for t in TASKS[:2]]
    heres = [type("_Here", (publish.Here,), {}) for _ in boards]
    main = fake_frame("/me/train.py", "<module>", line=7)

    def sample(number, *calls):  # each worker's call: (frame, kind), or None outside
        for board, here, call in zip(boards, heres, calls):
            monkeypatch.setattr(publish, "Here", here)
            seen = {me: call} if call else {}
            frames = {me: call[0] if call else main}
            publish.publish(board, number, seen, frames, now[0], 0.0, settings)
        now[0] += 1.0

    def step():
        return fake_frame(f"{TF}/eager/def_function.py", "__call__", main), "step"

    def get_next():
        return fake_frame(f"{TF}/data/ops/iterator_ops.py", "get_next", main), "input"

    caplog.set_level("ERROR", logger="safestrategy")
    for number in range(1, 11):
        sample(number, step(), step())
    sample(11, get_next(), step())
    beat = boards[0].heard()["worker:1"].beat
    assert (beat.where, beat.seconds) == (peers.STEP, 0.0)
    assert caplog.records == []
    hung, blocked = step(), get_next()
    for number in range(12, 19):
        sample(number, blocked, hung)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert said[0].startswith("this worker (worker:0) holds the others back: waiting for input")


class Store:
    """TensorFlow's key-value store as it behaves (TF 2.21): a key is inserted once, a read
    waits for it up to its timeout; ``frozen`` makes every call hang (a SIGSTOPped leader)."""

    def __init__(self):
        self.values, self.frozen = {}, threading.Event()

    def _wait(self):
        if self.frozen.is_set():
            time.sleep(3600)

    def put(self, key, value):
        self._wait()
        if key in self.values:
            raise type("AlreadyExistsError", (Exception,), {})(f"key {key} already exists.")
        self.values[key] = value

    def get(self, key, timeout_in_ms):
        self._wait()
        deadline = time.monotonic() + timeout_in_ms / 1000
        while key not in self.values:  # as TF's: answered as soon as the key is written
            if time.monotonic() >= deadline:
                raise type("DeadlineExceededError", (Exception,), {})(key)
            time.sleep(0.01)
        return self.values[key]

    def delete(self, key):
        self._wait()
        self.values.pop(key, None)

    def kv(self):
        return self.put, self.get, self.delete


def test_the_board_publishes_over_and_over_and_hears_a_counter_change():
    store, now = Store(), [100.0]
    cluster = ["127.0.0.1:1", "127.0.0.1:2"]
    zero = Board(store.kv(), cluster, TASKS[:2], "worker:0", lambda: now[0])
    one = Board(store.kv(), cluster, TASKS[:2], "worker:1", lambda: now[0])
    for sample in (1, 2):
        one.publish(sample, peers.STEP, 3.0 * sample, "train.py:9")  # inserted again
        zero.publish(sample, peers.STEP, 3.0, "")
        zero.look()
        now[0] += 5
    assert zero.heard()["worker:1"] == Heard(
        Beat("worker:1", one.host, 2, "step", 6.0, "train.py:9"), 5.0
    )
    zero.look()  # the same counter again: heard no later
    now[0] += 5
    assert zero.heard()["worker:1"].ago == 10.0 and zero.seen


def test_time_this_worker_was_stopped_is_no_peers_silence():
    store, now = Store(), [100.0]
    zero, one = [Board(store.kv(), ["a", "b"], TASKS[:2], t, lambda: now[0]) for t in TASKS[:2]]
    one.publish(1, peers.STEP, 1.0, "")
    zero.look()
    now[0] += 20  # worker:0 was SIGSTOPped for 20 s, then continued
    zero.paused(20.0)
    assert zero.heard()["worker:1"].ago == 0.0
    assert zero.verdict(1.0).kind != GONE


def test_a_worker_the_gone_leader_named_says_it_was_the_one_stopped():
    store, now = Store(), [100.0]
    zero, one = [Board(store.kv(), ["a", "b"], TASKS[:2], t, lambda: now[0]) for t in TASKS[:2]]
    zero.publish(1, peers.STEP, 1.0, "")
    one.publish(1, peers.STEP, 1.0, "")
    zero.publish(-1, peers.STEP, 1.0, "", peers.Verdict(GONE, "worker:1", "worker:1 stopped"))
    one.look()
    store.frozen.set()  # the leader ended, and with it the service
    one.call.bound = 0.2
    now[0] += 30
    one.look()
    verdict = one.verdict(1.0)
    assert verdict == peers.Verdict(
        GONE, "worker:1", "worker:1 stopped answering (worker:0 said so as it ended)"
    )  # the leader's verdict, not "worker:0 stopped answering": one verdict


def test_a_beat_this_version_cannot_read_is_unknown_not_an_error():
    assert Beat.from_json("{") is None
    assert Beat.from_json(Beat("worker:1", "h", 1, "somewhere new", 1.0).to_json()) is None


def test_the_first_beat_is_published_as_the_strategy_is_built_and_a_verdict_ends_with_its_stall(
    monkeypatch,
):
    from safestrategy import _env
    from safestrategy.report import Report
    from safestrategy.training import publish, sampler, watchdog

    monkeypatch.setattr(watchdog, "_board", None)
    monkeypatch.setattr(watchdog, "_watched", [])
    monkeypatch.setattr(publish, "Here", type("_Here", (publish.Here,), {}))
    store = Store()
    zero, one = [Board(store.kv(), ["a", "b"], TASKS[:2], t) for t in TASKS[:2]]
    report = Report(backend="ring", source="auto", mode="auto", devices=("/device:CPU:0",),
                    platform="Linux", tf_version="2.21.0", tf_api="tf.distribute",
                    candidates=(), task="worker:1", workers=2)  # fmt: skip
    watchdog.watch(_env.StallSettings(None, "warn"), report, None, None, one)
    zero.look()
    first = zero.heard()["worker:1"].beat
    assert first.where == peers.OUTSIDE and first.seconds == 0.0  # before any sample
    one.said = peers.Verdict(HELD, "worker:0", "worker:0 holds the others back")
    finished = sampler.Event(sampler.FINISHED, 1, sampler.Watched(None, sampler.OP, 0.0), 30.0)
    watchdog._handle(finished, _env.StallSettings(5.0, "warn"))
    assert one.said is None  # its later beats say no verdict: a later stall draws its own


def test_a_frozen_service_bounds_every_call_and_the_peers_are_unseen():
    store = Store()
    board = Board(store.kv(), ["a", "b"], TASKS[:2], "worker:0")
    store.frozen.set()
    started = time.monotonic()
    board.publish(1, peers.STEP, 1.0, "")
    board.look()
    assert time.monotonic() - started < 1.5  # one bounded wait, then "still stuck" at once
    assert not board.seen
    verdict = peers.verdict("worker:0", board.heard(), 5.0, board.seen)
    assert verdict.kind == UNSEEN and "could not be seen" in verdict.line


# --- real workers on 127.0.0.1 ----------------------------------------------------------

STALL = 5  #: the stall timeout the workers watch with once their step is compiled
WAIT = 240  #: seconds a worker may take to start and compile on a loaded 2-core machine


def workers(tmp_path, scenario, culprit, count):
    """``count`` workers of ``scenario``, all READY (tests/peers_worker.py's launcher)."""
    return peers_worker.cluster(tmp_path, scenario, culprit, count, STALL, WAIT, pytest.fail)


def stalled(processes, outputs, culprit):
    """Wait (bounded) for every worker but the culprit to end; each one's stderr."""
    for index, process in enumerate(processes):
        if index != culprit:
            try:
                process.wait(timeout=STALL * 6 + 30)
            except subprocess.TimeoutExpired:
                pytest.fail(f"worker {index} never ended:\n{outputs[index][1].read_text()[-3000:]}")
    return [err.read_text() for _, err in outputs]


def verdict_of(text):
    found = re.search(r"^(worker:\d .*|every worker .*|no worker .*)\.$", text, re.M)
    return found.group(1) if found else text[-3000:]


@needs_tf
def test_three_workers_name_the_one_that_sleeps_between_steps(seeing, tmp_path):
    with workers(tmp_path, "sleep", 2, 3) as (processes, outputs):
        errors = stalled(processes, outputs, 2)
        deadline = time.monotonic() + 3 * STALL / 5  # the culprit says so at a sample
        while "holds the others back" not in outputs[2][1].read_text():
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        culprit = outputs[2][1].read_text()
    for index in (0, 1):
        assert processes[index].returncode == 75, errors[index][-3000:]
        said = verdict_of(errors[index])
        assert said.startswith("worker:2 holds the others back: outside any TensorFlow call"), said
        assert "peers_worker.py:" in said and "Not recorded: a worker outside" in errors[index]
        assert "workers:" in errors[index]
    assert "this worker (worker:2) holds the others back: outside any TensorFlow" in culprit
    assert all(records.every(str(tmp_path / f"c{i}")) == [] for i in range(3))  # none anywhere


@needs_tf
@pytest.mark.skipif(os.name != "posix", reason="SIGSTOP is POSIX")
def test_a_sigstopped_worker_stopped_answering(seeing, tmp_path):
    with workers(tmp_path, "stop", 1, 2) as (processes, outputs):
        time.sleep(STALL / 5 * 2 + 0.5)  # two samples: its peer has heard it step
        os.kill(processes[1].pid, signal.SIGSTOP)
        errors = stalled(processes, outputs, 1)
    said = verdict_of(errors[0])
    if processes[0].returncode == 75:  # the round decided it
        assert re.match(r"worker:1 did not join the canary round( in \d+ s)?: it is frozen or "
                        r"gone \(it stopped answering \d+ s ago\)$", said), errors[0]  # fmt: skip
    else:  # TF's health check (its heartbeat timeout) came first: its abort names it
        assert gone_or_aborted(errors[0], "worker:1"), errors[0][-3000:]
    assert records.every(str(tmp_path / "c0")) == []


def gone_or_aborted(text, task):
    """Whether ``text`` names ``task`` gone: the round's verdict, or TensorFlow's own abort
    that came first (API.md: frozen or killed peers are usually decided first by it)."""
    return bool(re.search(rf"^({task} did not join the canary round|training stopped: {task} "
                          "stopped answering)", text, re.M))  # fmt: skip


@needs_tf
@pytest.mark.skipif(os.name != "posix", reason="SIGKILL is POSIX")
def test_a_worker_killed_while_away_is_gone_not_holding_the_others_back(seeing, tmp_path):
    with workers(tmp_path, "sleep", 1, 2) as (processes, outputs):
        time.sleep(STALL / 2)  # away (asleep between steps), then killed before any verdict
        os.kill(processes[1].pid, signal.SIGKILL)
        errors = stalled(processes, outputs, 1)
    assert gone_or_aborted(errors[0], "worker:1"), errors[0][-3000:]
    assert "holds the others back" not in errors[0]
    assert records.every(str(tmp_path / "c0")) == []


@needs_tf
@pytest.mark.skipif(os.name != "posix", reason="the test sends SIGINT as a terminal does")
def test_a_leader_its_user_stopped_ends_its_peer_promptly_and_says_why(seeing, tmp_path):
    """Ctrl-C on the leader (its exit ends the coordination service): its last beat says
    so, and the peer its exit aborts ends on that, within two samples, instead of
    "stopped answering" (which ``run`` relaunches, to wait for a worker not coming back)."""
    with workers(tmp_path, "interrupt", 0, 2) as (processes, outputs):
        time.sleep(STALL / 5 * 2 + 0.5)  # two samples: they have heard each other step
        os.kill(processes[0].pid, signal.SIGINT)
        started = time.monotonic()
        errors = stalled(processes, outputs, 0)
        ended = time.monotonic() - started
        processes[0].wait(timeout=30)
    assert "KeyboardInterrupt" in errors[0] and processes[0].returncode != 0
    assert "worker:0 was stopped by its user: telling the other workers" in errors[0]
    assert "training stopped: worker:0 was stopped by its user (Ctrl-C)" in errors[1], errors[1][
        -3000:
    ]
    assert "does not relaunch this worker" in errors[1]
    assert ended < 2 * STALL / 5 + 10  # two samples and the service's bound, not a stall
    assert records.every(str(tmp_path / "c1")) == []


@needs_tf
def test_every_worker_stuck_in_its_step_while_the_canary_answers_is_the_program(seeing, tmp_path):
    with workers(tmp_path, "all", -1, 2) as (processes, outputs):
        errors = stalled(processes, outputs, -1)
    for index in (0, 1):
        assert processes[index].returncode == 75, errors[index][-3000:]
        said = verdict_of(errors[index])
        assert said.startswith("every worker is inside the step, and the communication answers")
        assert "the all-reduce answered in" in errors[index]
        assert "Not recorded against ring: its all-reduce answers" in errors[index]
        assert records.every(str(tmp_path / f"c{index}")) == []


@needs_tf
def test_a_canary_that_does_not_answer_on_every_worker_is_recorded(seeing, tmp_path):
    with workers(tmp_path, "stuck", -1, 2) as (processes, outputs):
        errors = stalled(processes, outputs, -1)
    for index in (0, 1):
        assert processes[index].returncode == 75, errors[index][-3000:]
        said = verdict_of(errors[index])
        assert said.startswith("every worker joined the canary round, and the all-reduce itself "
                               "did not answer"), said  # fmt: skip
        (record,) = [s for _, _, s in records.every(str(tmp_path / f"c{index}"))]
        assert record.evidence == "canary" and record.cause.startswith("every worker joined")


@needs_tf
@pytest.mark.skipif(os.name != "posix", reason="a FIFO is POSIX")
def test_a_worker_blocked_in_its_own_eager_read_holds_the_others_back(seeing, tmp_path):
    with workers(tmp_path, "read", 1, 2) as (processes, outputs):
        errors = stalled(processes, outputs, -1)
    for index in (0, 1):  # the reader's own stall fires too: one verdict on both
        assert processes[index].returncode == 75, errors[index][-3000:]
        said = verdict_of(errors[index])
        assert said.startswith("worker:1 holds the others back: in a TensorFlow call of its "
                               "own, outside the strategy's collectives"), said  # fmt: skip
        assert records.every(str(tmp_path / f"c{index}")) == []


@needs_tf
def test_a_worker_late_to_a_checkpoint_holds_back_those_waiting_in_its_all_reduce(seeing, tmp_path):
    with workers(tmp_path, "checkpoint", 1, 2) as (processes, outputs):
        errors = stalled(processes, outputs, 1)
    assert processes[0].returncode == 75, errors[0][-3000:]
    said = verdict_of(errors[0])
    assert said.startswith("worker:1 holds the others back: outside any TensorFlow call"), said
    assert records.every(str(tmp_path / "c0")) == []


def test_a_service_that_answered_then_stopped_is_its_leader_gone():
    store = Store()
    cluster = ["127.0.0.1:1", "127.0.0.1:2"]
    leader = Board(store.kv(), cluster, TASKS[:2], "worker:0")
    board = Board(store.kv(), cluster, TASKS[:2], "worker:1")
    leader.publish(1, peers.STEP, 1.0, "")
    board.look()
    assert board.answered and board.seen
    store.frozen.set()  # the leader, which serves the store, is SIGSTOPped or killed
    board.look()
    # a moment ago: the beats heard until then speak (it may have ended on its own stall)
    assert board.verdict(5.0).kind == STUCK
    now = time.monotonic()
    board.clock = lambda: now + 12  # more than two samples of 5 s later
    verdict = board.verdict(5.0)
    assert (verdict.kind, verdict.task) == (GONE, "worker:0")
    assert "(it serves TensorFlow's coordination service)" in verdict.line


@pytest.mark.parametrize(
    "error, task",
    [
        (
            "UnavailableError: Collective ops is aborted by: Error reported from "
            "/job:worker/task:1: The following tasks are unhealthy (stopped sending "
            "heartbeats):\n/job:worker/replica:0/task:1\n",
            "worker:1",
        ),
        (
            "UnavailableError: Collective ops is aborted by: Socket closed\nAdditional GRPC "
            "error information from remote target /job:worker/replica:0/task:0 while calling "
            "/tensorflow.WorkerService/RecvBuf:",
            "worker:0",
        ),
        (
            "UnavailableError: Collective ops is aborted by: task /job:worker/task:0 is down",
            "worker:0",
        ),
        ("ValueError: the learning rate", None),
    ],
    ids=["unhealthy", "socket-closed", "is-down", "not-a-peer"],
)
def test_an_abort_for_a_peer_gone_names_the_worker_tensorflow_names(error, task):
    assert peers.gone_in(error, "worker:2") == task
    from safestrategy.training import hooks

    store = Store()
    board = Board(store.kv(), ["a", "b", "c"], TASKS, "worker:2")
    lost = hooks.lost_peer(board, error)
    if task is None:
        assert lost is None
    else:
        text = lost.text
        assert text.startswith(f"training stopped: {task} ended before its first heartbeat")
        assert "workers:" in text and "Nothing is recorded" in text


def test_an_abort_after_a_peer_ended_on_its_stall_takes_that_peers_verdict(monkeypatch):
    """The leader's input blocks; worker:1 fires, says its verdict in its last beat and
    ends; TF aborts worker:2's collectives naming worker:1. worker:2 says what worker:1
    found; without such a beat it names the one TF names (none of the peers' health probes
    here)."""
    from safestrategy import _env
    from safestrategy.training import hooks, watchdog

    monkeypatch.setattr(watchdog, "_settings", _env.StallSettings(5.0, "exit"))
    store = Store()
    boards = [Board(store.kv(), ["a", "b", "c"], TASKS, task) for task in TASKS]
    for board, where in zip(boards, (peers.INPUT, peers.STEP, peers.STEP)):
        board.publish(1, where, 5.0, "train.py:40")
    error = (
        "UnavailableError: Collective ops is aborted by: Socket closed\nAdditional GRPC error "
        "information from remote target /job:worker/replica:0/task:1 while calling RecvBuf"
    )
    boards[2].look()
    # worker:0 had been away for 5 s: its beats say it held the others
    held = "training stopped: worker:0 holds the others back: waiting for input data for 5 s"
    assert hooks.lost_peer(boards[2], error).text.startswith(held)
    boards[0].publish(2, peers.INPUT, 0.5, "train.py:40")  # a moment away: between steps
    boards[2].look()
    assert hooks.lost_peer(boards[2], error).text.startswith(
        "training stopped: worker:1 stopped answering"
    )
    line = "worker:0 holds the others back: waiting for input data for 5 s (train.py:40)"
    boards[1].publish(2, peers.STEP, 5.0, "", peers.Verdict(HELD, "worker:0", line))
    text = hooks.lost_peer(boards[2], error).text
    assert text.startswith(f"training stopped: {line}; the workers that waited ended")


def test_a_worker_its_user_stopped_is_named_so_by_the_peer_its_exit_aborts(monkeypatch):
    """Ctrl-C on worker:1 (not the leader: its last beat stays in the leader's store, no
    wait): the leader's abort says it was stopped by its user, and tells ``run`` so."""
    from safestrategy import _env
    from safestrategy.training import hooks, watchdog

    monkeypatch.setattr(watchdog, "_settings", _env.StallSettings(5.0, "exit"))
    told = []
    monkeypatch.setattr(hooks, "tell_run", lambda *args: told.append(args[-1]))
    store = Store()
    leader, one = [Board(store.kv(), ["a", "b"], TASKS[:2], t) for t in TASKS[:2]]
    for sample, board in enumerate((leader, one), 1):
        board.publish(sample, peers.STEP, 2.0, "train.py:9")
    started = time.monotonic()
    hooks.stopped_by_user(one)
    assert time.monotonic() - started < 1.0  # no wait: the leader keeps its beat
    error = "UnavailableError: Collective ops is aborted by: Socket closed"
    lost = hooks.lost_peer(leader, error)
    stopped = peers.Verdict(peers.STOPPED, "worker:1", "worker:1 was stopped by its user")
    assert lost.verdict == stopped and told == [stopped]
    assert lost.text.startswith("training stopped: worker:1 was stopped by its user (Ctrl-C)")
    # a round the stopped worker did not join (its exit hung in teardown): stopped, not gone
    missing = peers.Verdict(GONE, "worker:1", "worker:1 did not join the canary round")
    assert leader.passed_on(missing) == stopped
    assert leader.passed_on(peers.Verdict(GONE, "worker:0", "x")).kind == GONE


def test_the_worker_an_abort_ends_first_names_the_killed_one_for_those_it_ends_next(
    monkeypatch,
):
    """3 workers, worker:2 killed: the leader's abort names worker:2, and its exit then
    ends worker:1 with "the leader is unreachable". The leader's last beat says worker:2,
    and it keeps the store up until worker:1 has read it (two samples), not longer; so
    worker:1 names worker:2, not the leader its own abort names."""
    from safestrategy import _env
    from safestrategy.training import hooks, watchdog

    monkeypatch.setattr(watchdog, "_settings", _env.StallSettings(5.0, "exit"))
    store = Store()
    leader, one, _ = [Board(store.kv(), ["a", "b", "c"], TASKS, t) for t in TASKS]
    for sample, board in enumerate((leader, one), 1):
        board.publish(sample, peers.STEP, 2.0, "train.py:9")
    killed = (
        "UnavailableError: Collective ops is aborted by: Socket closed\nAdditional GRPC error "
        "information from remote target /job:worker/replica:0/task:2 while calling RecvBuf"
    )
    lost = hooks.lost_peer(leader, killed)
    said = "worker:2 ended before its first heartbeat"  # it never published here
    assert lost.verdict == peers.Verdict(GONE, "worker:2", said)
    leader.publish(-1, peers.STEP, 2.0, "", lost.verdict)

    def sampling():  # worker:1's watchdog: publish, then look, a sample every 0.3 s
        for sample in range(3, 7):
            time.sleep(0.3)
            one.publish(sample, peers.STEP, 2.0, "train.py:9")
            one.look()

    started, peer = time.monotonic(), threading.Thread(target=sampling)
    peer.start()
    assert leader.read_by_peers(5.0, ["worker:2"])  # worker:2 ended: not waited for
    assert 0.5 < time.monotonic() - started < 1.5  # two of worker:1's samples
    peer.join(timeout=5)
    leader.publish(7, peers.STEP, 2.0, "")  # the leader's watchdog samples on: it keeps
    one.look()  # saying its verdict
    store.frozen.set()  # the leader ends, and with it the store
    unreachable = (
        "UnavailableError: Collective ops is aborted by: Failed to send RPC to coordination "
        "service. Either the leader task was preempted/died\nAdditional GRPC error "
        "information from remote target /job:worker/replica:0/task:0 while calling "
        "/tensorflow.CoordinationService/Heartbeat"
    )
    assert peers.gone_in(unreachable, "worker:1") == "worker:0"
    text = hooks.lost_peer(one, unreachable).text
    assert text.startswith("training stopped: worker:2 ended before its first heartbeat"), text


def test_a_peer_that_never_reads_is_waited_for_no_longer_than_the_bound():
    store = Store()
    zero, one = [Board(store.kv(), ["a", "b"], TASKS[:2], t) for t in TASKS[:2]]
    one.publish(1, peers.STEP, 1.0, "")
    zero.publish(-1, peers.STEP, 1.0, "", peers.Verdict(GONE, None, "a worker stopped"))
    started = time.monotonic()
    assert not zero.read_by_peers(0.5)  # worker:1 is frozen: it never samples again
    assert time.monotonic() - started < 1.5
    assert zero.read_by_peers(0.5, ["worker:1"])  # or it is the one that ended


def test_a_stalled_worker_names_the_one_the_gone_leader_said_was_gone_first():
    """3 workers, worker:2 killed: worker:1's step just hangs (its own ring neighbour is
    alive), so its watchdog fires after the leader ended on the abort. The leader's last
    beat said worker:2: worker:1 names worker:2, not the leader it can no longer reach."""
    store = Store()
    leader, one, two = [Board(store.kv(), ["a", "b", "c"], TASKS, t) for t in TASKS]
    for board in (leader, one, two):
        board.publish(1, peers.STEP, 2.0, "train.py:9")
    one.look()
    leader.publish(-1, peers.STEP, 2.0, "", peers.Verdict(GONE, "worker:2", "worker:2 st"))
    one.look()
    now = time.monotonic()
    one.clock = lambda: now + 12  # more than two samples of 5 s later
    store.frozen.set()  # the leader has ended, and with it the store
    one.look()
    verdict = one.verdict(5.0)
    assert verdict == peers.Verdict(
        GONE, "worker:2", "worker:2 stopped answering 12 s ago (worker:0 saw it first)"
    )


def test_a_worker_the_gone_leader_ended_names_the_one_its_user_stopped():
    """3 workers, Ctrl-C on worker:2: the leader ends saying so, and its exit ends
    worker:1, which can reach neither. The leader's last beat said worker:2 was stopped:
    worker:1 says that too, not that the leader stopped answering (seen in 6 of 20
    trials before, benchmarks/peers_trials.py --workers 3 --cases interrupt)."""
    store = Store()
    leader, one, two = [Board(store.kv(), ["a", "b", "c"], TASKS, t) for t in TASKS]
    for board in (leader, one, two):
        board.publish(1, peers.STEP, 2.0, "train.py:9")
    stopped = peers.Verdict(peers.STOPPED, "worker:2", "worker:2 was stopped by its user")
    leader.publish(-1, peers.STEP, 2.0, "", stopped)  # worker:2's own last beat unread
    one.look()
    now = time.monotonic()
    one.clock = lambda: now + 12
    store.frozen.set()
    one.look()
    assert one.verdict(5.0) == stopped
    assert one.passed_on(peers.Verdict(GONE, "worker:0", "worker:0 stopped answering")) == stopped
