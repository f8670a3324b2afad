"""What ``python -m safestrategy run`` costs: a steady Keras step, and a relaunch's start.

    PYTHONPATH=. python benchmarks/run_overhead.py [--rounds 9] [--json FILE]

Run it with the interpreter whose TensorFlow is to be measured (TF 2.x). Every
measured run is a fresh process running this file with ``--child``, on two logical
CPUs, ``make_mirrored_strategy(["/cpu:0", "/cpu:1"])`` (auto) and one small Keras
MLP, with one cache directory warmed by an untimed launch first. (Only a launch
made to hang has a layer that calls ``tf.py_function``, to hang in; none that is
measured has it.) Each round runs, in
this order (interleaved, round after round):

- ``plain``: the script started directly: a plain warm start. Its time to the
  first step is from just before the parent starts it to the end of the first
  ``fit`` batch (``time.perf_counter``: system-wide monotonic on Linux).
- ``run``: the same script under ``python -m safestrategy run``, nothing going wrong.
- ``relaunch``: the same script under ``run``, its first launch's first step hung,
  so that the watchdog (stall timeout 3 s on that launch only) records the stall
  on the winner and exits 75; ``run`` relaunches it, and the relaunch decides warm
  with a record on the cached winner (the next candidate by the cached timings,
  smoke-checked, nothing timed). Its time to the first step is from the stall's
  ERROR (logged just before the exit) to the end of the relaunch's first batch.
  The record is forgotten after each round (``records --forget``).

Two ratios, each median over median: the steady step under ``run`` against plain
(each process: ms per step of each of its timed epochs after an untimed one; its
figure the median of them, and the fastest too, shown beside), and the relaunch's
time to its first step against the plain warm start's. A benchmark, not a test:
run it on a quiet machine.
"""

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = ["/cpu:0", "/cpu:1"]
#: Marks the child's result lines on its stdout.
PREFIX = "@run_overhead@ "
#: Set (to "1") in the child's environment to hang the first launch's first step.
HANG = "RUN_OVERHEAD_HANG"
STEPS, EPOCHS, BATCH = 300, 8, 64  #: per timed epoch; timed epochs; rows per step


def say(**fields: Any) -> None:
    print(PREFIX + json.dumps(fields), flush=True)


def child() -> None:
    """The training: prints ``began`` (its first line of Python), ``first`` (the end of the
    first batch), ``epochs`` (ms per step of each timed epoch), and, when its step hangs,
    ``stalled`` (the stall's ERROR)."""
    say(began=time.perf_counter())
    hang = os.environ.get(HANG) == "1" and os.environ.get("SAFESTRATEGY_RESTART") == "0"
    if hang:
        os.environ["SAFESTRATEGY_STALL_TIMEOUT"] = "3"

    class Stalled(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR and "no progress" in record.getMessage():
                say(stalled=time.perf_counter())

    logging.getLogger("safestrategy").addHandler(Stalled())

    import numpy as np
    import tensorflow as tf

    sys.path.insert(0, ROOT)
    import safestrategy
    from safestrategy import _tf

    def step_input(x: Any) -> Any:
        time.sleep(3600)  # a hung all-reduce, as far as anyone can tell
        return x

    class Hangable(tf.keras.layers.Layer):
        def call(self, x: Any) -> Any:
            y = tf.py_function(step_input, [x], tf.float32)
            y.set_shape(x.shape)
            return y

    class Clock(tf.keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.epochs: List[float] = []
            self.first = True

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if self.first:
                self.first = False
                say(first=time.perf_counter())

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.started = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.epochs.append((time.perf_counter() - self.started) * 1000 / STEPS)

    _tf.configure_logical_cpus(tf, 2)
    strategy = safestrategy.make_mirrored_strategy(DEVICES)
    with strategy.scope():
        hangable = [Hangable()] if hang else []
        model = tf.keras.Sequential(
            [
                tf.keras.Input((64,)),
                *hangable,
                tf.keras.layers.Dense(512, activation="relu"),
                tf.keras.layers.Dense(1),
            ]
        )
        model.compile(optimizer="sgd", loss="mse")
    x = np.ones((STEPS * BATCH, 64), np.float32)
    y = np.ones((STEPS * BATCH, 1), np.float32)
    clock = Clock()
    model.fit(x, y, batch_size=BATCH, epochs=1 + EPOCHS, verbose=0, callbacks=[clock])
    say(epochs=clock.epochs[1:], backend=safestrategy.last_report().backend)


def launch(variant: str, cache: str) -> Dict[str, Any]:
    """One measured run of ``variant``: its child's result lines, merged (``started``: the
    parent's clock just before the start)."""
    script = [sys.executable, os.path.abspath(__file__), "--child"]
    command = script
    env = dict(os.environ, SAFESTRATEGY_CACHE_DIR=cache, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    if variant != "plain":
        command = [sys.executable, "-m", "safestrategy", "run", "--grace", "5", "--", *script]
    if variant == "relaunch":
        env[HANG] = "1"
    started = time.perf_counter()
    done = subprocess.run(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, timeout=600
    )
    lines = [
        json.loads(line[len(PREFIX) :])
        for line in done.stdout.decode().splitlines()
        if line.startswith(PREFIX)
    ]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{variant} failed ({done.returncode}):\n{done.stderr.decode()[-3000:]}")
    result: Dict[str, Any] = {"started": started, "backends": [], "began": []}
    for fields in lines:
        if "backend" in fields:
            result["backends"].append(fields["backend"])
        if "began" in fields:  # each launch's (under run: the relaunch's is the last)
            result["began"].append(fields["began"])
        result.update({k: v for k, v in fields.items() if k not in ("backend", "began")})
    if variant == "relaunch":
        subprocess.run(
            [sys.executable, "-m", "safestrategy", "records", "--forget"],
            env=env,
            stdout=subprocess.DEVNULL,
            check=True,
        )
    return result


def measure(rounds: int, cache: str) -> Dict[str, List[Dict[str, Any]]]:
    launch("plain", cache)  # untimed: races the candidates and caches their timings
    runs: Dict[str, List[Dict[str, Any]]] = {"plain": [], "run": [], "relaunch": []}
    for number in range(rounds):
        for variant in runs:
            runs[variant].append(launch(variant, cache))
        print(f"round {number + 1}/{rounds} done", file=sys.stderr, flush=True)
    return runs


def summary(runs: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Any]:
    def steady(variant: str, pick: Any) -> float:
        return statistics.median(pick(r["epochs"]) for r in runs[variant])

    plain, relaunch = runs["plain"], runs["relaunch"]
    first_plain = statistics.median(r["first"] - r["started"] for r in plain)
    first_relaunch = statistics.median(r["first"] - r["stalled"] for r in relaunch)
    # where the time goes: until the script's first line runs, and from there
    start_plain = statistics.median(r["began"][-1] - r["started"] for r in plain)
    start_relaunch = statistics.median(r["began"][-1] - r["stalled"] for r in relaunch)
    median = {v: steady(v, statistics.median) for v in ("plain", "run")}
    fastest = {v: steady(v, min) for v in ("plain", "run")}
    return {
        "steady_ms": median,
        "steady_fastest_ms": fastest,
        "steady_ratio": median["run"] / median["plain"],
        "steady_fastest_ratio": fastest["run"] / fastest["plain"],
        "first_step_s": {"plain warm start": first_plain, "relaunch": first_relaunch},
        "first_step_ratio": first_relaunch / first_plain,
        "until_first_line_s": {"plain warm start": start_plain, "relaunch": start_relaunch},
        "backends": {
            "plain": runs["plain"][0]["backends"],
            "relaunch": runs["relaunch"][0]["backends"],
        },
    }


def table(result: Dict[str, Any], rounds: int) -> str:
    steady, fastest = result["steady_ms"], result["steady_fastest_ms"]
    first, line = result["first_step_s"], result["until_first_line_s"]
    plain, relaunch = result["backends"]["plain"], result["backends"]["relaunch"]
    return "\n".join(
        [
            f"{rounds} interleaved rounds; medians over processes",
            "| steady Keras step | plain | under run | run / plain |",
            "|---|---:|---:|---:|",
            f"| median of each process's epochs | {steady['plain']:.2f} ms | "
            f"{steady['run']:.2f} ms | {result['steady_ratio']:.3f}x (target <= 1.01) |",
            f"| fastest epoch of each process | {fastest['plain']:.2f} ms | "
            f"{fastest['run']:.2f} ms | {result['steady_fastest_ratio']:.3f}x |",
            "",
            "| time to the first step | seconds | / plain warm start | of it, to the first line |",
            "|---|---:|---:|---:|",
            f"| plain warm start (on {plain[-1]}) | {first['plain warm start']:.2f} | 1.000x "
            f"| {line['plain warm start']:.3f} |",
            f"| child's exit -> relaunch's first step (on {relaunch[-1]}) | "
            f"{first['relaunch']:.2f} | {result['first_step_ratio']:.3f}x (target <= 1.05) "
            f"| {line['relaunch']:.3f} |",
        ]
    )


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (9+)")
    parser.add_argument("--json", help="where to write the raw figures (default: print only)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child()
        return
    with tempfile.TemporaryDirectory() as cache:
        runs = measure(args.rounds, cache)
    result = summary(runs)
    print(table(result, args.rounds))
    if args.json:
        import tensorflow as tf

        record = {
            "tf": tf.__version__,
            "python": platform.python_version(),
            "rounds": args.rounds,
            "summary": result,
            "runs": runs,
        }
        with open(args.json, "w") as stream:
            json.dump(record, stream, indent=1)


if __name__ == "__main__":
    main()
