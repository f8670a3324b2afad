"""The stall watchdog: a training that stops making progress is noticed and explained.

One daemon thread per process samples Python's own view of every thread
(``sys._current_frames()``) every few seconds. On each thread it finds the
outermost frame of one TensorFlow execution call (:data:`ENTRY_POINTS`): a
``tf.function`` call (the training step), an eager op, a TF1 ``session.run``,
an iterator's ``get_next``. The same frame object on later samples is the
same call still running; when it has run for longer than
``SAFESTRATEGY_STALL_TIMEOUT`` that is a stall. A thread that is in no
TensorFlow call (a notebook between cells, a script after training) is never
one. Nothing wraps TensorFlow's calls, so a training step costs exactly what it
cost before; the price is one walk over the threads' stacks per sample.

Deciding is pure (:func:`outermost_call`, :func:`advance`, :func:`message`);
:func:`watch` starts the thread, which logs, records the stall
(:mod:`safestrategy.checks.stalls`) and, with ``SAFESTRATEGY_STALL_ACTION=exit``,
ends the process with :data:`EXIT_CODE`.
"""

import contextlib
import fnmatch
import itertools
import logging
import os
import re
import sys
import threading
import time
import traceback
import weakref
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from . import _env, _peers, _rundir
from .backends import BACKEND_NAMES, COLLECTIVE, COMMUNICATION_NAMES, NCCL, get_backend
from .checks import probe, stalls
from .checks.nccl import REMEDIES
from .report import NOT_TRIED, OK, Report

logger = logging.getLogger("safestrategy")

#: ``EX_TEMPFAIL``: a hung collective never returns, so a scheduler's restart is the way out.
EXIT_CODE = 75

#: The command that lists (and with ``--forget`` forgets) every record in the cache directory.
RECORDS_COMMAND = "python -m safestrategy records"

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


#: What to try for a stall outside the all-reduce, where no backend helps.
OUTSIDE_TIP = (
    "look where the stack waits: the input pipeline (a reader, a generator, a remote file "
    "system) or your own code, not the all-reduce"
)


#: What to try when another worker holds this one back.
PEER_TIP = (
    "look at the worker the verdict names: its own log, its stack (py-spy dump), whether "
    "it still runs"
)


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


def _is_library(filename: str) -> bool:
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
        if f is entry or not _is_library(f.f_code.co_filename)
    ]
    return "".join(traceback.StackSummary.from_list(kept).format()).rstrip()


def _on_nccl(report: Report, name: str) -> bool:
    """Backend ``name`` of ``report`` all-reduces with NCCL: ``nccl``, or a ``collective``
    that requested NCCL (the report says which it requested), or one not checked here (a
    forced or listed setting without it) on GPUs, where TF's collective runs NCCL."""
    if name in (NCCL, "NcclAllReduce"):
        return True
    if name != COLLECTIVE:
        return False
    result = next((c for c in report.candidates if c.name == name), None)
    if result is None or result.status == NOT_TRIED:
        return any("GPU" in device.upper() for device in report.devices)
    return "(NCCL requested)" in result.reason


def _alternatives(report: Report) -> List[str]:
    """The backends to suggest instead of ``report``'s: those that passed on these devices,
    then those not checked here (not tried, or absent from a listed or forced setting);
    never one that failed or was skipped here, one that needs a GPU where there is none,
    nor another NCCL when NCCL stalled."""
    names = COMMUNICATION_NAMES if report.task is not None else BACKEND_NAMES
    status = {c.name: c.status for c in report.candidates}
    stuck_on_nccl = _on_nccl(report, report.backend)
    gpu = any("GPU" in device.upper() for device in report.devices)
    if report.task is not None:  # a worker's devices are its GPUs, else its CPU
        names = tuple(name for name in names if name != NCCL or gpu)

    def fits(name: str) -> bool:
        if name == report.backend or (stuck_on_nccl and _on_nccl(report, name)):
            return False
        return gpu or name not in BACKEND_NAMES or not get_backend(name).needs_gpu

    passed = [n for n in names if status.get(n) == OK and fits(n)]
    unchecked = [n for n in names if status.get(n, NOT_TRIED) == NOT_TRIED and fits(n)]
    return passed + unchecked


def _tips(report: Optional[Report], nccl: Mapping[str, str]) -> List[str]:
    """What to try, from what ``report`` shows of these devices (None: not known)."""
    tips = []
    if report is not None and _on_nccl(report, report.backend):
        fixes = [f"{n}=1" for n, _ in REMEDIES if n not in nccl]
        if fixes:
            tips.append(f"NCCL's own fixes, one at a time: {', then '.join(fixes)}")
        tips.append("NCCL_DEBUG=INFO shows where NCCL waits")
    if report is not None and report.task is None and not report.candidates:
        tips.append(  # the caller's own cross_device_ops: no setting of ours applies
            f"your own cross_device_ops ({report.backend}) is used as given, and "
            f"{_env.ENV_BACKEND} is ignored while you pass one: pass another "
            "cross_device_ops=, or none and let safestrategy choose"
        )
    elif report is not None and (report.task is not None or len(report.devices) > 1):
        variable = _env.ENV_COMMUNICATION if report.task is not None else _env.ENV_BACKEND
        others = _alternatives(report)
        if others:
            tips.append(
                f"another backend: {variable}={others[0]}"
                + (f" (or {', '.join(others[1:])})" if others[1:] else "")
            )
        elif report.task is not None:  # multi-worker RING: nothing safer to switch to
            tips.append("check that every worker still runs: one that died or hangs stops the rest")
    tips.append(
        f"if one call is simply long (a long first compile, Keras steps_per_execution=N): "
        f"raise {_env.ENV_STALL_TIMEOUT}"
    )
    return tips


def _recorded(report: Report, place: Optional[stalls.Place]) -> Optional[str]:
    """What the ERROR says of the record it writes (None: none is written)."""
    if place is None:
        return None
    if place.kind == stalls.MULTIWORKER_KIND:
        listed = (
            f"The stall is recorded for this worker (`{RECORDS_COMMAND}` lists it, "
            f"`{RECORDS_COMMAND} --forget` forgets it)"
        )
        return f"{listed}: {stalls.after_record(report, place)}."
    return (
        f"The stall is recorded: {stalls.after_record(report, place)} on these devices "
        f"(`{stalls.refresh_command(report.devices)}` re-allows it)."
    )


def message(
    seconds: float,
    kind: str,
    thread: str,
    stack: str,
    report: Optional[Report],
    nccl: Mapping[str, str],
    settings: _env.StallSettings,
    place: Optional[stalls.Place] = None,
    suspects: Sequence[Report] = (),
    outside: bool = False,
    peers: Optional[Tuple[_peers.Verdict, str]] = None,
) -> str:
    """The ERROR for a stall: how long, where, which backend and devices, what to try, and
    whether it is recorded (``place``: where; None: nothing is). ``report`` None with
    ``suspects``: the stuck call's strategy could not be told among these. ``outside``:
    the call is outside the all-reduce (input, no strategy's call), which no backend cures.
    ``peers``: multi-worker, the verdict every worker draws and the table of workers."""
    headline = (
        f"training has made no progress for {seconds:.0f} s: thread {thread!r} has been in "
        f"one TensorFlow call for that long ({_env.ENV_STALL_TIMEOUT}={settings.timeout:g}), "
        f"{WHERE[kind]}."
    )
    if settings.action == "exit":
        closing = f"{_env.ENV_STALL_ACTION}=exit: ending the process with exit code {EXIT_CODE}."
    elif place is not None:
        closing = "Still waiting: if the call finishes after all, the record is withdrawn."
    else:
        closing = "Still waiting."
    held = peers is not None and peers[0].kind in (_peers.HELD, _peers.GONE)
    if held:
        closing = f"Not recorded: {_NOT_THE_COMMUNICATION[peers[0].kind]}. " + closing
    elif outside:
        closing = (
            f"Not recorded against {report.backend if report else 'a backend'}: the call is "
            "outside the all-reduce, and another backend would wait the same way. " + closing
        )
    if peers is not None:
        headline += f"\n{peers[0].line}.\nworkers:\n{peers[1]}"
    return _explained(
        headline, stack, report, nccl, closing, place, suspects, not (outside or held), held
    )


#: Why a multi-worker verdict records nothing against the communication.
_NOT_THE_COMMUNICATION = {
    _peers.HELD: "a worker outside the all-reduce holds the others back, and another "
    "communication would wait for it the same way",
    _peers.GONE: "a worker stopped answering (a peer gone), which no communication cures",
}


def _explained(
    headline: str,
    stack: str,
    report: Optional[Report],
    nccl: Mapping[str, str],
    closing: str,
    place: Optional[stalls.Place] = None,
    suspects: Sequence[Report] = (),
    backends: bool = True,
    peer: bool = False,
) -> str:
    """A stall's headline with where, which backend and devices, what to try, ``closing``.
    ``backends``: whether another backend is worth trying (not for a stall outside it);
    ``peer``: another worker is the cause (look there)."""
    lines = [headline, "where (most recent call last):", stack]
    if report is not None:
        task = f"; this is {report.task} of {report.workers} workers" if report.task else ""
        lines.append(
            f"backend {report.backend} ({report.mode}) on {', '.join(report.devices)}{task}"
        )
    elif suspects:
        lines.append(
            f"backend unknown: {len(suspects)} strategies are watched in this process and the "
            "stuck call does not show which one it runs:"
        )
        lines.extend(
            f"  - backend {r.backend} ({r.mode}) on {', '.join(r.devices)}" for r in suspects
        )
    settings_text = " ".join(f"{n}={v}" for n, v in sorted(nccl.items())) or "none set"
    lines.append(f"NCCL variables: {settings_text}")
    lines.append("what to try:")
    tips = _tips(report, nccl) if backends else [OUTSIDE_TIP, *_tips(None, nccl)]
    if peer:
        tips = [PEER_TIP, *_tips(None, nccl)]
    lines.extend(f"  - {tip}" for tip in tips)
    said = _recorded(report, place) if report is not None else None
    if said is not None:
        lines.append(said)
    elif suspects:
        lines.append(
            "Nothing is recorded: a record against the wrong one would demote a backend that works."
        )
    lines.append(closing)
    return "\n".join(lines)


def interval(timeout: float) -> float:
    """Seconds between samples: a fifth of the timeout, at most 5."""
    return min(5.0, timeout / 5)


def stopped_for(elapsed: float, pause: float) -> float:
    """Seconds a sample's sleep of ``pause`` overran by being stopped: its whole overrun
    when that is over a second and over the pause itself (a stopped process, a debugger),
    else 0 (a late wake-up is not a stop)."""
    overrun = elapsed - pause
    return overrun if overrun > max(1.0, pause) else 0.0


class _Strategy(NamedTuple):
    """A strategy under watch: held weakly (a strategy that is gone is not watched), with
    its report and where its record goes (None: no record is written for it)."""

    ref: Callable[[], Any]
    report: Report
    place: Optional[stalls.Place]

    @property
    def same(self) -> Tuple[str, Tuple[str, ...], Optional[str]]:
        """Strategies with the same backend and devices count as one (a re-run cell)."""
        return self.report.backend, self.report.devices, self.report.task


_lock = threading.Lock()
_thread: Optional[threading.Thread] = None
_settings: Optional[_env.StallSettings] = None
_watched: List[_Strategy] = []
#: The record each stalled call wrote (by thread), withdrawn if the call finishes.
_written: Dict[int, _Strategy] = {}
#: Multi-worker: where this worker says it is, to its peers (None: one machine).
_board: Optional[_peers.Board] = None


def _held(strategy: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(strategy)
    except TypeError:  # not weakly referenceable (a test's stand-in): held as it is
        return lambda: strategy


def watch(
    settings: _env.StallSettings,
    report: Report,
    strategy: Any = None,
    place: Optional[stalls.Place] = None,
    board: Optional[_peers.Board] = None,
) -> None:
    """Watch this process for ``strategy`` (the factories call this): the thread starts
    once; the latest settings apply. ``place``: where a stall of it is recorded (None:
    nowhere, e.g. a forced backend, one device, the cache off). ``board``: multi-worker,
    where this worker publishes its whereabouts and reads its peers' (the latest wins)."""
    global _thread, _settings, _board
    with _lock:
        _settings = settings
        if board is not None:
            _board = board
        _watched[:] = [w for w in _watched if w.ref() is not None]
        _watched.append(_Strategy(_held(strategy), report, place))
        if settings.timeout is None or (_thread is not None and _thread.is_alive()):
            return
        _thread = threading.Thread(target=_run, name="safestrategy-watchdog", daemon=True)
        _thread.start()


def _distinct() -> List[_Strategy]:
    """The strategies watched and alive, one per backend and devices (the latest)."""
    with _lock:
        alive = [w for w in _watched if w.ref() is not None]
    return list({w.same: w for w in alive}.values())


def _owner(frame: Any, watched: Sequence[_Strategy]) -> Optional[_Strategy]:
    """The watched strategy whose call ``frame``'s stack runs: a frame of one of its
    methods (``strategy.run``, ``reduce``, its ``extended``), or of a Keras model's
    ``fit``/``evaluate``/``predict`` whose ``distribute_strategy`` it is; None: not told."""
    if len(watched) == 1:
        return watched[0]
    return _on_stack(frame, watched)


def _on_stack(frame: Any, watched: Sequence[_Strategy]) -> Optional[_Strategy]:
    """The watched strategy a frame of the stack ending at ``frame`` runs, or None."""
    by_id: Dict[int, _Strategy] = {}
    for entry in watched:
        strategy = entry.ref()
        if strategy is None:  # gone: no frame runs it (and None is every frame's "no self")
            continue
        by_id[id(strategy)] = entry
        with contextlib.suppress(Exception):
            by_id[id(strategy.extended)] = entry
    while frame is not None:
        owner = frame.f_locals.get("self")
        found = by_id.get(id(owner)) if owner is not None else None
        if found is None and getattr(type(owner), "distribute_strategy", None) is not None:
            with contextlib.suppress(Exception):
                found = by_id.get(id(owner.distribute_strategy))
        if found is not None:
            return {w.same: w for w in watched}.get(found.same, found)
        frame = frame.f_back
    return None


def outside_allreduce(kind: str, frame: Any, watched: Sequence[_Strategy]) -> bool:
    """Whether a stalled call of ``kind`` is outside every strategy's all-reduce, so that
    no other backend can cure it: an iterator's ``get_next`` outside a step, or an eager op
    that no strategy's call (``strategy.run``, Keras ``fit``) is running."""
    if kind == INPUT:
        return True
    return kind == OP and (frame is None or _on_stack(frame, watched) is None)


def _sample(me: int) -> Tuple[Dict[int, Tuple[Any, str]], Dict[int, Any]]:
    frames = sys._current_frames()
    frames.pop(me, None)
    seen = {}
    for thread, frame in frames.items():
        call = outermost_call(frame)
        if call is not None:
            seen[thread] = call
    return seen, frames


def _run() -> None:
    me = threading.get_ident()
    state: Dict[int, Watched] = {}
    for sample in itertools.count(1):
        settings = _settings
        if settings is None or settings.timeout is None:
            return  # turned off; watch() starts a new thread when it is turned on
        pause = interval(settings.timeout)
        before = time.monotonic()
        time.sleep(pause)
        now = time.monotonic()
        seen, frames = _sample(me)
        _rundir.heartbeat(sample, inside=bool(seen))  # under `run` only: it judges silence
        stopped = stopped_for(now - before, pause)
        state, events = advance(state, seen, now, settings.timeout, stopped)
        board = _board
        if board is not None:  # before any stall is handled: the peers hear it as it fires
            try:
                _publish(board, sample, seen, frames, now, stopped, settings)
            except Exception:  # peers are an explanation, never a reason to stop watching
                logger.debug("stall watchdog: publishing to the peers failed", exc_info=True)
        for event in events:
            try:
                _handle(event, frames.get(event.thread), settings)
            except Exception:  # the watchdog must never be what breaks a training
                logger.debug("stall watchdog: handling %s failed", event, exc_info=True)
        del seen, frames


class _Here:
    """Where this worker has been since when (its own clock, time stopped left out): in
    the same call (a steady training is in a new step at every sample, never in one for
    long), or outside any call; and whether it already said that it holds its peers
    back."""

    where: Optional[str] = None
    call: Any = None  #: the frame marking the call (:class:`_peers.Where`)
    since = 0.0
    said = False


def _hold(timeout: float) -> float:
    """How long a worker must have been away to hold its peers back through a stall of
    ``timeout``: the timeout, less two samples' slack (they started waiting at about the
    moment it left)."""
    return max(0.0, timeout - 2 * interval(timeout))


def _publish(
    board: _peers.Board,
    sample: int,
    seen: Mapping[int, Tuple[Any, str]],
    frames: Mapping[int, Any],
    now: float,
    stopped: float,
    settings: _env.StallSettings,
) -> None:
    """Tell the peers where this worker is, hear theirs; a worker away from the all-reduce
    for as long as its peers have waited in it (the stall timeout, less two samples) says
    once that it holds them back."""
    where, at, call = _peers.whereabouts(frames, seen, threading.main_thread().ident, _is_library)
    if where != _Here.where or call is not _Here.call:
        _Here.where, _Here.call, _Here.since, _Here.said = where, call, now, False
    else:
        _Here.since += stopped
    board.publish(sample, where, now - _Here.since, at)
    board.look()
    if _Here.said or where not in _peers.AWAY or settings.timeout is None:
        return
    heard = board.heard()
    peers = [one.beat for task, one in heard.items() if task != board.me]
    waiting = [b for b in peers if b is not None and b.where in (_peers.STEP, _peers.PY_FUNCTION)]
    # a peer fires within a sample of its call reaching the timeout
    if not waiting or any(
        b.seconds < settings.timeout - interval(settings.timeout) for b in waiting
    ):
        return
    # names this worker only once it has been away for the hold itself (its own beat)
    verdict = board.verdict(interval(settings.timeout), _hold(settings.timeout))
    if verdict.kind == _peers.HELD and verdict.task == board.me:
        _Here.said = True
        logger.error(
            "%s.\nworkers:\n%s\nNothing is recorded: another communication would wait for "
            "this worker the same way.",
            verdict.line.replace(f"{board.me} ", f"this worker ({board.me}) ", 1),
            _peers.table(board.me, heard),
        )


def _thread_name(ident: int) -> str:
    return next((t.name for t in threading.enumerate() if t.ident == ident), str(ident))


def _nccl_variables() -> Dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.startswith("NCCL_")}


def _stalled(text: str, culprit: Optional[_Strategy], seconds: float, cause: str = "") -> None:
    """Log a stall's ERROR and record it where ``culprit``'s records go (if anywhere), with
    its ``cause`` (a multi-worker verdict)."""
    logger.error(text)
    if culprit is not None and culprit.place is not None:
        report = culprit.report
        chosen = next((c for c in report.candidates if c.name == report.backend), None)
        remedy = chosen.remedy if chosen is not None else {}
        stalls.record(culprit.place, report.backend, seconds, remedy, cause=cause)


def _handle(event: Event, frame: Any, settings: _env.StallSettings) -> None:
    if event.what == FINISHED:
        written = _written.pop(event.thread, None)
        logger.info(
            "the TensorFlow call on thread %r that stalled finished after all, after about "
            "%.0f s: a slow call, not a hang%s",
            _thread_name(event.thread),
            event.seconds,
            "; the stall record is withdrawn" if written is not None else "",
        )
        if written is not None and written.place is not None:
            stalls.withdraw(written.place, written.report.backend)
        return
    watched = _distinct()
    culprit = _owner(frame, watched)
    outside = outside_allreduce(event.watched.kind, frame, watched)
    if outside and culprit is not None:  # reported, never recorded against a backend
        culprit = culprit._replace(place=None)
    board, peers = _board, None
    if board is not None and culprit is not None and culprit.report.task is not None:
        verdict = board.verdict(interval(settings.timeout), _hold(settings.timeout))
        peers = verdict, _peers.table(board.me, board.heard())
        if verdict.kind in (_peers.HELD, _peers.GONE):  # not the communication's doing
            culprit = culprit._replace(place=None)
    stack = stack_text(frame, event.watched.call) if frame is not None else "  (gone)"
    thread = _thread_name(event.thread)
    text = message(
        event.seconds,
        event.watched.kind,
        thread,
        stack,
        culprit.report if culprit is not None else None,
        _nccl_variables(),
        settings,
        culprit.place if culprit is not None else None,
        [w.report for w in watched] if culprit is None else (),
        outside,
        peers,
    )
    if peers is not None and board is not None:  # the last beat says it, for the peers
        _last_word(board, peers[0], settings.timeout, wait=settings.action == "exit")
    cause = peers[0].line if peers is not None and peers[0].kind == _peers.STUCK else ""
    _stalled(text, culprit, event.seconds, cause)
    recorded = culprit is not None and culprit.place is not None
    if recorded:
        _written[event.thread] = culprit
    _tell_run(event.watched.kind, outside, recorded, peers[0] if peers is not None else None)
    if settings.action == "exit":
        _exit()


def _last_word(board: _peers.Board, verdict: _peers.Verdict, timeout: float, wait: bool) -> None:
    """Say ``verdict`` in this worker's last beat; with ``wait`` (it is about to end), give
    every peer still answering up to two samples to read it: the worker this exit ends
    next (every one, when this is the leader) then names the same culprit, not this one."""
    with contextlib.suppress(Exception):  # the peers are an explanation, never a hold-up
        here = _Here.where or _peers.STEP
        board.publish(-1, here, time.monotonic() - _Here.since, "", verdict)
        if wait:
            ended = [verdict.task] if verdict.kind == _peers.GONE and verdict.task else []
            board.read_by_peers(2 * interval(timeout) + _peers.BOUND, ended)


def _tell_run(where: str, outside: bool, recorded: bool, verdict: Optional[_peers.Verdict]) -> None:
    """The run directory's ``stall-<pid>.json``: where the stall was, whether it was
    recorded, and the workers' verdict (``run`` judges the launch by it)."""
    said: Dict[str, Any] = {"where": where, "outside": outside, "recorded": recorded}
    if verdict is not None:
        said.update(verdict=verdict.kind, culprit=verdict.task, line=verdict.line)
    _rundir.stalled(said)


def _flush_logs() -> None:
    chain: Optional[logging.Logger] = logger
    while chain is not None:
        for handler in chain.handlers:
            with contextlib.suppress(Exception):  # a broken handler must not keep us alive
                handler.flush()
        chain = chain.parent if chain.propagate else None
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _exit() -> None:
    """End the process now: the stuck thread never returns, so no normal exit can."""
    _flush_logs()
    probe.close_all()
    os._exit(EXIT_CODE)


def collective_timeout_message(
    timeout: float,
    error: BaseException,
    stack: str,
    report: Optional[Report],
    nccl: Mapping[str, str],
    place: Optional[stalls.Place] = None,
) -> str:
    """The ERROR for the user's own ``CommunicationOptions(timeout_seconds=...)`` ending a
    collective that waited too long: a stall that TensorFlow itself cut short."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    headline = (
        f"training stopped: a collective all-reduce waited longer than the "
        f"CommunicationOptions(timeout_seconds={timeout:g}) you set ({type(error).__name__}: "
        f"{first}); most likely a worker stopped taking part."
    )
    closing = "TensorFlow's error follows."
    return _explained(headline, stack, report, nccl, closing, place)


_hooked = False
#: The multi-worker strategy whose user-set collective timeout is reported (the latest).
_timed_out: Optional[_Strategy] = None


def report_collective_timeouts(
    timeout: float, report: Report, strategy: Any = None, place: Optional[stalls.Place] = None
) -> None:
    """Multi-worker with the user's ``CommunicationOptions(timeout_seconds=...)``: report
    its ``DeadlineExceededError``, when nothing catches it, like a stall (the ERROR and the
    record at ``place``) before Python reports it as usual. Installed once; the latest
    strategy applies."""
    global _hooked, _timed_out
    _timed_out = _Strategy(_held(strategy), report, place)
    if _hooked:
        return
    _hooked = True
    before = sys.excepthook

    def hook(kind: Any, error: BaseException, trace: Any) -> None:
        if kind.__name__ == "DeadlineExceededError":
            try:
                _collective_timeout(timeout, error, trace)
            except Exception:  # reporting must never hide the error itself
                logger.debug("reporting a collective timeout failed", exc_info=True)
        before(kind, error, trace)

    sys.excepthook = hook


def _collective_timeout(timeout: float, error: BaseException, trace: Any) -> None:
    culprit = _timed_out
    report = culprit.report if culprit is not None else None
    place = culprit.place if culprit is not None else None
    kept = [entry for entry in traceback.extract_tb(trace) if not _is_library(entry.filename)]
    stack = "".join(traceback.StackSummary.from_list(kept).format()).rstrip()
    text = collective_timeout_message(timeout, error, stack, report, _nccl_variables(), place)
    _stalled(text, culprit, timeout)
    _flush_logs()


_peers_hooked = False


def report_lost_peers() -> None:
    """Multi-worker: when TensorFlow aborts the collectives because a peer is gone (its
    health check, the coordination service, the transport to a dead peer; what ends the
    others first when a worker is killed or stopped and the stall timeout is long), and
    nothing catches it, say which worker and show every worker's last beat before Python
    reports the error as usual. Installed once; the latest board applies."""
    global _peers_hooked
    if _peers_hooked:
        return
    _peers_hooked = True
    before = sys.excepthook

    def hook(kind: Any, error: BaseException, trace: Any) -> None:
        board = _board
        if board is not None:
            try:
                lost = lost_peer(board, f"{kind.__name__}: {error}")
                if lost is not None:
                    logger.error(lost.text)
                    _flush_logs()
                    _last_word(board, lost.verdict, _timeout(), wait=True)
            except Exception:  # reporting must never hide the error itself
                logger.debug("reporting a lost peer failed", exc_info=True)
        before(kind, error, trace)

    sys.excepthook = hook


class Lost(NamedTuple):
    """An abort for a peer gone: the ERROR to log, and the verdict it draws."""

    text: str
    verdict: _peers.Verdict


def _timeout() -> float:
    settings = _settings
    return settings.timeout if settings is not None and settings.timeout else 25.0


def lost_peer(board: _peers.Board, error: str) -> Optional[Lost]:
    """What an abort of the collectives because a peer is gone says (None: it is not
    one): the verdict a peer said as it ended first (a stall of its own, or this same
    abort, met while the one that is gone was the only one down), else the worker
    TensorFlow names, else the one the peers' beats say went quiet."""
    if not any(word in error for word in _peers.PEER_GONE):
        return None
    down = board.down()  # first: the peers this abort ends are still alive a moment more
    board.look()
    timeout = _timeout()
    verdict = board.verdict(interval(timeout), _hold(timeout))
    quoted = next(line.strip() for line in error.splitlines() if line.strip())[:200]
    table = _peers.table(board.me, board.heard())
    told = board.told()
    if told is None and verdict.kind == _peers.HELD:  # its last beats said so already
        told = verdict
    if told is not None and told.kind in (_peers.HELD, _peers.STUCK):
        # a peer fired on its own stall and ended, and TF aborted the rest: its verdict
        if told.kind == _peers.HELD:
            _tell_run(STEP, False, False, told)
        text = (
            f"training stopped: {told.line}; the workers that waited ended on that stall, "
            f"and TensorFlow aborted the collectives ({quoted}).\nworkers:\n{table}\n"
            "Nothing is recorded on this worker."
        )
        return Lost(text, told)
    if told is not None and told.kind == _peers.GONE and told.task not in (None, board.me):
        task: Optional[str] = told.task  # the abort that ended it ends this one now
    else:
        named = _peers.gone_in(error, board.me)
        task = named if named in down or not down else down[0]
        if task is None and verdict.kind == _peers.GONE:
            task = verdict.task
    heard = board.heard().get(task) if task is not None else None
    ago = f" {heard.ago:.0f} s ago" if heard is not None and heard.ago is not None else ""
    who = f"{task} stopped answering{ago}" if task else "a worker stopped answering"
    text = (
        f"training stopped: {who}: TensorFlow aborted the collectives ({quoted}).\n"
        f"workers:\n{table}\n"
        "Nothing is recorded: a peer gone is no communication's fault (`python -m "
        "safestrategy run` relaunches the training without a record)."
    )
    return Lost(text, _peers.Verdict(_peers.GONE, task, who))
