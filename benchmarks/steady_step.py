"""Steady-state Keras step time: make_mirrored_strategy() against stock and hand-made strategies.

    PYTHONPATH=. python benchmarks/steady_step.py [--cpus 2 3] [--rounds 9] [--steps 20]
        [--width 2048] [--json FILE]
    python benchmarks/steady_step.py --table FILE     # the table of an earlier --json, again

TF 2.x (Keras fits eagerly-built ``tf.function`` steps there; TF 1.x Keras shares one
graph and session between models, which would put every variant in one graph).
For each device count (``--cpus``) a fresh child process configures that many
logical CPUs and builds, all in that one process and on the same devices:

- ``make_mirrored_strategy(devices)`` (``auto``, cache off: it races now);
- stock ``tf.distribute.MirroredStrategy(devices)`` (no ``cross_device_ops``);
- every backend configured by hand that sums right there (safestrategy's smoke
  check; ``hierarchical_copy`` does not on 3 devices).

Each gets the same Keras MLP (``--width`` wide: 512 -> W -> W -> W/2 -> 10, about
28 MB of float32 gradients at the default 2048, like auto's 32 MB payload) under its
``strategy.scope()``, compiled with SGD, and one untimed ``fit`` (tracing, first
allocations). Then ``--rounds`` interleaved rounds (A B C ... A B C ...): each
variant fits ``--steps`` steps of a repeated in-memory dataset, timed as a whole;
a round's figure is its time per step. A variant's figure is the median over
rounds; ratios are to the fastest. A benchmark, not a test: run it on a quiet machine.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

PREFIX = "@steady_step@ "
AUTO = "make_mirrored_strategy(devices)"
STOCK = "stock MirroredStrategy(devices)"
BATCH = 96  #: global batch: whole per-replica batches on 2 and 3 devices


# --- the child: one fresh process, one device count, every variant ------------------------


def _strategies(tf: Any, devices: List[str]) -> Dict[str, Any]:
    """Every variant's strategy, by label; the chosen backend as ``AUTO``'s note."""
    import safestrategy
    from safestrategy import _tf
    from safestrategy.backends import (
        BACKEND_NAMES,
        build_cross_device_ops,
        build_strategy,
        get_backend,
    )
    from safestrategy.checks.allreduce import smoke_check

    era = _tf.era(tf.__version__)
    strategies = {AUTO: safestrategy.make_mirrored_strategy(devices)}
    strategies[STOCK] = tf.distribute.MirroredStrategy(devices)
    for name in BACKEND_NAMES:
        if get_backend(name).needs_gpu or smoke_check(tf, era, devices, name).status != "ok":
            continue
        ops = build_cross_device_ops(tf, era, name, devices)
        strategies[f"{name} by hand"] = build_strategy(tf, era, devices, ops)
    return strategies


def _model(tf: Any, strategy: Any, width: int) -> Any:
    with strategy.scope():
        layers = tf.keras.layers
        model = tf.keras.Sequential(
            [
                tf.keras.Input(shape=(512,)),
                layers.Dense(width, activation="relu"),
                layers.Dense(width, activation="relu"),
                layers.Dense(width // 2, activation="relu"),
                layers.Dense(10),
            ]
        )
        model.compile(optimizer="sgd", loss="mse")
    return model


def child(cpus: int, rounds: int, steps: int, width: int) -> Dict[str, Any]:
    os.environ["SAFESTRATEGY_CACHE"] = "off"
    import numpy as np
    import tensorflow as tf

    import safestrategy
    from safestrategy import _tf

    if not tf.__version__.startswith("2."):
        raise SystemExit(f"steady_step.py needs TF 2.x; this is TF {tf.__version__}")
    _tf.configure_logical_cpus(tf, cpus)
    devices = [f"/device:CPU:{i}" for i in range(cpus)]
    strategies = _strategies(tf, devices)
    chosen = safestrategy.last_report().backend
    x = np.random.RandomState(0).rand(BATCH * steps, 512).astype(np.float32)
    y = np.random.RandomState(1).rand(BATCH * steps, 10).astype(np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()
    models = {label: _model(tf, strategy, width) for label, strategy in strategies.items()}
    for model in models.values():  # untimed: tracing, first allocations
        model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    times: Dict[str, List[float]] = {label: [] for label in models}
    for round_ in range(rounds):
        for label, model in models.items():
            started = time.perf_counter()
            model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
            times[label].append((time.perf_counter() - started) * 1000 / steps)
        print(f"  {cpus} CPUs, round {round_ + 1}/{rounds}", file=sys.stderr, flush=True)
    return {"tf": tf.__version__, "cpus": cpus, "chosen": chosen, "times": times}


# --- the parent -----------------------------------------------------------------------------


def run_child(cpus: int, args: argparse.Namespace) -> Dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTRATEGY_")}
    command = [sys.executable, os.path.abspath(__file__), "--child", str(cpus)]
    command += ["--rounds", str(args.rounds), "--steps", str(args.steps)]
    command += ["--width", str(args.width)]
    process = subprocess.run(command, env=env, stdout=subprocess.PIPE)
    lines = [line for line in process.stdout.decode().splitlines() if line.startswith(PREFIX)]
    if process.returncode != 0 or not lines:
        raise RuntimeError(f"the {cpus}-CPU child exited {process.returncode}")
    return json.loads(lines[-1][len(PREFIX) :])


def table(record: Dict[str, Any]) -> str:
    lines = [
        f"TF {record['tf']}, Python {record['python']}, MLP width {record['width']}, "
        f"batch {BATCH}, {record['steps']} steps x {record['rounds']} rounds",
        f"{'cpus':>4}  {'variant':34} {'ms/step':>8} {'min-max':>15} {'/ fastest':>9}",
    ]
    for cpus, run in record["runs"].items():
        figures = {label: statistics.median(times) for label, times in run["times"].items()}
        fastest = min(figures.values())
        for label, value in sorted(figures.items(), key=lambda pair: pair[1]):
            times = run["times"][label]
            note = f"  auto chose {run['chosen']} (target <= 1.03x)" if label == AUTO else ""
            lines.append(
                f"{cpus:>4}  {label:34} {value:8.2f} {min(times):7.2f}-{max(times):<7.2f}"
                f" {value / fastest:8.3f}x{note}"
            )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpus", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--steps", type=int, default=20, help="steps timed per round")
    parser.add_argument("--width", type=int, default=2048, help="MLP width")
    parser.add_argument("--json", help="where to write the raw times (default: print only)")
    parser.add_argument("--table", metavar="JSON", help="print the table of a --json file, only")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = child(args.child, args.rounds, args.steps, args.width)
        print(PREFIX + json.dumps(result), flush=True)
        return
    if args.table:
        with open(args.table) as stream:
            print(table(json.load(stream)))
        return
    runs = {str(cpus): run_child(cpus, args) for cpus in args.cpus}
    record = {
        "kind": "steady_step",
        "tf": next(iter(runs.values()))["tf"],
        "python": platform.python_version(),
        "machine_cpus": os.cpu_count(),
        "width": args.width,
        "steps": args.steps,
        "rounds": args.rounds,
        "runs": runs,
    }
    print(table(record))
    if args.json:
        with open(args.json, "w") as stream:
            json.dump(record, stream, indent=1)


if __name__ == "__main__":
    main()
