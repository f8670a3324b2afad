"""``python -m safestrategy --benchmark``: each passing backend's all-reduce over a range of sizes.

The table nccl-tests users know from ``all_reduce_perf``: for each size (bytes per
replica, :data:`SIZES`: 4 KiB to 64 MiB by 4x) one float32 tensor per replica is
all-reduced (sum) with the backend's own cross-device ops, the way
:mod:`safestrategy.checks.timing` times ``auto``'s payload (one strategy per backend, a
warm-up, then the median of :data:`RUNS`). ``algbw`` is bytes / time; ``busbw`` is
``algbw * 2(n-1)/n`` for n devices, nccl-tests' all-reduce factor, which makes the
figure comparable across device counts (a ring moves ``2(n-1)/n`` of the data per link).
GB/s are 10^9 bytes per second, as nccl-tests prints them.

Only backends whose smoke check passed are timed. What may hang or abort (``nccl``, and
``collective`` where it requested NCCL) is timed in a fresh probe process, bounded by the
timeout for each size (:func:`safestrategy.checks.probe.sweep_ms`); the rest in this
process (the CLI's own), as the checks did. A sweep that fails or times out is a
:class:`Sweep` with the reason and no rows, and the other backends are still timed.
matplotlib (the ``bench`` extra) draws the plot and is imported only for it.
"""

import importlib.util
import os
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Sequence

from . import _tf
from ._devices import cpu_count, parse_devices
from ._env import DEFAULT_TIMEOUT
from .backends import COLLECTIVE, NCCL, NCCL_IMPLEMENTATION
from .checks import nccl, probe, timing
from .checks.allreduce import first_line, graph_api, session_config
from .report import OK, CandidateResult, Report

#: Bytes per replica: 4 KiB, 16 KiB, ..., 64 MiB.
SIZES = tuple(4096 * 4**power for power in range(8))
#: Timed runs per size, after one untimed (see :func:`safestrategy.checks.timing.batches_ms`).
RUNS = 5
PLOT_INSTALL = "pip install 'safestrategy[bench]'  (or: pip install matplotlib)"


class Row(NamedTuple):
    """One size of one backend's sweep."""

    size: int  #: bytes per replica
    ms: float  #: median milliseconds of the all-reduce

    @property
    def count(self) -> int:
        """float32 elements per replica."""
        return self.size // 4

    @property
    def algbw(self) -> float:
        """GB/s: bytes per replica over time."""
        return self.size / (self.ms / 1000) / 1e9 if self.ms > 0 else 0.0

    def busbw(self, replicas: int) -> float:
        """GB/s: ``algbw * 2(n-1)/n``, nccl-tests' all-reduce bus bandwidth."""
        return self.algbw * 2 * (replicas - 1) / replicas


class Sweep(NamedTuple):
    """One backend's rows, and whether it is the one the report chose."""

    backend: str
    chosen: bool
    rows: List[Row]
    #: Why it could not be measured (then there are no rows); None when it was.
    failed: Optional[str] = None


def can_plot() -> bool:
    """Whether matplotlib is installed (looked up, not imported: that takes a second)."""
    return importlib.util.find_spec("matplotlib") is not None


def measure(
    tf: Any,
    report: Report,
    timeout: Optional[float],
    before: Optional[Callable[[str], None]] = None,
) -> Iterator[Sweep]:
    """Every passing backend's sweep over :data:`SIZES` on the report's devices, each as
    soon as it is measured (or has failed: :attr:`Sweep.failed` says why).

    ``before(name)`` is called as each backend starts (progress). What may hang runs in a
    fresh probe process with the NCCL remedy it needed, bounded by ``timeout`` seconds per
    size (None: the default); the rest here, an NCCL remedy set first as the factory would.
    """
    devices = list(report.devices)
    parsed = parse_devices(devices)
    graph = graph_api(tf)
    config = None
    if graph is not None:  # TF 1.x: a session with the devices the report names
        gpus = any(d.kind == "GPU" for d in parsed)
        config = session_config(graph, cpu_count(parsed), gpus=gpus)
    era = _tf.era(tf.__version__)
    for candidate in (c for c in report.candidates if c.status == OK):
        if before is not None:
            before(candidate.name)
        chosen = candidate.name == report.backend
        counts = [size // 4 for size in SIZES]
        if _may_hang(candidate):
            try:
                times = _in_probe_process(devices, candidate, counts, timeout)
            except (probe.ProbeTimeout, RuntimeError) as error:  # ProbeDied is one
                yield Sweep(candidate.name, chosen, [], str(error))
                continue
        else:
            try:
                nccl.apply_remedy(candidate.remedy, devices)
                batches = [[count] for count in counts]
                times = timing.batches_ms(
                    tf, era, devices, candidate.name, batches, config, timeout, RUNS
                )
            except Exception as error:  # whatever TensorFlow raises: a line, not a traceback
                yield Sweep(candidate.name, chosen, [], "{}: {}".format(*first_line(error)))
                continue
        yield Sweep(candidate.name, chosen, [Row(size, ms) for size, ms in zip(SIZES, times)])


def _may_hang(candidate: CandidateResult) -> bool:
    """``nccl``, or ``collective`` where it requested NCCL (its reason says so): these run
    in a probe process, as their checks did."""
    requested = f"({NCCL_IMPLEMENTATION} requested)"
    return candidate.name == NCCL or (
        candidate.name == COLLECTIVE and candidate.reason.endswith(requested)
    )


def _in_probe_process(
    devices: List[str], candidate: CandidateResult, counts: List[int], timeout: Optional[float]
) -> List[float]:
    """The sweep in a fresh probe process, given ``timeout`` seconds per size and closed
    afterwards; raises ``ProbeTimeout``, ``ProbeDied`` or ``RuntimeError`` saying why not."""
    per_size = DEFAULT_TIMEOUT if timeout is None else timeout
    request = {"job": "mirrored", "devices": devices}
    process, _ = probe.start(request, per_size, env=candidate.remedy)
    with process:
        return probe.sweep_ms(process, candidate.name, counts, RUNS, per_size * len(counts))


def table(sweep: Sweep, replicas: int) -> str:
    """One backend's rows as nccl-tests prints them (out-of-place columns only)."""
    lines = [
        f"# {sweep.backend}{'  (chosen)' if sweep.chosen else ''}",
        f"# {'size':>10} {'count':>13} {'type':>9} {'redop':>7} {'time':>10} {'algbw':>7}"
        f" {'busbw':>7}",
        f"# {'(B)':>10} {'(elements)':>13} {'':>9} {'':>7} {'(us)':>10} {'(GB/s)':>7}"
        f" {'(GB/s)':>7}",
    ]
    for row in sweep.rows:
        lines.append(
            f"  {row.size:>10} {row.count:>13} {'float':>9} {'sum':>7} {row.ms * 1000:>10.1f}"
            f" {row.algbw:>7.2f} {row.busbw(replicas):>7.2f}"
        )
    average = sum(row.busbw(replicas) for row in sweep.rows) / max(len(sweep.rows), 1)
    lines.append(f"# Avg bus bandwidth    : {average:.3f}")
    return "\n".join(lines)


def _human(size: int) -> str:
    """4096 -> "4K", 67108864 -> "64M" (binary units, as nccl-tests' -b/-e take them)."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if size >= scale:
            return f"{size // scale}{unit}"
    return str(size)


def plot(sweeps: Sequence[Sweep], report: Report, path: str) -> None:
    """Bus bandwidth against size, one line per measured backend (the chosen one thick), to
    ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # a file, no window: works without a display
    import matplotlib.pyplot as plt

    replicas = len(report.devices)
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for sweep in (sweep for sweep in sweeps if sweep.failed is None):
        axis.plot(
            [row.size for row in sweep.rows],
            [row.busbw(replicas) for row in sweep.rows],
            marker="o",
            linewidth=3 if sweep.chosen else 1.5,
            label=sweep.backend + (" (chosen)" if sweep.chosen else ""),
        )
    axis.set_xscale("log", base=2)
    axis.set_xticks(SIZES)
    axis.set_xticklabels([_human(size) for size in SIZES])
    axis.set_xlabel("bytes per replica")
    axis.set_ylabel("bus bandwidth (GB/s)")
    axis.set_title(
        f"all-reduce (sum, float32), {replicas} devices, TF {report.tf_version}\n"
        f"{', '.join(report.devices)}; median of {RUNS} runs after a warm-up"
    )
    axis.grid(True, alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(os.fspath(path), dpi=100)
    plt.close(figure)
