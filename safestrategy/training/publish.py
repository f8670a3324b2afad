"""This worker's side of the peers: what it tells them at each sample, and its last word.

At each sample the watchdog publishes where this worker is
(:func:`~safestrategy.training.peers.whereabouts`) and for how long, on its own
clock with time stopped left out, and reads its peers' beats; a worker away
from the all-reduce for as long as its peers have waited in it says once that
it holds them back. A worker that ends on a verdict says it in its last beat
(:func:`last_word`), so that the peers it ends next name the same culprit.
"""

import contextlib
import logging
import sys
import threading
import time
from typing import Any, Mapping, Optional, Tuple

from .. import _env
from . import peers
from .board import BOUND, Board
from .collectives import runs_collectives
from .sampler import calls, interval, is_library, ours

logger = logging.getLogger("safestrategy")


class Here:
    """Where this worker has been since when (its own clock, time stopped left out): in
    the same call (a steady training is in a new step at every sample, never in one for
    long), or outside any call; and whether it already said that it holds its peers
    back."""

    where: Optional[str] = None
    at = ""
    call: Any = None  #: the frame marking the call (:class:`~safestrategy.training.peers.Where`)
    since = 0.0
    said = False


def hold(timeout: float) -> float:
    """How long a worker must have been away to hold its peers back through a stall of
    ``timeout``: the timeout, less two samples' slack (they started waiting at about the
    moment it left)."""
    return max(0.0, timeout - 2 * interval(timeout))


def publish(
    board: Board,
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
    where, at, call = peers.whereabouts(frames, seen, threading.main_thread().ident, is_library)
    if where != Here.where or call is not Here.call:
        Here.where, Here.call, Here.since, Here.said = where, call, now, False
    else:
        Here.since += stopped
    Here.at = at
    board.paused(stopped)  # time this worker was stopped is no peer's silence
    board.publish(sample, where, now - Here.since, at)
    board.look()
    if Here.said or where not in peers.AWAY or settings.timeout is None:
        return
    heard = board.heard()
    beats = [one.beat for task, one in heard.items() if task != board.me]
    waiting = [b for b in beats if b is not None and b.where in (peers.STEP, peers.PY_FUNCTION)]
    # a peer fires within a sample of its call reaching the timeout
    if not waiting or any(
        b.seconds < settings.timeout - interval(settings.timeout) for b in waiting
    ):
        return
    # names this worker only once it has been away for the hold itself (its own beat)
    verdict = board.verdict(interval(settings.timeout), hold(settings.timeout))
    if verdict.kind == peers.HELD and verdict.task == board.me:
        Here.said = True
        logger.error(
            "%s.\nworkers:\n%s\nNothing is recorded: another communication would wait for "
            "this worker the same way.",
            verdict.line.replace(f"{board.me} ", f"this worker ({board.me}) ", 1),
            peers.table(board.me, heard),
        )


def again(board: Board, sample: int) -> None:
    """Say again where this worker is (a new sample number): as the strategy is built
    (its first beat), and while the sampling thread waits for a canary round (a worker
    judging a stall is not one that stopped answering)."""
    with contextlib.suppress(Exception):  # before any sample: outside any call yet
        board.publish(sample, Here.where or peers.OUTSIDE, _seconds(), Here.at)


def _seconds() -> float:
    """For how long this worker has been where it last said: none before its first
    sample (a beat at build saying "outside since the clock's epoch" reads, to a peer
    whose step the dead worker's abort ends, as a worker holding it back for hours)."""
    return time.monotonic() - Here.since if Here.where is not None else 0.0


def joining() -> Tuple[str, str, float, bool]:
    """Where this worker is as it joins a canary round (the rounds' listener asks): where
    its threads are, at which user line, for how long, and whether its main thread's call
    runs the strategy's collectives (:mod:`~safestrategy.training.collectives`)."""
    frames = sys._current_frames()
    for ident in ours():
        frames.pop(ident, None)
    main = threading.main_thread().ident
    where, at, _ = peers.whereabouts(frames, calls(frames), main, is_library)
    seconds = time.monotonic() - Here.since if where == Here.where else 0.0
    # the main thread's call, or a thread it waits on (a checkpoint's reduction runs
    # its collectives on a pool's threads)
    inside = runs_collectives(frames.get(main)) or any(
        runs_collectives(frame, graphs=False) for frame in frames.values()
    )
    return where, at, seconds, inside


def last_word(board: Board, verdict: peers.Verdict, timeout: float, wait: bool) -> None:
    """Say ``verdict`` in this worker's last beat; with ``wait`` (it is about to end), give
    every peer still answering up to two samples to read it: the worker this exit ends
    next (every one, when this is the leader) then names the same culprit, not this one."""
    with contextlib.suppress(Exception):  # the peers are an explanation, never a hold-up
        board.publish(-1, Here.where or peers.STEP, _seconds(), "", verdict)
        if wait:
            ended = [verdict.task] if verdict.kind == peers.GONE and verdict.task else []
            board.read_by_peers(2 * interval(timeout) + BOUND, ended)
