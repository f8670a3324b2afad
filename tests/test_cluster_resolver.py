"""``make_multiworker_strategy(cluster_resolver=...)`` on real TensorFlow: two workers on
127.0.0.1 from TensorFlow's own ``SimpleClusterResolver``, no TF_CONFIG (Slurm's step and
``SlurmClusterResolver``: tests/test_slurm.py, under a real Slurm)."""

import json
import sys

import pytest

from .conftest import ROOT, free_ports, workers_together


def results(ended):
    """Each worker's ``RESULT`` line of tests/cluster_worker.py, in order."""
    found = []
    for code, stdout, stderr in ended:
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        assert code == 0 and lines, stderr[-3000:]
        found.append(json.loads(lines[0][len("RESULT ") :]))
    return found


def test_any_cluster_resolver_gives_the_workers_and_they_train_like_one_process(tf2):
    from .mw_worker import WAIT, train

    addresses = json.dumps([f"127.0.0.1:{port}" for port in free_ports(2)])
    envs = [{"TF_CONFIG": "", "CLUSTER": addresses, "INDEX": str(i)} for i in range(2)]
    command = [sys.executable, str(ROOT / "tests" / "cluster_worker.py"), "simple"]
    found = results(workers_together([command] * 2, envs, WAIT))
    expected = train(tf2)  # one process, the whole global batch
    for index, result in enumerate(found):
        assert (result["source"], result["origin"]) == (
            "resolver",
            "cluster_resolver=SimpleClusterResolver",
        )
        assert "cluster      from cluster_resolver=SimpleClusterResolver" in result["text"]
        assert result["task"] == index and result["backend"] == "ring"
        assert result["weights"] == pytest.approx(expected, abs=1e-5)
