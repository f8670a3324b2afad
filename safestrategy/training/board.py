"""Where the workers tell each other where they are: TensorFlow's own coordination service.

Each worker publishes its :class:`~safestrategy.training.peers.Beat` to the
coordination service's key-value store, which ``MultiWorkerMirroredStrategy``
starts and which answers while this worker's own threads are blocked in an
all-reduce (TF 2.21: a peer's fresh heartbeat read in < 0.01 s). Nothing after
the build uses a channel of safestrategy's own. Every call is bounded
(:data:`BOUND` s, on a thread of its own), and an absent or failing service
never blocks the watchdog: the verdict then says the peers could not be seen.
"""

import contextlib
import hashlib
import queue
import re
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .peers import GONE, STOPPED, Beat, Heard, Verdict, named, verdict

#: Keys live under one prefix per cluster: ``safestrategy/peers/<cluster id>/<task>``.
PREFIX = "safestrategy/peers"
#: Seconds any one call to the coordination service may take.
BOUND = 1.0
#: Milliseconds a read waits for a key no worker has written (a peer without safestrategy).
ABSENT_MS = 100


def cluster_id(addresses: Sequence[str]) -> str:
    """One short name per cluster (every worker's address, in order): keys of another
    training on the same service never mix with these."""
    return hashlib.sha256("\n".join(addresses).encode()).hexdigest()[:16]


class _Bounded:
    """Calls run one at a time on a thread of their own; a caller waits at most ``bound``
    s, and while one call is still stuck (a frozen leader) every later one fails at once:
    the watchdog is never held, and no thread is started per call."""

    def __init__(self, bound: float = BOUND):
        self.bound = bound
        self.calls: Any = queue.Queue()
        self.busy = threading.Lock()
        threading.Thread(target=self._serve, name="safestrategy-peers", daemon=True).start()

    def _serve(self) -> None:
        while True:
            function, args, answer, done = self.calls.get()
            try:
                answer.append((True, function(*args)))
            except Exception as error:  # the service's errors are answers, not crashes
                answer.append((False, error))
            finally:
                self.busy.release()
                done.set()

    def __call__(self, function: Callable[..., Any], *args: Any) -> Tuple[bool, Any]:
        if not self.busy.acquire(blocking=False):
            return False, TimeoutError("a call to the coordination service is still stuck")
        answer: List[Tuple[bool, Any]] = []
        done = threading.Event()
        self.calls.put((function, args, answer, done))
        if not done.wait(self.bound):
            return False, TimeoutError(f"no answer within {self.bound:g} s")
        return answer[0]


class Board:
    """This worker's side of the key-value store: publish its beat, read every worker's.
    ``kv``: TensorFlow's ``set_config_key_value``, ``get_config_key_value(key,
    timeout_in_ms)``, ``delete_config_key_value`` and, where there is one,
    ``check_collective_ops_peer_health(task, timeout_in_ms)`` (or stand-ins in tests)."""

    def __init__(
        self,
        kv: Sequence[Optional[Callable[..., Any]]],
        cluster: Sequence[str],
        tasks: Sequence[str],
        me: str,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.put, self.get, self.delete = kv[:3]
        self.probe = kv[3] if len(kv) > 3 else None  # check_collective_ops_peer_health
        self.cluster = list(cluster)  #: every worker's address, in order
        self.prefix = f"{PREFIX}/{cluster_id(cluster)}"
        self.tasks, self.me, self.clock = list(tasks), me, clock
        self.host = socket.gethostname()
        self.call = _Bounded()
        self.last: Dict[str, Tuple[Beat, float]] = {}  # task -> (beat, when its counter changed)
        self.seen = True  #: whether the service answered the latest look
        self.answered = False  #: whether it ever answered
        self.said: Optional[Verdict] = None  #: the verdict this worker said (it ends on it)

    def _key(self, task: str) -> str:
        return f"{self.prefix}/{task}"

    def publish(
        self, sample: int, where: str, seconds: float, at: str, said: Optional[Verdict] = None
    ) -> Beat:
        """Say where this worker is (a key can only be inserted once: delete, then set), and
        with ``said`` the verdict it drew as it ends; every later beat says it again (the
        watchdog goes on sampling while the worker ends)."""
        self.said = said = said or self.said
        line, kind = (said.line, said.kind) if said is not None else ("", "")
        beat = Beat(self.me, self.host, sample, where, round(seconds, 1), at, line, kind)
        key = self._key(self.me)
        with contextlib.suppress(Exception):
            self.call(self.delete, key)
            self.call(self.put, key, beat.to_json())
        self._heard(beat)
        return beat

    def paused(self, seconds: float) -> None:
        """This worker was stopped for ``seconds`` (SIGSTOP, a GIL held): its peers were not
        silent for that long, so each one's last change moves on by as much."""
        if seconds > 0:
            self.last = {
                task: (beat, when + seconds if task != self.me else when)
                for task, (beat, when) in self.last.items()
            }

    def _heard(self, beat: Beat) -> None:
        old = self.last.get(beat.task)
        if old is None or old[0].sample != beat.sample:
            self.last[beat.task] = (beat, self.clock())
        else:
            self.last[beat.task] = (beat, old[1])

    def look(self) -> None:
        """Read every peer's beat (bounded; a peer with no key yet is not an error)."""
        answered = False
        for task in self.tasks:
            if task == self.me:
                continue
            ok, value = self.call(self.get, self._key(task), ABSENT_MS)
            if ok:
                answered = True
                beat = Beat.from_json(value)
                if beat is not None:
                    self._heard(beat)
            elif type(value).__name__ in ("DeadlineExceededError", "NotFoundError"):
                answered = True  # the service answered: that worker has said nothing
        self.seen = answered or len(self.tasks) < 2
        self.answered = self.answered or answered

    def heard(self) -> Dict[str, Heard]:
        """Every worker as last heard, in the cluster's order."""
        now = self.clock()
        found = {}
        for task in self.tasks:
            known = self.last.get(task)
            found[task] = Heard(known[0], now - known[1]) if known else Heard(None, None)
        return found

    def told(self) -> Optional[Verdict]:
        """The verdict a peer drew as it ended (its own stall, or an abort that it saw
        first) and said in its last beat, if any."""
        for task in self.tasks:
            said = self._said_by(task)
            if task != self.me and said is not None:
                return said
        return None

    def _said_by(self, task: str) -> Optional[Verdict]:
        known = self.last.get(task)
        if known is None or not known[0].said:
            return None
        beat = known[0]
        named = re.match(r"(\w+:\d+) ", beat.said)
        return Verdict(beat.kind, named.group(1) if named else None, beat.said)

    def down(self) -> List[str]:
        """The peers TensorFlow's own health probe finds down now (bounded, each)."""
        if self.probe is None:
            return []
        found = []
        for task in self.tasks:
            if task != self.me:
                job, index = task.split(":")
                ok, _ = self.call(self.probe, f"/job:{job}/replica:0/task:{index}", ABSENT_MS * 5)
                if not ok:
                    found.append(task)
        return found

    def read_by_peers(self, bound: float, ended: Sequence[str] = ()) -> bool:
        """Wait, at most ``bound`` s, until every peer but ``ended`` has published twice
        since this worker's last beat: each then looked at least once after it (a peer
        publishes, then looks, at every sample). A worker about to end calls this so that
        the peers its exit ends next (the leader's ends every one: it serves the store)
        have read its verdict. False when some did not (or the service is gone)."""
        self.look()
        since = {
            task: known[0].sample
            for task, known in self.last.items()
            if task != self.me and task not in ended and not known[0].said
        }
        deadline = time.monotonic() + bound  # a real wait, whatever clock tells "ago"
        while self.seen:
            behind = [
                task
                for task, sample in since.items()
                if self.last[task][0].sample < sample + 2 and not self.last[task][0].said
            ]
            if not behind:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
            self.look()
        return False

    def verdict(self, interval: float, hold: float = 0.0) -> Verdict:
        """:func:`verdict` from what this board heard (the leader: the cluster's first); a
        worker gone that said, as it ended, that another was gone first passes it on."""
        leader = self.tasks[0] if self.answered and self.tasks else None
        return self.passed_on(verdict(self.me, self.heard(), interval, self.seen, leader, hold))

    def passed_on(self, found: Verdict) -> Verdict:
        """``found``, or, where it names a worker gone, what that worker said as it ended:
        that its user stopped it, or that another was gone first."""
        heard = self.heard()
        said = self._said_by(found.task) if found.kind == GONE and found.task else None
        if said is not None and said.kind == STOPPED and said.task in (found.task, *heard):
            # its user stopped it (Ctrl-C), or it ended because a peer's user stopped that
            # one (the leader's exit, after a worker's Ctrl-C, ends every other)
            return said
        if said is not None and said.kind == GONE and said.task == self.me:
            # it ended saying this worker was gone: this one was stopped, not it
            line = f"{self.me} stopped answering ({found.task} said so as it ended)"
            return Verdict(GONE, self.me, line)
        if said is not None and said.kind == GONE and said.task in heard:
            # it ended because it saw that one gone first (the leader's exit ends them all)
            line = f"{named(heard[said.task], said.task)} ({found.task} saw it first)"
            return Verdict(GONE, said.task, line)
        return found
