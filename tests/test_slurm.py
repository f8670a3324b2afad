"""tests/slurm.py: the one-node Slurm runs a job's tasks, and a second start reuses it.

No TensorFlow here: this checks the cluster the multi-worker Slurm tests stand on.
"""

import json
import re
import subprocess
import sys
import tempfile

import pytest

from . import slurm as slurm_cluster
from .conftest import ROOT

#: What each task prints (what TensorFlow's SlurmClusterResolver reads, and the ids).
VARIABLES = (
    "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_NODELIST",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURMD_NODENAME",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
)


def test_srun_runs_two_tasks_on_the_node(slurm):
    code = f"import os; print(' '.join(os.environ[name] for name in {VARIABLES!r}))"
    done = subprocess.run(
        ["srun", "-N1", "-n2", sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        universal_newlines=True,
        env=slurm_cluster.environment(slurm.directory),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    tasks = sorted(
        (dict(zip(VARIABLES, line.split())) for line in done.stdout.splitlines()),
        key=lambda task: task["SLURM_PROCID"],
    )
    assert [task["SLURM_PROCID"] for task in tasks] == ["0", "1"], done.stdout
    for task in tasks:
        assert task["SLURM_STEP_NUM_TASKS"] == "2"
        assert task["SLURM_STEP_NODELIST"] == slurm.node
        assert task["SLURM_STEP_TASKS_PER_NODE"] == "2"
        assert task["SLURMD_NODENAME"] == slurm.node
    assert len({(task["SLURM_JOB_ID"], task["SLURM_STEP_ID"]) for task in tasks}) == 1, tasks


def test_a_second_start_reuses_the_running_daemons(slurm):
    again = slurm_cluster.start(slurm.directory)
    assert again == slurm
    assert slurm_cluster.status(slurm.directory) == slurm.pids


def test_the_cli_prints_the_directory_and_the_pids(slurm):
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "slurm.py"), "status", "--dir", slurm.directory],
        stdout=subprocess.PIPE,
        universal_newlines=True,
        timeout=60,
    )
    named = " ".join(f"{name}={slurm.pids[name]}" for name in slurm_cluster.DAEMONS)
    assert (done.returncode, done.stdout) == (0, f"{slurm.directory} {named}\n")


# --- multi-worker training under srun, on real TensorFlow --------------------------------

WORKER = str(ROOT / "tests" / "cluster_worker.py")


def srun(slurm, tasks, *command, env=None):
    """``srun -N1 -n<tasks> command`` started (not waited for), sharing a fresh
    ``WORKERS_DONE`` directory for tests/mw_worker.py's ``leave_together``."""
    base = slurm_cluster.environment(slurm.directory)
    base.update(PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG="")
    base.update(WORKERS_DONE=tempfile.mkdtemp(prefix="workers-done-"), **(env or {}))
    return subprocess.Popen(
        ["srun", "-N1", f"-n{tasks}", "--kill-on-bad-exit=1", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        universal_newlines=True,
        env=base,
    )


def results(step, tasks, within=240):
    """Every task's ``RESULT`` of tests/cluster_worker.py, by task; the step must succeed."""
    try:
        out, err = step.communicate(timeout=within)
    finally:
        step.kill()
    found = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert step.returncode == 0 and len(found) == tasks, err[-4000:]
    return sorted(found, key=lambda result: result["task"])


@pytest.mark.parametrize("tasks", [2, 3])
def test_srun_with_no_tf_config_trains_every_task_to_one_process_weights(slurm, tf2, tasks):
    from .mw_worker import train

    found = results(srun(slurm, tasks, sys.executable, WORKER, "slurm"), tasks)
    expected = train(tf2)  # stock TensorFlow in one process, the whole global batch
    job = found[0]["origin"]
    assert re.fullmatch(r"Slurm job \d+ step \d+", job), job
    for index, result in enumerate(found):
        assert (result["task"], result["source"], result["origin"]) == (index, "slurm", job)
        assert f"cluster      from {job}" in result["text"]
        assert f"workers      {tasks} (this is worker:{index})" in result["text"]
        assert result["weights"] == pytest.approx(expected, abs=1e-5)


def test_tensorflows_slurm_resolver_as_cluster_resolver(slurm, tf2):
    """TensorFlow's own SlurmClusterResolver, as it can be built on a CPU node, given as
    ``cluster_resolver=``: its cluster, with the devices TensorFlow sees (no nvidia-smi)."""
    from .conftest import free_ports

    env = {"PORT": str(free_ports(1)[0])}
    found = results(srun(slurm, 2, sys.executable, WORKER, "slurm-resolver", env=env), 2)
    for result in found:
        assert (result["source"], result["origin"]) == ("resolver", "cluster_resolver=CpuSlurm")
    assert found[0]["weights"] == found[1]["weights"]


def test_auto_strategy_under_srun_takes_the_multi_worker_branch(slurm, tf2):
    found = results(srun(slurm, 2, sys.executable, WORKER, "auto"), 2)
    for result in found:
        assert result["branch"] == "multi-worker" and result["source"] == "slurm"
        assert result["text"][0].startswith("branch       multi-worker: a cluster of 2 workers")


def test_two_steps_at_once_on_one_node_take_ports_of_their_own(slurm, tf2):
    steps = [srun(slurm, 2, sys.executable, WORKER, "slurm") for _ in range(2)]
    found = [results(step, 2) for step in steps]
    assert found[0][0]["origin"] != found[1][0]["origin"]  # two jobs
    assert found[0][0]["weights"] == found[1][0]["weights"]


def test_run_supervises_each_task_under_srun(slurm, tf2):
    command = [sys.executable, "-m", "safestrategy", "run", "--", sys.executable, WORKER]
    found = results(srun(slurm, 2, *command, "slurm"), 2)
    assert found[0]["weights"] == found[1]["weights"]


def test_run_under_srun_relaunches_every_task_on_a_crash_in_the_all_reduce(slurm, tf2, tmp_path):
    """tests/run_mw_worker.py under ``srun -n2 python -m safestrategy run``, the tasks
    sharing one cache (one node's home): worker 1 aborts mid-step on the first launch, as a
    crashing NCCL does. As over TF_CONFIG (tests/test_run.py): its run records the crash
    (under its own task) and relaunches, its peer is relaunched with nothing recorded, and
    both agree on NCCL with the next remedy and train."""
    command = [sys.executable, "-m", "safestrategy", "run", "--grace", "5", "--"]
    command += [sys.executable, str(ROOT / "tests" / "run_mw_worker.py"), "1"]
    env = {"SAFESTRATEGY_CACHE_DIR": str(tmp_path / "cache"), "SAFESTRATEGY_STALL_TIMEOUT": "15"}
    files = ["-o", str(tmp_path / "task-%t.out"), "-e", str(tmp_path / "task-%t.err")]
    step = srun(slurm, 2, *files, *command, env=env)
    assert step.wait(timeout=400) == 0, (tmp_path / "task-1.err").read_text()[-4000:]
    for task in (0, 1):
        out = (tmp_path / f"task-{task}.out").read_text()
        first, second = [json.loads(line) for line in re.findall(r"^REPORT (.*)$", out, re.M)]
        assert (first["cluster_source"], second["cluster_source"]) == ("slurm", "slurm")
        nccl = second["candidates"][0]
        assert (second["backend"], nccl["remedy"]) == ("nccl", {"NCCL_P2P_DISABLE": "1"})
        assert "worker:1 recorded it: crashed during training" in nccl["reason"]
        assert re.findall(r"^TOTAL (\S+)$", out, re.M) == ["18.0"]
    said = (tmp_path / "task-1.err").read_text()
    assert "launch 2 of 4: training crashed on nccl (killed by SIGABRT) (recorded)" in said
    peer = (tmp_path / "task-0.err").read_text()
    assert re.search(r"launch 2 of 4: a peer is gone \(.+\); nothing recorded", peer)


def test_a_task_holding_the_others_back_is_named_under_srun(slurm, seeing, tmp_path):
    """tests/peers_worker.py's ``sleep`` under ``srun -n3``, no TF_CONFIG, one cache for
    the three tasks (one node's home): task 2 sleeps in its own Python between steps, and
    tasks 0 and 1 end on the stall naming it, with nothing recorded."""
    cache = tmp_path / "cache"
    env = {"PEERS_STALL_TIMEOUT": "5", "SAFESTRATEGY_STALL_ACTION": "exit"}
    env.update(SAFESTRATEGY_CACHE_DIR=str(cache))
    files = ["-o", str(tmp_path / "task-%t.out"), "-e", str(tmp_path / "task-%t.err")]
    worker = str(ROOT / "tests" / "peers_worker.py")
    step = srun(slurm, 3, *files, sys.executable, worker, "sleep", "2", env=env)
    try:
        step.wait(timeout=300)  # task 0's exit 75 ends the step (--kill-on-bad-exit)
    finally:
        step.kill()
    for task in (0, 1):
        said = (tmp_path / f"task-{task}.err").read_text()
        found = re.search(r"^(worker:\d .*)\.$", said, re.M)
        assert found, said[-3000:]
        assert found.group(1).startswith(
            "worker:2 holds the others back: outside any TensorFlow call"
        ), said[-3000:]
        assert "peers_worker.py:" in found.group(1)
    from safestrategy import records

    assert records.every(str(cache)) == []
