"""The mirror checked during training (0.7): a strategy's all-reduce is checked in the step.

Every strategy a factory returns (TF 2.4+, eager) carries a check on its own
cross-device ops (:mod:`~safestrategy.mirror.instep`): every
``SAFESTRATEGY_VERIFY_EVERY`` all-reduce batches, the replicas' copies of what
the all-reduce returned are compared bitwise and a linear checksum of its
inputs is held against its output. What a mismatch means is decided purely
(:mod:`~safestrategy.mirror.verdict`); what follows (the ERROR, the record, the
run directory, the exit) is :mod:`~safestrategy.mirror.broken`'s.
"""

from .verdict import MirrorBrokenError

__all__ = ["MirrorBrokenError"]
