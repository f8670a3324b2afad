"""The stall watchdog: a training that stops making progress is noticed and explained.

One daemon thread per process samples Python's own view of every thread
(``sys._current_frames()``) every few seconds and asks
:mod:`~safestrategy.training.sampler` which TensorFlow call each is in and for
how long. Nothing wraps TensorFlow's calls, so a training step costs exactly
what it cost before; the price is one walk over the threads' stacks per sample.
On a stall it tells (the ERROR, in :mod:`~safestrategy.training.words`' words;
the run directory for ``run``), records it where the records say it belongs
(:mod:`safestrategy.records`), and with ``SAFESTRATEGY_STALL_ACTION=exit`` ends
the process with :data:`~safestrategy._env.EXIT_STALL`. Multi-worker, each
sample is also published to the peers (:mod:`~safestrategy.training.publish`)
and a stall's ERROR carries the verdict every worker draws.
"""

import contextlib
import itertools
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from .. import _env, _rundir, records
from ..checks import probe
from ..checks.allreduce import in_fresh_thread
from ..report import Report
from . import canary, peers, publish
from .board import Board
from .collectives import runs_collectives
from .rounds import Round, Rounds
from .sampler import (
    FINISHED,
    INPUT,
    OP,
    Event,
    Watched,
    advance,
    calls,
    interval,
    is_library,
    ours,
    stack_text,
    stopped_for,
)
from .words import headline, message, stuck_where

logger = logging.getLogger("safestrategy")


class Strategy(NamedTuple):
    """A strategy under watch: held weakly (a strategy that is gone is not watched), with
    its report and where its record goes (None: no record is written for it)."""

    ref: Callable[[], Any]
    report: Report
    place: Optional[records.Place]

    @property
    def same(self) -> Tuple[str, Tuple[str, ...], Optional[str]]:
        """Strategies with the same backend and devices count as one (a re-run cell)."""
        return self.report.backend, self.report.devices, self.report.task


_lock = threading.Lock()
_thread: Optional[threading.Thread] = None
_settings: Optional[_env.StallSettings] = None
_watched: List[Strategy] = []
#: The record each stalled call wrote (by thread), withdrawn if the call finishes.
_written: Dict[int, Strategy] = {}
#: Multi-worker: where this worker says it is, to its peers (None: one machine).
_board: Optional[Board] = None
#: Multi-worker: the canary rounds this worker joins and asks for (None: none can run).
_rounds: Optional[Rounds] = None


def held(strategy: Any) -> Callable[[], Any]:
    """A weak reference to ``strategy`` (a stand-in that cannot have one: itself)."""
    try:
        return weakref.ref(strategy)
    except TypeError:  # not weakly referenceable (a test's stand-in): held as it is
        return lambda: strategy


def watch(
    settings: _env.StallSettings,
    report: Report,
    strategy: Any = None,
    place: Optional[records.Place] = None,
    board: Optional[Board] = None,
    rounds: Optional[Rounds] = None,
) -> None:
    """Watch this process for ``strategy`` (the factories call this): the thread starts
    once; the latest settings apply. ``place``: where a stall of it is recorded (None:
    nowhere, e.g. a forced backend, one device, the cache off). ``board``: multi-worker,
    where this worker publishes its whereabouts and reads its peers' (the latest wins);
    ``rounds``: the canary rounds that judge a multi-worker stall (the latest wins)."""
    global _thread, _settings, _board, _rounds
    with _lock:
        _settings = settings
        if board is not None:
            _board = board
        if rounds is not None:
            _rounds = rounds
        if _rounds is not None and settings.timeout is not None:
            _rounds.set_timeout(settings.timeout)
        if board is not None:  # the first beat, as the strategy is built
            publish.again(board, next(_samples))
        _watched[:] = [w for w in _watched if w.ref() is not None]
        _watched.append(Strategy(held(strategy), report, place))
        if settings.timeout is None or (_thread is not None and _thread.is_alive()):
            return
        _thread = threading.Thread(target=_run, name="safestrategy-watchdog", daemon=True)
        _thread.start()


def _distinct() -> List[Strategy]:
    """The strategies watched and alive, one per backend and devices (the latest)."""
    with _lock:
        alive = [w for w in _watched if w.ref() is not None]
    return list({w.same: w for w in alive}.values())


def _owner(frame: Any, watched: Sequence[Strategy]) -> Optional[Strategy]:
    """The watched strategy whose call ``frame``'s stack runs: a frame of one of its
    methods (``strategy.run``, ``reduce``, its ``extended``), or of a Keras model's
    ``fit``/``evaluate``/``predict`` whose ``distribute_strategy`` it is; None: not told."""
    if len(watched) == 1:
        return watched[0]
    return _on_stack(frame, watched)


def _on_stack(frame: Any, watched: Sequence[Strategy]) -> Optional[Strategy]:
    """The watched strategy a frame of the stack ending at ``frame`` runs, or None."""
    by_id: Dict[int, Strategy] = {}
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


def outside_allreduce(kind: str, frame: Any, watched: Sequence[Strategy]) -> bool:
    """Whether a stalled call of ``kind`` is outside every strategy's all-reduce, so that
    no other backend can cure it: an iterator's ``get_next`` outside a step, or an eager op
    that no strategy's call (``strategy.run``, Keras ``fit``) is running."""
    if kind == INPUT:
        return True
    return kind == OP and (frame is None or _on_stack(frame, watched) is None)


_beats = itertools.count(1)
#: The watchdog's samples, and the beats said again while a canary round is waited for.
_samples = itertools.count(1)


#: Where the last heartbeat put the training (said again while a canary is waited for).
_last_where = [_rundir.OUTSIDE]


def _beat(where: Optional[str] = None) -> None:
    """A heartbeat, under `run` only (it judges silence and whose a death is): each
    sample's, ``where`` it found the training; and each second of a canary's wait, the
    last one's again (the wait must not read as a silent process)."""
    if where is not None:
        _last_where[0] = where
    _rundir.heartbeat(next(_beats), _last_where[0])


def _heard_where(seen: Mapping[int, Any], frames: Mapping[int, Any]) -> str:
    """Where a sample found the training, for ``run``: in no TF call, in its own TF work,
    or in a call that runs the strategy's collectives (read only under ``run``, each graph
    once: :mod:`~safestrategy.training.collectives`)."""
    if not seen:
        return _rundir.OUTSIDE
    if _rundir.directory() is None:  # no heartbeat is written: nothing to read for
        return _rundir.INSIDE
    inside = any(runs_collectives(frames.get(ident)) for ident in seen)
    return _rundir.COLLECTIVES if inside else _rundir.INSIDE


def _run() -> None:
    me = threading.get_ident()
    state: Dict[int, Watched] = {}
    while True:
        sample = next(_samples)
        settings = _settings
        if settings is None or settings.timeout is None:
            return  # turned off; watch() starts a new thread when it is turned on
        pause = interval(settings.timeout)
        before = time.monotonic()
        time.sleep(pause)
        now = time.monotonic()
        frames = sys._current_frames()
        for ident in (me, *ours()):  # a canary waiting on a frozen peer is not a stall
            frames.pop(ident, None)
        seen = calls(frames)
        try:
            _beat(_heard_where(seen, frames))
        except Exception:  # a graph that cannot be read is own work, never a stop
            logger.debug("stall watchdog: reading the call's graphs failed", exc_info=True)
            _beat(_rundir.INSIDE)
        stopped = stopped_for(now - before, pause)
        state, events = advance(state, seen, now, settings.timeout, stopped)
        board = _board
        if board is not None:  # before any stall is handled: the peers hear it as it fires
            try:
                publish.publish(board, sample, seen, frames, now, stopped, settings)
            except Exception:  # peers are an explanation, never a reason to stop watching
                logger.debug("stall watchdog: publishing to the peers failed", exc_info=True)
        for event in events:
            try:
                _handle(event, settings, frames)
            except Exception:  # the watchdog must never be what breaks a training
                logger.debug("stall watchdog: handling %s failed", event, exc_info=True)
        del seen, frames


def current_board() -> Optional[Board]:
    """Where this worker tells its peers where it is (None: one machine, or no service)."""
    return _board


def stall_timeout() -> float:
    """The stall timeout in force (25 s where none is: the watchdog is off)."""
    settings = _settings
    return settings.timeout if settings is not None and settings.timeout else 25.0


def _thread_name(ident: int) -> str:
    return next((t.name for t in threading.enumerate() if t.ident == ident), str(ident))


def nccl_variables() -> Dict[str, str]:
    """The ``NCCL_*`` variables in force, for the ERROR."""
    return {name: value for name, value in os.environ.items() if name.startswith("NCCL_")}


def stalled(
    text: str, culprit: Optional[Strategy], seconds: float, cause: str = "", evidence: str = ""
) -> None:
    """Log a stall's ERROR and record it where ``culprit``'s records go (if anywhere), with
    its ``cause`` (a multi-worker verdict, what the canary showed) and ``evidence``."""
    logger.error(text)
    if culprit is not None and culprit.place is not None:
        report = culprit.report
        chosen = next((c for c in report.candidates if c.name == report.backend), None)
        remedy = chosen.remedy if chosen is not None else {}
        records.record(
            culprit.place, report.backend, seconds, remedy, cause=cause, evidence=evidence
        )


def _handle(
    event: Event, settings: _env.StallSettings, frames: Optional[Mapping[int, Any]] = None
) -> None:
    """One event of a sample: a stall fired (tell, check the all-reduce, record what the
    canary convicts, exit under ``exit``) or a stalled call finished after all (withdraw).
    ``frames``: every thread's innermost frame (the stuck one's stack, and where)."""
    frames = frames or {}
    frame = frames.get(event.thread)
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
            records.withdraw(written.place, written.report.backend)
        if _board is not None:  # the stall is over: so is the verdict its beats said
            _board.said = None
        return
    watched = _distinct()
    culprit = _owner(frame, watched)
    outside = outside_allreduce(event.watched.kind, frame, watched)
    board, drawn = _board, None
    thread = _thread_name(event.thread)
    first = headline(event.seconds, event.watched.kind, thread, settings)
    answer, where = None, ""
    if board is not None and culprit is not None and culprit.report.task is not None:
        drawn, answer = _round(board, first, settings)
        where = _where(frames) if drawn[0].kind == peers.PROGRAM else ""
    elif culprit is not None and not outside:
        answer = _canary(culprit, first, settings.timeout)
        where = _where(frames)
    if culprit is not None:  # records only what the canary shows is the all-reduce's doing
        peer = drawn is not None and drawn[0].kind in peers.A_WORKERS_DOING
        convicted = answer is not None and answer.convicts  # only the canary convicts
        culprit = culprit._replace(
            place=records.recordable(culprit.place, outside, peer, convicted)
        )
    stack = stack_text(frame, event.watched.call) if frame is not None else "  (gone)"
    text = message(
        event.seconds,
        event.watched.kind,
        thread,
        stack,
        culprit.report if culprit is not None else None,
        nccl_variables(),
        settings,
        culprit.place if culprit is not None else None,
        [w.report for w in watched] if culprit is None else (),
        outside,
        drawn,
        answer,
        where,
    )
    if drawn is not None and board is not None:  # the last beat says it, for the peers
        publish.last_word(board, drawn[0], settings.timeout, wait=settings.action == "exit")
    evidence = "canary" if answer is not None and answer.convicts else ""
    cause = (drawn[0].line if drawn is not None else answer.said()) if evidence else ""
    stalled(text, culprit, event.seconds, cause, evidence)
    recorded = culprit is not None and culprit.place is not None
    if recorded:
        _written[event.thread] = culprit
    tell_run(event.watched.kind, outside, recorded, drawn[0] if drawn is not None else None, answer)
    if settings.action == "exit":
        end_process()


def _round(
    board: Board, first: str, settings: _env.StallSettings
) -> Tuple[Tuple[peers.Verdict, str], Optional[canary.Answer]]:
    """Multi-worker: the verdict every worker draws from a canary round (the latest, if
    a peer asked for it a moment ago, else a new one), with the workers' table, and what
    the canary showed (None: a worker is gone, which no all-reduce shows). Where no round
    can run, the beats' verdict, and no canary: nothing is recorded on a guess."""
    rounds, timeout = _rounds, settings.timeout or stall_timeout()
    if rounds is None:
        found, why = None, "no canary rounds here (no coordination service or eager collective)"
    elif not board.seen:  # its leader frozen or gone: a round would only wait
        found, why = None, "no canary round can run: TensorFlow's coordination service is silent"
    else:
        found, why = _ask(board, rounds, first, timeout), "the canary round could not be asked for"
    board.look()
    heard = board.heard()
    if found is None or rounds is None:
        verdict = board.verdict(interval(timeout), publish.hold(timeout))
        return (verdict, peers.table(board.me, heard)), canary.Answer(canary.NONE, 0.0, why)
    verdict = board.passed_on(peers.judged(board.tasks, found.joins, heard, found.waited))
    gone = verdict.kind in (peers.GONE, peers.STOPPED)
    answer = None if gone else canary.from_round(found.joins, rounds.bound)
    return (verdict, peers.table(board.me, heard)), answer


def _ask(board: Board, rounds: Rounds, first: str, timeout: float) -> Optional[Round]:
    """Ask for a round and gather it, on a thread of its own: meanwhile this thread keeps
    beating and looking (the board is never called from two threads), and a worker whose
    beats stopped is not waited for to join. None: no round (never raises)."""
    rounds.set_timeout(timeout)
    wait = rounds.join_bound + rounds.bound
    logger.error("%s Asking every worker to run a canary all-reduce (at most %g s).",
                 first, round(wait, 1))  # fmt: skip
    late = 2 * interval(timeout) + 1.0  # as the beats' verdict counts a worker gone

    def tick() -> None:
        _beat()
        publish.again(board, next(_samples))
        board.look()

    def silent(task: str) -> bool:
        ago = board.heard().get(task)
        return ago is not None and ago.ago is not None and ago.ago > late

    try:
        return in_fresh_thread(
            lambda: rounds.ask(2 * interval(timeout), silent), wait + 2, tick, 0.5
        )
    except Exception:  # no round is no evidence, never a crash
        return None


def _canary(culprit: Strategy, first: str, timeout: float) -> canary.Answer:
    """Check whether ``culprit``'s all-reduce still answers; ``first``, the ERROR's first
    line, is logged before it runs (it may take up to its bound)."""
    strategy = culprit.ref()
    why = canary.unavailable(culprit.report, strategy)
    if why is not None:
        return canary.Answer(canary.NONE, 0.0, why)
    seconds = canary.bound(timeout)
    logger.error(
        "%s Checking whether the all-reduce itself answers (at most %g s).", first, seconds
    )
    tf = sys.modules["tensorflow"]
    return canary.run(tf, culprit.report, strategy, seconds, _beat)


def _where(frames: Mapping[int, Any]) -> str:
    """Where the stuck step waits, as the ERROR says it (``running your Python in a
    py_function (train.py:40)``), from every thread's frames."""
    if not frames:
        return ""
    found = peers.whereabouts(frames, calls(frames), threading.main_thread().ident, is_library)
    return stuck_where(found.where, found.at)


def tell_run(
    where: str,
    outside: bool,
    recorded: bool,
    verdict: Optional[peers.Verdict],
    answer: Optional[canary.Answer] = None,
) -> None:
    """The run directory's ``stall-<pid>.json``: where the stall was, whether it was
    recorded, what the canary showed and the workers' verdict (``run`` judges the launch
    by it)."""
    said: Dict[str, Any] = {"where": where, "outside": outside, "recorded": recorded}
    if answer is not None:
        said.update(canary=answer.kind, canary_said=answer.said())
    if verdict is not None:
        said.update(verdict=verdict.kind, culprit=verdict.task, line=verdict.line)
    _rundir.stalled(said)


def flush_logs() -> None:
    """Flush the ``safestrategy`` logger's handlers and the standard streams (before an exit)."""
    chain: Optional[logging.Logger] = logger
    while chain is not None:
        for handler in chain.handlers:
            with contextlib.suppress(Exception):  # a broken handler must not keep us alive
                handler.flush()
        chain = chain.parent if chain.propagate else None
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def end_process() -> None:
    """End the process now with :data:`~safestrategy._env.EXIT_STALL`: a stuck thread never
    returns, so no normal exit can (a stall); a broken mirror must not train on (a check)."""
    flush_logs()
    probe.close_all()
    os._exit(_env.EXIT_STALL)
