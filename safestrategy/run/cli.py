"""``python -m safestrategy run -- COMMAND``: relaunch a training an all-reduce stalled or killed.

The watchdog can end a stuck process (exit 75) and the next launch avoids the
backend that stalled, but someone has to launch it again, and a scheduler
relaunches with the same broken configuration. ``run`` starts the command as a
child (:func:`~safestrategy.run.supervise.supervise`), reads what it left in
its run directory, asks :func:`~safestrategy.run.judge.judge` what follows,
writes the record it says, and relaunches. POSIX only; never imports TensorFlow.
"""

import argparse
import os
import sys
from typing import List, Optional, Sequence, Tuple

from .. import _env, _machine, _procs, _rundir, records
from .judge import judge
from .launches import KEEP_LAUNCHES, prune, runs_directory
from .supervise import say, supervise


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="safestrategy run",
        description="Run a training and relaunch it when an all-reduce stalled or crashed "
        "it, so that its own next decision trains on the next backend (POSIX only).",
        epilog="example: python -m safestrategy run --max-restarts 3 -- python train.py",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="N",
        help="relaunches after the first launch (default: %(default)s)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds run gives a training to end by itself: after Ctrl-C, after the "
        "training says it finished (its heartbeat) but has not exited, and between SIGTERM "
        "and SIGKILL (default: %(default)g)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS ...]")
    return parser


def _cannot(settings: _env.StallSettings, cache: bool, user_action: bool) -> List[str]:
    """What ``run`` cannot do under the user's settings."""
    notes = []
    if user_action and settings.action == "warn":
        notes.append(
            f"{_env.ENV_STALL_ACTION}=warn: a stalled training is not ended, so not relaunched"
        )
    if settings.timeout is None:
        notes.append(f"{_env.ENV_STALL_TIMEOUT}=off: no stall is seen and no heartbeat is judged")
    if not cache:
        notes.append(f"{_env.ENV_CACHE}=off: no record is kept, so no relaunch on the next backend")
    return notes


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if _machine.system() == "Windows":
        print(
            "safestrategy run: POSIX only in 0.4 (Windows would need Job Objects and console "
            "control events): run the training directly",
            file=sys.stderr,
        )
        return 2
    if not command:
        parser.error("give the command to run after --, e.g. -- python train.py")
    if args.max_restarts < 0 or not args.grace > 0:
        parser.error("--max-restarts takes a whole number >= 0, --grace a positive number")
    try:
        settings = _env.resolve_stall()
        cache = _env.resolve_switch(_env.ENV_CACHE)
    except ValueError as error:
        print(f"safestrategy run: error: {error}", file=sys.stderr)
        return 2
    user_action = bool(os.environ.get(_env.ENV_STALL_ACTION, "").strip())
    notes = _cannot(settings, cache, user_action)
    if notes:
        say("; ".join(notes))
    base, runs = runs_directory(cache)
    _procs.become_subreaper()  # a training a wrapper left behind is still found and ended
    env = dict(os.environ)
    if not user_action:
        env[_env.ENV_STALL_ACTION] = "exit"
    launches = args.max_restarts + 1
    rows: List[Tuple[int, str, str, float]] = []
    verdict = None
    for number in range(launches):
        where = os.path.join(base, f"launch-{number + 1}")  # as run's lines number it
        os.makedirs(where, exist_ok=True)
        if runs is not None:
            prune(runs, KEEP_LAUNCHES)
        env.update(
            {
                _env.ENV_RESTART: str(number),
                _env.ENV_RUN_DIR: where,
                _env.ENV_RUN_GRACE: repr(args.grace),
            }
        )
        try:
            ended = supervise(command, env, where, settings.timeout, args.grace)
        except OSError as error:
            print(f"safestrategy run: cannot start {command[0]!r}: {error}", file=sys.stderr)
            return 127
        launch = _rundir.read(where)
        verdict = judge(ended, launch, records.read)
        if verdict.record is not None:
            record = verdict.record
            records.record(
                record.place,
                record.backend,
                record.seconds,
                record.remedy,
                record.kind,
                record.cause,
                record.where,
            )
        backend = str(launch.decisions[-1].get("backend")) if launch.decisions else "-"
        rows.append((number + 1, backend, verdict.ended, ended.seconds))
        if not verdict.relaunch:
            if verdict.code != 0:
                say(f"launch {number + 1} ended ({verdict.ended}): {verdict.why}; not relaunched")
            break
        if number + 1 == launches:
            say(f"launch {number + 1}: {verdict.why}; the {args.max_restarts} restarts are spent")
            break
        say(f"launch {number + 2} of {launches}: {verdict.why}")
    say("launches:\n" + _table(rows))
    return verdict.code if verdict is not None else 0


def _table(rows: Sequence[Tuple[int, str, str, float]]) -> str:
    lines = [f"  {'launch':>6}  {'backend':<18} {'ended':<28} {'seconds':>8}"]
    lines.extend(f"  {n:>6}  {b:<18} {e:<28} {s:>8.1f}" for n, b, e, s in rows)
    return "\n".join(lines)
