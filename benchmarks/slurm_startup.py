"""Start-up under ``srun``: the cluster read from Slurm's step, against a hand-written TF_CONFIG.

    PYTHONPATH=. python benchmarks/slurm_startup.py [--tasks 2] [--rounds 9] [--json FILE]

Run it as root with the interpreter whose TensorFlow is to be measured (TF 2.x), with
nothing else running: it starts a one-node Slurm (``tests/slurm.py``, in a temporary
directory, stopped at the end by the pids it saved). Each round runs both ways one after
the other, in an order that alternates round by round, each a fresh
``srun -N1 -n<tasks>`` with a fresh cache directory shared by its tasks (one node's home):

- ``slurm``: ``tests/cluster_worker.py slurm``: no TF_CONFIG, ``make_multiworker_strategy()``
  reads Slurm's step (hosts, tasks, this task, the port formula);
- ``tf_config``: this file with ``--task``, which does what a user's wrapper does without
  safestrategy's Slurm support (TF_CONFIG from ``SLURM_PROCID`` and ports the launcher
  chose), then ``tests/cluster_worker.py``'s ``tf_config``.

A task's start-up is cluster_worker's ``startup``: from its first line, before
``import tensorflow``, to the strategy built (the probe of RING across the tasks
included). The ratio is the median of the ``slurm`` tasks' start-ups over the median of
the ``tf_config`` ones. A benchmark, not a test.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests import cluster_worker  # noqa: E402
from tests import slurm as slurm_cluster  # noqa: E402

WAYS = ("slurm", "tf_config")
WORKER = os.path.join(ROOT, "tests", "cluster_worker.py")


def task() -> None:
    """One task of the ``tf_config`` way: TF_CONFIG as a user's wrapper writes it."""
    ports = os.environ["BENCH_PORTS"].split(",")
    index = int(os.environ["SLURM_PROCID"])
    workers = [f"127.0.0.1:{port}" for port in ports]
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
    )
    cluster_worker.main("tf_config")


def step(directory: str, way: str, tasks: int) -> List[float]:
    """One ``srun`` of ``way``: each task's start-up, in seconds."""
    scratch = tempfile.mkdtemp(prefix="slurm-startup-")
    env = slurm_cluster.environment(directory)
    env.update(PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG="")
    env.update(WORKERS_DONE=os.path.join(scratch, "done"), SAFESTRATEGY_CACHE_DIR=scratch)
    os.mkdir(env["WORKERS_DONE"])
    if way == "slurm":
        command = [sys.executable, WORKER, "slurm"]
    else:
        from tests.conftest import free_ports  # here: a task must not import safestrategy early

        env["BENCH_PORTS"] = ",".join(str(port) for port in free_ports(tasks))
        command = [sys.executable, os.path.abspath(__file__), "--task"]
    try:
        done = subprocess.run(
            ["srun", "-N1", f"-n{tasks}", "--kill-on-bad-exit=1", *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            universal_newlines=True,
            env=env,
            timeout=300,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    lines = done.stdout.splitlines()
    found = [json.loads(line[7:]) for line in lines if line.startswith("RESULT ")]
    if done.returncode != 0 or len(found) != tasks:
        raise SystemExit(f"{way}: srun exited {done.returncode}:\n{done.stderr[-3000:]}")
    return [result["startup"] for result in found]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--task", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.task:
        return task()
    directory = tempfile.mkdtemp(prefix="slurm-startup-cluster-")
    slurm_cluster.start(directory)
    seconds: Dict[str, List[float]] = {way: [] for way in WAYS}
    try:
        step(directory, "slurm", args.tasks)  # untimed: the file cache warm for both
        for number in range(args.rounds):
            for way in WAYS if number % 2 == 0 else WAYS[::-1]:
                seconds[way] += step(directory, way, args.tasks)
                print(f"round {number} {way}: {seconds[way][-args.tasks :]}", flush=True)
    finally:
        slurm_cluster.stop(directory)
        shutil.rmtree(directory, ignore_errors=True)
    import tensorflow as tf

    medians = {way: statistics.median(found) for way, found in seconds.items()}
    result: Dict[str, Any] = {
        "tasks": args.tasks,
        "rounds": args.rounds,
        "tf": tf.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "seconds": seconds,
        "median_s": medians,
        "ratio_slurm_over_tf_config": medians["slurm"] / medians["tf_config"],
    }
    print(
        f"start-up per task, median of {args.rounds} rounds x {args.tasks} tasks: "
        f"Slurm's step {medians['slurm']:.2f} s, hand-written TF_CONFIG "
        f"{medians['tf_config']:.2f} s: ratio {result['ratio_slurm_over_tf_config']:.3f}"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
