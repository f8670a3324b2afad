"""safestrategy: a MirroredStrategy that starts on every machine.

``make_mirrored_strategy()`` replaces ``tf.distribute.MirroredStrategy()`` and
picks the cross-device all-reduce (NCCL, hierarchical copy, or reduction to one
GPU or the CPU) from one it actually ran and checked on your devices;
``make_multiworker_strategy()`` does the same for TensorFlow's
``MultiWorkerMirroredStrategy`` (NCCL or RING, agreed by every worker).
Importing this package imports no TensorFlow and touches no device.
"""

from .backends import BACKEND_NAMES
from .factory import NoWorkingBackendError, last_report, make_mirrored_strategy, probe
from .multiworker import make_multiworker_strategy
from .report import CandidateResult, Report

__version__ = "0.1.0"

__all__ = [
    "BACKEND_NAMES",
    "CandidateResult",
    "NoWorkingBackendError",
    "Report",
    "__version__",
    "last_report",
    "make_mirrored_strategy",
    "make_multiworker_strategy",
    "probe",
]
