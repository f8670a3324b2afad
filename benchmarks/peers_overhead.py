"""What publishing a worker's whereabouts costs a steady step (2 workers on 127.0.0.1).

    PYTHONPATH=. .nox/tf221/bin/python benchmarks/peers_overhead.py [--rounds 11] [--steps 2000]

Two workers (tests/peers_worker.py ``steady``: RING on CPUs, a custom-loop step of a
``py_function`` and an all-reduce; Keras 3's ``fit`` cannot train with
MultiWorkerMirroredStrategy, keras-team/keras#20585) run rounds of the same steps,
with the watchdog publishing and reading the peers' beats on every other round and
not on the others (the same rounds on both workers: they step together). The stall
timeout is 25 s, so the watchdog samples every 5 s, as with the default 600 s. Prints
the median round of each variant and their ratio (worker 0's rounds; medians of
interleaved rounds, the first pair dropped as warm-up), the median of each pair's ratio,
how long each sample's publishing took on worker 0's watchdog thread (the KV calls run
on a thread of their own while it waits, so this bounds the CPU publishing takes from
the steps: the round ratios on 2 noisy cores cannot show 1 %), and every verdict either
worker logged: a healthy training logs none. Not a timed test.
"""

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from safestrategy.training import sampler
from tests import peers_worker

#: The workers' stall timeout, and the seconds between the watchdog's samples at it (5 s,
#: as at the default 600 s).
STALL = 25
SAMPLE = sampler.interval(STALL)
#: A verdict's line (or a stall's), which a healthy training never logs.
VERDICT = re.compile(r"holds the others back|inside the same step|stopped answering|no progress")


def fail(why):
    raise SystemExit(why)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11, help="pairs of rounds")
    parser.add_argument("--steps", type=int, default=2000, help="steps per round (> 5 s)")
    args = parser.parse_args()
    import os

    os.environ.update(PEERS_ROUNDS=str(2 * (args.rounds + 1)), PEERS_STEPS=str(args.steps))
    with tempfile.TemporaryDirectory() as where:
        where = Path(where)
        with peers_worker.cluster(where, "steady", -1, 2, STALL, 240, fail) as (processes, outputs):
            for process in processes:
                process.wait(timeout=3600)
            text = outputs[0][0].read_text()
            logs = [err.read_text() for _, err in outputs]
    found = re.findall(r"^ROUND (\d+) (on|off) (\S+)$", text, re.MULTILINE)
    times = {"on": [], "off": []}
    for number, variant, seconds in found:
        if int(number) >= 2:  # the first pair warms up
            times[variant].append(float(seconds) / args.steps * 1000)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    pairs = statistics.median(a / b for a, b in zip(times["on"], times["off"]))
    print(f"{len(times['on'])} interleaved pairs of {args.steps} steps, 2 workers")
    print(f"step with publishing    {on:.3f} ms (median)")
    print(f"step without publishing {off:.3f} ms (median)")
    print(f"ratio {on / off:.4f}x (fastest rounds: {min(times['on']) / min(times['off']):.4f}x)")
    print(f"median ratio of a pair's two rounds {pairs:.4f}x")
    spent = [float(s) for s in re.search(r"^PUBLISHED(.*)$", text, re.M).group(1).split()]
    each = statistics.median(spent) * 1000
    print(
        f"publishing on worker 0's watchdog thread: {len(spent)} samples, {each:.2f} ms each "
        f"(median; slowest {max(spent) * 1000:.2f} ms), one per {SAMPLE:g} s: "
        f"{100 * each / (1000 * SAMPLE):.3f} % of the worker's time at most"
    )
    said = [line for log in logs for line in log.splitlines() if VERDICT.search(line)]
    print(f"verdicts logged in this healthy training: {len(said)} (must be 0)")
    for line in said:
        print(f"  {line}")


if __name__ == "__main__":
    main()
