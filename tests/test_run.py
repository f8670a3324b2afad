"""``python -m safestrategy run``: the run directory, and real relaunches of a real Keras
training (tests/run_script.py); its pure table is tests/test_judge.py."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from safestrategy import _rundir, records, run
from safestrategy.run import judge

from .conftest import (
    ROOT,
    gone,
    needs_tf,
    read_line,
    run_python,
    tf_configs,
    workers_together,
)


def test_run_exits_2_on_windows_with_one_line(monkeypatch, capsys):
    from safestrategy import _machine

    monkeypatch.setattr(_machine, "system", lambda: "Windows")
    assert run.main(["--", sys.executable, "-c", "pass"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("safestrategy run: POSIX only in 0.4")


CHILD_FILES = """
import os, sys, time
sys.path.insert(0, {root!r})
from safestrategy import _rundir
os.environ.get("SAFESTRATEGY_RUN_DIR") or sys.exit("no run dir")
_rundir.decision({{"backend": "reduce_to_cpu", "devices": ["/device:CPU:0", "/device:CPU:1"]}})
_rundir.heartbeat(7, _rundir.COLLECTIVES)
if sys.argv[1] == "grandchild":
    import subprocess
    code = "import sys; sys.path.insert(0, {root!r}); from safestrategy import _rundir; "
    subprocess.run([sys.executable, "-c", code + "_rundir.heartbeat(99, _rundir.COLLECTIVES)"])
raise ValueError("the last words")
"""


@pytest.mark.skipif(os.name != "posix", reason="run is POSIX only")
def test_the_child_leaves_its_decision_heartbeat_and_error_and_a_grandchild_writes_nothing(
    tmp_path,
):
    script = tmp_path / "child.py"
    script.write_text(CHILD_FILES.format(root=str(ROOT)))
    env = {"SAFESTRATEGY_CACHE_DIR": str(tmp_path / "cache"), "SAFESTRATEGY_STALL_TIMEOUT": "off"}
    done = run_python(
        "-m",
        "safestrategy",
        "run",
        "--",
        sys.executable,
        str(script),
        "grandchild",
        env=env,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    (launch_dir,) = (tmp_path / "cache" / "runs").glob("*/launch-1")  # launch 1
    left = _rundir.read(str(launch_dir))
    assert [d["backend"] for d in left.decisions] == ["reduce_to_cpu"]
    assert list(left.beats.values()) in ([_rundir.FINISHED], ["7 collectives"])
    assert left.error.strip() == "ValueError: the last words"
    assert len(list(launch_dir.glob("heartbeat-*"))) == 1  # the grandchild's 99 went nowhere
    assert not list(launch_dir.glob("fault-*"))  # no empty dump left by a normal exit
    assert judge.NOT_CURABLE in done.stderr and "launches:" in done.stderr


# --- real relaunches of a real Keras training (TF2, two logical CPUs) ----------------------

SCRIPT = str(ROOT / "tests" / "run_script.py")
LISTED = "hierarchical_copy,reduce_to_cpu"


def supervised(scenario, tmp_path, *options, timeout=300, wrapper=(), **env):
    """``run`` on tests/run_script.py ``scenario``, behind ``wrapper`` (a command prefix)."""
    settings = {
        "SAFESTRATEGY_CACHE_DIR": str(tmp_path / "cache"),
        "SAFESTRATEGY_BACKEND": LISTED,
        "RUN_SCRIPT_BACKUP": str(tmp_path / "backup"),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        **env,
    }
    args = ["-m", "safestrategy", "run", "--grace", "2", *options, "--", *wrapper]
    return run_python(*args, sys.executable, SCRIPT, scenario, env=settings, timeout=timeout)


def backends(done):
    return re.findall(r"^BACKEND (\S+)$", done.stdout, re.MULTILINE)


def relaunched_once(scenario, tmp_path, wrapper=(), env=None):
    """``scenario`` under ``run``: trouble on the first launch, a clean second on the next
    backend of the list; the finished run."""
    done = supervised(scenario, tmp_path, wrapper=wrapper, **(env or {}))
    assert done.returncode == 0, done.stderr[-3000:]
    assert backends(done) == ["hierarchical_copy", "reduce_to_cpu"]
    return done


@needs_tf
def test_a_stalled_training_is_relaunched_on_the_next_backend_and_resumes(tf2, tmp_path):
    # behind bash -c: the real factory in a grandchild writes its own files
    done = relaunched_once("stall", tmp_path, ["bash", "-c", '"$@"; exit $?', "bash"])
    assert "safestrategy run: launch 2 of 4: training stalled on hierarchical_copy" in done.stderr
    # BackupAndRestore: the relaunch runs only the epochs left after the last finished one
    assert re.findall(r"^EPOCHS (\d+)$", done.stdout, re.MULTILINE) == ["2"]


@needs_tf
def test_resuming_from_model_checkpoint_as_keras_ios_guide_does(tf2, tmp_path):
    done = relaunched_once("checkpoint", tmp_path)
    assert re.findall(r"^EPOCHS (\d+)$", done.stdout, re.MULTILINE) == ["2"]


@needs_tf
def test_resuming_a_custom_loop_from_its_checkpoint_manager(tf2, tmp_path):
    done = relaunched_once("manager", tmp_path)
    # launch 1 stalled at its 5th step: launch 2 restores after step 4 and runs the other 4
    assert re.findall(r"^STEPS (\d+)$", done.stdout, re.MULTILINE) == ["4"]


@needs_tf
def test_an_nccl_error_is_a_crash_record_and_the_relaunch_takes_another_backend(tf2, tmp_path):
    done = relaunched_once("crash", tmp_path, ["timeout", "600"])  # a grandchild again
    assert "training crashed on hierarchical_copy" in done.stderr
    listing = run_python(
        "-m", "safestrategy", "records", env={"SAFESTRATEGY_CACHE_DIR": str(tmp_path / "cache")}
    )
    assert "hierarchical_copy" in listing.stdout and "crashed during training" in listing.stdout


@needs_tf
def test_a_broken_mirror_ends_the_launch_is_recorded_and_resumes_on_the_next_backend(tf2, tmp_path):
    done = relaunched_once("corrupt", tmp_path, env={"SAFESTRATEGY_STALL_ACTION": "exit"})
    assert (
        "safestrategy run: launch 2 of 4: training's all-reduce returned wrong numbers on "
        "replicas 0 and 1 (/device:CPU:0, /device:CPU:1) at step 6 (recorded); the next "
        "decision avoids "
        "hierarchical_copy while another backend passes without a record"
    ) in done.stderr
    assert (
        "training's all-reduce returned wrong numbers at step 6 on backend hierarchical_copy"
        in (done.stderr)
    )
    assert re.findall(r"^EPOCHS (\d+)$", done.stdout, re.MULTILINE) == ["2"]  # resumed
    listing = run_python(
        "-m", "safestrategy", "records", env={"SAFESTRATEGY_CACHE_DIR": str(tmp_path / "cache")}
    )
    assert "returned wrong numbers during training on" in listing.stdout


@needs_tf
def test_an_abort_in_the_first_step_before_any_heartbeat_is_a_crash(tf2, tmp_path):
    # one launch only: that it is judged a crash is the point (the relaunch is tested above)
    done = supervised("first-step", tmp_path, "--max-restarts", "0")
    assert done.returncode == 134, done.stderr[-3000:]
    assert "training crashed on hierarchical_copy (killed by SIGABRT) (recorded)" in done.stderr
    assert "the 0 restarts are spent" in done.stderr and backends(done) == []
    found = records.every(str(tmp_path / "cache"))
    assert [(s.backend, s.kind) for _, _, s in found] == [("hierarchical_copy", "crash")]


@needs_tf
def test_the_users_own_error_and_a_death_in_teardown_are_not_relaunched(tf2, tmp_path):
    user = supervised("user", tmp_path)
    assert user.returncode == 1 and "ValueError: the learning rate" in user.stderr
    assert judge.NOT_CURABLE in user.stderr and "launch 2" not in user.stderr
    teardown = supervised("teardown", tmp_path / "teardown")
    assert teardown.returncode == 134, teardown.stderr[-3000:]
    assert backends(teardown) == ["hierarchical_copy"] and "launch 2" not in teardown.stderr


@needs_tf
def test_restarts_are_bounded(tf2, tmp_path):
    done = supervised("always-stall", tmp_path, "--max-restarts", "1")
    assert done.returncode == 75, done.stderr[-3000:]
    assert backends(done) == ["hierarchical_copy", "reduce_to_cpu"]
    assert "the 1 restarts are spent" in done.stderr


@needs_tf
@pytest.mark.skipif(os.name != "posix", reason="run is POSIX only")
def test_a_starved_watchdog_is_killed_recorded_and_relaunched(tf2, tmp_path):
    done = relaunched_once("starve", tmp_path)
    (orphans,) = re.findall(r"^ORPHANS (\d+) (\d+)$", done.stdout, re.MULTILINE)
    for pid in map(int, orphans):  # the grandchild that ignores SIGTERM, the probe process
        assert gone(pid), f"{pid} outlived the killed launch"
    assert "training went silent on hierarchical_copy (recorded)" in done.stderr


@needs_tf
@pytest.mark.skipif(os.name != "posix", reason="run is POSIX only")
def test_an_input_stall_is_reported_never_recorded_and_not_relaunched(tf2, tmp_path):
    env = {
        "SAFESTRATEGY_CACHE_DIR": str(tmp_path / "cache"),
        "SAFESTRATEGY_BACKEND": LISTED,
        "SAFESTRATEGY_STALL_TIMEOUT": "3",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    script = str(ROOT / "tests" / "stall_script.py")
    args = ["-m", "safestrategy", "run", "--grace", "2", "--", sys.executable, script, "input"]
    done = run_python(*args, env=env, timeout=300)
    assert done.returncode == 75, done.stderr[-3000:]
    assert "waiting for input data (an iterator's get_next, outside a step)" in done.stderr
    assert "Not recorded against hierarchical_copy: the call is outside the all-reduce" in (
        done.stderr
    )
    assert "training stalled waiting for input data" in done.stderr
    assert "outside the all-reduce: nothing recorded" in done.stderr and "launch 2" not in (
        done.stderr
    )
    assert records.every(str(tmp_path / "cache")) == []  # no backend demoted, on any launch


# --- two workers, one run each (tests/run_mw_worker.py) ------------------------------------

MW_SCRIPT = str(ROOT / "tests" / "run_mw_worker.py")
#: Seconds the test waits for both runs: two launches of two workers and their probe
#: processes, a peer freed by TF within its stall timeout (15 s) at worst.
MW_WAIT = 400


def two_workers_under_run(dies, tmp_path):
    """Worker ``dies`` aborts mid-step on the first launch; each worker under its own
    ``run`` with its own cache (two machines): [(returncode, stdout, stderr)] by worker."""
    command = [sys.executable, "-m", "safestrategy", "run", "--grace", "5", "--"]
    command += [sys.executable, MW_SCRIPT, str(dies)]
    envs = [
        {
            "TF_CONFIG": config,
            "SAFESTRATEGY_CACHE_DIR": str(tmp_path / f"cache-{index}"),
            "SAFESTRATEGY_STALL_TIMEOUT": "15",  # the first step compiles while watched
        }
        for index, config in enumerate(tf_configs(2))
    ]
    return workers_together([command] * len(envs), envs, MW_WAIT, "a worker's run")


@needs_tf
@pytest.mark.skipif(os.name != "posix", reason="run is POSIX only")
@pytest.mark.parametrize("dies", [1, 0], ids=["a-worker-dies", "the-leader-dies"])
def test_a_worker_that_aborts_mid_step_and_its_peer_meet_again_and_demote_nccl_together(
    tf2, tmp_path, dies
):
    """NCCL chosen across two workers (the GPU seam, in the children); one aborts mid-step.
    Its run records a crash on NCCL and relaunches it; its peer, whose all-reduce TF
    aborted because the peer is gone, is relaunched with nothing recorded. Back together,
    the dead worker's hello carries its record: both fail NCCL on it, retry it with the
    remedy not tried yet, agree, train, and both runs exit 0."""
    workers = two_workers_under_run(dies, tmp_path)
    peer = 1 - dies
    for index, (code, out, err) in enumerate(workers):
        assert code == 0, f"worker {index}:\n{err[-4000:]}"
        reports = [json.loads(line) for line in re.findall(r"^REPORT (.*)$", out, re.MULTILINE)]
        first, second = reports  # two launches
        assert first["backend"] == "nccl" and first["candidates"][0]["remedy"] == {}
        nccl = second["candidates"][0]
        assert (second["backend"], nccl["remedy"]) == ("nccl", {"NCCL_P2P_DISABLE": "1"})
        assert f"worker:{dies} recorded it: crashed during training" in nccl["reason"]
        assert re.findall(r"^TOTAL (\S+)$", out, re.MULTILINE) == ["18.0"]  # 6 steps of 1 + 2
    assert (
        "launch 2 of 4: training crashed on nccl (killed by SIGABRT) (recorded)"
        in (workers[dies][2])
    )
    assert re.search(r"launch 2 of 4: a peer is gone \(.+\); nothing recorded", workers[peer][2])
    listing = run_python(
        "-m",
        "safestrategy",
        "records",
        env={"SAFESTRATEGY_CACHE_DIR": str(tmp_path / f"cache-{peer}")},
    )
    assert "nccl" not in listing.stdout, listing.stdout  # the peer recorded nothing


ORPHANS = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print("GRANDCHILD", child.pid, flush=True)
time.sleep(600)
"""

#: A child that says which signal reached it. It sets the handling it relies on (a runner
#: may start the tests with SIGINT ignored, and a child inherits that): SIGTERM is said
#: and ends it, SIGINT is said and ignored, SIGHUP and SIGQUIT are only said.
SIGNALS = """
import os, signal, sys, time
def say(number, frame):
    print("GOT", signal.Signals(number).name, flush=True)
    if number == signal.SIGTERM:
        sys.exit(0)
for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(number, say)
print("CHILD", os.getpid(), flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def supervising(tmp_path, child, *options):
    """``run [options] -- python <child>`` started, its output piped: yields it and the pid
    the child printed first; killed at the end, whatever happened. run sets its own
    handlers for the signals it forwards, so nothing it inherits matters."""
    script = tmp_path / "child.py"
    script.write_text(child)
    env = dict(os.environ, SAFESTRATEGY_CACHE_DIR=str(tmp_path / "cache"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "safestrategy", "run", *options, "--"]
    supervisor = subprocess.Popen(
        [*command, sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        universal_newlines=True,
    )
    try:
        yield supervisor, int(read_line(supervisor.stdout, 60, "the child's pid").split()[1])
    finally:
        supervisor.kill()
        supervisor.wait(timeout=30)


@pytest.mark.skipif(os.name != "posix", reason="run is POSIX only")
def test_sigterm_to_run_ends_the_whole_group_and_exits_143(tmp_path):
    with supervising(tmp_path, ORPHANS, "--grace", "1") as (supervisor, grandchild):
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=30) == 143
        assert gone(grandchild), f"grandchild {grandchild} (ignoring SIGTERM) outlived run"


@pytest.mark.skipif(os.name != "posix", reason="run is POSIX only")
@pytest.mark.parametrize("sent, code", [(signal.SIGHUP, 129), (signal.SIGQUIT, 131)])
def test_sighup_and_sigquit_to_run_reach_the_child_as_sigterm(tmp_path, sent, code):
    with supervising(tmp_path, SIGNALS, "--grace", "60") as (supervisor, _):
        supervisor.send_signal(sent)
        assert read_line(supervisor.stdout, 30, "the forwarded signal") == "GOT SIGTERM\n"
        assert supervisor.wait(timeout=30) == code


@pytest.mark.skipif(os.name != "posix", reason="run is POSIX only")
def test_a_second_sigint_kills_a_child_that_ignores_the_first_at_once(tmp_path):
    with supervising(tmp_path, SIGNALS, "--grace", "600") as (supervisor, child):
        supervisor.send_signal(signal.SIGINT)
        assert read_line(supervisor.stdout, 30, "the forwarded SIGINT") == "GOT SIGINT\n"
        assert not gone(child, within=1.0)  # it ignored the first, and --grace is 10 minutes
        supervisor.send_signal(signal.SIGINT)
        assert supervisor.wait(timeout=30) == 130
        assert gone(child)


DEAF = """
import os, signal, time
for number in (signal.SIGINT, signal.SIGTERM):
    signal.signal(number, signal.SIG_IGN)
print("CHILD", os.getpid(), flush=True)
time.sleep(600)
"""
BUSY_SUPERVISOR = """
import os, sys
from safestrategy.run.supervise import supervise
child = [sys.executable, sys.argv[1]]
ended = supervise(child, os.environ, sys.argv[2], None, grace=600, poll=0.0002)
print("ENDED", ended.returncode, flush=True)
"""


@pytest.mark.skipif(os.name != "posix", reason="run is POSIX only")
def test_signals_that_land_while_run_sleeps_never_wedge_it(tmp_path):
    """run's handler once set a ``threading.Event``, whose lock the main thread may hold
    (in the Event's own wait) as a signal lands: a second Ctrl-C in CI never ended run. Its
    loop here sleeps 0.2 ms, so some of hundreds of signals hit that moment (the old handler
    failed this every time: wedged, or its loop broken and run killed by the next SIGHUP);
    run must still answer Ctrl-C."""
    (tmp_path / "child.py").write_text(DEAF)
    (tmp_path / "supervisor.py").write_text(BUSY_SUPERVISOR)
    supervisor = subprocess.Popen(
        [
            sys.executable,
            str(tmp_path / "supervisor.py"),
            str(tmp_path / "child.py"),
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        universal_newlines=True,
    )
    try:
        read_line(supervisor.stdout, 60, "the child's pid")
        for _ in range(400):  # forwarded as SIGTERM, which the child ignores
            supervisor.send_signal(signal.SIGHUP)
            time.sleep(0.002)
        supervisor.send_signal(signal.SIGINT)
        time.sleep(0.2)
        supervisor.send_signal(signal.SIGINT)
        assert supervisor.wait(timeout=30) == 0
        assert read_line(supervisor.stdout, 5, "the end") == f"ENDED {-signal.SIGKILL}\n"
    finally:
        supervisor.kill()
        supervisor.wait(timeout=30)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_sigkilled_run_leaves_no_child_behind(tmp_path):
    with supervising(tmp_path, SIGNALS) as (supervisor, child):
        supervisor.kill()  # run can forward nothing: the kernel ends its child
        supervisor.wait(timeout=30)
        assert gone(child), f"the child {child} outlived a SIGKILLed run"


#: In a terminal: the child reads a line (a background group would be stopped by SIGTTIN),
#: and after run the shell's group has the terminal again.
IN_A_TERMINAL = """
import os, subprocess, sys
child = ("import os; print('FOREGROUND', os.tcgetpgrp(0) == os.getpgrp(), os.getpgrp(), "
         "flush=True); print('READ', input(), flush=True)")
subprocess.call([sys.executable, "-m", "safestrategy", "run", "--", sys.executable, "-c", child])
print("BACK", os.tcgetpgrp(0) == os.getpgrp(), flush=True)
"""


@pytest.mark.skipif(os.name != "posix", reason="run is POSIX only")
def test_in_a_terminal_the_child_has_the_foreground_and_the_shell_gets_it_back(tmp_path):
    import pty
    import select

    env = dict(os.environ, SAFESTRATEGY_CACHE_DIR=str(tmp_path / "cache"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    pid, terminal = pty.fork()  # the shell: a session leader, the pty its terminal
    if pid == 0:
        os.execve(sys.executable, [sys.executable, "-c", IN_A_TERMINAL], env)
    seen, groups = "", []
    deadline = time.monotonic() + 60
    try:
        while not re.search(r"BACK \w+\r?\n", seen) and time.monotonic() < deadline:
            if select.select([terminal], [], [], 1.0)[0]:
                try:
                    seen += os.read(terminal, 4096).decode(errors="replace")
                except OSError:  # the shell ended: the pty is closed
                    break
            said = re.search(r"FOREGROUND \w+ (\d+)\r?\n", seen)
            if said and not groups:  # the child's group: killed at the end, whatever happened
                groups = [int(said.group(1))]
                os.write(terminal, b"a line\n")
        assert "FOREGROUND True" in seen, seen
        assert "READ a line" in seen, seen
        assert "BACK True" in seen, seen
    finally:
        for group in groups:
            with contextlib.suppress(OSError):
                os.killpg(group, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(terminal)


@pytest.mark.skipif(os.name != "posix", reason="run is POSIX only")
def test_run_never_imports_tensorflow(tmp_path):
    code = (
        "import sys; from safestrategy import cli; "
        "code = cli.main(['run', '--', sys.executable, '-c', 'pass']); "
        "print('TF', 'tensorflow' in sys.modules, code)"
    )
    done = run_python("-c", code, env={"SAFESTRATEGY_CACHE_DIR": str(tmp_path)}, timeout=120)
    assert "TF False 0" in done.stdout, done.stderr


@pytest.mark.skipif(os.name != "posix", reason="run is POSIX only")
@pytest.mark.parametrize(
    "settings, said, code",
    [
        ({}, [], 0),
        (
            {"SAFESTRATEGY_STALL_ACTION": "warn", "SAFESTRATEGY_CACHE": "off"},
            ["=warn: a stalled training is not ended", "SAFESTRATEGY_CACHE=off: no record"],
            0,
        ),
        ({"SAFESTRATEGY_STALL_TIMEOUT": "off"}, ["=off: no stall is seen"], 0),
        ({"SAFESTRATEGY_STALL_TIMEOUT": "soon"}, ["error: 'soon' from the environment"], 2),
    ],
    ids=["defaults", "warn-and-cache-off", "stall-timeout-off", "a-bad-value"],
)
def test_what_run_cannot_do_under_the_users_settings_is_one_line_at_the_start(
    tmp_path, settings, said, code
):
    env = {"SAFESTRATEGY_CACHE_DIR": str(tmp_path), **settings}
    command = ["-m", "safestrategy", "run", "--", sys.executable, "-c", "print('CHILD')"]
    done = run_python(*command, env=env, timeout=120)
    assert done.returncode == code, done.stderr
    lines = [line for line in done.stderr.splitlines() if "launches:" not in line]
    first = [line for line in lines if line.startswith("safestrategy run: ")][:1]
    assert len(first) == (1 if said else 0), done.stderr
    assert all(part in first[0] for part in said), done.stderr
    assert ("CHILD" in done.stdout) == (code == 0)


TF1_TRAINING = """
import os, sys, time
sys.path.insert(0, {root!r})
import tensorflow as tf
import safestrategy
with tf.Graph().as_default():
    strategy = safestrategy.make_mirrored_strategy(["/cpu:0", "/cpu:1"])
    print("BACKEND", safestrategy.last_report().backend, flush=True)
    first = os.environ.get("SAFESTRATEGY_RESTART") == "0"
    step = tf.py_func(lambda: time.sleep(3600 if first else 0) or 1.0, [], tf.float64)
    with tf.Session(config=tf.ConfigProto(device_count={{"CPU": 2}})) as session:
        session.run(step)
"""


@needs_tf
@pytest.mark.skipif(os.name != "posix", reason="run is POSIX only")
def test_a_tf1_session_run_stall_no_canary_can_check_is_said_once_and_not_relaunched(tf1, tmp_path):
    """TF 1.x graphs run no eager all-reduce, so no canary can tell the stuck py_func from
    a hung all-reduce (API.md, 0.5.2): reported, not recorded, not relaunched."""
    script = tmp_path / "tf1_training.py"
    script.write_text(TF1_TRAINING.format(root=str(ROOT)))
    env = {
        "SAFESTRATEGY_CACHE_DIR": str(tmp_path / "cache"),
        "SAFESTRATEGY_BACKEND": LISTED,
        "SAFESTRATEGY_STALL_TIMEOUT": "5",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    args = ["-m", "safestrategy", "run", "--grace", "2", "--", sys.executable, str(script)]
    done = run_python(*args, env=env, timeout=300)
    assert done.returncode == 75, done.stderr[-3000:]
    assert backends(done) == ["hierarchical_copy"]
    said = "no all-reduce could be run to check it (TensorFlow 1.x: no eager all-reduce)"
    assert done.stderr.count(f"Not recorded against hierarchical_copy: {said}") == 1
    assert "a relaunch on another backend would only be a guess; not relaunched" in done.stderr
    assert not list((tmp_path / "cache").glob("stall-*.json"))


# --- the training as any descendant of the command (no TensorFlow: the run directory's
# seam, written as the factory and the watchdog write it) -------------------------------

#: A training two wrappers down: its decision, heartbeat and record as the factory and the
#: watchdog write them. Launch 0 stalls (a record, exit 75) or aborts inside a call; the
#: relaunch trains on the next backend of the list and exits 0.
WRAPPED = """
import os, sys
sys.path.insert(0, {root!r})
from safestrategy import _rundir
from safestrategy import records
cache = os.environ["SAFESTRATEGY_CACHE_DIR"]
place = records.Place(records.KIND, {{"machine": "m", "devices": ["/cpu:0", "/cpu:1"]}}, True)
first = os.environ["SAFESTRATEGY_RESTART"] == "0"
backend = "hierarchical_copy" if first else "reduce_to_cpu"
_rundir.decision({{"backend": backend, "devices": ["/cpu:0", "/cpu:1"], "mode": "list",
                   "place": {{"kind": place.kind, "key": dict(place.key)}}, "read": True,
                   "unread": None, "cache": cache, "remedy": {{}}, "stall_timeout": 600}})
_rundir.heartbeat(1, _rundir.COLLECTIVES)
print("TRAINING", backend, os.getppid() != int(os.environ["RUN_PID"]), flush=True)
if first and sys.argv[1] == "stall":
    records.record(place, backend, 5.0, {{}})
    os._exit(75)
if first:
    os.abort()
"""

#: How the command wraps the training (``{py}``: this interpreter, ``{mode}``).
WRAPPERS = {
    "script": ["./train.sh", "{mode}"],
    "bash -c": ["bash", "-c", '"$0" wrapped.py "$1"; exit $?', "{py}", "{mode}"],
    "timeout": ["timeout", "600", "{py}", "wrapped.py", "{mode}"],
    "env": ["env", "SAFESTRATEGY_CACHE_DIR={cache}", "{py}", "wrapped.py", "{mode}"],
}


@pytest.mark.skipif(os.name != "posix", reason="run is POSIX only")
@pytest.mark.parametrize("mode", ["stall", "crash"])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_training_behind_a_wrapper_is_judged_and_relaunched(tmp_path, wrapper, mode):
    (tmp_path / "wrapped.py").write_text(WRAPPED.format(root=str(ROOT)))
    script = tmp_path / "train.sh"
    script.write_text(f'#!/bin/sh\n"{sys.executable}" wrapped.py "$1"\ncode=$?\nexit $code\n')
    script.chmod(0o755)
    own = tmp_path / "own-cache"  # the "env" wrapper's: the training's, not run's
    command = [part.format(py=sys.executable, mode=mode, cache=own) for part in WRAPPERS[wrapper]]
    code = "import os, sys; os.environ['RUN_PID'] = str(os.getpid()); "
    code += "from safestrategy import run; sys.exit(run.main(sys.argv[1:]))"
    env = {"SAFESTRATEGY_CACHE_DIR": str(tmp_path / "cache"), "SAFESTRATEGY_BACKEND": LISTED}
    done = subprocess.run(
        [sys.executable, "-c", code, "--grace", "2", "--", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        universal_newlines=True,
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        cwd=str(tmp_path),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    trainings = re.findall(r"^TRAINING (\S+) (\S+)$", done.stdout, re.MULTILINE)
    grandchild = wrapper != "env"  # env execs the training: it is the child itself
    assert trainings == [("hierarchical_copy", str(grandchild)), ("reduce_to_cpu", str(grandchild))]
    ended = "stalled on hierarchical_copy" if mode == "stall" else "crashed on hierarchical_copy"
    assert f"launch 2 of 4: training {ended}" in done.stderr
    if mode == "crash":  # run wrote the record where the training reads, whatever its cache
        cache = own if wrapper == "env" else tmp_path / "cache"
        assert [s.backend for _, _, s in records.every(str(cache))] == ["hierarchical_copy"]


#: A training that says it finished (the heartbeat's atexit) and then hangs at exit, as a
#: gRPC teardown can: an atexit handler registered before it runs after it.
HANGS_AT_EXIT = """
import atexit, os, sys, time
sys.path.insert(0, {root!r})
atexit.register(time.sleep, 600)
from safestrategy import _rundir
_rundir.decision({{"backend": "reduce_to_cpu", "devices": ["/cpu:0", "/cpu:1"]}})
print("CHILD", os.getpid(), flush=True)
"""


@pytest.mark.skipif(os.name != "posix", reason="run is POSIX only")
def test_a_training_that_finished_but_hangs_at_exit_is_ended_after_grace(tmp_path):
    with supervising(tmp_path, HANGS_AT_EXIT.format(root=str(ROOT)), "--grace", "1") as (
        supervisor,
        child,
    ):
        assert supervisor.wait(timeout=60) == 137
        assert gone(child)
        said = supervisor.stderr.read()
    assert f"the training (pid {child}) said it finished over 1 s ago and has not exited" in said
    assert "hung at exit" in said and "launch 2" not in said


@pytest.mark.skipif(os.name != "posix", reason="run is POSIX only")
def test_runs_keeps_the_last_20_launches(tmp_path):
    runs = tmp_path / "runs"
    for number in range(25):
        old = runs / f"20260101-000000-{number:02d}" / "launch-1"
        old.mkdir(parents=True)
        os.utime(str(old), (1e9 + number, 1e9 + number))
    done = run_python(
        "-m", "safestrategy", "run", "--", sys.executable, "-c", "pass",
        env={"SAFESTRATEGY_CACHE_DIR": str(tmp_path)}, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    left = sorted(p.parent.name for p in runs.glob("*/launch-*"))
    assert len(left) == 21 and len(list(runs.iterdir())) == 21  # 20 ended, and its own
    assert "20260101-000000-04" not in left and "20260101-000000-05" in left  # oldest gone


#: A launch that waits for every other run to have started, then says whether its
#: run directory is still there (exit 3 if not).
SHARED = """
import os, sys, time
started = sys.argv[1]
open(os.path.join(started, str(os.getpid())), "w").close()
deadline = time.monotonic() + 90
while len(os.listdir(started)) < int(sys.argv[2]) and time.monotonic() < deadline:
    time.sleep(0.1)
time.sleep(0.5)
sys.exit(0 if os.path.isdir(os.environ["SAFESTRATEGY_RUN_DIR"]) else 3)
"""


@pytest.mark.skipif(os.name != "posix", reason="run is POSIX only")
def test_runs_sharing_one_cache_never_prune_a_launch_still_running(tmp_path):
    """25 runs at once on one cache (the tasks of Slurm steps on one node): the later ones
    prune past the 20 launches kept, and must pass over every one still running."""
    from safestrategy.run.launches import KEEP_LAUNCHES

    count = KEEP_LAUNCHES + 5
    (tmp_path / "started").mkdir()
    (tmp_path / "shared.py").write_text(SHARED)
    env = dict(os.environ, SAFESTRATEGY_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "safestrategy", "run", "--", sys.executable]
    command += [str(tmp_path / "shared.py"), str(tmp_path / "started"), str(count)]
    runs = []
    try:
        for _ in range(count):
            runs.append(subprocess.Popen(command, env=env, stderr=subprocess.PIPE))
            time.sleep(0.05)  # each prunes as it starts, while the earlier ones run
        codes = [run.wait(timeout=120) for run in runs]
    finally:
        for run in runs:
            run.kill()
            run.wait(timeout=30)
    assert codes == [0] * count
    launches = list((tmp_path / "cache" / "runs").glob("*/launch-*"))
    assert len(launches) == count  # nothing pruned while they ran
    subprocess.run([*command[:-3], "-c", "pass"], env=env, timeout=60, check=True)
    launches = list((tmp_path / "cache" / "runs").glob("*/launch-*"))
    assert len(launches) == KEEP_LAUNCHES + 1  # the ended ones kept, and the newest run's
