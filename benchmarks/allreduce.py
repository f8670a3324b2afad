"""Each backend's all-reduce time on the payload, side by side in one process; auto's choice marked.

    PYTHONPATH=. python benchmarks/allreduce.py [--cpus 2 3] [--rounds 9] [--processes 1]
        [--payload-mb 32] [--json FILE]
    python benchmarks/allreduce.py --table FILE     # the table of an earlier --json, again

Run it with the interpreter whose TensorFlow is to be measured (TF 2.x or 1.15).
For each device count (``--cpus``) a fresh child process configures that many
logical CPUs (TF2; a session's ``device_count`` on TF 1.x), then:

1. asks safestrategy what ``auto`` chooses there (``probe()``, cache off, the
   same payload), and notes its per-candidate medians;
2. smoke-checks every backend by hand (safestrategy's own check, in-process) and
   keeps those that sum right (``hierarchical_copy`` on 3 devices does not);
3. times, interleaved (A B C, B C A, C A B, ...: each round starts one variant
   later, so none always runs first), ``--rounds`` rounds of: each kept
   backend configured by hand, and the stock ``MirroredStrategy(devices)`` with no
   ``cross_device_ops`` (TF >= 2.13: ``CollectiveAllReduce``; TF 1.15: what
   ``select_cross_device_ops`` picks, named in the output). A round builds the
   strategy afresh and takes the median of safestrategy's timer
   (``checks.timing.batches_ms``: an untimed run, then ``RUNS`` runs of the batch all-reduce
   of ``payload_sizes(payload_mb)``, the way Keras reduces gradients).

A variant's figure is the median over rounds (with ``--processes N``, the median
over processes of each process's median); the ratio is chosen / fastest. A
benchmark, not a test: run it on a quiet machine.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence

#: Marks the child's one result line on its stdout.
PREFIX = "@allreduce@ "
STOCK = "stock MirroredStrategy(devices)"


# --- the child: one fresh process, one device count ---------------------------------------


def _configure(tf: Any, cpus: int) -> Any:
    """This process's CPUs as ``cpus`` devices; the TF 1.x session config (None on TF2)."""
    from safestrategy import _tf
    from safestrategy.checks.allreduce import graph_api, session_config

    if tf.__version__.startswith("2."):
        _tf.configure_logical_cpus(tf, cpus)
        return None
    return session_config(graph_api(tf), cpus, gpus=False)


def _stock_ops_name(tf: Any, devices: Sequence[str], config: Any) -> str:
    """The class TF's MirroredStrategy(devices) all-reduces with, where TF says so."""
    from safestrategy import _tf
    from safestrategy.backends import build_strategy

    if not tf.__version__.startswith("2."):
        from tensorflow.python.distribute import cross_device_ops

        select = getattr(cross_device_ops, "select_cross_device_ops", None)
        select = select or cross_device_ops.choose_the_best  # its TF 1.x name
        chosen = select(devices, session_config=config)
        return f"{select.__name__}: {type(chosen).__name__}"
    strategy = build_strategy(tf, _tf.era(tf.__version__), list(devices))
    ops = getattr(strategy.extended, "_cross_device_ops", None)
    return type(ops).__name__ if ops is not None else "unknown"


def _round_ms(tf: Any, era: str, devices: List[str], name: Optional[str], mb: float, config: Any):
    """One round of one variant (None: stock, no cross_device_ops at all): a fresh
    strategy, safestrategy's timer (median of RUNS)."""
    from safestrategy.checks import allreduce, timing

    return timing.batches_ms(tf, era, devices, name, [allreduce.payload_sizes(mb)], config)[0]


def child(cpus: int, rounds: int, mb: float) -> Dict[str, Any]:
    os.environ["SAFESTRATEGY_PAYLOAD_MB"] = repr(mb)
    os.environ["SAFESTRATEGY_CACHE"] = "off"
    import tensorflow as tf

    import safestrategy
    from safestrategy import _tf
    from safestrategy.backends import BACKEND_NAMES, get_backend
    from safestrategy.checks.allreduce import smoke_check

    config = _configure(tf, cpus)
    era = _tf.era(tf.__version__)
    devices = [f"/device:CPU:{i}" for i in range(cpus)]
    report = safestrategy.probe(devices)
    checks = {}
    for name in BACKEND_NAMES:
        if get_backend(name).needs_gpu:
            continue
        result = smoke_check(tf, era, devices, name, config)
        checks[name] = f"{result.status}: {result.reason}"
    right = [name for name in checks if checks[name].startswith("ok")]
    variants: Dict[str, Optional[str]] = {name: name for name in right}
    variants[STOCK] = None
    times: Dict[str, List[float]] = {label: [] for label in variants}
    labels = list(variants)
    for round_ in range(rounds):
        # A fixed order gave the variant run first 4 % on TF 1.15 (stock against the same
        # algorithm by hand, 9 rounds twice); alternating took it to noise.
        for label in labels[round_ % len(labels) :] + labels[: round_ % len(labels)]:
            times[label].append(_round_ms(tf, era, devices, variants[label], mb, config))
        print(f"  {cpus} CPUs, round {round_ + 1}/{rounds}", file=sys.stderr, flush=True)
    return {
        "tf": tf.__version__,
        "cpus": cpus,
        "devices": devices,
        "chosen": report.backend,
        "why": report.reason,
        "auto_ms": {c.name: c.ms for c in report.candidates if c.ms is not None},
        "checks": checks,
        "stock_ops": _stock_ops_name(tf, devices, config),
        "times": times,
    }


# --- the parent: one child per device count and process, medians, ratios ------------------


def run_child(cpus: int, rounds: int, mb: float) -> Dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTRATEGY_")}
    command = [sys.executable, os.path.abspath(__file__), "--child", str(cpus)]
    command += ["--rounds", str(rounds), "--payload-mb", repr(mb)]
    process = subprocess.run(command, env=env, stdout=subprocess.PIPE)
    lines = [line for line in process.stdout.decode().splitlines() if line.startswith(PREFIX)]
    if process.returncode != 0 or not lines:
        raise RuntimeError(f"the {cpus}-CPU child exited {process.returncode}")
    return json.loads(lines[-1][len(PREFIX) :])


def medians(runs: Sequence[Dict[str, Any]]) -> Dict[str, float]:
    """Each variant's median over rounds, then the median of those over processes."""
    labels = runs[0]["times"]
    per_process = {label: [statistics.median(r["times"][label]) for r in runs] for label in labels}
    return {label: statistics.median(values) for label, values in per_process.items()}


def table(record: Dict[str, Any]) -> str:
    lines = [
        f"TF {record['tf']}, Python {record['python']}, payload {record['payload_mb']:g} MB, "
        f"{record['rounds']} rounds x {record['processes']} process(es)",
        f"{'cpus':>4}  {'variant':32} {'median ms':>9} {'min-max ms':>17} {'/ fastest':>9}  note",
    ]
    for cpus, runs in record["runs"].items():
        figures = medians(runs)
        fastest = min(figures.values())
        chosen = runs[0]["chosen"]
        for label, value in sorted(figures.items(), key=lambda pair: pair[1]):
            every = [t for r in runs for t in r["times"][label]]
            note = "chosen by auto" if label == chosen else ""
            if label == STOCK:
                note = runs[0]["stock_ops"]
            lines.append(
                f"{cpus:>4}  {label:32} {value:9.2f} {min(every):8.2f}-{max(every):<8.2f}"
                f" {value / fastest:8.3f}x  {note}"
            )
        wrong = [name for name, check in runs[0]["checks"].items() if not check.startswith("ok")]
        for name in wrong:
            lines.append(
                f"{cpus:>4}  {name:32} {'':>9} {'':>17} {'':>9}  not timed: {name} "
                f"{runs[0]['checks'][name]}"
            )
        ratio = figures[chosen] / fastest if chosen in figures else float("nan")
        lines.append(f"{cpus:>4}  auto chose {chosen}: {ratio:.3f}x the fastest (target <= 1.03x)")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpus", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--processes", type=int, default=1, help="fresh processes per count")
    parser.add_argument("--payload-mb", type=float, default=32.0)
    parser.add_argument("--json", help="where to write the raw times (default: print only)")
    parser.add_argument("--table", metavar="JSON", help="print the table of a --json file, only")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(PREFIX + json.dumps(child(args.child, args.rounds, args.payload_mb)), flush=True)
        return
    if args.table:
        with open(args.table) as stream:
            print(table(json.load(stream)))
        return
    runs = {
        str(cpus): [run_child(cpus, args.rounds, args.payload_mb) for _ in range(args.processes)]
        for cpus in args.cpus
    }
    first = next(iter(runs.values()))[0]
    record = {
        "kind": "allreduce",
        "tf": first["tf"],
        "python": platform.python_version(),
        "machine_cpus": os.cpu_count(),
        "payload_mb": args.payload_mb,
        "rounds": args.rounds,
        "processes": args.processes,
        "runs": runs,
    }
    print(table(record))
    if args.json:
        with open(args.json, "w") as stream:
            json.dump(record, stream, indent=1)


if __name__ == "__main__":
    main()
