"""The command line: the probe report for this machine, as text or JSON.

With ``TF_CONFIG`` set it shows the multi-worker view (:mod:`safestrategy._mw_cli`).

Exit status: 0 a working backend was found, 1 none was (or TensorFlow is
missing), 2 bad arguments or bad ``SAFESTRATEGY_*`` values.
"""

import argparse
import contextlib
import os
import sys
from typing import List, Optional, Sequence

from . import _tf
from ._cluster import ENV_TF_CONFIG
from ._devices import Device, parse_devices
from ._env import (
    DEFAULT_TIMEOUT,
    ENV_BACKEND,
    ENV_CACHE,
    ENV_CACHE_DIR,
    ENV_NCCL_REMEDIES,
    ENV_TIMEOUT,
)
from .backends import BACKENDS
from .factory import NoWorkingBackendError, decide
from .report import CandidateResult


def _parser() -> argparse.ArgumentParser:
    backends = "\n".join(f"  {b.name:<18} {b.summary}" for b in BACKENDS)
    parser = argparse.ArgumentParser(
        prog="safestrategy",
        description="Find the cross-device all-reduce that works on this machine's devices: "
        "each candidate is run for real and its sums checked.",
        epilog=f"backends, in auto order:\n{backends}\n\n"
        f"environment: {ENV_BACKEND} (same values as --backend), "
        f"{ENV_TIMEOUT} (seconds, default {DEFAULT_TIMEOUT:g}), "
        f"{ENV_CACHE} (on/off), {ENV_CACHE_DIR}, {ENV_NCCL_REMEDIES} (on/off)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON only")
    parser.add_argument(
        "--backend", metavar="NAME", help="auto, one backend, or a comma-separated list"
    )
    parser.add_argument(
        "--devices", nargs="+", metavar="D", help="devices to check (default: all GPUs, else CPU)"
    )
    parser.add_argument("--timeout", type=float, metavar="S", help="seconds per smoke check")
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument(
        "--refresh", action="store_true", help="ignore cached NCCL verdicts: check again, rewrite"
    )
    cache.add_argument(
        "--no-cache", action="store_true", help="neither read nor write cached NCCL verdicts"
    )
    return parser


def _split_cpu(devices: Optional[Sequence[Device]]) -> None:
    """TF2: split this process's CPU into as many logical devices as ``devices`` name.

    This process is the CLI's own, so it can do what a training script does to
    mirror over CPUs (the library never changes its caller's device set-up).
    """
    cpus = max([d.index + 1 for d in devices or () if d.kind == "CPU"] or [1])
    if cpus > 1 and (_tf.tf_version() or "").startswith("2."):
        with contextlib.suppress(RuntimeError):  # already started: the devices are what they are
            _tf.configure_logical_cpus(_tf.import_tf(), cpus)


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if os.environ.get(ENV_TF_CONFIG, "").strip():  # TensorFlow's own variable: multi-worker
        from . import _mw_cli

        return _mw_cli.main(args)

    def progress(result: CandidateResult) -> None:
        print(result.line(), flush=True)

    def starting() -> None:  # every input is valid: nothing printed before a usage error
        print("checking all-reduce backends...", flush=True)

    try:
        _split_cpu(parse_devices(args.devices) if args.devices else None)
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
    return status
