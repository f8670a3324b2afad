"""The command line: the probe report for this machine, as text or JSON.

With ``TF_CONFIG`` set it shows the multi-worker view (:mod:`safestrategy.multiworker.cli`).
``python -m safestrategy records`` lists (``--forget``: forgets) every stall and crash
record in the cache directory it names, of both key spaces, importing nothing beyond the
cache.
``--benchmark`` then times every backend that passed over a range of sizes
(:mod:`safestrategy._benchmark`), ``--plot FILE.png`` draws it. Text output shows
progress as it goes: each candidate's result as it comes, and the elapsed time
while a check (NCCL's probe process) or a timing runs long.

Exit status: 0 a working backend was found, 1 none was (or TensorFlow is
missing, or the plot could not be drawn), 2 bad arguments or bad ``SAFESTRATEGY_*``
values (``--plot`` without matplotlib, or to a file that cannot be written, too: it is
found out before anything runs, like a bad argument).
"""

import argparse
import contextlib
import os
import sys
import threading
import time
from typing import Any, Iterator, List, Mapping, Optional, Sequence

from . import _benchmark, _machine, _tf, records
from ._devices import Device, cpu_count, parse_devices
from ._env import (
    DEFAULT_PAYLOAD_MB,
    DEFAULT_STALL_TIMEOUT,
    DEFAULT_TIMEOUT,
    DEFAULT_VERIFY_EVERY,
    ENV_BACKEND,
    ENV_CACHE,
    ENV_CACHE_DIR,
    ENV_COMMUNICATION,
    ENV_NCCL_REMEDIES,
    ENV_PAYLOAD,
    ENV_PORT_BASE,
    ENV_STALL_ACTION,
    ENV_STALL_TIMEOUT,
    ENV_TF_CONFIG,
    ENV_TIMEOUT,
    ENV_VERIFY_EVERY,
    cache_dir,
    resolve_switch,
    resolve_timeout,
)
from .backends import BACKEND_NAMES, BACKENDS, COMMUNICATION_NAMES
from .checks.allreduce import first_line
from .factory import decide
from .report import OK, CandidateResult, NoWorkingBackendError, Report

#: Seconds without output after which the text view says how long it has been working.
PROGRESS_EVERY = 5.0


def _parser() -> argparse.ArgumentParser:
    backends = "\n".join(f"  {b.name:<18} {b.summary}" for b in BACKENDS)
    parser = argparse.ArgumentParser(
        prog="safestrategy",
        description="Find the cross-device all-reduce that works on this machine's devices: "
        "each candidate is run for real and its sums checked.",
        epilog=f"backends, in auto order:\n{backends}\n\n"
        "subcommands:\n  records            list (--forget: forget) the stall, crash and "
        f"wrong-numbers records in the cache directory ({ENV_CACHE_DIR}), one-machine and "
        "multi-worker alike\n"
        "  run -- COMMAND     run a training, relaunching it on the next backend when an "
        "all-reduce stalls, crashes or returns wrong numbers (POSIX)\n\n"
        "environment:\n"
        f"  {ENV_BACKEND:<28} same values as --backend\n"
        f"  {ENV_TIMEOUT:<28} seconds per smoke check (default {DEFAULT_TIMEOUT:g})\n"
        f"  {ENV_PAYLOAD:<28} MiB auto times each candidate on (default "
        f"{DEFAULT_PAYLOAD_MB:g})\n"
        f"  {ENV_CACHE:<28} on/off: cached verdicts, timings and records\n"
        f"  {ENV_CACHE_DIR:<28} where they are kept\n"
        f"  {ENV_NCCL_REMEDIES:<28} on/off: NCCL's fixes tried when NCCL fails\n"
        f"  {ENV_STALL_TIMEOUT:<28} seconds one TensorFlow call may run in training "
        f"(default {DEFAULT_STALL_TIMEOUT:g}; off)\n"
        f"  {ENV_STALL_ACTION:<28} warn (default) or exit (code 75) on a stall or wrong "
        "numbers\n"
        f"  {ENV_VERIFY_EVERY:<28} check the all-reduce in training every N steps (default "
        f"{DEFAULT_VERIFY_EVERY}; off)\n"
        f"  {ENV_COMMUNICATION:<28} multi-worker: auto, nccl, ring or a list\n"
        f"  {ENV_PORT_BASE:<28} Slurm: the first port of each host's tasks (default: from\n"
        f"  {'':<28} the job and step ids, see docs/multiworker.md)\n\n"
        "with TF_CONFIG set, or as a task of a Slurm step of several (srun -n2), this is the\n"
        "multi-worker view: run it on every worker",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON only")
    parser.add_argument(
        "--backend", metavar="NAME", help="auto, one backend, or a comma-separated list"
    )
    parser.add_argument(
        "--devices",
        nargs="+",
        metavar="D",
        help="devices to check (default: what MirroredStrategy() picks here: every GPU, else CPU)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help=f"seconds per smoke check (default {DEFAULT_TIMEOUT:g}, or {ENV_TIMEOUT})",
    )
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument(
        "--refresh",
        action="store_true",
        help="check again and rewrite: ignore cached NCCL verdicts and auto's timings (every "
        "candidate is timed again), and forget the stall and crash records of these devices",
    )
    cache.add_argument(
        "--no-cache", action="store_true", help="neither read nor write cached NCCL verdicts"
    )
    parser.add_argument(
        "--benchmark",
        action="store_true",
        help="then time every backend that passed: all-reduce time and bus bandwidth "
        "from 4 KiB to 64 MiB, as nccl-tests prints them",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help=f"--benchmark, and draw bus bandwidth by size to FILE.png "
        f"(needs matplotlib: {_benchmark.PLOT_INSTALL})",
    )
    return parser


@contextlib.contextmanager
def _elapsed(
    show: bool = True, armed: Optional[threading.Event] = None
) -> Iterator["threading.Event"]:
    """While the block runs, print the elapsed time after every :data:`PROGRESS_EVERY`
    seconds without other output (``show``: else print nothing), from when ``armed`` is
    set (None: at once; so nothing is printed before a usage error). Set the yielded event
    whenever something is printed."""
    printed, done = threading.Event(), threading.Event()
    if not show:
        yield printed
        return
    started = time.monotonic()

    def tick() -> None:
        while not done.wait(PROGRESS_EVERY):
            if printed.is_set() or (armed is not None and not armed.is_set()):
                printed.clear()
            else:
                print(f"  ... {time.monotonic() - started:.0f} s elapsed", flush=True)

    thread = threading.Thread(target=tick, name="safestrategy-progress", daemon=True)
    thread.start()
    try:
        yield printed
    finally:
        done.set()
        thread.join()


def _benchmark_and_plot(tf: Any, report: Report, args: argparse.Namespace) -> int:
    """Time every backend that passed over the sizes, print the tables (a line for a backend
    that could not be measured), draw the plot; the exit status (1: no plot drawn)."""
    replicas = len(report.devices)
    if not any(candidate.status == OK for candidate in report.candidates):
        print(f"\nnothing to benchmark: {report.reason}")
        return 0
    print(
        f"\n# all-reduce (sum, float32) on {replicas} devices: {', '.join(report.devices)}"
        f"\n# median of {_benchmark.RUNS} runs after a warm-up; busbw = algbw * 2(n-1)/n",
        flush=True,
    )
    with _elapsed() as printed:

        def before(name: str) -> None:
            print(f"# timing {name} ...", flush=True)
            printed.set()

        sweeps = []
        for sweep in _benchmark.measure(tf, report, resolve_timeout(args.timeout), before):
            if sweep.failed is None:
                print(_benchmark.table(sweep, replicas), flush=True)
                sweeps.append(sweep)
            else:
                print(f"# {sweep.backend}: not measured: {sweep.failed}", flush=True)
    if not args.plot:
        return 0
    try:
        if not sweeps:
            raise RuntimeError("no backend was measured")
        _benchmark.plot(sweeps, report, args.plot)
    except Exception as error:  # matplotlib's errors, OSError: a line, not a traceback
        kind, message = first_line(error)
        print(f"safestrategy: could not draw the plot: {kind}: {message}", file=sys.stderr)
        return 1
    print(f"# plot written to {args.plot}")
    return 0


def _cannot_write(path: str) -> Optional[str]:
    """Why ``path`` cannot be written (``--plot``), or None when it can: an existing file
    must be writable, a new one's directory must exist and be writable."""
    if os.path.isdir(path):
        return "it is a directory"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else "the file is not writable"
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        return f"no directory {directory}"
    return None if os.access(directory, os.W_OK) else f"the directory {directory} is not writable"


#: What the report of one device says next: nothing was checked, and how to see checks.
ONE_DEVICE_NEXT = (
    "nothing was checked: one device has nothing to all-reduce. To watch the checks run "
    "here, split the CPU into two logical devices: python -m safestrategy --devices /cpu:0 "
    "/cpu:1"
)


def _split_cpu(devices: Optional[Sequence[Device]]) -> None:
    """TF2: split this process's CPU into as many logical devices as ``devices`` name.

    This process is the CLI's own, so it can do what a training script does to
    mirror over CPUs (the library never changes its caller's device set-up).
    """
    cpus = cpu_count(devices or ())
    if cpus > 1 and (_tf.tf_version() or "").startswith("2."):
        with contextlib.suppress(RuntimeError):  # already started: the devices are what they are
            _tf.configure_logical_cpus(_tf.import_tf(), cpus)


def _where_from() -> str:
    """Why the cache directory is the one it is, as ``records`` says it."""
    if os.environ.get(ENV_CACHE_DIR, "").strip():
        return f"from {ENV_CACHE_DIR}"
    return f"the user cache directory; {ENV_CACHE_DIR} names another"


def _records(argv: List[str]) -> int:
    """``python -m safestrategy records [--forget] [--backend NAME]``: every record in the
    one cache directory this process reads (one-machine and multi-worker), listed or
    forgotten, and which directory that is; nothing is checked."""
    names = sorted(set(BACKEND_NAMES) | set(COMMUNICATION_NAMES))
    parser = argparse.ArgumentParser(
        prog="safestrategy records",
        description="List the stall and crash records in one cache directory (one-machine "
        "and multi-worker alike, TF_CONFIG set or not), or forget them. The directory is "
        f"{ENV_CACHE_DIR} if set, else the user cache directory; here: {cache_dir()}. A training "
        f"run with another {ENV_CACHE_DIR} keeps its records there: give the same "
        f"{ENV_CACHE_DIR} to list them.",
    )
    parser.add_argument("--forget", action="store_true", help="forget them")
    parser.add_argument("--backend", choices=names, metavar="NAME", help="only this backend's")
    args = parser.parse_args(argv)
    try:
        cache = resolve_switch(ENV_CACHE)
    except ValueError as error:
        print(f"safestrategy: error: {error}", file=sys.stderr)
        return 2
    if not cache:
        print(f"{ENV_CACHE}=off: nothing is recorded or read")
        return 0
    where = cache_dir()
    read = f"the cache directory {where} ({_where_from()})"
    if args.forget:
        gone = records.forget(where, args.backend)
        print(f"forgot {gone} record{'' if gone == 1 else 's'} in {read}")
        return 0
    found = [r for r in records.every(where) if args.backend in (None, r[2].backend)]
    print(f"{len(found)} record{'' if len(found) == 1 else 's'} in {read}")
    machine = _machine.identity() if any(kind == records.KIND for kind, _, _ in found) else {}
    tf_version = _tf.tf_version()
    for kind, key, stall in found:
        if kind == records.MULTIWORKER_KIND:
            place = f"multi-worker, {key.get('task')} of {', '.join(key.get('cluster') or ())}"
        else:
            place = f"one machine, {', '.join(key.get('devices') or ())}"
        print(f"{stall.line()}  [{place}; TF {key.get('tf')}]")
        unread = records.unread_here(key, machine, tf_version)
        if unread:
            print(f"    not read by any decision here ({unread}): `records --forget` forgets it")
    return 0


def _a_cluster(environ: Mapping[str, str]) -> bool:
    """Whether this process is one worker of several: TF_CONFIG (TensorFlow's own variable)
    is set, or it is a task of a Slurm job step of several."""
    from .multiworker import slurm  # pure: no TensorFlow

    return bool(environ.get(ENV_TF_CONFIG, "").strip()) or slurm.step_tasks(environ) > 1


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["records"]:
        return _records(argv[1:])
    if argv[:1] == ["run"]:  # here: the supervisor needs none of the checks' machinery
        from . import run

        return run.main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    benchmark = args.benchmark or bool(args.plot)
    if benchmark and args.json:
        parser.error("--json prints the report only: leave out --benchmark and --plot")
    if args.plot and not _benchmark.can_plot():
        print(
            f"safestrategy: error: --plot needs matplotlib: {_benchmark.PLOT_INSTALL}",
            file=sys.stderr,
        )
        return 2
    unwritable = _cannot_write(args.plot) if args.plot else None
    if unwritable is not None:
        print(
            f"safestrategy: error: --plot cannot write {args.plot}: {unwritable}", file=sys.stderr
        )
        return 2
    if _a_cluster(os.environ):  # the multi-worker wing (sockets and all) only when asked
        from .multiworker import cli as multiworker_cli

        return multiworker_cli.main(args)

    armed = threading.Event()

    def starting() -> None:  # every input is valid: nothing printed before a usage error
        print("checking all-reduce backends...", flush=True)
        armed.set()

    try:
        _split_cpu(parse_devices(args.devices) if args.devices else None)
        with _elapsed(show=not args.json, armed=armed) as printed:

            def progress(result: CandidateResult) -> None:
                print(result.line(), flush=True)
                printed.set()

            report = decide(
                args.devices,
                backend=args.backend,
                timeout=args.timeout,
                cache=False if args.no_cache else None,
                refresh=args.refresh,
                on_result=None if args.json else progress,
                on_start=None if args.json else starting,
            )[0]
        status = 0
    except ValueError as error:
        print(f"safestrategy: error: {error}", file=sys.stderr)
        return 2
    except NoWorkingBackendError as error:
        report, status = error.report, 1
        if not args.json:
            print(f"safestrategy: {error}", file=sys.stderr)
    except (ImportError, RuntimeError) as error:
        print(f"safestrategy: {error}", file=sys.stderr)
        return 1
    print(report.to_json() if args.json else f"\n{report}")
    if not args.json and len(report.devices) == 1:
        print(f"\n{ONE_DEVICE_NEXT}")
    if benchmark and status == 0:
        status = _benchmark_and_plot(_tf.import_tf(), report, args)
    return status
