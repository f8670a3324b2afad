"""The stall watchdog: the pure parts from hand-built inputs, then real Keras trainings
(tests/stall_script.py) that stall, crawl or idle, each in its own process."""

import json
import logging
import re
import sys
import types

import pytest

import safestrategy
from safestrategy import _env, _watchdog, factory
from safestrategy._devices import parse_devices
from safestrategy._watchdog import INPUT, OP, SESSION, STEP, advance, classify, outermost_call
from safestrategy.checks import stalls as _stalls
from safestrategy.report import Report

from .conftest import ROOT, gone, needs_tf, run_python

SITE = "/venv/lib/python3.11/site-packages"
TF221 = f"{SITE}/tensorflow/python"
TF115 = "/venv/lib/python3.7/site-packages/tensorflow_core/python"


def code(filename, name):
    return types.SimpleNamespace(co_filename=filename, co_name=name)


def frames(*codes):
    """A fake stack, outermost first; returns the innermost frame."""
    frame = None
    for number, (filename, name) in enumerate(codes):
        frame = types.SimpleNamespace(f_code=code(filename, name), f_back=frame, f_lineno=number)
    return frame


# --- which frames are TensorFlow executing something -------------------------------------


@pytest.mark.parametrize(
    "filename, name, kind",
    [
        (f"{TF221}/eager/polymorphic_function/polymorphic_function.py", "__call__", STEP),
        (f"{TF115}/eager/def_function.py", "__call__", STEP),
        (f"{TF115}/eager/function.py", "__call__", STEP),
        (f"{TF221}/eager/execute.py", "quick_execute", OP),
        (f"{TF221}/ops/gen_collective_ops.py", "collective_reduce_v2", OP),
        (f"{TF115}/client/session.py", "run", SESSION),
        (f"{TF115}/client/session.py", "__call__", SESSION),
        (f"{TF221}/data/ops/iterator_ops.py", "__next__", INPUT),
        (f"{TF221}/data/ops/multi_device_iterator_ops.py", "get_next", INPUT),
        (f"{TF221}/eager/polymorphic_function/polymorphic_function.py", "_call", None),
        (f"{TF221}/data/ops/dataset_ops.py", "map", None),
        ("/home/me/train.py", "__call__", None),
        ("/home/me/eager/execute.py", "quick_execute", None),
    ],
)
def test_the_table_says_which_frames_execute(filename, name, kind):
    assert classify(code(filename, name)) == kind


def test_the_outermost_call_is_the_one_timed():
    stack = frames(
        ("/home/me/train.py", "<module>"),
        (f"{SITE}/keras/src/trainer.py", "fit"),
        (f"{TF221}/eager/polymorphic_function/polymorphic_function.py", "__call__"),
        (f"{TF221}/eager/execute.py", "quick_execute"),
    )
    frame, kind = outermost_call(stack)
    assert (frame.f_code.co_name, kind) == ("__call__", STEP)
    assert outermost_call(frames(("/home/me/train.py", "<module>"))) is None


def test_the_stack_is_trimmed_to_the_users_frames_and_the_entry():
    stack = frames(
        ("/home/me/train.py", "<module>"),
        (f"{SITE}/keras/src/trainer.py", "fit"),
        (f"{TF221}/eager/polymorphic_function/polymorphic_function.py", "__call__"),
        (f"{TF221}/eager/execute.py", "quick_execute"),
    )
    text = _watchdog.stack_text(stack, outermost_call(stack)[0])
    assert "train.py" in text and "polymorphic_function.py" in text
    assert "trainer.py" not in text and "execute.py" not in text


# --- when a call is a stall -------------------------------------------------------------


def run_samples(samples, timeout=10.0, every=2.0):
    """Feed ``advance`` one sample per ``every`` seconds; the events, as (time, what)."""
    state, seen_events = {}, []
    for number, seen in enumerate(samples):
        state, events = advance(state, seen, number * every, timeout)
        seen_events.extend((number * every, event.what) for event in events)
    return seen_events


def test_one_call_past_the_timeout_fires_once_then_finishes():
    call = object()
    samples = [{1: (call, STEP)}] * 8 + [{}]
    assert run_samples(samples) == [(10.0, "stalled"), (16.0, "finished")]


def test_calls_shorter_than_the_timeout_never_fire_however_many():
    calls = [object() for _ in range(5)]
    samples = [{1: (calls[n // 4], STEP)} for n in range(20)]  # a new call every 8 s
    assert run_samples(samples) == []


def test_an_idle_process_never_fires():
    assert run_samples([{}] * 100) == []


def test_threads_are_timed_apart():
    slow = object()
    samples = [{1: (slow, OP), 2: (object(), STEP)} for _ in range(7)]
    events = run_samples(samples)
    assert events == [(10.0, "stalled")]


# --- settings and the message ----------------------------------------------------------


def test_stall_settings_default_off_and_exit():
    assert _env.resolve_stall({}) == (600.0, "warn")
    assert _env.resolve_stall({"SAFESTRATEGY_STALL_TIMEOUT": " OFF "}).timeout is None
    settings = _env.resolve_stall(
        {"SAFESTRATEGY_STALL_TIMEOUT": "2.5", "SAFESTRATEGY_STALL_ACTION": "Exit"}
    )
    assert settings == (2.5, "exit")


@pytest.mark.parametrize(
    "variable, value",
    [
        ("SAFESTRATEGY_STALL_TIMEOUT", "ten"),
        ("SAFESTRATEGY_STALL_TIMEOUT", "-1"),
        ("SAFESTRATEGY_STALL_ACTION", "kill"),
    ],
)
def test_bad_stall_settings_are_value_errors_before_any_device(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError) as error:
        safestrategy.make_mirrored_strategy(["/cpu:0", "/cpu:99"])  # no device error first
    assert repr(value) in str(error.value) and variable in str(error.value)
    assert ("off" if "TIMEOUT" in variable else "warn, exit") in str(error.value)


def report(**fields):
    base = dict(
        backend="nccl",
        source="default",
        mode="auto",
        devices=("/device:GPU:0", "/device:GPU:1"),
        platform="Linux",
        tf_version="2.21.0",
        tf_api="tf2",
        candidates=(),
    )
    return Report(**{**base, **fields})


def test_the_message_says_where_what_and_what_to_try():
    worker = _stalls.Place(_stalls.MULTIWORKER_KIND, {"task": "worker:1"}, read=False)
    text = _watchdog.message(
        612.0,
        INPUT,
        "MainThread",
        '  File "train.py", line 3, in <module>',
        report(task="worker:1", workers=2),
        {"NCCL_SHM_DISABLE": "1"},
        _env.StallSettings(600.0, "exit"),
        worker,
    )
    for words in (
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
        assert words in text
    assert "NCCL_SHM_DISABLE=1, then" not in text  # the user's own is not suggested
    # a multi-worker stall is not read by any next choice: it says so, not "skips"
    assert "--refresh" not in text and "next automatic choice" not in text


def stall_text(backend="nccl", candidates=(), place="machine", **fields):
    """The ERROR for a stall of ``backend`` with these candidates (``place``: "machine",
    a record read by the next choice; None: no record)."""
    where = report(backend=backend, candidates=candidates, **fields)
    recorded = _stalls.Place(_stalls.KIND, {}, True, where.devices) if place else None
    settings = _env.StallSettings(600.0, "warn")
    return _watchdog.message(601.0, STEP, "MainThread", "", where, {}, settings, recorded)


def result(name, status, reason="fake"):
    return safestrategy.CandidateResult(name, status, reason)


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
        return _stalls.place_for(tf, report(mode=mode, devices=devices))

    assert place("list", CPUS) is not None and place("list", CPUS).read
    assert place("forced", CPUS) is None  # the next forced choice takes it anyway
    assert place("auto", CPUS[:1]) is None  # one device: nothing all-reduces
    assert place("auto", CPUS, cache="off") is None
    assert "is recorded" not in stall_text("nccl", (), place=None)
    said = "The stall is recorded: the next decision tries nccl with NCCL_P2P_DISABLE=1, then "
    assert said in stall_text("nccl", ())  # what the next decision does, as run says it
    said = "the next decision avoids hierarchical_copy while another backend passes"
    assert said in stall_text("hierarchical_copy", ())


def test_a_call_that_finishes_withdraws_only_the_record_its_own_stall_wrote(monkeypatch):
    """A crash record from ``run`` (another process) is not the watchdog's to withdraw."""
    place = _stalls.Place(_stalls.KIND, {"devices": CPUS}, True)
    _stalls.record(place, "hierarchical_copy", 12.0, {}, kind="crash", cause="SIGABRT")
    watched = _watchdog._Strategy(lambda: None, report(backend="hierarchical_copy"), place)
    monkeypatch.setattr(_watchdog, "_written", {2: watched})
    settings = _env.StallSettings(600.0, "warn")

    def finishes(thread):
        call = _watchdog.Watched(object(), STEP, 0.0, fired=True)
        _watchdog._handle(_watchdog.Event(_watchdog.FINISHED, thread, call, 700.0), None, settings)

    finishes(1)  # its stall wrote nothing: the crash record stays
    assert _stalls.read(place, "hierarchical_copy").kind == "crash"
    finishes(2)  # this one wrote the record for its strategy: withdrawn
    assert _stalls.read(place, "hierarchical_copy") is None


# --- the next decision, from a stall record -------------------------------------------------

CPUS = ["/cpu:0", "/cpu:1"]


def recorded_stall(tf, backend, remedy=None, devices=CPUS):
    """A stall record as the watchdog writes it, for ``backend`` on ``devices``."""
    names = tuple(str(d) for d in parse_devices(devices))
    _stalls.record(_stalls.on_machine(tf, names), backend, 601.0, remedy or {})
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
def test_refresh_forgets_the_stalls(tf):
    recorded_stall(tf, "hierarchical_copy")
    assert safestrategy.probe(CPUS).stalls
    factory._decisions.clear()
    assert factory.decide(CPUS, refresh=True)[0].stalls == ()
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

SCRIPT = "tests/stall_script.py"
T = 3.0


def train(scenario, tmp_path, timeout=240, **env):
    settings = {
        "SAFESTRATEGY_STALL_TIMEOUT": f"{T:g}",
        "SAFESTRATEGY_CACHE_DIR": str(tmp_path / "cache"),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        **env,
    }
    return run_python(SCRIPT, scenario, env=settings, timeout=timeout)


def logged(stderr, level):
    """(time, first line) of each record at ``level``, from the script's log format."""
    found = re.findall(rf"^(\d+\.\d+) {level} (.*)$", stderr, re.MULTILINE)
    return [(float(when), text) for when, text in found]


@needs_tf
def test_a_blocked_step_is_reported_ends_the_process_and_is_remembered(tf2, tmp_path, run_cli):
    pidfile = tmp_path / "probe.pid"
    # A list, not auto: which backend auto's race picks on a loaded machine is not the point.
    listed = {"SAFESTRATEGY_BACKEND": "hierarchical_copy,reduce_to_cpu"}
    run = train(
        "block",
        tmp_path,
        SAFESTRATEGY_STALL_ACTION="exit",
        FAKE_WORKER_PIDFILE=str(pidfile),
        **listed,
    )
    assert run.returncode == 75, run.stderr[-3000:]
    started = float(re.search(r"^MARK (\S+) step 5 starts", run.stderr, re.MULTILINE).group(1))
    ((when, first),) = logged(run.stderr, "ERROR")
    assert when - started <= T + 4  # the timeout, a sample interval, a loaded machine
    assert "in the training step (input reading included)" in first
    assert re.search(r'stall_script.py", line \d+, in <module>\n +model.fit\(', run.stderr)
    assert "backend hierarchical_copy (list) on /device:CPU:0, /device:CPU:1" in run.stderr
    assert gone(int(pidfile.read_text()))  # the probe process left open went with it

    cache = {"SAFESTRATEGY_CACHE_DIR": str(tmp_path / "cache"), **listed}
    again = train("report", tmp_path, **listed)
    second = json.loads(again.stdout.strip().splitlines()[-1])
    stalled = next(c for c in second["candidates"] if c["name"] == "hierarchical_copy")
    assert second["backend"] != "hierarchical_copy"
    assert stalled["reason"].startswith("stalled during training on ")
    assert "hierarchical_copy failed" in again.stderr and "--refresh" in again.stderr
    assert [s["backend"] for s in second["stalls"]] == ["hierarchical_copy"]

    listing = run_cli("--devices", "/cpu:0", "/cpu:1", env=cache)
    assert "stalled during training on" in listing.stdout
    run_cli("--devices", "/cpu:0", "/cpu:1", "--refresh", "--json", env=cache)
    after = json.loads(run_cli("--devices", "/cpu:0", "/cpu:1", "--json", env=cache).stdout)
    assert (after["backend"], after["stalls"]) == ("hierarchical_copy", [])


@needs_tf
def test_a_stall_is_blamed_on_the_stuck_strategy_not_the_last_one_built(tf2, tmp_path):
    """Two strategies in a process; fit on the first (hierarchical_copy) stalls after the
    second (reduce_to_cpu) was built: the ERROR and the record name the first."""
    run = train("two", tmp_path, SAFESTRATEGY_STALL_ACTION="exit")
    assert run.returncode == 75, run.stderr[-3000:]
    assert "backend hierarchical_copy (list) on /device:CPU:0, /device:CPU:1" in run.stderr
    assert "backend reduce_to_cpu" not in run.stderr.split("where (most recent call last)")[1]
    cache = {"SAFESTRATEGY_CACHE_DIR": str(tmp_path / "cache")}
    listed = run_python("-m", "safestrategy", "records", env=cache, timeout=120)
    assert "hierarchical_copy" in listed.stdout and "reduce_to_cpu" not in listed.stdout


@needs_tf
def test_a_stall_no_strategy_can_be_blamed_for_lists_them_all_and_records_nothing(tf2, tmp_path):
    run = train("loop", tmp_path, SAFESTRATEGY_STALL_ACTION="exit")
    assert run.returncode == 75, run.stderr[-3000:]
    assert "backend unknown: 2 strategies are watched" in run.stderr
    assert "  - backend hierarchical_copy (list)" in run.stderr
    assert "  - backend reduce_to_cpu (list)" in run.stderr
    assert "Nothing is recorded" in run.stderr
    cache = {"SAFESTRATEGY_CACHE_DIR": str(tmp_path / "cache")}
    listed = run_python("-m", "safestrategy", "records", env=cache, timeout=120)
    assert listed.returncode == 0 and "stalled during training" not in listed.stdout


@needs_tf
def test_a_slow_step_is_an_error_then_info_and_no_record(tf2, tmp_path):
    run = train("slow", tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    started = float(re.search(r"^MARK (\S+) step 5 starts", run.stderr, re.MULTILINE).group(1))
    errors = [when for when, _ in logged(run.stderr, "ERROR")]
    finished = [when for when, text in logged(run.stderr, "INFO") if "finished after all" in text]
    # (a loaded machine may compile the first step for longer than T: a stall that ends too)
    assert len([when for when in errors if when > started]) == 1
    assert len(finished) == len(errors) and all(e < f for e, f in zip(errors, finished))
    assert "RECORDS 0" in run.stdout


@needs_tf
def test_long_steps_a_long_first_step_idle_and_pauses_never_fire(tf2, tmp_path):
    run = train("never", tmp_path, SAFESTRATEGY_STALL_TIMEOUT="6")  # the first compile < 6 s
    assert run.returncode == 0, run.stderr[-3000:]
    assert "DONE" in run.stdout
    assert logged(run.stderr, "ERROR") == []
    found = re.findall(r"^MARK (\S+) (step \d+ \w+)$", run.stderr, re.MULTILINE)
    marks = {label: float(when) for when, label in found}
    took = {n: marks[f"step {n} ends"] - marks[f"step {n} starts"] for n in (1, 2, 4)}
    assert took[1] > took[2] and took[4] >= 0.8 * 6  # compiling, a normal step, a long one
    assert not list((tmp_path / "cache").glob("stall-*.json"))


# --- TF 1.x: session.run is watched ------------------------------------------------------

TF1_SCRIPT = """
import logging, sys, time
import tensorflow as tf
import safestrategy
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
with tf.Graph().as_default():
    strategy = safestrategy.make_mirrored_strategy(["/cpu:0", "/cpu:1"])
    stuck = tf.py_func(lambda: time.sleep(3600) or 1.0, [], tf.float64)
    with tf.Session(config=tf.ConfigProto(device_count={"CPU": 2})) as session:
        session.run(stuck)
"""


@needs_tf
def test_tf1_session_run_is_watched(tf1, tmp_path):
    env = {
        "SAFESTRATEGY_STALL_TIMEOUT": "2",
        "SAFESTRATEGY_STALL_ACTION": "exit",
        "SAFESTRATEGY_CACHE_DIR": str(tmp_path / "cache"),
    }
    script = tmp_path / "tf1_stall.py"
    script.write_text(TF1_SCRIPT)
    run = run_python(str(script), env={**env, "PYTHONPATH": str(ROOT)}, timeout=240)
    assert run.returncode == 75, run.stderr[-3000:]
    assert "in session.run (the training step in TF1 graph mode)" in run.stderr
    assert "session.run(stuck)" in run.stderr


@needs_tf
def test_a_collective_timeout_the_user_set_is_reported_like_a_stall(tf, monkeypatch, caplog):
    """Multi-worker with CommunicationOptions(timeout_seconds=...): TensorFlow's own
    DeadlineExceededError, uncaught, gets the stall's ERROR and record, then Python's report."""
    before = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: before.append(args))
    monkeypatch.setattr(_watchdog, "_hooked", False)
    monkeypatch.setattr(_watchdog, "_timed_out", None)
    ring = report(
        backend="ring", devices=("/device:CPU:0",), candidates=(), workers=2, task="worker:1"
    )
    worker = _stalls.on_worker(tf, ["127.0.0.1:1", "127.0.0.1:2"], "worker:1")
    _watchdog.report_collective_timeouts(30.0, ring, None, worker)
    try:
        raise tf.errors.DeadlineExceededError(None, None, "Collective ops is aborted by: timeout")
    except tf.errors.DeadlineExceededError as error:
        caught = error
    with caplog.at_level(logging.ERROR, logger="safestrategy"):
        sys.excepthook(type(caught), caught, caught.__traceback__)
    assert [args[1] for args in before] == [caught]  # Python's own report still follows
    (text,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "CommunicationOptions(timeout_seconds=30) you set" in text
    assert "Collective ops is aborted by: timeout" in text
    assert "this is worker:1 of 2 workers" in text and "test_watchdog.py" in text
    # a multi-worker record lives in its own key space, never read by one machine's choice
    assert _stalls.recorded(tf, ["/device:CPU:0"]) == ()
    recorded = [(kind, stall.backend) for kind, _, stall in _stalls.every(_stalls.directory())]
    assert recorded == [(_stalls.MULTIWORKER_KIND, "ring")]
    sys.excepthook(ValueError, ValueError("other"), None)  # other errors: only Python's report
    assert len(before) == 2 and len(caplog.records) == 1


def test_time_stopped_is_no_calls_time():
    """Ctrl-Z, SIGSTOP or a debugger stop the watchdog's thread with the rest: its sleep
    overruns by the time stopped, which no call spent running."""
    assert _watchdog.stopped_for(5.2, 5.0) == 0.0  # a late wake-up is not a stop
    assert _watchdog.stopped_for(65.0, 5.0) == 60.0
    assert _watchdog.stopped_for(3.0, 0.2) == pytest.approx(2.8)
    call = object()
    state, _ = advance({}, {1: (call, STEP)}, 0.0, 10.0)
    state, events = advance(state, {1: (call, STEP)}, 65.0, 10.0, stopped=60.0)
    assert events == [] and state[1].since == 60.0  # 5 s of running, not 65
    state, events = advance(state, {1: (call, STEP)}, 71.0, 10.0)
    assert [e.what for e in events] == ["stalled"]


def test_a_stall_outside_the_allreduce_is_reported_and_never_recorded():
    watched = [_watchdog._Strategy(lambda: None, report(), None)]
    assert _watchdog.outside_allreduce(INPUT, None, watched)
    user = types.SimpleNamespace(f_code=code("/me/train.py", "<module>"), f_locals={}, f_back=None)
    assert _watchdog.outside_allreduce(OP, user, watched)  # an eager op no strategy runs
    assert not _watchdog.outside_allreduce(STEP, None, watched)
    settings = _env.StallSettings(600.0, "exit")
    text = _watchdog.message(
        615, INPUT, "MainThread", "  stack", report(), {}, settings, outside=True
    )
    assert "Not recorded against nccl: the call is outside the all-reduce" in text
    assert _watchdog.OUTSIDE_TIP in text and "another backend:" not in text
    assert "NCCL's own fixes" not in text


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
        "read": _stalls.Place(_stalls.KIND, {}, True),
        "unread": _stalls.Place("x", {}, False),
    }
    why = _stalls.unread(report(**fields), places.get(place))
    assert (why is None) if said is None else why.startswith(said)


def test_with_the_cache_off_the_reason_is_the_cache(monkeypatch):
    monkeypatch.setenv("SAFESTRATEGY_CACHE", "off")
    why = _stalls.unread(report(candidates=(result("nccl", "ok"),)), None)
    assert why == "SAFESTRATEGY_CACHE=off keeps no record"
