"""Shared fixtures. TensorFlow is imported once per test process, on first use.

One pytest process serves one TensorFlow version (nox runs one per version).
TF2 logical CPU devices must be configured before the runtime starts, so the
``tf`` fixture configures ``LOGICAL_CPUS`` of them once; a test that needs
fewer uses the first ones. TF1 tests run graph mode in a ``tf.Session`` made
with :func:`session_config`.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from safestrategy._tf import configure_logical_cpus

ROOT = Path(__file__).resolve().parent.parent
FAKE_WORKER = str(Path(__file__).with_name("fake_worker.py"))
LOGICAL_CPUS = 3

HAS_TF = importlib.util.find_spec("tensorflow") is not None
needs_tf = pytest.mark.skipif(not HAS_TF, reason="TensorFlow is not installed in this environment")


def cpus(n):
    """The first ``n`` logical CPU device names."""
    return [f"/cpu:{i}" for i in range(n)]


@pytest.fixture(autouse=True)
def fresh_decisions():
    """Each test probes for itself: forget the decisions earlier tests cached."""
    from safestrategy import factory

    factory._decisions.clear()


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """Use tests/fake_worker.py as the probe process; returns a function that sets
    its behaviour (see that file) and returns the file its pid is written to."""
    from safestrategy import _probe, _tf

    monkeypatch.setattr(_probe, "WORKER_COMMAND", [sys.executable, FAKE_WORKER])
    monkeypatch.setattr(_tf, "tf_version", lambda: "2.99.0")
    pidfile = tmp_path / "pid"
    monkeypatch.setenv("FAKE_WORKER_PIDFILE", str(pidfile))

    def behave(behaviour):
        monkeypatch.setenv("FAKE_WORKER", behaviour)
        return pidfile

    return behave


@pytest.fixture(scope="session")
def tf():
    """TensorFlow, with ``LOGICAL_CPUS`` logical CPU devices (TF2) configured once."""
    if not HAS_TF:
        pytest.skip("TensorFlow is not installed in this environment")
    import tensorflow as tf

    if tf.__version__.startswith("2."):
        configure_logical_cpus(tf, LOGICAL_CPUS)
    return tf


@pytest.fixture(scope="session")
def tf2(tf):
    """TensorFlow 2 (eager); skips on TF 1.x."""
    if not tf.__version__.startswith("2."):
        pytest.skip(f"needs TF2 eager mode; this is TF {tf.__version__}")
    return tf


@pytest.fixture(scope="session")
def tf1(tf):
    """TensorFlow 1.x (graph mode); skips on TF2."""
    if tf.__version__.startswith("2."):
        pytest.skip(f"needs TF 1.x graph mode; this is TF {tf.__version__}")
    return tf


def session_config(tf, n=LOGICAL_CPUS):
    """A TF1 session config with ``n`` CPU devices."""
    return tf.ConfigProto(device_count={"CPU": n})


def run_python(*args, env=None, cwd=ROOT, timeout=600):
    """Run this interpreter with ``args`` (and ``env`` added) in a subprocess."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        universal_newlines=True,
        env=full_env,
        timeout=timeout,
        cwd=str(cwd),
    )


@pytest.fixture
def run_cli():
    """Run ``python -m safestrategy ARGS`` in a subprocess; returns CompletedProcess."""

    def run(*args, env=None, timeout=600):
        return run_python("-m", "safestrategy", *args, env=env, timeout=timeout)

    return run
