"""A stall on one machine convicts the all-reduce only on evidence: trials of each case.

    PYTHONPATH=. .nox/tf221/bin/python benchmarks/canary_trials.py [--trials 20]
        [--cases pyfunc map block] [--stall 3]

Each trial runs tests/stall_script.py (Keras ``fit`` on two logical CPUs,
``SAFESTRATEGY_STALL_ACTION=exit``) in a fresh process with a cache of its own; the
cases take turns, so a loaded moment falls on each alike:

- ``pyfunc``: a layer's ``py_function`` hangs in the 5th step; ``map``: a ``tf.data``
  map hangs from the 3rd step on (a read from a dead file system). Right: the canary
  answered, the ERROR says where (``running your Python in a py_function``), nothing is
  recorded.
- ``block``: the backend's all-reduce itself hangs (tests/hung_allreduce.py, so the
  canary through the same ops hangs too). Right: the canary did not answer and the stall
  is recorded, with ``evidence: canary``.

A trial is right when the process exits 75 with one stall's ERROR saying the right
thing and the cache holds exactly what it should. Prints right/trials per case and the
slowest canary answer. Not a timed test: seconds per trial.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "stall_script.py"
CASES = ("pyfunc", "map", "block")
ANSWERED = re.compile(r"the all-reduce answered in (\d+) ms: the step is stuck outside it: ")
HUNG = re.compile(r"the all-reduce itself did not answer in ([\d.]+) s")


def records(cache):
    """The stall records in ``cache``: each one's backend and evidence."""
    found = []
    for path in Path(cache).glob("stall-*.json"):
        entry = json.loads(path.read_text())["value"]
        found.append((entry.get("backend"), entry.get("evidence", "")))
    return found


def trial(case, stall):
    """One trial: (right, why, canary's answer in s or None)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "SAFESTRATEGY_STALL_TIMEOUT": f"{stall:g}",
            "SAFESTRATEGY_STALL_ACTION": "exit",
            "SAFESTRATEGY_CACHE_DIR": cache,
            "TF_CPP_MIN_LOG_LEVEL": "2",
        }
        ran = subprocess.run(
            [sys.executable, str(SCRIPT), case],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        log = ran.stderr
        if ran.returncode != 75:
            return False, f"exit {ran.returncode}", None
        if log.count("Checking whether the all-reduce itself answers") != 1:
            return False, "not one stall", None
        written = records(cache)
        if case == "block":
            hung = HUNG.search(log)
            if hung is None:
                return False, "the canary did not hang", None
            if len(written) != 1 or written[0][1] != "canary":
                return False, f"records {written}", None
            return True, "", float(hung.group(1))
        answered = ANSWERED.search(log)
        if answered is None or "running your Python in a py_function" not in log:
            return False, "no answer, or not where", None
        if written:
            return False, f"recorded {written}", None
        return True, "", int(answered.group(1)) / 1000


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--stall", type=float, default=3.0, help="SAFESTRATEGY_STALL_TIMEOUT")
    args = parser.parse_args()
    right = {case: 0 for case in args.cases}
    slowest = {case: 0.0 for case in args.cases}
    for number in range(args.trials):
        for case in args.cases:  # interleaved
            ok, why, seconds = trial(case, args.stall)
            right[case] += ok
            if seconds is not None:
                slowest[case] = max(slowest[case], seconds)
            print(f"trial {number + 1} {case}: {'right' if ok else 'WRONG: ' + why}", flush=True)
    for case in args.cases:
        print(f"{case:<7} {right[case]}/{args.trials} right; slowest canary {slowest[case]:.3f} s")


if __name__ == "__main__":
    main()
