"""``python -m safestrategy run``: the supervisor that relaunches a training an all-reduce
stalled or killed (:mod:`~safestrategy.run.cli`); :mod:`~safestrategy.run.judge` is its
pure table, :mod:`~safestrategy.run.supervise` one launch."""

from .cli import main

__all__ = ["main"]
