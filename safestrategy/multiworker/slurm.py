"""A Slurm job step as the workers of multi-worker training: who they are, in Slurm's order.

Read from the step's own variables only (``SLURM_STEP_*``, ``SLURM_PROCID``): a batch
script or an ``salloc`` shell running ``python train.py`` is one process, however many
tasks its job has. Pure: the environment in, a :class:`Step` or a ``ValueError`` out.

The workers are the step's tasks by ``SLURM_PROCID``: the hosts of
``SLURM_STEP_NODELIST`` expanded as Slurm expands them (``node[9-10]`` is node9 then
node10, not sorted as text as TensorFlow's ``SlurmClusterResolver`` sorts them), with
``SLURM_STEP_TASKS_PER_NODE`` tasks each, laid out block-wise (Slurm's default: task
ids fill one node, then the next). Tasks on one host listen on consecutive ports from a
port base: ``SAFESTRATEGY_PORT_BASE``, else :func:`port_base`'s formula. No GPU count is
read from Slurm: a task's devices are those TensorFlow sees in it.
"""

import itertools
import re
from typing import List, Mapping, NamedTuple, Optional, Tuple

from .._env import ENV_PORT_BASE

#: The port formula's range: from here, below Linux's ephemeral ports (32768-60999), in
#: windows of :data:`WINDOW` ports, one window per job step on a node.
FIRST_PORT = 12000
WINDOW = 16
WINDOWS = (32768 - FIRST_PORT) // WINDOW  # 1298
#: The steps of one job that take consecutive windows before the next job's start.
STEPS_PER_JOB = 8


class Step(NamedTuple):
    """The step's tasks (host, port) by task id, this task's id, and the step's name."""

    tasks: Tuple[Tuple[str, int], ...]
    procid: int
    job: str
    step: str
    ports: str  #: where the ports came from, as an error about one names it

    def describe(self) -> str:
        return f"Slurm job {self.job} step {self.step}"


def expand_hostlist(text: str) -> List[str]:
    """Slurm's host list expanded in its own order: ``a[1-2,05],b`` is a1, a2, a05, b.
    Ranges keep their zero padding (``n[08-10]``: n08 n09 n10); several bracketed parts in
    one name expand as Slurm does, the last one fastest."""
    hosts: List[str] = []
    for name in _split_top(text.strip()):
        parts = re.split(r"\[([^\]]*)\]", name)  # text, ranges, text, ranges, ..., text
        if any("[" in part or "]" in part for part in parts):
            raise ValueError(f"host list {text!r}: unbalanced brackets in {name!r}")
        choices = [[part] if i % 2 == 0 else _ranges(part, text) for i, part in enumerate(parts)]
        hosts.extend("".join(chosen) for chosen in itertools.product(*choices))
    if not hosts or any(not host for host in hosts):
        raise ValueError(f"host list {text!r} names no host")
    return hosts


def _split_top(text: str) -> List[str]:
    """``text`` split at the commas outside brackets."""
    names, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            names.append(text[start:i])
            start = i + 1
    return [*names, text[start:]]


def _ranges(spec: str, text: str) -> List[str]:
    """``1-3,07`` as ["1", "2", "3", "07"] (a range pads to its first number's width)."""
    found = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        if not first.isdigit() or not (last or first).isdigit() or int(last or first) < int(first):
            raise ValueError(f"host list {text!r}: {part!r} is not a number or a range")
        width = len(first)
        found.extend(str(n).zfill(width) for n in range(int(first), int(last or first) + 1))
    return found


def expand_tasks_per_node(text: str) -> List[int]:
    """Slurm's ``2(x3),1`` as [2, 2, 2, 1]."""
    counts = []
    for part in text.strip().split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None or int(match.group(1)) < 1:
            raise ValueError(f"tasks per node {text!r}: {part!r} is not N or N(xM)")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def port_base(job: int, step: int) -> int:
    """The first port of a step's window: ``12000 + 16 * ((8 * job + step) mod 1298)``.

    Windows of 16 ports from 12000 up to 32767, below Linux's ephemeral range, one per
    step: the steps of one job take consecutive windows, so concurrent steps of a job
    never share a port (up to 8 steps running at once, each with up to 16 tasks on a
    node); two jobs on one node share a window only when ``8 * job`` falls on the same
    window (job ids 649 apart), and then the port taken is an error naming
    ``SAFESTRATEGY_PORT_BASE``, which picks the base by hand."""
    return FIRST_PORT + WINDOW * ((STEPS_PER_JOB * job + step) % WINDOWS)


def _number(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name, "").strip()
    if not value.isdigit():
        raise ValueError(f"Slurm's {name}={value!r} is not a whole number")
    return int(value)


def step_tasks(environ: Mapping[str, str]) -> int:
    """How many tasks this process's Slurm step has (``SLURM_STEP_NUM_TASKS``); 0 outside
    a step. Never ``SLURM_NTASKS``: a batch script's own ``python train.py`` is one
    process, whatever the allocation."""
    count = environ.get("SLURM_STEP_NUM_TASKS", "").strip()
    return int(count) if count.isdigit() else 0


def read(environ: Mapping[str, str], port_base_setting: Optional[int]) -> Optional[Step]:
    """The step's workers when this process is one task of a step of several; None
    otherwise (no step, or one task). ``ValueError`` when the step cannot be read as
    workers (a distribution other than block, variables that disagree)."""
    total = step_tasks(environ)
    if total < 2:
        return None
    hosts = expand_hostlist(environ.get("SLURM_STEP_NODELIST", ""))
    counts = expand_tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE", ""))
    if len(counts) != len(hosts) or sum(counts) != total:
        raise ValueError(
            f"Slurm's step does not add up: SLURM_STEP_NODELIST has {len(hosts)} hosts, "
            f"SLURM_STEP_TASKS_PER_NODE {counts} tasks, SLURM_STEP_NUM_TASKS={total}"
        )
    distribution = environ.get("SLURM_DISTRIBUTION", "").strip()
    if max(counts) > 1 and distribution.split(":")[0] not in ("", "block"):
        raise ValueError(
            f"SLURM_DISTRIBUTION={distribution!r}: tasks laid out other than block-wise "
            "cannot be told apart from Slurm's variables; run the step with "
            "--distribution=block (Slurm's default), or set TF_CONFIG for each task"
        )
    job, step = _number(environ, "SLURM_JOB_ID"), _number(environ, "SLURM_STEP_ID")
    if port_base_setting is not None:
        base, ports = port_base_setting, f"{ENV_PORT_BASE}={port_base_setting}"
    else:
        base = port_base(job, step)
        ports = f"the port formula for job {job} step {step} (set {ENV_PORT_BASE} to choose)"
        if max(counts) > WINDOW:
            raise ValueError(
                f"{max(counts)} tasks on one node need more than the formula's {WINDOW} "
                f"ports per step: set {ENV_PORT_BASE} (ports base, base + 1, ...)"
            )
    if base + max(counts) - 1 > 65535:
        raise ValueError(f"{ports}: ports from {base} run past 65535 for {max(counts)} tasks")
    tasks = tuple((host, base + local) for host, n in zip(hosts, counts) for local in range(n))
    procid = _number(environ, "SLURM_PROCID")
    if procid >= total:
        raise ValueError(f"SLURM_PROCID={procid} is not a task of a step of {total}")
    node = environ.get("SLURMD_NODENAME", "").strip()
    if node and node != tasks[procid][0]:
        raise ValueError(
            f"task {procid} of Slurm job {job} step {step} runs on {node}, but block layout "
            f"of SLURM_STEP_NODELIST puts it on {tasks[procid][0]}"
        )
    return Step(tasks, procid, str(job), str(step), ports)
