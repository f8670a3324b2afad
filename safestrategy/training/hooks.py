"""Exception hooks: errors that end a multi-worker training, explained before Python reports them.

Two errors end a worker's collectives without a stall the watchdog could see:
the user's own ``CommunicationOptions(timeout_seconds=...)`` cutting a
collective short (reported like a stall, with its record), and TensorFlow
aborting the collectives because a peer is gone (the worker it names, every
worker's last beat, nothing recorded). Each hook is installed once, chains the
hook already there, and never hides the error itself.
"""

import logging
import sys
import traceback
from typing import Any, NamedTuple, Optional

from .. import records
from ..report import Report
from . import peers, publish
from .board import BOUND, Board
from .sampler import STEP, interval, is_library
from .watchdog import (
    Strategy,
    current_board,
    flush_logs,
    held,
    nccl_variables,
    stall_timeout,
    stalled,
    tell_run,
)
from .words import collective_timeout_message

logger = logging.getLogger("safestrategy")

_hooked = False
#: The multi-worker strategy whose user-set collective timeout is reported (the latest).
_timed_out: Optional[Strategy] = None


def report_collective_timeouts(
    timeout: float, report: Report, strategy: Any = None, place: Optional[records.Place] = None
) -> None:
    """Multi-worker with the user's ``CommunicationOptions(timeout_seconds=...)``: report
    its ``DeadlineExceededError``, when nothing catches it, like a stall (the ERROR and the
    record at ``place``) before Python reports it as usual. Installed once; the latest
    strategy applies."""
    global _hooked, _timed_out
    _timed_out = Strategy(held(strategy), report, place)
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
    kept = [entry for entry in traceback.extract_tb(trace) if not is_library(entry.filename)]
    stack = "".join(traceback.StackSummary.from_list(kept).format()).rstrip()
    text = collective_timeout_message(timeout, error, stack, report, nccl_variables(), place)
    stalled(text, culprit, timeout)
    flush_logs()


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
        board = current_board()
        if board is not None and issubclass(kind, KeyboardInterrupt):
            stopped_by_user(board)
        elif board is not None:
            try:
                lost = lost_peer(board, f"{kind.__name__}: {error}")
                if lost is not None:
                    logger.error(lost.text)
                    flush_logs()
                    publish.last_word(board, lost.verdict, stall_timeout(), wait=True)
            except Exception:  # reporting must never hide the error itself
                logger.debug("reporting a lost peer failed", exc_info=True)
        before(kind, error, trace)

    sys.excepthook = hook


def stopped_by_user(board: Board) -> None:
    """This worker's user stopped it (Ctrl-C): say so in its last beat, so that the peers
    its exit ends say why and are not relaunched to wait for it (they would, the probe
    timeout and a stall timeout long). The leader's exit ends the service: it waits, at
    most two samples, for its peers to read it first."""
    leader = board.tasks[:1] == [board.me]
    timeout = stall_timeout()
    if leader:
        logger.warning(
            "%s was stopped by its user: telling the other workers (at most %.0f s; "
            "Ctrl-C again ends it now)",
            board.me,
            2 * interval(timeout) + BOUND,
        )
    verdict = peers.Verdict(peers.STOPPED, board.me, f"{board.me} was stopped by its user")
    publish.last_word(board, verdict, timeout, wait=leader)


class Lost(NamedTuple):
    """An abort for a peer gone: the ERROR to log, and the verdict it draws."""

    text: str
    verdict: peers.Verdict


def lost_peer(board: Board, error: str) -> Optional[Lost]:
    """What an abort of the collectives because a peer is gone says (None: it is not
    one): the verdict a peer said as it ended first (a stall of its own, or this same
    abort, met while the one that is gone was the only one down), else the worker
    TensorFlow names, else the one the peers' beats say went quiet."""
    if not any(word in error for word in peers.PEER_GONE):
        return None
    down = board.down()  # first: the peers this abort ends are still alive a moment more
    board.look()
    timeout = stall_timeout()
    verdict = board.verdict(interval(timeout), publish.hold(timeout))
    quoted = next(line.strip() for line in error.splitlines() if line.strip())[:200]
    table = peers.table(board.me, board.heard())
    told = board.told()
    if told is None and verdict.kind == peers.HELD:  # its last beats said so already
        told = verdict
    if told is not None and told.kind in (peers.HELD, peers.STUCK):
        # a peer fired on its own stall and ended, and TF aborted the rest: its verdict
        if told.kind == peers.HELD:
            tell_run(STEP, False, False, told)
        text = (
            f"training stopped: {told.line}; the workers that waited ended on that stall, "
            f"and TensorFlow aborted the collectives ({quoted}).\nworkers:\n{table}\n"
            "Nothing is recorded on this worker."
        )
        return Lost(text, told)
    if told is not None and told.kind == peers.STOPPED:
        tell_run(STEP, False, False, told)
        text = (
            f"training stopped: {told.line} (Ctrl-C), and TensorFlow aborted the "
            f"collectives ({quoted}).\nworkers:\n{table}\nNothing is recorded, and `python "
            "-m safestrategy run` does not relaunch this worker: it would wait for one that "
            "is not coming back."
        )
        return Lost(text, told)
    if told is not None and told.kind == peers.GONE and told.task not in (None, board.me):
        task: Optional[str] = told.task  # the abort that ended it ends this one now
    else:
        named = peers.gone_in(error, board.me)
        task = named if named in down or not down else down[0]
        if task is None and verdict.kind == peers.GONE:
            task = verdict.task
    heard = board.heard().get(task) if task is not None else None
    ago = f" {heard.ago:.0f} s ago" if heard is not None and heard.ago is not None else ""
    who = f"{task} stopped answering{ago}" if task else "a worker stopped answering"
    if heard is not None and heard.beat is None:
        who = f"{task} ended before its first heartbeat"
    text = (
        f"training stopped: {who}: TensorFlow aborted the collectives ({quoted}).\n"
        f"workers:\n{table}\n"
        "Nothing is recorded: a peer gone is no communication's fault (`python -m "
        "safestrategy run` relaunches the training without a record)."
    )
    return Lost(text, peers.Verdict(peers.GONE, task, who))
