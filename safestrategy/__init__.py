"""safestrategy: a MirroredStrategy that starts on every machine.

``make_mirrored_strategy()`` replaces ``tf.distribute.MirroredStrategy()`` and
picks the cross-device all-reduce (NCCL, hierarchical copy, or reduction to one
GPU or the CPU) from one it actually ran and checked on your devices;
``make_multiworker_strategy()`` does the same for TensorFlow's
``MultiWorkerMirroredStrategy`` (NCCL or RING, agreed by every worker), the workers
from a ``cluster_resolver=``, TF_CONFIG or a Slurm step; ``auto_strategy()`` picks
between them (and ``OneDeviceStrategy``) for wherever the script runs.
Importing this package imports no TensorFlow and touches no device.
"""

import sys
from typing import Any

from .auto import auto_strategy
from .backends import BACKEND_NAMES
from .factory import make_mirrored_strategy, probe
from .mirror import MirrorBrokenError
from .report import CandidateResult, NoWorkingBackendError, Report, last_report

if sys.version_info >= (3, 7):  # noqa: UP036  (3.6 is supported: TF 1.12)

    def __getattr__(name: str) -> Any:
        """The multi-worker factory, loaded on first use (sockets and all: ~20 ms of start-up
        that single-machine training should not pay)."""
        if name == "make_multiworker_strategy":
            from .multiworker import make_multiworker_strategy

            return make_multiworker_strategy
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

else:  # pragma: no cover - Python 3.6 has no module __getattr__
    from .multiworker import make_multiworker_strategy

__version__ = "0.6.0"

__all__ = [
    "BACKEND_NAMES",
    "CandidateResult",
    "MirrorBrokenError",
    "NoWorkingBackendError",
    "Report",
    "__version__",
    "auto_strategy",
    "last_report",
    "make_mirrored_strategy",
    "make_multiworker_strategy",
    "probe",
]
