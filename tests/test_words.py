"""The words of a stall (safestrategy.training.words): the ERROR from hand-built reports."""

import pytest

from safestrategy import _env, records
from safestrategy.training import words
from safestrategy.training.sampler import (
    INPUT,
    STEP,
)

from .conftest import CPUS, report, result


def test_the_message_says_where_what_and_what_to_try():
    worker = records.Place(records.MULTIWORKER_KIND, {"task": "worker:1"}, read=False)
    text = words.message(
        612.0,
        INPUT,
        "MainThread",
        '  File "train.py", line 3, in <module>',
        report(task="worker:1", workers=2),
        {"NCCL_SHM_DISABLE": "1"},
        _env.StallSettings(600.0, "exit"),
        worker,
    )
    for said in (
        "612 s",
        "waiting for input data",
        'File "train.py", line 3',
        "backend nccl (auto) on /device:GPU:0, /device:GPU:1; this is worker:1 of 2 workers",
        "NCCL variables: NCCL_SHM_DISABLE=1",
        "NCCL_P2P_DISABLE=1",
        "NCCL_DEBUG=INFO",
        "SAFESTRATEGY_COMMUNICATION=ring",
        "raise SAFESTRATEGY_STALL_TIMEOUT",
        "The stall is recorded for this worker (`python -m safestrategy records` lists it",
        "exit code 75",
    ):
        assert said in text
    assert "NCCL_SHM_DISABLE=1, then" not in text  # the user's own is not suggested
    # a multi-worker stall is not read by any next choice: it says so, not "skips"
    assert "--refresh" not in text and "next automatic choice" not in text


def stall_text(backend="nccl", candidates=(), place="machine", **fields):
    """The ERROR for a stall of ``backend`` with these candidates (``place``: "machine",
    a record read by the next choice; None: no record)."""
    where = report(backend=backend, candidates=candidates, **fields)
    recorded = records.Place(records.KIND, {}, True, where.devices) if place else None
    settings = _env.StallSettings(600.0, "warn")
    return words.message(601.0, STEP, "MainThread", "", where, {}, settings, recorded)


def tips(text):
    """The "what to try" lines of an ERROR (not the lines after them)."""
    listed = text.split("what to try:\n  - ", 1)[1].split("\n  - ")
    return [*listed[:-1], listed[-1].split("\n", 1)[0]]


def test_what_to_try_names_only_backends_that_passed_here_or_were_not_checked():
    three = ("/device:CPU:0", "/device:CPU:1", "/device:CPU:2")
    candidates = (
        result("collective", "failed", "TF 2.12's MirroredStrategy default is NcclAllReduce"),
        result("nccl", "skipped", "no GPU among the devices"),
        result("hierarchical_copy", "failed", "wrong sum: expected 6 on each of 3 replicas"),
        result("reduce_to_gpu", "skipped", "no GPU among the devices"),
        result("reduce_to_cpu", "ok"),
    )
    advice = "".join(tips(stall_text("reduce_to_cpu", candidates, devices=three)))
    for name in ("hierarchical_copy", "reduce_to_gpu", "collective", "another backend", "NCCL"):
        assert name not in advice  # each failed or was skipped here: nothing is left to offer
    listed = (result("hierarchical_copy", "ok"), result("reduce_to_cpu", "ok"))
    advice = tips(stall_text("reduce_to_cpu", listed, mode="list", devices=three[:2]))
    # passed here first, then what the list did not check; never a GPU backend on CPUs
    assert "another backend: SAFESTRATEGY_BACKEND=hierarchical_copy (or collective)" in advice


def test_an_nccl_stall_is_not_offered_collective_on_nccl_and_ring_gets_no_nccl_fixes():
    candidates = (
        result("collective", "ok", "all 2 replicas got the right sum (NCCL requested)"),
        result("nccl", "ok"),
        result("hierarchical_copy", "ok"),
    )
    text = stall_text("nccl", candidates)
    switch = next(tip for tip in tips(text) if tip.startswith("another backend"))
    assert switch.startswith("another backend: SAFESTRATEGY_BACKEND=hierarchical_copy")
    assert "collective" not in switch and "NCCL_P2P_DISABLE=1" in text
    ring = (result("collective", "ok", "all 2 replicas got the right sum (RING requested)"),)
    cpus = ("/device:CPU:0", "/device:CPU:1")
    text = stall_text("collective", ring, devices=cpus)
    assert "NCCL_P2P_DISABLE" not in text and "NCCL_DEBUG" not in text


@pytest.mark.parametrize("mode", ["forced", "list"])
def test_a_forced_or_listed_nccl_stall_is_never_offered_collective_on_gpus(mode):
    """collective was not checked (absent from the setting, or not tried after nccl passed):
    on GPUs it is NCCL again, so it is not what to try."""
    candidates = (result("nccl", "ok"),)
    if mode == "list":
        candidates += (result("reduce_to_gpu", "not tried", "nccl was chosen"),)
    text = stall_text("nccl", candidates, place=None, mode=mode)
    switch = next(tip for tip in tips(text) if tip.startswith("another backend"))
    assert "collective" not in switch
    assert switch.startswith("another backend: SAFESTRATEGY_BACKEND=hierarchical_copy")
    cpus = ("/device:CPU:0", "/device:CPU:1")  # on CPUs collective is RING: still offered
    text = stall_text("reduce_to_cpu", (result("reduce_to_cpu", "ok"),), mode=mode, devices=cpus)
    assert "collective" in next(tip for tip in tips(text) if tip.startswith("another backend"))


def test_your_own_cross_device_ops_is_what_to_change_and_nothing_is_recorded():
    text = stall_text("ReductionToOneDevice", (), place=None, source="argument", mode="forced")
    assert "pass another cross_device_ops=" in text and "SAFESTRATEGY_BACKEND is ignored" in text
    assert "another backend: SAFESTRATEGY_BACKEND" not in text and "is recorded" not in text


def test_the_record_is_promised_only_where_one_is_written_and_read(tf, monkeypatch):
    def place(mode, devices, cache="on"):
        monkeypatch.setenv("SAFESTRATEGY_CACHE", cache)
        return records.place_for(tf, report(mode=mode, devices=devices))

    assert place("list", CPUS) is not None and place("list", CPUS).read
    assert place("forced", CPUS) is None  # the next forced choice takes it anyway
    assert place("auto", CPUS[:1]) is None  # one device: nothing all-reduces
    assert place("auto", CPUS, cache="off") is None
    assert "is recorded" not in stall_text("nccl", (), place=None)
    said = "The stall is recorded: the next decision tries nccl with NCCL_P2P_DISABLE=1, then "
    assert said in stall_text("nccl", ())  # what the next decision does, as run says it
    said = "the next decision avoids hierarchical_copy while another backend passes"
    assert said in stall_text("hierarchical_copy", ())


def test_the_canary_decides_what_the_error_says_of_the_allreduce():
    from safestrategy.training.canary import ANSWERED, HUNG, NONE, Answer

    where = report(
        backend="reduce_to_cpu", devices=CPUS, candidates=(result("reduce_to_cpu", "ok"),)
    )
    place = records.Place(records.KIND, {}, True, where.devices)
    settings = _env.StallSettings(600.0, "warn")

    def said(answer, recorded):
        return words.message(
            601.0,
            STEP,
            "MainThread",
            "",
            where,
            {},
            settings,
            recorded,
            canary=answer,
            where="running your Python in a py_function (train.py:40)",
        )

    answered = said(Answer(ANSWERED, 0.004), None)
    first = answered.splitlines()[0]
    assert first.endswith(
        "; the all-reduce answered in 4 ms: the step is stuck outside it: running your Python "
        "in a py_function (train.py:40)."
    )
    assert "Not recorded against reduce_to_cpu: its all-reduce answers" in answered
    assert words.OUTSIDE_TIP in answered and "another backend:" not in answered
    hung = said(Answer(HUNG, 6.2), place)
    assert "; the all-reduce itself did not answer in 6.2 s." in hung.splitlines()[0]
    assert "The stall is recorded" in hung and "another backend:" in hung
    none = said(Answer(NONE, 0.0, "TensorFlow 1.x: no eager all-reduce"), None)
    assert "no all-reduce could be run" not in none.splitlines()[0]
    assert (
        "Not recorded against reduce_to_cpu: no all-reduce could be run to check it "
        "(TensorFlow 1.x: no eager all-reduce), and a stall is recorded only when" in none
    )
