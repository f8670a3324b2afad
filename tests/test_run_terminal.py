"""``run`` at a real terminal: an interactive ``bash`` with job control in a pty (pexpect),
driven as a user drives it: Ctrl-C, Ctrl-Z then ``fg``, ``run ... &``. The trainings are
small scripts (no TensorFlow): what is tested is the job, not the all-reduce. Every wait
is bounded, and every process a test started is killed by pid at its end."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from safestrategy import _procs

from .conftest import ROOT, gone, read_line

pexpect = pytest.importorskip("pexpect")  # the test extra has it wherever run runs (POSIX)

pytestmark = pytest.mark.skipif(os.name != "posix", reason="run is POSIX only")

WAIT = 60  #: seconds any one expected line may take (a loaded CI machine)

#: A training that says its pid, then says each SIGINT and goes on (one blocked in C++
#: does not end at Ctrl-C); it finishes on its own after ``sys.argv[1]`` s.
DEAF = """
import os, signal, sys, time
signal.signal(signal.SIGINT, lambda n, f: print("GOT SIGINT", flush=True))
print("CHILD", os.getpid(), flush=True)
time.sleep(float(sys.argv[1]))
"""

#: A training that built a strategy (a decision in the run directory) and whose heartbeat
#: says "inside a TF call", advancing every 0.1 s of its own running time: 3 s of it, then
#: it prints DONE. With a 1 s stall timeout and --grace 1, 2 s of silence is a hang.
BEATING = """
import os, sys, time
sys.path.insert(0, {root!r})
from safestrategy import _rundir
_rundir.decision({{"backend": "reduce_to_cpu", "devices": ["/cpu:0", "/cpu:1"],
                   "stall_timeout": 1.0}})
print("CHILD", os.getpid(), flush=True)
for tick in range(30):
    _rundir.heartbeat(tick, _rundir.COLLECTIVES)
    time.sleep(0.1)
print("DONE", flush=True)
"""


@pytest.fixture
def shell(tmp_path):
    """An interactive bash in a pty, prompt ``READY> ``; its pids to kill are added to
    ``shell.pids``. SIGINT is set to its default for bash (a runner may ignore it)."""
    for name, text in (("deaf.py", DEAF), ("beating.py", BEATING.format(root=str(ROOT)))):
        (tmp_path / name).write_text(text)
    env = dict(os.environ, SAFESTRATEGY_CACHE_DIR=str(tmp_path / "cache"), PS1="READY> ")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("PROMPT_COMMAND", None)
    bash = pexpect.spawn(
        "bash",
        ["--norc", "--noprofile", "-i"],
        env=env,
        cwd=str(tmp_path),
        encoding="utf-8",
        timeout=WAIT,
        dimensions=(40, 200),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    bash.pids = []
    bash.run = f"{sys.executable} -m safestrategy run"
    bash.python = sys.executable
    try:
        bash.expect_exact("READY> ")
        yield bash
    finally:
        for pid in bash.pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        bash.close(force=True)


def expect_all(bash, *texts):
    """Each of ``texts``, in whatever order they come (two processes write at once); the
    text read meanwhile."""
    left, seen = list(texts), ""
    while left:
        left.pop(bash.expect_exact(left))
        seen += bash.before + bash.after
    return seen


def child_pid(bash):
    bash.expect(r"CHILD (\d+)\r\n")
    pid = int(bash.match.group(1))
    bash.pids.append(pid)
    return pid


def test_ctrl_c_reaches_the_training_and_run_which_says_so_and_a_second_kills_at_once(shell):
    shell.sendline(f'{shell.run} --grace 600 -- {shell.python} deaf.py 600; echo "EXIT $?"')
    child = child_pid(shell)
    shell.sendintr()  # Ctrl-C: the terminal signals the foreground job, run and training
    said = expect_all(shell, "GOT SIGINT", "Ctrl-C again to kill it now")
    assert "safestrategy run: stopping: the training ends within 600 s (--grace)" in said
    shell.expect(pexpect.TIMEOUT, timeout=1.5)
    assert "GOT SIGINT" not in shell.before  # once: run passed on no second copy
    assert not gone(child, within=0.5)  # it did not stop at the first, and grace is long
    shell.sendintr()
    shell.expect_exact("EXIT 130")
    assert gone(child), f"the training {child} outlived the second Ctrl-C"
    assert "launch 2" not in shell.before


def test_ctrl_z_stops_the_whole_job_and_fg_goes_on_with_nothing_killed(shell):
    env = "SAFESTRATEGY_STALL_TIMEOUT=1"
    shell.sendline(f"{env} {shell.run} --grace 1 -- {shell.python} beating.py")
    child = child_pid(shell)
    shell.sendcontrol("z")
    shell.expect_exact("READY> ")  # the whole job is stopped: the shell has the terminal
    assert _procs.stopped([child]) == [child], "the training still runs after Ctrl-Z"
    shell.sendline("sleep 4; fg")  # stopped for twice the stall timeout + grace
    shell.expect_exact("DONE")
    shell.expect_exact("READY> ")
    assert "silent" not in shell.before and "exit 0" in shell.before
    shell.sendline('echo "EXIT $?"')  # fg's status: the job's
    shell.expect_exact("EXIT 0")


def test_a_background_run_leaves_the_terminal_to_the_shell(shell):
    shell.sendline(f"{shell.run} --grace 1 -- {shell.python} deaf.py 600 &")
    child = child_pid(shell)
    shell.sendline("echo ALIVE")  # the shell still reads its terminal (no EIO)
    shell.expect_exact("ALIVE\r\n")
    shell.sendintr()  # a Ctrl-C at the prompt is the shell's, not the background job's
    shell.expect_exact("READY> ")
    shell.sendline(f"kill -0 {child} && echo STILL RUNNING")
    shell.expect_exact("STILL RUNNING\r\n")
    assert "GOT SIGINT" not in shell.before
    shell.sendline('kill %1; wait $!; echo "WAITED $?"')
    shell.expect_exact("WAITED 143")
    assert gone(child)


def test_a_training_stopped_alone_is_not_silent(tmp_path):
    """SIGSTOP (or a debugger) to the training, not to run: time stopped is no silence."""
    (tmp_path / "beating.py").write_text(BEATING.format(root=str(ROOT)))
    env = dict(os.environ, SAFESTRATEGY_CACHE_DIR=str(tmp_path / "cache"))
    env.update(SAFESTRATEGY_STALL_TIMEOUT="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "safestrategy", "run", "--grace", "1", "--"]
    supervisor = subprocess.Popen(
        [*command, sys.executable, "beating.py"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=str(tmp_path),
        universal_newlines=True,
    )
    try:
        child = int(read_line(supervisor.stdout, WAIT, "the child's pid").split()[1])
        os.kill(child, signal.SIGSTOP)
        time.sleep(4)  # twice the stall timeout + grace
        os.kill(child, signal.SIGCONT)
        out, err = supervisor.communicate(timeout=WAIT)
        assert supervisor.returncode == 0, err
        assert "DONE" in out and "silent" not in err
    finally:
        supervisor.kill()
        supervisor.wait(timeout=30)
