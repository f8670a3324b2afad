"""Fresh-process time to the first trained Keras step: safestrategy against stock or by hand.

    PYTHONPATH=. python benchmarks/first_step.py [--repeat N] [--json FILE] [--scenario NAME ...]
    python benchmarks/first_step.py --table FILE     # the table of an earlier --json, again

Run it with the interpreter whose TensorFlow is to be measured (TF 2.x or 1.15);
every measured run is a fresh ``sys.executable`` child running this file with
``--child``. The parent reads ``time.perf_counter()`` just before it starts the
child and passes it on; the child reads the same clock (system-wide monotonic
on Linux) at the end of the first ``model.fit`` batch, so a time covers
interpreter start-up, importing TensorFlow, building the strategy, building
and compiling the model, and one training step. The variants run interleaved
(A B C ... A B C ...) and each scenario's ratio is median over median.

The ``auto`` scenario compares ``make_mirrored_strategy(devices)`` with stock
``tf.distribute.MirroredStrategy(devices)``: cold (nothing cached: every candidate
checked and raced on the payload) and warm (timings cached: the winner checked, nothing
timed). A cold run gets a fresh, empty ``SAFESTRATEGY_CACHE_DIR``; a warm run gets one
filled by an untimed run before the first repetition. ``nccl-probe`` patches
``safestrategy._tf.nccl_kernel_count`` to 1 in the child, because no installed
TensorFlow here registers an NcclAllReduce kernel: the rest (cache key, cache
read, probe process) is the real code path of a build that has them.

Prints a table and writes every raw time to ``--json`` (plot it with
``benchmarks/plot_first_step.py``). A benchmark, not a test.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

#: Two logical CPUs, the device set of every multi-device scenario.
DEVICES = ["/cpu:0", "/cpu:1"]
#: Arguments of the hand-made cross-device ops: what safestrategy's reduce_to_cpu passes.
OPS_KWARGS = {"ReductionToOneDevice": {"reduce_to_device": "/device:CPU:0"}}
#: Marks the child's one result line on its stdout.
PREFIX = "@first_step@ "
#: Variable whose presence makes the child report a patched NCCL kernel count.
SIMULATE_NCCL = "FIRST_STEP_SIMULATE_NCCL_KERNELS"


class Variant(NamedTuple):
    """One way to get a strategy, as the child builds it."""

    name: str
    cpus: int  #: logical CPU devices configured before the strategy
    devices: Optional[List[str]]  #: None: the constructor's default
    safe: bool  #: make_mirrored_strategy() rather than tf.distribute.MirroredStrategy
    backend: Optional[str] = None  #: safe: backend=; else the tf.distribute ops class
    cache: Optional[str] = None  #: safe: "cold" or "warm"
    simulate_nccl: bool = False


class Scenario(NamedTuple):
    name: str
    title: str
    baseline: Variant
    candidates: Tuple[Variant, ...]
    #: each candidate's ratio to stay within (None: none), or one per TensorFlow major
    #: version ({"2": ..., "1": ...}): read them through :func:`targets`
    targets: Tuple[Any, ...]


#: The cold ``auto`` race's targets against stock, by TensorFlow major version (API.md,
#: "How auto chooses": <= 1.25x on 2 logical CPUs with TF 2.21, <= 1.8x with TF 1.15);
#: warm is <= 1.03x on both.
COLD_TARGETS = {"2": 1.25, "1": 1.8}


def targets(scenario: Scenario, tf_version: str) -> Tuple[Optional[float], ...]:
    """``scenario``'s target for each candidate on TensorFlow ``tf_version``."""
    major = str(tf_version).split(".")[0]
    return tuple(t.get(major) if isinstance(t, dict) else t for t in scenario.targets)


_REDUCE_TO_CPU = Variant("hand-reduce_to_cpu", 2, DEVICES, False, "ReductionToOneDevice")

SCENARIOS = (
    Scenario(
        "one-device",
        "no arguments, one CPU",
        Variant("tf-default", 1, None, False),
        (Variant("safe-default", 1, None, True, cache="cold"),),
        (1.03,),
    ),
    Scenario(
        "auto",
        "auto against stock MirroredStrategy(devices), 2 logical CPUs",
        Variant("tf-default-2cpu", 2, DEVICES, False),
        (
            Variant("safe-auto-cold", 2, DEVICES, True, cache="cold"),
            Variant("safe-auto-warm", 2, DEVICES, True, cache="warm"),
        ),
        (COLD_TARGETS, 1.03),
    ),
    Scenario(
        "nccl-listed",
        "nccl,reduce_to_cpu, this TF's kernel count",
        _REDUCE_TO_CPU,
        (Variant("safe-nccl-listed", 2, DEVICES, True, "nccl,reduce_to_cpu", "cold"),),
        (1.05,),
    ),
    Scenario(
        "nccl-probe",
        "nccl,reduce_to_cpu, kernel count patched to 1",
        _REDUCE_TO_CPU,
        (
            Variant("safe-nccl-cold", 2, DEVICES, True, "nccl,reduce_to_cpu", "cold", True),
            Variant("safe-nccl-warm", 2, DEVICES, True, "nccl,reduce_to_cpu", "warm", True),
        ),
        (None, 1.05),
    ),
)


# --- the child: one fresh process, one strategy, one training step -------------------------


def _strategy(tf: Any, variant: Variant) -> Tuple[Any, Dict[str, Any]]:
    """The variant's strategy, the backend it all-reduces with and safestrategy's checks."""
    if variant.safe:
        import safestrategy
        from safestrategy import _tf

        if os.environ.get(SIMULATE_NCCL):
            _tf.nccl_kernel_count = lambda tf: 1
        strategy = safestrategy.make_mirrored_strategy(variant.devices, backend=variant.backend)
        report = safestrategy.last_report()
        return strategy, {
            "backend": report.backend,
            "candidates": [c.to_dict() for c in report.candidates],
        }
    if variant.backend is None:
        return tf.distribute.MirroredStrategy(variant.devices), {"backend": "TensorFlow's default"}
    ops = getattr(tf.distribute, variant.backend)(**OPS_KWARGS.get(variant.backend, {}))
    strategy = tf.distribute.MirroredStrategy(variant.devices, cross_device_ops=ops)
    return strategy, {"backend": variant.backend}


def child(variant: Variant, started: float) -> Dict[str, Any]:
    """Train one step; the seconds since ``started`` at each milestone."""
    marks = {"python": time.perf_counter() - started}
    import numpy as np
    import tensorflow as tf

    marks["import"] = time.perf_counter() - started
    if not tf.__version__.startswith("2."):  # TF1: the CPUs are a session's, set as Keras's
        config = tf.ConfigProto(device_count={"CPU": variant.cpus})
        tf.keras.backend.set_session(tf.Session(config=config))
    elif variant.cpus > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        logical = [tf.config.LogicalDeviceConfiguration() for _ in range(variant.cpus)]
        tf.config.set_logical_device_configuration(cpu, logical)
    strategy, how = _strategy(tf, variant)
    marks["strategy"] = time.perf_counter() - started

    class FirstStep(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            marks.setdefault("step", time.perf_counter() - started)

    with strategy.scope():
        inputs = tf.keras.Input(shape=(8,))
        model = tf.keras.Model(inputs, tf.keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 8), np.float32), np.ones((8, 1), np.float32)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[FirstStep()])
    return {"tf": tf.__version__, **how, "marks": marks}


# --- the parent: interleaved fresh processes, medians, ratios ------------------------------


def run_child(variant: Variant, cache_dir: Optional[str]) -> Dict[str, Any]:
    """One fresh process of ``variant``: its result, with ``seconds`` to the first step."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTRATEGY_")}
    env.pop(SIMULATE_NCCL, None)
    if cache_dir is not None:
        env["SAFESTRATEGY_CACHE_DIR"] = cache_dir
    if variant.simulate_nccl:
        env[SIMULATE_NCCL] = "1"
    command = [sys.executable, os.path.abspath(__file__), "--child", variant.name]
    started = time.perf_counter()
    process = subprocess.run(
        [*command, repr(started)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    lines = [line for line in process.stdout.decode().splitlines() if line.startswith(PREFIX)]
    if process.returncode != 0 or not lines:
        tail = process.stderr.decode(errors="replace")[-3000:]
        raise RuntimeError(f"{variant.name} exited {process.returncode}:\n{tail}")
    result: Dict[str, Any] = json.loads(lines[-1][len(PREFIX) :])
    result["seconds"] = result["marks"]["step"]
    return result


def measure(scenarios: Sequence[Scenario], repeat: int, scratch: str) -> Dict[str, List[Any]]:
    """Every variant's results, ``repeat`` interleaved rounds of one fresh process each.

    The cache folders are made in ``scratch``: one warm, one fresh per cold run.
    """
    warm_dir = os.path.join(scratch, "warm")
    variants = list({v.name: v for s in scenarios for v in (s.baseline, *s.candidates)}.values())
    for variant in variants:  # untimed: fills the warm cache, and the OS's file cache
        if variant.cache == "warm":
            run_child(variant, warm_dir)
    runs: Dict[str, List[Any]] = {variant.name: [] for variant in variants}
    for round_ in range(repeat):
        for variant in variants:
            cache_dir = None
            if variant.cache == "warm":
                cache_dir = warm_dir
            elif variant.cache == "cold":
                cache_dir = tempfile.mkdtemp(prefix="cold-", dir=scratch)
            result = run_child(variant, cache_dir)
            runs[variant.name].append(result)
            print(f"  round {round_ + 1}/{repeat} {variant.name:24} {result['seconds']:7.2f} s")
    return runs


def quantile(times: Sequence[float], q: float) -> float:
    """The ``q`` quantile, interpolated between order statistics (Python 3.6 has no quantiles)."""
    ordered = sorted(times)
    at = q * (len(ordered) - 1)
    below = int(at)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (at - below)


def table(scenarios: Sequence[Scenario], runs: Dict[str, List[Any]]) -> str:
    """One line per variant: median and spread to the first step, ratio to the baseline.

    ``build s`` is the median time from TensorFlow imported to the strategy built:
    where safestrategy's own work (its import, checks, cache, probe process) shows.
    """
    lines = [
        f"{'scenario':12} {'variant':24} {'median s':>8} {'min-max s':>13} {'IQR s':>13}"
        f" {'build s':>7} {'ratio':>6} {'target':>6}  backend"
    ]
    for scenario in scenarios:
        base = quantile([r["seconds"] for r in runs[scenario.baseline.name]], 0.5)
        tf = runs[scenario.baseline.name][0].get("tf", "")
        goals = {v.name: t for v, t in zip(scenario.candidates, targets(scenario, tf))}
        for variant in (scenario.baseline, *scenario.candidates):
            results = runs[variant.name]
            times = [r["seconds"] for r in results]
            median, q1, q3 = (quantile(times, q) for q in (0.5, 0.25, 0.75))
            low, high = min(times), max(times)
            build = quantile([r["marks"]["strategy"] - r["marks"]["import"] for r in results], 0.5)
            target = f"{goals[variant.name]:.2f}" if goals.get(variant.name) else ""
            lines.append(
                f"{scenario.name:12} {variant.name:24} {median:8.2f} {low:6.2f}-{high:<6.2f}"
                f" {q1:6.2f}-{q3:<6.2f} {build:7.2f} {median / base:5.3f}x {target:>6}"
                f"  {results[0]['backend']}"
            )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7, help="rounds of runs (default 7)")
    parser.add_argument("--json", help="where to write the raw times (default: print only)")
    parser.add_argument("--table", metavar="JSON", help="print the table of a --json file, only")
    parser.add_argument(
        "--scenario", nargs="+", choices=[s.name for s in SCENARIOS], help="default: all"
    )
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "STARTED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        by_name = {v.name: v for s in SCENARIOS for v in (s.baseline, *s.candidates)}
        result = child(by_name[args.child[0]], float(args.child[1]))
        print(PREFIX + json.dumps(result), flush=True)
        return
    if args.table:
        with open(args.table) as stream:
            record = json.load(stream)
        names = {scenario["name"] for scenario in record["scenarios"]}
        print(f"TF {record['tf']}, Python {record['python']}, {record['repeat']} rounds")
        print(table([s for s in SCENARIOS if s.name in names], record["runs"]))
        return
    scenarios = [s for s in SCENARIOS if not args.scenario or s.name in args.scenario]
    with tempfile.TemporaryDirectory(prefix="first-step-") as scratch:
        runs = measure(scenarios, args.repeat, scratch)
    print(table(scenarios, runs))
    if args.json:
        first = next(iter(runs.values()))[0]
        record = {
            "tf": first["tf"],
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "repeat": args.repeat,
            "scenarios": [
                {
                    "name": s.name,
                    "title": s.title,
                    "targets": list(targets(s, first["tf"])),
                    "baseline": s.baseline.name,
                    "candidates": [v.name for v in s.candidates],
                }
                for s in scenarios
            ],
            "runs": runs,
        }
        with open(args.json, "w") as stream:
            json.dump(record, stream, indent=1)


if __name__ == "__main__":
    main()
