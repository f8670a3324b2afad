"""Multi-worker canary rounds: when a worker's stall fires, every worker runs one known-sum
all-reduce, and says where it was as it joined.

A canary through the strategy would take the step's collective keys while the
workers are out of step, and cross-wire with it (shared/notes/canary.md). So a
round is an eager raw ``CollectiveReduceV2`` on a group key of safestrategy's own
(the same on every worker, from the cluster), its instance key the round's
number, agreed over TensorFlow's coordination service:

- ``safestrategy/canary/<cluster>/round/<n>``: round *n* is asked for (a key is
  inserted once: two workers asking at once share the round);
- ``.../<n>/<task>/joined``: where that worker was as it joined
  (:class:`~safestrategy.training.peers.Join`); ``.../<n>/<task>/answer``: the same,
  with what its all-reduce showed.

Each worker listens for rounds on a thread of its own from the strategy's build
on and joins each exactly once, in order; a round that timed out is never
reused. A worker that does not join within :attr:`Rounds.join_bound` is frozen or
gone. The verdict is drawn from the round alone
(:func:`~safestrategy.training.peers.judged`), so every worker draws the same one.
"""

import contextlib
import threading
import time
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

from ..checks.allreduce import Abandoned, first_line, in_fresh_thread, wrong_sums
from .board import BOUND, cluster_id
from .canary import ANSWERED, FAILED, HUNG, WRONG, bound, raw_allreduce
from .peers import Join
from .sampler import interval

PREFIX = "safestrategy/canary"
#: Milliseconds one listening read waits for the next round before it reads again.
LISTEN_MS = 1000
#: The canary's collective group keys: far above the strategy's own (they count from 1).
GROUP_BASE = 1 << 30
#: What a worker says of itself as it joins: (where, at, seconds, inside).
Here = Tuple[str, str, float, bool]


class Round(NamedTuple):
    """One round as this worker gathered it: every worker that joined (with its answer
    where it came in time), and how long joining was waited for (s)."""

    number: int
    joins: Dict[str, Join]
    waited: float


class Rounds:
    """This worker's side of the canary rounds. ``kv``: the coordination service's
    ``set_config_key_value`` and ``get_config_key_value(key, timeout_in_ms)`` (stand-ins in
    tests); ``devices``: this worker's devices in the strategy (full names); ``hint``: the
    communication (``ring``, ``nccl``); ``here``: where this worker is, read as it joins;
    ``timeout``: the stall timeout (the bounds follow from it); ``collective``: the
    all-reduce of round ``n`` (default: :func:`~safestrategy.training.canary.raw_allreduce`
    on ``devices``)."""

    def __init__(
        self,
        kv: Sequence[Callable[..., Any]],
        cluster: Sequence[str],
        tasks: Sequence[str],
        me: str,
        devices: Sequence[str],
        hint: str,
        here: Callable[[], Here],
        timeout: float,
        collective: Optional[Callable[[int], Any]] = None,
    ):
        self.put, self.get = kv[0], kv[1]
        name = cluster_id(cluster)
        self.prefix = f"{PREFIX}/{name}"
        self.group = GROUP_BASE + int(name[:6], 16)
        self.tasks, self.me, self.devices, self.hint = list(tasks), me, list(devices), hint
        self.here = here
        self.set_timeout(timeout)
        self.collective = collective or self._allreduce
        self.lock = threading.Lock()
        self.latest: Tuple[int, float] = (0, float("-inf"))  # the last round heard, and when
        threading.Thread(target=self._listen, name="safestrategy-rounds", daemon=True).start()

    def set_timeout(self, timeout: float) -> None:
        """The stall timeout in force: the canary's bound and the join bound follow (at
        least 2 samples + 2 x the key-value bound + 2 s)."""
        self.bound = bound(timeout)
        self.join_bound = 2 * interval(timeout) + 2 * BOUND + 2.0

    def _key(self, number: int, task: str, what: str) -> str:
        return f"{self.prefix}/{number}/{task}/{what}"

    def _listen(self) -> None:
        """Join every round, in order, each once (a daemon thread, from the build on)."""
        number = 1
        while True:
            try:
                self.get(f"{self.prefix}/round/{number}", LISTEN_MS)
            except Exception as error:  # not asked for yet, or the service is away
                if type(error).__name__ != "DeadlineExceededError":
                    time.sleep(1.0)
                continue
            with self.lock:
                self.latest = (number, time.monotonic())
            with contextlib.suppress(Exception):  # a round is evidence, never a crash
                self._join(number)
            number += 1

    def _join(self, number: int) -> None:
        where, at, seconds, inside = self.here()
        join = Join(self.me, where, at, round(seconds, 1), inside)
        self.put(self._key(number, self.me, "joined"), join.to_json())
        started = time.monotonic()
        try:
            values = in_fresh_thread(lambda: self.collective(number), self.bound)
            wrong = wrong_sums(values, len(self.devices) * len(self.tasks), len(self.devices))
            join = join._replace(kind=WRONG if wrong else ANSWERED, detail=wrong or "")
        except Abandoned:
            join = join._replace(kind=HUNG)
        except Exception as error:  # the all-reduce's error is its failure
            join = join._replace(kind=FAILED, detail=": ".join(first_line(error)))
        join = join._replace(took=round(time.monotonic() - started, 4))
        self.put(self._key(number, self.me, "answer"), join.to_json())

    def _allreduce(self, number: int) -> Any:
        import tensorflow as tf

        first = self.tasks.index(self.me) * len(self.devices)
        size = len(self.devices) * len(self.tasks)
        return raw_allreduce(tf, self.devices, first, size, self.group, number, self.hint)

    def ask(
        self, fresh: float, silent: Callable[[str], bool] = lambda task: False
    ) -> Optional[Round]:
        """The round a stall here is judged by: the latest one, if it was asked for less
        than ``fresh`` s ago (a peer's stall fired at about the same moment), else a new
        one; gathered within the join bound and the canary's. ``silent(task)``: that
        worker's beats stopped (it stopped answering), so it is not waited for to join.
        None: no round could be asked for (the service does not answer)."""
        with self.lock:
            number, when = self.latest
        if time.monotonic() - when > fresh:
            number += 1
            try:
                self.put(f"{self.prefix}/round/{number}", self.me)
            except Exception as error:
                if type(error).__name__ != "AlreadyExistsError":
                    return None  # a peer asked for it first otherwise: the same round
        return self._gather(number, silent)

    def _gather(self, number: int, silent: Callable[[str], bool]) -> Round:
        started = time.monotonic()
        joins: Dict[str, Join] = {}
        for task in self.tasks:
            key, stop = self._key(number, task, "joined"), lambda task=task: silent(task)
            found = self._read(key, started + self.join_bound, stop)
            if found is not None:
                joins[task] = found
        waited = time.monotonic() - started
        for task in list(joins):
            key, until = self._key(number, task, "answer"), started + self.join_bound + self.bound
            joins[task] = self._read(key, until, lambda: False) or joins[task]
        return Round(number, joins, waited)

    def _read(self, key: str, deadline: float, stop: Callable[[], bool]) -> Optional[Join]:
        """The join at ``key``, waited for until ``deadline`` (monotonic) or ``stop()``, in
        slices of half a second; None if none came."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or stop():
                return None
            try:
                return Join.from_json(self.get(key, max(1, int(min(left, 0.5) * 1000))))
            except Exception as error:
                if type(error).__name__ != "DeadlineExceededError":
                    time.sleep(min(0.2, max(0.0, left)))
