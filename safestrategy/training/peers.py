"""Which worker holds the others back: what each worker says of itself, and the one verdict
every worker draws from what all of them said (pure).

When one worker of a ``MultiWorkerMirroredStrategy`` stops, the others wait for it
in the same all-reduce, and each one's own stack says only that. So at each
sample the watchdog publishes this worker's whereabouts (:class:`Beat`: a
counter, where its threads are, for how long, at which line of the user's code)
through :mod:`safestrategy.training.board`, TensorFlow's coordination service.

- :func:`whereabouts`: where this worker is, from the watchdog's sample.
- :func:`verdict`: the one verdict, from what every worker said and when each was
  last heard on this worker's own clock: every worker inside the same step
  (the communication is stuck), worker k outside it (it holds the others back), or
  worker k unheard for more than two samples (it stopped answering).
- :func:`table`, :func:`gone_in`: the workers' table in the ERROR; the worker an
  abort's text names.
"""

import fnmatch
import json
import os
import re
import sysconfig
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from .canary import ANSWERED, FAILED, HUNG, WRONG

#: Multi-worker: the collectives were aborted because a peer is gone: TF's health check
#: ("is down"), the coordination service (a peer "stopped sending heartbeats"), or the
#: transport to a peer that died ("Socket closed" from a remote target, the coordination
#: service's leader among them).
PEER_GONE = (
    "is down",
    "check alive failed",
    "heartbeat",
    "coordination service",
    "CoordinationService/Heartbeat",  # a frozen leader: its heartbeats' RPCs time out
    "Socket closed",
    "Connection reset by peer",
    "failed to connect to all addresses",
)

STEP = "step"  #: inside a step or ``strategy.run`` (where the all-reduce waits)
PY_FUNCTION = "py_function"  #: running the user's Python inside a ``py_function``
INPUT = "input"  #: in an iterator's ``get_next`` outside a step
CHECKPOINT = "checkpoint"  #: saving a checkpoint
OUTSIDE = "outside"  #: in no TensorFlow call: the user's Python between steps

WHERE = {
    STEP: "inside a step",
    PY_FUNCTION: "running your Python in a py_function",
    INPUT: "waiting for input data",
    CHECKPOINT: "saving a checkpoint",
    OUTSIDE: "outside any TensorFlow call",
}
#: Where a worker does not take part in the all-reduce its peers wait in.
AWAY = (INPUT, CHECKPOINT, OUTSIDE)

#: Frames that say what a thread is doing, by file (under ``tensorflow/python/``, or
#: ``tensorflow_core/python/`` on TF 1.15) and function (None: any).
_SIGNS: Tuple[Tuple[str, Optional[Tuple[str, ...]], str], ...] = (
    # a Dataset.from_generator's generator runs in a py_function: that is input, not a step
    ("data/ops/from_generator_op.py", None, INPUT),
    ("ops/script_ops.py", ("__call__",), PY_FUNCTION),
    (
        "checkpoint/*.py",
        ("save", "write", "_write", "_save_cached_when_graph_building"),
        CHECKPOINT,
    ),
    ("training/saver.py", ("save",), CHECKPOINT),
    ("training/tracking/util.py", ("save", "write"), CHECKPOINT),
)
_PATTERNS = tuple(
    (f"*/{root}/python/{path}", names, sign)
    for root in ("tensorflow", "tensorflow_core")
    for path, names, sign in _SIGNS
)
#: Keras's own saving (``model.save``, ``save_weights``, ``ModelCheckpoint``).
_KERAS_SAVING = ("*/keras/*saving*/*.py", "*/tf_keras/*saving*/*.py")


class Beat(NamedTuple):
    """What one worker says of itself at one sample."""

    task: str  #: "worker:1"
    host: str
    sample: int  #: the watchdog's counter: a beat that does not change is not heard
    where: str  #: one of :data:`WHERE`
    seconds: float  #: for how long it has been there, on its own clock (time stopped left out)
    at: str = ""  #: the user's line it is at ("train.py:40"), where known
    #: the verdict this worker drew when its own stall fired (its last beat): peers whose
    #: collectives TensorFlow aborts as it ends take the same one
    said: str = ""
    kind: str = ""  #: that verdict's kind

    def to_json(self) -> str:
        return json.dumps(self._asdict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Optional["Beat"]:
        return _from_json(cls, text)


def _from_json(cls: Any, text: str) -> Any:
    """A ``cls`` from its JSON; None where this version cannot read it (a newer version's,
    or a damaged one): the caller says "unknown"."""
    try:
        data = json.loads(text)
        found = cls(**{name: data[name] for name in cls._fields if name in data})
    except (ValueError, TypeError, KeyError):
        return None
    return found if found.where in WHERE else None


class Join(NamedTuple):
    """What one worker said as it joined a canary round (:mod:`~safestrategy.training.rounds`),
    as of that moment: where its threads were, and whether its main thread's call runs the
    strategy's collectives; then what its canary all-reduce showed."""

    task: str
    where: str  #: one of :data:`WHERE`
    at: str  #: the user's line, where known
    seconds: float  #: for how long it has been there
    inside: bool  #: its main thread is in a call that runs the strategy's collectives
    kind: str = ""  #: its canary's answer (:data:`~safestrategy.training.canary.KINDS`); "": none
    took: float = 0.0  #: seconds its canary took
    detail: str = ""  #: the canary's error or wrong sum

    def to_json(self) -> str:
        return json.dumps(self._asdict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Optional["Join"]:
        return _from_json(cls, text)


class Heard(NamedTuple):
    """A worker as this one last heard it: its beat, and how long ago on this worker's clock
    its counter last changed (None: never heard)."""

    beat: Optional[Beat]
    ago: Optional[float]


class Verdict(NamedTuple):
    """What holds the workers back, the same on every worker."""

    kind: str  #: "stuck", "held", "gone", "stopped", "program" or "unseen"
    task: Optional[str]  #: the worker it names ("held", "gone", "stopped")
    line: str  #: the sentence every worker says


STUCK, HELD, GONE, UNSEEN = "stuck", "held", "gone", "unseen"
#: a worker its user stopped (Ctrl-C) said so as it ended: its peers end on it, and no
#: ``run`` relaunches them to wait for a worker that is not coming back
STOPPED = "stopped"
#: The verdicts that name a worker as the cause: nothing is recorded against the
#: communication on any worker (the watchdog, its ERROR, and ``run``'s judge read it).
A_WORKERS_DOING = (HELD, GONE, STOPPED)
#: every worker is inside the step and the canary answers: the program, not the communication
PROGRAM = "program"


def _sign(filename: str, name: str) -> Optional[str]:
    filename = filename.replace(os.sep, "/")
    for pattern, names, sign in _PATTERNS:
        if (names is None or name in names) and fnmatch.fnmatchcase(filename, pattern):
            return sign
    if name in ("save", "save_weights", "save_model") and any(
        fnmatch.fnmatchcase(filename, pattern) for pattern in _KERAS_SAVING
    ):
        return CHECKPOINT
    return None


def _stack(frame: Any) -> List[Any]:
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames  # innermost first


def _below(*paths: str) -> Tuple[str, ...]:
    """Each of ``paths`` as a folder prefix, as written and with its links resolved."""
    return tuple(
        {
            os.path.join(form(path), "")
            for path in paths
            for form in (os.path.abspath, os.path.realpath)
        }
    )


#: Frames that are neither TensorFlow's nor the user's: Python's own (``threading.py``,
#: ``queue.py``) and safestrategy's.
NOT_USERS = _below(sysconfig.get_paths()["stdlib"], os.path.dirname(os.path.dirname(__file__)))


def _line(frames: Sequence[Any], is_library: Callable[[str], bool]) -> str:
    """The innermost frame of the user's code, as ``file.py:line``: not a library's, not
    Python's own, not safestrategy's."""
    for frame in frames:
        filename = frame.f_code.co_filename
        if not is_library(filename) and not filename.startswith(NOT_USERS):
            return f"{os.path.basename(filename)}:{frame.f_lineno}"
    return ""


class Where(NamedTuple):
    """Where this worker is (one of :data:`WHERE`), at which user line, and the frame
    that marks the one call it is in: the same object on the next sample is the same call
    still running (None outside any call)."""

    where: str
    at: str
    call: Any = None


def whereabouts(
    frames: Mapping[int, Any],
    calls: Mapping[int, Tuple[Any, str]],
    main: Optional[int],
    is_library: Callable[[str], bool],
) -> Where:
    """Where this worker is: ``frames`` every thread's innermost frame, ``calls`` the
    outermost TF call each thread is in and its kind (the watchdog's sample: ``step``/
    ``op``/``session``/``input``), ``main`` the main thread. A py_function's or a
    checkpoint's or an input generator's thread speaks first (it is what the step waits
    on), then a step, then input; with no thread in a TF call, the main thread's line."""
    found: Dict[str, Tuple[str, Any]] = {}
    for frame in frames.values():
        stack = _stack(frame)
        for candidate in stack:
            sign = _sign(candidate.f_code.co_filename, candidate.f_code.co_name)
            if sign is not None:
                found.setdefault(sign, (_line(stack, is_library), candidate))
                break
    for sign in (PY_FUNCTION, CHECKPOINT, INPUT):
        if sign in found:
            return Where(sign, *found[sign])
    # a step first (an op and session.run are steps too), then input; the lowest thread
    in_calls = sorted((kind == "input", thread) for thread, (_, kind) in calls.items())
    for is_input, thread in in_calls:
        if thread in frames:
            line = _line(_stack(frames[thread]), is_library)
            return Where(INPUT if is_input else STEP, line, calls[thread][0])
    return Where(OUTSIDE, _line(_stack(frames[main]), is_library) if main in frames else "")


def named(heard: Heard, task: str) -> str:
    """What the verdict says of ``task`` when it is not heard any more."""
    beat = heard.beat
    if beat is None:
        return (
            f"{task} was never heard from: it ended before its first heartbeat (said as its "
            "strategy is built), or runs no safestrategy factory"
        )
    return f"{task} stopped answering {heard.ago:.0f} s ago"


def verdict(
    me: str,
    heard: Mapping[str, Heard],
    interval: float,
    seen: bool = True,
    leader: Optional[str] = None,
    hold: float = 0.0,
) -> Verdict:
    """The verdict from every worker's last beat (``heard``, by task, this worker's
    included), judged alike on every worker. ``interval``: seconds between samples; a
    worker not heard for more than two of them has stopped answering. ``seen``: whether
    the coordination service answered this worker's latest look; ``leader``: the worker
    that serves it, once it has answered (a service that answered and then stopped is its
    leader gone: killed, frozen, its host lost). ``hold``: how long a worker must have been
    away to hold the others back (one that left its step a moment ago is between steps)."""
    late = 2 * interval + 1.0
    if not seen and leader is not None and leader != me:
        one = heard.get(leader, Heard(None, None))
        if one.beat is None or one.ago is None or one.ago > late:
            ago = f" {one.ago:.0f} s ago" if one.ago is not None else ""
            line = f"{leader} stopped answering{ago} (it serves TensorFlow's coordination service)"
            return Verdict(GONE, leader, line)
        seen = True  # it went a moment ago (it may have just ended on its own stall): the
        # beats heard until then still say what held the workers
    if not seen:
        return Verdict(UNSEEN, None, "the other workers could not be seen (TensorFlow's "
                       "coordination service did not answer)")  # fmt: skip
    for task, one in heard.items():
        if task != me and (one.beat is None or (one.ago is not None and one.ago > late)):
            return Verdict(GONE, task, named(one, task))
    beats = {task: one.beat for task, one in heard.items() if one.beat is not None}
    waiting = [task for task, beat in beats.items() if beat.where in (STEP, PY_FUNCTION)]
    away = [task for task, b in beats.items() if b.where in AWAY and b.seconds >= hold]
    python = [task for task, b in beats.items() if b.where == PY_FUNCTION and b.seconds >= hold]
    stepping = [task for task, beat in beats.items() if beat.where == STEP]
    if not stepping:  # all in a py_function: the step every worker is inside is stuck
        python = []
    if waiting and not away and not (python and stepping):
        return Verdict(STUCK, None, "every worker is inside the same step: the communication "
                       "(or a device) is stuck")  # fmt: skip
    culprits = away or (python if stepping else [])
    if not culprits:  # no one in the all-reduce, and no one away for long: between steps
        return Verdict(UNSEEN, None, "the workers' beats do not show what holds them")
    task = culprits[0]
    beat = beats[task]
    at = f" ({beat.at})" if beat.at else ""
    what = f"{WHERE[beat.where]} for {beat.seconds:.0f} s{at}"
    if not waiting:
        return Verdict(HELD, task, f"no worker is in the all-reduce: {task} is {what}")
    return Verdict(HELD, task, f"{task} holds the others back: {what}")


def judged(
    tasks: Sequence[str], joins: Mapping[str, Join], heard: Mapping[str, Heard], waited: float
) -> Verdict:
    """The verdict of a canary round, the same on every worker: ``joins`` is what each
    worker that joined said (by task), ``heard`` the beats as of now (they say why one did
    not join), ``waited`` how long the round was waited for.

    A worker that did not join is frozen or gone. Every worker joined and the all-reduce
    did not answer right: the communication is stuck. It answered: a worker whose main
    thread is in no call that runs the strategy's collectives holds the others back (one
    running its Python in a ``py_function`` while the others wait, too); every worker
    inside such a call is the program, not the communication."""
    for task in tasks:
        if task not in joins:
            one = heard.get(task, Heard(None, None))
            within = f" in {waited:.0f} s" if waited >= 1 else ""  # its beats had stopped
            line = f"{task} did not join the canary round{within}: it is frozen or gone"
            if one.beat is None:
                line += " (never heard from)"
            elif one.ago is not None and one.ago >= 1:
                line += f" (it stopped answering {one.ago:.0f} s ago)"
            return Verdict(GONE, task, line)
    bad = next((joins[t] for t in tasks if joins[t].kind != ANSWERED), None)
    if bad is not None:
        said = _SAID.get(bad.kind, "did not answer")
        detail = f" ({bad.detail})" if bad.detail else ""
        line = f"every worker joined the canary round, and the all-reduce itself {said}"
        line += f" on {bad.task}{detail}: the communication (or a device) is stuck"
        return Verdict(STUCK, None, line)
    away = [t for t in tasks if not joins[t].inside]
    python = [t for t in tasks if joins[t].where == PY_FUNCTION]
    culprits = away or (python if len(python) < len(tasks) else [])
    if culprits:
        join = joins[culprits[0]]
        at = f" ({join.at})" if join.at else ""
        where = WHERE[join.where] if join.where != STEP or join.inside else OWN_CALL
        what = f"{where} for {join.seconds:.0f} s{at}"
        if len(away) == len(tasks):
            line = f"no worker is in the all-reduce: {join.task} is {what}"
        else:
            line = f"{join.task} holds the others back: {what}"
        return Verdict(HELD, join.task, line)
    line = "every worker is inside the step, and the communication answers: the step is stuck in "
    line += "the program"
    if not python:
        line += " (a native op inside one worker's step, or mismatched collectives: cannot tell "
        line += "which worker)"
    return Verdict(PROGRAM, None, line)


#: A worker in a TensorFlow call that runs none of the strategy's collectives (an eager
#: read, its own evaluation), as a verdict says it.
OWN_CALL = "in a TensorFlow call of its own, outside the strategy's collectives"
#: What a round's canary showed, as the verdict says it.
_SAID = {HUNG: "did not answer", FAILED: "failed", WRONG: "summed wrong"}


def table(me: str, heard: Mapping[str, Heard]) -> str:
    """Every worker: task, host, where, since, last heard."""
    rows = [("task", "host", "where", "since", "last heard")]
    for task, one in heard.items():
        beat = one.beat
        if beat is None:
            rows.append((task, "?", "never heard", "", ""))
            continue
        where = WHERE[beat.where] + (f" ({beat.at})" if beat.at else "")
        last = "this worker" if task == me else f"{one.ago:.0f} s ago"
        rows.append((task, beat.host, where, f"{beat.seconds:.0f} s", last))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "\n".join(
        "  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
        for row in rows
    )


#: Where TensorFlow's error names the worker that is gone: its coordination service's list
#: of unhealthy tasks, the remote target a transport error came from, a task "is down".
_GONE_TASK = re.compile(
    r"(?:unhealthy[^\n]*\n\s*|remote target |task )/job:(\w+)(?:/replica:\d+)?/task:(\d+)"
)


def gone_in(error: str, me: str) -> Optional[str]:
    """The worker an abort's text says is gone (``"worker:1"``; never ``me``), if it
    says one and it is an abort for a peer gone (:data:`PEER_GONE`)."""
    if not any(word in error for word in PEER_GONE):
        return None
    for job, index in _GONE_TASK.findall(error):
        task = f"{job}:{index}"
        if task != me:
            return task
    return None
