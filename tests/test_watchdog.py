"""The stall watchdog: the pure parts from hand-built inputs, then real Keras trainings
(tests/stall_script.py) that stall, crawl or idle, each in its own process."""

import json
import re
import types

import pytest

import safestrategy
from safestrategy import _env, records
from safestrategy.training import canary, sampler, watchdog, words
from safestrategy.training.sampler import (
    INPUT,
    OP,
    STEP,
)

from .conftest import CPUS, ROOT, gone, needs_tf, report, run_python


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


def test_a_call_that_finishes_withdraws_only_the_record_its_own_stall_wrote(monkeypatch):
    """A crash record from ``run`` (another process) is not the watchdog's to withdraw."""
    place = records.Place(records.KIND, {"devices": CPUS}, True)
    records.record(place, "hierarchical_copy", 12.0, {}, kind="crash", cause="SIGABRT")
    watched = watchdog.Strategy(lambda: None, report(backend="hierarchical_copy"), place)
    monkeypatch.setattr(watchdog, "_written", {2: watched})
    settings = _env.StallSettings(600.0, "warn")

    def finishes(thread):
        call = sampler.Watched(object(), STEP, 0.0, fired=True)
        watchdog._handle(sampler.Event(sampler.FINISHED, thread, call, 700.0), settings)

    finishes(1)  # its stall wrote nothing: the crash record stays
    assert records.read(place, "hierarchical_copy").kind == "crash"
    finishes(2)  # this one wrote the record for its strategy: withdrawn
    assert records.read(place, "hierarchical_copy") is None


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


def fired(stderr):
    """(time, first line) of each stall's first ERROR: logged as it fires, before the
    canary checks the all-reduce (its full ERROR follows)."""
    return [(when, text) for when, text in logged(stderr, "ERROR") if "Checking whether" in text]


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
    ((when, first),) = fired(run.stderr)
    assert when - started <= T + 4  # the timeout, a sample interval, a loaded machine
    assert "in the training step (input reading included)" in first
    bound = canary.bound(T)
    full = [(w, text) for w, text in logged(run.stderr, "ERROR") if (w, text) != (when, first)]
    ((convicted, line),) = full
    assert f"the all-reduce itself did not answer in {bound:.1f} s" in line
    assert bound - 0.5 <= convicted - when <= bound + 4
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
    assert second["stalls"][0]["evidence"] == "canary"

    listing = run_cli("--devices", "/cpu:0", "/cpu:1", env=cache)
    assert "stalled during training on" in listing.stdout
    run_cli("--devices", "/cpu:0", "/cpu:1", "--refresh", "--json", env=cache)
    after = json.loads(run_cli("--devices", "/cpu:0", "/cpu:1", "--json", env=cache).stdout)
    assert (after["backend"], after["stalls"]) == ("hierarchical_copy", [])


@needs_tf
@pytest.mark.parametrize(
    "scenario, where",
    [
        ("pyfunc", r"running your Python in a py_function \(stall_script.py:\d+\)"),
        ("map", r"running your Python in a py_function \(stall_script.py:\d+\)"),
    ],
)
def test_a_hang_in_the_users_code_inside_the_step_is_reported_and_never_recorded(
    tf2, tmp_path, run_cli, scenario, where
):
    """The step hangs in a layer's py_function, or in a tf.data map: the canary through the
    same backend answers, so nothing is recorded and the next decision is the same."""
    run = train(scenario, tmp_path, SAFESTRATEGY_STALL_ACTION="exit")
    assert run.returncode == 75, run.stderr[-3000:]
    assert len(fired(run.stderr)) == 1
    assert re.search(
        r"the all-reduce answered in \d+ ms: the step is stuck outside it: " + where, run.stderr
    )
    assert re.search(r"Not recorded against \w+: its all-reduce answers", run.stderr)
    assert words.OUTSIDE_TIP in run.stderr and "another backend:" not in run.stderr
    cache = {"SAFESTRATEGY_CACHE_DIR": str(tmp_path / "cache")}
    listed = run_python("-m", "safestrategy", "records", env=cache, timeout=120)
    assert listed.returncode == 0 and "stalled during training" not in listed.stdout


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
    errors = [when for when, _ in fired(run.stderr)]
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


def test_a_stall_outside_the_allreduce_is_reported_and_never_recorded():
    watched = [watchdog.Strategy(lambda: None, report(), None)]
    assert watchdog.outside_allreduce(INPUT, None, watched)
    code = types.SimpleNamespace(co_filename="/me/train.py", co_name="<module>")
    user = types.SimpleNamespace(f_code=code, f_locals={}, f_back=None)
    assert watchdog.outside_allreduce(OP, user, watched)  # an eager op no strategy runs
    assert not watchdog.outside_allreduce(STEP, None, watched)
    settings = _env.StallSettings(600.0, "exit")
    text = words.message(615, INPUT, "MainThread", "  stack", report(), {}, settings, outside=True)
    assert "Not recorded against nccl: the call is outside the all-reduce" in text
    assert words.OUTSIDE_TIP in text and "another backend:" not in text
    assert "NCCL's own fixes" not in text
