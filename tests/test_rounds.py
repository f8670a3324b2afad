"""Multi-worker canary rounds (training/rounds.py) over a stand-in key-value store, and the
verdict a round draws (peers.judged): without TensorFlow. The real rounds run in
tests/test_peers.py's workers."""

import threading
import time

import pytest

from safestrategy.training import peers
from safestrategy.training.peers import GONE, HELD, PROGRAM, PY_FUNCTION, STEP, STUCK, Heard, Join
from safestrategy.training.rounds import Rounds

from .test_peers import Store

TASKS = ["worker:0", "worker:1", "worker:2"]
CLUSTER = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]


def right(devices=1, tasks=2):
    """A stand-in all-reduce that sums right, as each worker sees its own replicas."""
    total = devices * tasks * (devices * tasks + 1) / 2
    return lambda number: [(f"/cpu:{i}", [total] * 4) for i in range(devices)]


def hangs(number):
    time.sleep(3600)


def cluster(store, heres, collectives, count=2):
    """``count`` workers' rounds on ``store``, each with its ``here`` and all-reduce, and
    short bounds (the real ones follow from the stall timeout)."""
    found = []
    for index in range(count):
        rounds = Rounds(
            store.kv(), CLUSTER[:count], TASKS[:count], TASKS[index], ["/cpu:0"], "ring",
            heres[index], 5.0, collectives[index],
        )  # fmt: skip
        rounds.bound, rounds.join_bound = 0.5, 1.0
        found.append(rounds)
    return found


def at(where, inside, line="train.py:9"):
    return lambda: (where, line, 7.0, inside)


def test_every_worker_joins_a_round_once_and_says_where_it_was():
    store = Store()
    zero, _ = cluster(store, [at(STEP, True), at(peers.OUTSIDE, False)], [right(), right()])
    found = zero.ask(fresh=0.5)
    assert found.number == 1 and set(found.joins) == {"worker:0", "worker:1"}
    assert [j.kind for j in found.joins.values()] == ["answered", "answered"]
    assert found.joins["worker:1"] == Join("worker:1", peers.OUTSIDE, "train.py:9", 7.0, False,
                                           "answered", found.joins["worker:1"].took)  # fmt: skip
    verdict = peers.judged(TASKS[:2], found.joins, {}, found.waited)
    assert verdict == peers.Verdict(
        HELD, "worker:1", "worker:1 holds the others back: outside any TensorFlow call for 7 s "
        "(train.py:9)"
    )  # fmt: skip


def test_two_stalls_firing_together_share_one_round_and_a_later_one_asks_anew():
    store = Store()
    zero, one = cluster(store, [at(STEP, True)] * 2, [right(), right()])
    answers = [None, None]
    threads = [
        threading.Thread(target=lambda i=i, r=r: answers.__setitem__(i, r.ask(fresh=5.0)))
        for i, r in enumerate((zero, one))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert [a.number for a in answers] == [1, 1]
    assert answers[0].joins == answers[1].joins  # the same facts on both
    assert zero.ask(fresh=0.0).number == 2  # a round is never reused once it is stale


def test_a_worker_that_never_joins_is_waited_for_no_longer_than_the_join_bound():
    store = Store()
    (zero,) = cluster(store, [at(STEP, True)], [right()], count=1)
    zero.tasks = TASKS[:2]  # worker:1 has no rounds: frozen, or gone
    started = time.monotonic()
    found = zero.ask(fresh=0.5)
    assert 0.9 < time.monotonic() - started < 2.0
    verdict = peers.judged(TASKS[:2], found.joins, {"worker:1": Heard(None, None)}, found.waited)
    assert verdict.kind == GONE and verdict.task == "worker:1"
    assert verdict.line == "worker:1 did not join the canary round in 1 s: it is frozen or gone " \
        "(never heard from)"  # fmt: skip


def test_a_worker_whose_beats_stopped_is_not_waited_for():
    store = Store()
    (zero,) = cluster(store, [at(STEP, True)], [right()], count=1)
    zero.tasks, zero.join_bound = TASKS[:2], 6.0
    started = time.monotonic()
    found = zero.ask(fresh=0.5, silent=lambda task: task == "worker:1")
    assert time.monotonic() - started < 1.0 and "worker:1" not in found.joins


def test_an_all_reduce_that_hangs_on_every_worker_is_the_communication_stuck():
    store = Store()
    zero, _ = cluster(store, [at(STEP, True)] * 2, [hangs, hangs])
    found = zero.ask(fresh=0.5)
    assert [j.kind for j in found.joins.values()] == ["hung", "hung"]
    verdict = peers.judged(TASKS[:2], found.joins, {}, found.waited)
    assert verdict.kind == STUCK
    assert verdict.line.startswith("every worker joined the canary round, and the all-reduce "
                                   "itself did not answer on worker:0")  # fmt: skip


def test_a_wrong_sum_is_said_with_the_worker_it_came_from():
    store = Store()
    wrong = lambda number: [("/cpu:0", [2.0] * 4)]  # noqa: E731
    zero, _ = cluster(store, [at(STEP, True)] * 2, [right(), wrong])
    found = zero.ask(fresh=0.5)
    assert found.joins["worker:1"].kind == "wrong"
    verdict = peers.judged(TASKS[:2], found.joins, {}, found.waited)
    assert verdict.kind == STUCK and "summed wrong on worker:1" in verdict.line


def join(task, where=STEP, inside=True, kind="answered"):
    return Join(task, where, "train.py:9", 12.0, inside, kind)


@pytest.mark.parametrize(
    "joins, kind, task, says",
    [
        ([join("worker:0"), join("worker:1"), join("worker:2")], PROGRAM, None,
         "cannot tell which worker"),
        ([join("worker:0", PY_FUNCTION), join("worker:1", PY_FUNCTION)] * 1
         + [join("worker:2", PY_FUNCTION)], PROGRAM, None, "stuck in the program"),
        ([join("worker:0"), join("worker:1", PY_FUNCTION), join("worker:2")], HELD, "worker:1",
         "worker:1 holds the others back: running your Python in a py_function for 12 s"),
        ([join("worker:0", peers.CHECKPOINT), join("worker:1", peers.OUTSIDE, False),
          join("worker:2", peers.CHECKPOINT)], HELD, "worker:1",
         "worker:1 holds the others back: outside any TensorFlow call"),
        ([join(t, peers.INPUT, False) for t in TASKS], HELD, "worker:0",
         "no worker is in the all-reduce: worker:0 is waiting for input data"),
        ([join("worker:0"), join("worker:1", kind="failed"), join("worker:2")], STUCK, None,
         "the all-reduce itself failed on worker:1"),
        ([join("worker:0"), join("worker:2")], GONE, "worker:1", "worker:1 did not join"),
        ([join("worker:0"), join("worker:1", STEP, False), join("worker:2")], HELD, "worker:1",
         "worker:1 holds the others back: in a TensorFlow call of its own, outside"),
    ],
    ids=["native-op", "every-py-function", "one-py-function", "checkpoint", "input", "failed",
         "missing", "own-call"],
)  # fmt: skip
def test_a_round_draws_one_verdict(joins, kind, task, says):
    verdict = peers.judged(TASKS, {j.task: j for j in joins}, {}, 6.0)
    assert (verdict.kind, verdict.task) == (kind, task)
    assert says in verdict.line
    if kind == PROGRAM and says == "stuck in the program":
        assert "cannot tell" not in verdict.line  # every worker shows its py_function


def test_a_join_this_version_cannot_read_is_unknown_not_an_error():
    assert Join.from_json("{") is None
    assert Join.from_json('{"task": "worker:1"}') is None
    assert Join.from_json(join("worker:1", where="somewhere new").to_json()) is None
    assert Join.from_json(join("worker:1").to_json()) == join("worker:1")
