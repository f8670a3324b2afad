"""Shared fixtures. TensorFlow is imported once per test process, on first use.

One pytest process serves one TensorFlow version (nox runs one per version).
TF2 logical CPU devices must be configured before the runtime starts, so the
``tf`` fixture configures ``LOGICAL_CPUS`` of them once; a test that needs
fewer uses the first ones. TF1 tests run graph mode in a ``tf.Session`` made
with :func:`session_config`.
"""

import importlib.util
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from safestrategy._tf import configure_logical_cpus

from . import slurm as slurm_cluster

ROOT = Path(__file__).resolve().parent.parent
FAKE_WORKER = str(Path(__file__).with_name("fake_worker.py"))
LOGICAL_CPUS = 3

HAS_TF = importlib.util.find_spec("tensorflow") is not None
needs_tf = pytest.mark.skipif(not HAS_TF, reason="TensorFlow is not installed in this environment")


def cpus(n):
    """The first ``n`` logical CPU device names."""
    return [f"/cpu:{i}" for i in range(n)]


#: Environment variables the library may set (NCCL remedies) or read.
LIBRARY_VARIABLES = (
    "NCCL_P2P_DISABLE",
    "NCCL_SHM_DISABLE",
    "SAFESTRATEGY_BACKEND",
    "SAFESTRATEGY_PROBE_TIMEOUT",
    "SAFESTRATEGY_CACHE",
    "SAFESTRATEGY_NCCL_REMEDIES",
    "SAFESTRATEGY_COMMUNICATION",
    "SAFESTRATEGY_PAYLOAD_MB",
    "SAFESTRATEGY_VERIFY_EVERY",
    "TF_XLA_FLAGS",
    "SAFESTRATEGY_RUN_DIR",
    "SAFESTRATEGY_RUN_GRACE",
    "SAFESTRATEGY_RESTART",
)


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """Each test decides for itself: no decision remembered from another test, an empty
    verdict cache of its own, none of the caller's SAFESTRATEGY_*/NCCL_* remedy variables,
    and whatever the library sets in os.environ undone afterwards."""
    from safestrategy import _env, factory

    factory._decisions.clear()
    monkeypatch.setattr(_env, "_applied", {})
    for variable in LIBRARY_VARIABLES:
        monkeypatch.setenv(variable, "")  # records the original, so teardown restores it
        monkeypatch.delenv(variable)
    monkeypatch.setenv("SAFESTRATEGY_CACHE_DIR", str(tmp_path / "cache"))
    # auto times candidates on a payload: 1 MB keeps each test's races short (the default
    # 32 MB is tested where it matters)
    monkeypatch.setenv("SAFESTRATEGY_PAYLOAD_MB", "1")


GPUS = ["/gpu:0", "/gpu:1"]


class Fake:
    """The probe-process seam: tests/fake_worker.py as the probe process, and a
    TensorFlow that has GPUs 0-3 and NCCL kernels (what a CPU cannot show)."""

    def __init__(self, monkeypatch, tmp_path):
        self.monkeypatch = monkeypatch
        self.pidfile = tmp_path / "pid"
        self.log = tmp_path / "starts"
        monkeypatch.setenv("FAKE_WORKER_PIDFILE", str(self.pidfile))
        monkeypatch.setenv("FAKE_WORKER_LOG", str(self.log))
        monkeypatch.setenv("FAKE_WORKER_ROOT", str(ROOT))  # for copies of the fake elsewhere

    def __call__(self, behaviour):
        """Set how the fake probe process behaves (see fake_worker.py); returns the pidfile."""
        self.monkeypatch.setenv("FAKE_WORKER", behaviour)
        return self.pidfile

    def starts(self):
        """One line per probe process started: "start" and the NCCL_* variables it had."""
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
def fake(monkeypatch, tmp_path, tf):
    from safestrategy import _devices, _tf
    from safestrategy.checks import probe as _probe

    gpus = tuple(_devices.Device("GPU", i) for i in range(4))
    visible = _devices.Visible((_devices.Device("CPU", 0), *gpus), any_cpu=True)
    monkeypatch.setattr(_probe, "CHILD_COMMAND", [sys.executable, FAKE_WORKER])
    monkeypatch.setattr(_tf, "visible_devices", lambda tf: visible)
    monkeypatch.setattr(_tf, "logical_gpus", lambda tf: gpus)
    monkeypatch.setattr(_tf, "nccl_kernel_count", lambda tf: 1)
    return Fake(monkeypatch, tmp_path)


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
def slurm():
    """A real one-node Slurm (tests/slurm.py), started once per test process and shared by
    every test that asks for it: its ``Cluster`` (directory, node, pids). Client commands
    need ``slurm_cluster.environment(slurm.directory)``. Skips saying why where Slurm
    cannot start (not root, not Linux, not installed); at the session's end the daemons
    it started are stopped by their saved pids and the directory goes."""
    reason = slurm_cluster.unavailable()
    if reason:
        pytest.skip(reason)
    directory = tempfile.mkdtemp(prefix="slurm-")
    try:
        yield slurm_cluster.start(directory)
    finally:
        slurm_cluster.stop(directory)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def tf2(tf):
    """TensorFlow 2 (eager); skips on TF 1.x."""
    if not tf.__version__.startswith("2."):
        pytest.skip(f"needs TF2 eager mode; this is TF {tf.__version__}")
    return tf


@pytest.fixture
def seeing(tf2):
    """TF 2.x whose workers can see each other (a bounded read of the coordination
    service's store, asked as the factory asks); else the test is skipped, saying why."""
    import inspect

    from tensorflow.python.eager import context

    if "timeout_in_ms" not in inspect.signature(context.context().get_config_key_value).parameters:
        pytest.skip(f"TF {tf2.__version__}'s get_config_key_value has no timeout: said once")
    return tf2


@pytest.fixture(scope="session")
def tf1(tf):
    """TensorFlow 1.x (graph mode); skips on TF2."""
    if tf.__version__.startswith("2."):
        pytest.skip(f"needs TF 1.x graph mode; this is TF {tf.__version__}")
    return tf


def all_reduced(tf, strategy):
    """TF2: every replica's (device, [first, last]) after one sum all-reduce through
    ``strategy``'s own cross-device ops, replica i contributing i + 1 (the smoke check's)."""
    from safestrategy.checks import allreduce

    inputs = allreduce.payload(tf, strategy.extended.worker_devices, [allreduce.VECTOR_SIZE])
    return allreduce.eager_race(tf, strategy, inputs).first()


def gone(pid, within=10.0):
    """True once process ``pid`` no longer exists (polled, at most ``within`` seconds)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def read_line(stream, within, waiting_for):
    """The next line of ``stream``, or the test fails after ``within`` seconds saying what it
    waited for (a reader thread: a pipe's ``readline`` has no timeout of its own)."""
    lines = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()
    try:
        return lines.get(timeout=within)
    except queue.Empty:
        pytest.fail(f"no line within {within} s: waited for {waiting_for}")


def session_config(tf, n=LOGICAL_CPUS):
    """A TF1 session config with ``n`` CPU devices."""
    return tf.ConfigProto(device_count={"CPU": n})


def free_ports(n):
    """``n`` distinct ports free on 127.0.0.1 now."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_configs(n, ports=None):
    """``n`` workers' TF_CONFIG values on 127.0.0.1 (``ports``: their ports, else free ones)."""
    ports = ports or free_ports(n)
    workers = [f"127.0.0.1:{port}" for port in ports]
    return [
        json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}})
        for i in range(n)
    ]


def workers_together(commands, envs, within, what="a worker"):
    """Start every command (``envs``: each one's environment added to this one's, with
    the repository on PYTHONPATH, and ``WORKERS_DONE``, a directory they share for
    ``tests/mw_worker.py``'s ``leave_together``) and wait for them all, each within
    ``within`` s: [(returncode, stdout, stderr)] in order. On a timeout every one is
    killed and the test fails with their stderr's tails (a hung worker's thread stacks
    among them)."""
    done = tempfile.mkdtemp(prefix="workers-done-")
    base = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2", WORKERS_DONE=done)
    processes, outputs = [], []
    try:
        for command, env in zip(commands, envs):
            processes.append(
                subprocess.Popen(
                    command,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    universal_newlines=True,
                    env=dict(base, **env),
                    cwd=str(ROOT),
                )
            )
        for process in processes:
            outputs.append(process.communicate(timeout=within))
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
        unread = processes[len(outputs) :]
        stderr = [err for _, err in outputs] + [process.communicate()[1] for process in unread]
        tails = "\n---\n".join(text[-6000:] for text in stderr)
        pytest.fail(f"{what} did not end within {within} s; their stderr:\n{tails}")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        shutil.rmtree(done, ignore_errors=True)
    return [(p.returncode, out, err) for p, (out, err) in zip(processes, outputs)]


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


CPUS = ["/cpu:0", "/cpu:1"]


def report(**fields):
    """A hand-built report (NCCL on two GPUs, auto, unless ``fields`` say otherwise)."""
    from safestrategy.report import Report

    base = dict(
        backend="nccl",
        source="default",
        mode="auto",
        devices=("/device:GPU:0", "/device:GPU:1"),
        platform="Linux",
        tf_version="2.21.0",
        tf_api="tf2",
        candidates=(),
    )
    return Report(**{**base, **fields})


def result(name, status, reason="fake"):
    """A hand-built candidate result."""
    from safestrategy.report import CandidateResult

    return CandidateResult(name, status, reason)
