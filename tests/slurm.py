"""A real one-node Slurm for the tests: Debian's munged, slurmctld and slurmd on 127.0.0.1.

    python tests/slurm.py start|stop|status [--dir DIR]

``start`` runs the three daemons as root with all they read and write (config, munge key,
socket, state, spool, pid and log files) under one directory, on ports chosen free, and
returns once the node is ``idle``; a second ``start`` on the same directory reuses the
daemons still up there. ``stop`` cancels the jobs, then ends exactly the pids ``start``
saved (TERM, then KILL after a bound), never a process found by its name. Every wait is
bounded; a failure quotes the tail of the log that says why. The settings are those
``/work/shared/notes/slurm.md`` measured: ``CPUs=4`` with ``config_overrides`` and
``OverSubscribe=YES`` let ``srun -n3`` and ``-n4`` run on two cores. A client command
needs :func:`environment` (``SLURM_CONF``: without it srun asks DNS for the controller).
Standard library only, Python 3.6 syntax: the test legs import it on 3.6 to 3.11.
"""

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, NamedTuple, Optional, Sequence

DAEMONS = ("munged", "slurmctld", "slurmd")  #: in start order; stopped in reverse
CLIENTS = ("srun", "sinfo", "squeue", "scancel")
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")  #: what .ci/run installs
DEFAULT_DIR = os.path.join(tempfile.gettempdir(), "safestrategy-slurm")
PARTITION = "tests"
#: each directory's mode: munged wants the key's private, the socket's open to clients
DIRECTORIES = {"": 0o755, "key": 0o700, "socket": 0o755, "state": 0o700, "spool": 0o755}
READY_WITHIN = 20.0  #: seconds for the node to be idle once the daemons run
STOP_WITHIN = 10.0  #: seconds for a daemon to end on TERM before it gets KILL
CONF = """\
ClusterName=safestrategy
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/socket/munge.socket
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmdParameters=config_overrides
ReturnToService=2
NodeName={node} NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName={partition} Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class SlurmError(RuntimeError):
    """Slurm cannot start here, or did not start or stop in time; ``log``: the tail saying why."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message + ("\n" + log if log else ""))
        self.log = log


class Cluster(NamedTuple):
    directory: str  #: where everything lives
    node: str  #: the node's name (``hostname -s``)
    pids: Dict[str, int]  #: daemon -> pid


def node_name() -> str:
    """This machine's short host name, as ``hostname -s`` prints it: the node's name."""
    return socket.gethostname().split(".")[0]


def _which(name: str) -> Optional[str]:
    """``name``'s path; the sbin directories count even where PATH lacks them."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin"]))


def unavailable() -> Optional[str]:
    """Why Slurm cannot start here (a test's skip reason), or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"tests/slurm.py runs Slurm on Linux only; this is {sys.platform}"
    if os.geteuid() != 0:
        return f"tests/slurm.py runs Slurm's daemons as root; this is uid {os.geteuid()}"
    missing = ", ".join(name for name in DAEMONS + CLIENTS if _which(name) is None)
    if not missing:
        return None
    if _which("apt-get") is None:
        return f"Slurm is not installed (no {missing}) and there is no apt-get to install it"
    return (
        f"Slurm is not installed (no {missing}); .ci/run runs apt-get install {' '.join(PACKAGES)}"
    )


def environment(directory: str = DEFAULT_DIR, base: Optional[Dict[str, str]] = None):
    """``base`` (default: this process's environment) with what srun, sinfo... need."""
    return dict(os.environ if base is None else base, SLURM_CONF=_path(directory, "slurm.conf"))


def status(directory: str = DEFAULT_DIR) -> Dict[str, int]:
    """The daemons ``start`` saved in ``directory`` that still run: name -> pid."""
    try:
        with open(_path(directory, "pids.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return {}
    return {name: pid for name, pid in saved.items() if _ours(pid, directory)}


def start(directory: str = DEFAULT_DIR) -> Cluster:
    """The cluster in ``directory``: reused when its three daemons run, else started anew.

    SlurmError when Slurm cannot start here (:func:`unavailable`), a daemon fails, or the
    node is not idle within ``READY_WITHIN`` s; what it started by then is stopped."""
    reason = unavailable()
    if reason:
        raise SlurmError(reason)
    directory, node = os.path.abspath(directory), node_name()
    sinfo = ("sinfo", "-h", "-n", node, "-o", "%t")  # the node's state: "idle" when ready
    running = status(directory)
    if len(running) == len(DAEMONS) and _client(directory, *sinfo) == "idle":
        return Cluster(directory, node, running)
    stop(directory)  # what is left of a cluster from before
    _prepare(directory, node)
    pids = {}  # type: Dict[str, int]
    try:
        for name, arguments in _arguments(directory, node).items():
            pids[name] = _launch(directory, name, arguments)
            with open(_path(directory, "pids.json"), "w") as f:
                json.dump(pids, f)
        deadline, state = time.monotonic() + READY_WITHIN, _client(directory, *sinfo)
        while state != "idle":
            if time.monotonic() > deadline:
                what = f"node {node} not idle within {READY_WITHIN} s (sinfo: {state!r})"
                raise SlurmError(what, _tail(_logs(directory, "slurmctld", "slurmd")))
            time.sleep(0.05)
            state = _client(directory, *sinfo)
    except BaseException:
        stop(directory)
        raise
    return Cluster(directory, node, pids)


def stop(directory: str = DEFAULT_DIR) -> Dict[str, int]:
    """Cancel the jobs, then end the daemons ``start`` saved, the last started first
    (TERM, then KILL after ``STOP_WITHIN`` s). Returns the pids it ended: name -> pid."""
    running = status(directory)
    if "slurmctld" in running:
        _client(directory, "scancel", "--partition", PARTITION)
        with contextlib.suppress(SlurmError):  # jobs left or not, the daemons go
            _wait(lambda: not _client(directory, "squeue", "-h", "-o", "%i"), 5.0, "jobs left")
    for name in reversed(DAEMONS):
        if name in running:
            _end(name, running[name], directory)
    return running


def _end(name: str, pid: int, directory: str) -> None:
    """TERM daemon ``pid``, KILL it if it still runs after ``STOP_WITHIN`` s."""
    try:
        os.kill(pid, signal.SIGTERM)
        _wait(lambda: not _ours(pid, directory), STOP_WITHIN, f"{name} ({pid}) ran on after TERM")
    except ProcessLookupError:
        pass
    except SlurmError:
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: not _ours(pid, directory), 5.0, f"{name} ({pid}) ran on after KILL")


def _path(directory: str, *parts: str) -> str:
    return os.path.join(os.path.abspath(directory), *parts)


def _logs(directory: str, *names: str) -> List[str]:
    """The daemons' log files, and what each printed before it opened its own."""
    return [_path(directory, name + suffix) for name in names for suffix in (".log", ".out")]


def _tail(paths: Sequence[str], lines: int = 15) -> str:
    """The last ``lines`` lines of each of ``paths`` that has any, headed by its path."""
    parts = []
    for path in paths:
        if os.path.exists(path) and os.path.getsize(path):
            with open(path, errors="replace") as f:
                parts.append(f"--- {path}:\n" + "".join(f.readlines()[-lines:]))
    return "".join(parts).rstrip()


def _ours(pid: int, directory: str) -> bool:
    """True while ``pid`` runs (a zombie does not) with a path in ``directory`` on its
    command line: a pid another process took since is never ours."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] == "Z":
                return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return (os.path.abspath(directory) + os.sep).encode() in f.read()
    except (OSError, IndexError):
        return False


def _client(directory: str, *command: str) -> str:
    """What client ``command`` (sinfo, squeue...) prints for the cluster in ``directory``."""
    try:
        return subprocess.run(
            [_which(command[0]) or command[0], *command[1:]],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            universal_newlines=True,
            env=environment(directory),
            timeout=5,
        ).stdout.strip()
    except subprocess.TimeoutExpired:
        return f"{command[0]} did not answer within 5 s"


def _wait(check, within: float, what: str, logs: Sequence[str] = ()):
    """Poll ``check()`` until it returns something true, and return that; SlurmError
    saying ``what`` (and quoting ``logs``) after ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise SlurmError(f"{what} within {within} s", _tail(logs))
        time.sleep(0.05)


def _prepare(directory: str, node: str) -> None:
    """The directories, a munge key, and a config on ports free now, all in ``directory``;
    no log or pid file from before (a log's tail must be this start's)."""
    if os.path.islink(directory) or (
        os.path.exists(directory) and os.stat(directory).st_uid != os.geteuid()
    ):
        raise SlurmError(f"{directory} is a link or not ours; choose another --dir")
    shutil.rmtree(_path(directory, "spool"), ignore_errors=True)
    for sub, mode in DIRECTORIES.items():
        os.makedirs(_path(directory, sub), exist_ok=True)
        os.chmod(_path(directory, sub), mode)
    for name in os.listdir(directory):
        if name.endswith((".log", ".out", ".pid")):
            os.remove(_path(directory, name))
    key = _path(directory, "key", "munge.key")
    if not os.path.exists(key):
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400), "wb") as f:
            f.write(os.urandom(1024))
    sockets = [socket.socket(), socket.socket()]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    with open(_path(directory, "slurm.conf"), "w") as f:
        f.write(CONF.format(dir=directory, node=node, ports=ports, partition=PARTITION))


def _arguments(directory: str, node: str) -> Dict[str, List[str]]:
    """Each daemon's arguments, in start order; each names ``directory`` (see _ours)."""
    munged = {
        "key-file": "key/munge.key",
        "socket": "socket/munge.socket",
        "pid-file": "munged.pid",
        "log-file": "munged.log",
        "seed-file": "state/munged.seed",
    }
    conf = _path(directory, "slurm.conf")
    return {
        "munged": [f"--{option}={_path(directory, path)}" for option, path in munged.items()],
        "slurmctld": ["-c", "-f", conf],  # -c: no state (jobs, nodes) from a run before
        "slurmd": ["-N", node, "-f", conf],
    }


def _launch(directory: str, name: str, arguments: List[str]) -> int:
    """Run daemon ``name`` (it forks into the background) and return its pid."""
    logs = _logs(directory, name)
    try:
        with open(logs[1], "w") as out:
            command = [_which(name) or name, *arguments]
            code = subprocess.call(command, stdout=out, stderr=out, timeout=10)
    except subprocess.TimeoutExpired:
        raise SlurmError(
            f"{name} did not go into the background within 10 s", _tail(logs)
        ) from None
    if code != 0:
        raise SlurmError(f"{name} exited with {code}", _tail(logs))

    def pid():
        try:
            with open(_path(directory, name + ".pid")) as f:
                found = int(f.read().strip() or 0)
        except (OSError, ValueError):
            return None
        return found if _ours(found, directory) else None

    return _wait(pid, 5.0, f"{name} wrote no pid file of a running process", logs)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("start", "stop", "status"))
    parser.add_argument("--dir", default=DEFAULT_DIR, help="default: %(default)s")
    args = parser.parse_args(argv)
    directory = os.path.abspath(args.dir)
    try:
        act = {"start": lambda d: start(d).pids, "stop": stop, "status": status}[args.action]
        pids = act(directory)
    except SlurmError as error:
        print(f"slurm.py: {error}", file=sys.stderr)
        return 1
    print(directory, *(f"{name}={pids.get(name, '-')}" for name in DAEMONS))
    return 0 if args.action == "stop" or len(pids) == len(DAEMONS) else 1


if __name__ == "__main__":
    sys.exit(main())
