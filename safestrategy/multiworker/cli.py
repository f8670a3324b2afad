"""``python -m safestrategy`` with TF_CONFIG set, or as a task of a Slurm step of
several (``srun -n2 python -m safestrategy``): the multi-worker view.

It takes part in the workers' agreement like the factory does, building
nothing: run it on every worker (at the same time, on the ports
the training will use, so not while the training runs) and each prints the
choice they all agreed on. Run on one worker alone, it prints this worker's
facts and, after the timeout, which workers did not answer.
"""

import argparse
import sys

from ..report import CandidateResult, NoWorkingBackendError
from . import factory as multiworker
from .rendezvous import MissingWorkersError


def main(args: argparse.Namespace) -> int:
    """The multi-worker view; exit status as for the one-machine view."""
    if args.backend or args.devices:
        print(
            "safestrategy: error: --backend and --devices are for one machine; with TF_CONFIG "
            "set (or in a Slurm step of several tasks) this is the multi-worker view (choose "
            "with SAFESTRATEGY_COMMUNICATION; unset TF_CONFIG, or srun -n1, for the "
            "one-machine view)",
            file=sys.stderr,
        )
        return 2
    try:
        multiworker.require_tf2()
        request = multiworker.request(None, args.timeout)
    except ValueError as error:
        print(f"safestrategy: error: {error}", file=sys.stderr)
        return 2
    except (ImportError, RuntimeError) as error:
        print(f"safestrategy: {error}", file=sys.stderr)
        return 1
    cluster = request.cluster
    if not args.json:
        workers = ", ".join(f"{a.task} ({a})" for a in cluster.workers)
        print(f"multi-worker: {cluster.origin} names {len(cluster.workers)} workers: {workers}")
        print(
            f"this is {cluster.task}; waiting up to {request.timeout:g} s for the others "
            "(run this on every worker)...",
            flush=True,
        )

    def progress(result: CandidateResult) -> None:
        print(result.line(), flush=True)

    try:
        report = multiworker.decide(request, on_result=None if args.json else progress)
        status = 0
    except NoWorkingBackendError as error:
        report, status = error.report, 1
        if not args.json:
            print(f"safestrategy: {error}", file=sys.stderr)
    except ValueError as error:  # the workers disagree on TF_CONFIG or the setting
        print(f"safestrategy: error: {error}", file=sys.stderr)
        return 2
    except (MissingWorkersError, OSError) as error:
        print(f"safestrategy: {error}", file=sys.stderr)
        return 1
    print(report.to_json() if args.json else f"\n{report}")
    return status
