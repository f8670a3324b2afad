"""Which TensorFlow call each thread is in, and for how long: the watchdog's eyes (pure).

On each thread the outermost frame of one TensorFlow execution call
(:data:`ENTRY_POINTS`) is found: a ``tf.function`` call (the training step),
an eager op, a TF1 ``session.run``, an iterator's ``get_next``. The same frame
object on later samples is the same call still running (:func:`advance`); when
it has run for longer than the stall timeout that is a stall. A thread in no
TensorFlow call is never one. Nothing here starts a thread or imports
TensorFlow: frames in, calls and events out.
"""

import fnmatch
import os
import re
import threading
import traceback
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

STEP = "step"  #: a tf.function call: under Keras fit, the training step (input included)
OP = "op"  #: one eager op
SESSION = "session"  #: TF1 (or compat.v1) session.run: the training step in graph mode
INPUT = "input"  #: an iterator's get_next outside a step

_ITERATOR_CALLS = ("get_next", "get_next_as_optional", "__next__", "next")

#: Where TensorFlow runs something, by file (under ``tensorflow/python/``, or
#: ``tensorflow_core/python/`` on TF 1.15) and function; read from the sources of
#: TF 1.15 and 2.21. ``None``: any function of the file.
ENTRY_POINTS: Tuple[Tuple[str, Optional[Tuple[str, ...]], str], ...] = (
    # tf.function: polymorphic_function.Function (TF 2.13+), def_function.Function
    # (TF 1.15-2.12), and the concrete / defun functions below them (TF 1.x eager: function.py).
    ("eager/polymorphic_function/polymorphic_function.py", ("__call__",), STEP),
    ("eager/polymorphic_function/concrete_function.py", ("__call__",), STEP),
    ("eager/def_function.py", ("__call__",), STEP),
    ("eager/function.py", ("__call__",), STEP),
    # Eager ops: the slow path, and the generated wrappers whose fast path is all C.
    ("eager/execute.py", ("quick_execute", "execute_with_cancellation"), OP),
    ("ops/gen_*_ops.py", None, OP),
    # TF1 graph mode: Session.run, and the callables Keras's backend makes from a session.
    ("client/session.py", ("run", "partial_run", "__call__"), SESSION),
    ("data/ops/iterator_ops.py", _ITERATOR_CALLS, INPUT),
    ("data/ops/multi_device_iterator_ops.py", _ITERATOR_CALLS, INPUT),
)

_PATTERNS = tuple(
    (f"*/{root}/python/{path}", names, kind)
    for root in ("tensorflow", "tensorflow_core")
    for path, names, kind in ENTRY_POINTS
)

#: Packages whose frames are not the user's: a stack is trimmed to the user's frames.
_LIBRARIES = ("tensorflow", "tensorflow_core", "tensorflow_estimator", "keras", "tf_keras")

WHERE = {
    STEP: "in the training step (input reading included)",
    OP: "in an eager TensorFlow op",
    SESSION: "in session.run (the training step in TF1 graph mode)",
    INPUT: "waiting for input data (an iterator's get_next, outside a step)",
}


def classify(code: Any) -> Optional[str]:
    """The kind of TensorFlow execution call ``code`` is (:data:`ENTRY_POINTS`), or None."""
    return _classify(code.co_filename, code.co_name)


def _classify(filename: str, name: str) -> Optional[str]:
    filename = filename.replace(os.sep, "/")
    for pattern, names, kind in _PATTERNS:
        if (names is None or name in names) and fnmatch.fnmatchcase(filename, pattern):
            return kind
    return None


#: A frame line of a ``faulthandler`` dump: ``  File "/x/y.py", line 12 in name``.
_FAULT_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line \d+ in (?P<name>\S+)', re.MULTILINE)


def in_tf_call(fault: str) -> bool:
    """Whether a ``faulthandler`` dump shows a thread inside a TensorFlow execution call:
    the evidence of a crash in a step when no heartbeat was written yet (the first one)."""
    return any(_classify(m.group("file"), m.group("name")) for m in _FAULT_FRAME.finditer(fault))


def outermost_call(frame: Any) -> Optional[Tuple[Any, str]]:
    """The outermost TensorFlow execution frame on the stack ending at ``frame``, and its
    kind; None when the thread is in no TensorFlow call."""
    found = None
    while frame is not None:
        kind = classify(frame.f_code)
        if kind is not None:
            found = frame, kind
        frame = frame.f_back
    return found


class Watched(NamedTuple):
    """One thread's TensorFlow call, as first seen."""

    call: Any  #: its outermost TF frame: the same object for as long as the call runs
    kind: str
    since: float  #: when it was first seen (monotonic seconds)
    fired: bool = False  #: already reported as a stall


class Event(NamedTuple):
    """A stall fired (``stalled``) or a stalled call finished after all (``finished``)."""

    what: str
    thread: int
    watched: Watched
    seconds: float


STALLED, FINISHED = "stalled", "finished"


def advance(
    state: Mapping[int, Watched],
    seen: Mapping[int, Tuple[Any, str]],
    now: float,
    timeout: float,
    stopped: float = 0.0,
) -> Tuple[Dict[int, Watched], List[Event]]:
    """One sample: the threads' calls now (``seen``: thread -> (frame, kind)) against
    what was watched. A call is the same while its frame is the same object; one that
    has run for ``timeout`` seconds fires once; a fired one that is gone has finished.
    ``stopped``: seconds the process was stopped since the last sample (Ctrl-Z, SIGSTOP,
    a debugger), which no call has spent running."""
    watched: Dict[int, Watched] = {}
    events: List[Event] = []
    state = {thread: old._replace(since=old.since + stopped) for thread, old in state.items()}
    for thread, old in state.items():
        current = seen.get(thread)
        if current is not None and current[0] is old.call:
            watched[thread] = old
        elif old.fired:
            events.append(Event(FINISHED, thread, old, now - old.since))
    for thread, (call, kind) in seen.items():
        watched.setdefault(thread, Watched(call, kind, now))
    for thread, call in list(watched.items()):
        if not call.fired and now - call.since >= timeout:
            watched[thread] = call._replace(fired=True)
            events.append(Event(STALLED, thread, call, now - call.since))
    return watched, events


def is_library(filename: str) -> bool:
    """Whether ``filename`` is a library's (TensorFlow, Keras), not the user's code."""
    parts = filename.replace(os.sep, "/").split("/")
    return any(
        part in ("site-packages", "dist-packages") and parts[i + 1] in _LIBRARIES
        for i, part in enumerate(parts[:-1])
    )


def stack_text(frame: Any, entry: Any) -> str:
    """The stack ending at ``frame``, trimmed to the user's frames plus the TF ``entry``."""
    frames = []
    while frame is not None:
        frames.append((frame, frame.f_lineno))
        frame = frame.f_back
    kept = [
        traceback.FrameSummary(f.f_code.co_filename, line, f.f_code.co_name)
        for f, line in reversed(frames)
        if f is entry or not is_library(f.f_code.co_filename)
    ]
    return "".join(traceback.StackSummary.from_list(kept).format()).rstrip()


def interval(timeout: float) -> float:
    """Seconds between samples: a fifth of the timeout, at most 5."""
    return min(5.0, timeout / 5)


def stopped_for(elapsed: float, pause: float) -> float:
    """Seconds a sample's sleep of ``pause`` overran by being stopped: its whole overrun
    when that is over a second and over the pause itself (a stopped process, a debugger),
    else 0 (a late wake-up is not a stop)."""
    overrun = elapsed - pause
    return overrun if overrun > max(1.0, pause) else 0.0


def calls(frames: Mapping[int, Any]) -> Dict[int, Tuple[Any, str]]:
    """The outermost TensorFlow call (frame, kind) of each thread of ``frames`` that is in one
    (``frames``: thread -> innermost frame, as ``sys._current_frames()`` gives them)."""
    seen = {}
    for thread, frame in frames.items():
        call = outermost_call(frame)
        if call is not None:
            seen[thread] = call
    return seen


def ours() -> List[int]:
    """safestrategy's own threads (``safestrategy-*``: its checks, canaries, rounds, the
    watchdog): never the training's."""
    found = (t.ident for t in threading.enumerate() if t.name.startswith("safestrategy-"))
    return [ident for ident in found if ident is not None]
