"""Which worker holds the others back: trials of every injected case, 2 and 3 workers.

    PYTHONPATH=. .nox/tf221/bin/python benchmarks/peers_trials.py [--trials 20]
        [--workers 2 3] [--cases input sleep stop kill interrupt all stuck read checkpoint]
        [--stall 5]

Each trial starts fresh workers on 127.0.0.1 (tests/peers_worker.py: RING on CPUs,
``SAFESTRATEGY_STALL_ACTION=exit``), injects the case on worker k (k turns over every
worker, the coordination service's leader included), and reads every worker's log:

- ``input`` (k's input pipeline blocks), ``sleep`` (k sleeps in its own Python between
  steps): every worker that stalls says ``worker:k holds the others back``, and k says
  ``this worker (worker:k) holds the others back`` or that verdict itself;
- ``read`` (k blocks in an eager file read outside its step), ``checkpoint`` (k is late to
  a checkpoint of an ``ON_READ`` variable the others wait in): ``worker:k holds the
  others back``;
- ``stop`` (SIGSTOP), ``kill`` (SIGKILL), two samples after READY: every other worker says
  ``worker:k did not join the canary round`` (or ``worker:k stopped answering``: where
  TensorFlow's abort came first, or k is the leader, whose service then answers no one);
- ``interrupt`` (SIGINT, as a terminal's Ctrl-C, two samples after READY): every other
  worker says ``worker:k was stopped by its user`` (TensorFlow's abort, or a round k's
  teardown did not let it join);
- ``all`` (every worker's step blocks in a ``py_function``): every worker says ``every
  worker is inside the step, and the communication answers``;
- ``stuck`` (as ``all``, and the canary's own all-reduce hangs: a stuck communication):
  ``every worker joined the canary round, and the all-reduce itself did not answer``.

A trial is right when every worker says the right thing within the stall timeout + two
samples (the ERROR's "no progress for N s") and a record was written on every worker
for ``stuck`` and on none otherwise. Prints right/trials per case and size, and the
slowest time to the verdict. Not a timed test: minutes per case.
"""

import argparse
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from safestrategy import records
from tests import peers_worker

CASES = ("input", "sleep", "stop", "kill", "interrupt", "all", "stuck", "read", "checkpoint")
#: Cases whose culprit's own verdict is not waited for (it is stopped, or it sleeps).
QUIET = ("stop", "kill", "interrupt", "checkpoint")
#: Cases started by a signal to the culprit, and the signal.
SIGNALS = {"stop": signal.SIGSTOP, "kill": signal.SIGKILL, "interrupt": signal.SIGINT}
NAMED = re.compile(r"no progress for (\d+) s")


def expected(case, culprit, index):
    """What worker ``index`` must say, or None when it says nothing (a stopped culprit)."""
    name = f"worker:{culprit}"
    if case == "all":
        return "every worker is inside the step, and the communication answers"
    if case == "stuck":
        return "every worker joined the canary round, and the all-reduce itself did not answer"
    if index == culprit:
        if case in QUIET:
            return None
        return f"this worker ({name}) holds the others back|{name} holds the others back"
    if case == "interrupt":
        return f"{name} was stopped by its user"
    if case in ("stop", "kill"):
        return f"{name} did not join the canary round|{name} stopped answering"
    return f"{name} holds the others back"


class Failed(Exception):
    pass


def fail(why):
    raise Failed(why)


def trial(case, count, culprit, stall, where):
    """One trial: (right, seconds from the trouble to the slowest verdict, what was wrong).
    The trouble starts at READY (input, sleep, all) or at the signal (stop, kill,
    interrupt); a worker's verdict is timed by its ERROR's "no progress for N s", or,
    where TensorFlow aborted its collectives first (a peer killed), by when it ended."""
    with peers_worker.cluster(where, case, culprit, count, stall, 240, fail) as (
        processes,
        outputs,
    ):
        started = time.monotonic()
        if case in SIGNALS:
            time.sleep(2 * stall / 5 + 0.5)  # two samples: its peers have heard it step
            os.kill(processes[culprit].pid, SIGNALS[case])
            started = time.monotonic()
        deadline = started + stall * 6 + 30
        waiting = {i for i in range(count) if case in ("all", "stuck", "read") or i != culprit}
        ended = {}
        while waiting - set(ended) and time.monotonic() < deadline:
            for index in waiting - set(ended):
                if processes[index].poll() is not None:
                    ended[index] = time.monotonic() - started
            time.sleep(0.05)
        if waiting - set(ended):
            return False, None, f"workers {sorted(waiting - set(ended))} never ended"
        if case in ("input", "sleep"):  # the culprit says so at its next sample
            until = time.monotonic() + 3 * stall / 5 + 1
            while time.monotonic() < until and "holds the others back" not in (
                outputs[culprit][1].read_text()
            ):
                time.sleep(0.1)
        logs = [err.read_text() for _, err in outputs]
    slowest, wrong = 0.0, []
    for index in range(count):
        written = records.every(str(where / f"c{index}"))
        if bool(written) != (case == "stuck") and expected(case, culprit, index) is not None:
            wrong.append(f"worker {index}: {len(written)} records")
    for index, text in enumerate(logs):
        want = expected(case, culprit, index)
        if want is None:
            continue
        if not any(part in text for part in want.split("|")):
            said = re.findall(
                r"^(worker:.*|every .*|this worker .*|training stopped: .*)$", text, re.M
            )
            wrong.append(f"worker {index}: {(said or [text[-300:]])[0]}")
            continue
        named = [int(n) for n in NAMED.findall(text)]
        seconds = float(min(named)) if named else ended.get(index, 0.0)
        slowest = max(slowest, seconds)
    return not wrong, slowest, "; ".join(wrong)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--stall", type=float, default=5.0, help="the workers' stall timeout")
    args = parser.parse_args()
    bound = args.stall + 2 * min(5.0, args.stall / 5) + 1
    rows = []
    for count in args.workers:
        for case in args.cases:
            right, slowest, started = 0, 0.0, time.monotonic()
            for number in range(args.trials):
                culprit = number % count
                with tempfile.TemporaryDirectory() as where:
                    try:
                        ok, seconds, why = trial(case, count, culprit, args.stall, Path(where))
                    except Failed as error:
                        ok, seconds, why = False, None, str(error)[:300]
                in_time = seconds is not None and seconds <= bound
                right += ok and in_time
                slowest = max(slowest, seconds or 0.0)
                if not (ok and in_time):
                    print(
                        f"  {count} workers, {case}, worker:{culprit}: {why or seconds}", flush=True
                    )
            minutes = (time.monotonic() - started) / 60
            rows.append((count, case, right, args.trials, slowest, minutes))
            said = f"{right}/{args.trials} right, slowest {slowest:.0f} s (bound {bound:.0f} s)"
            print(f"{count} workers {case:<6} {said}, {minutes:.1f} min", flush=True)
    print("\n| workers | case | right | slowest verdict (s) |")
    print("|---|---|---|---|")
    for count, case, right, trials, slowest, _ in rows:
        print(f"| {count} | {case} | {right}/{trials} | {slowest:.0f} |")


if __name__ == "__main__":
    main()
