"""Which TensorFlow call each thread is in, and for how long (safestrategy.training.sampler):
from hand-built frames, no threads, no TensorFlow."""

import types

import pytest

from safestrategy.training import sampler
from safestrategy.training.sampler import (
    INPUT,
    OP,
    SESSION,
    STEP,
    advance,
    classify,
    outermost_call,
)

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
    text = sampler.stack_text(stack, outermost_call(stack)[0])
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


def test_time_stopped_is_no_calls_time():
    """Ctrl-Z, SIGSTOP or a debugger stop the watchdog's thread with the rest: its sleep
    overruns by the time stopped, which no call spent running."""
    assert sampler.stopped_for(5.2, 5.0) == 0.0  # a late wake-up is not a stop
    assert sampler.stopped_for(65.0, 5.0) == 60.0
    assert sampler.stopped_for(3.0, 0.2) == pytest.approx(2.8)
    call = object()
    state, _ = advance({}, {1: (call, STEP)}, 0.0, 10.0)
    state, events = advance(state, {1: (call, STEP)}, 65.0, 10.0, stopped=60.0)
    assert events == [] and state[1].since == 60.0  # 5 s of running, not 65
    state, events = advance(state, {1: (call, STEP)}, 71.0, 10.0)
    assert [e.what for e in events] == ["stalled"]
