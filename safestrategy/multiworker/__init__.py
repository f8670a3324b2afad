"""Multi-worker training: ``make_multiworker_strategy()`` and what it is made of.

``factory`` builds TensorFlow's ``MultiWorkerMirroredStrategy`` with the
communication every worker agreed on; ``agree`` holds the pure rules of that
agreement; ``rendezvous`` is how the workers meet and exchange facts and
verdicts; ``cluster`` finds the workers (a resolver, ``TF_CONFIG``, a Slurm step, which
``slurm`` reads); ``cli`` is the multi-worker view of ``python -m safestrategy``.
"""

from .factory import make_multiworker_strategy
from .rendezvous import MissingWorkersError

__all__ = ["MissingWorkersError", "make_multiworker_strategy"]
