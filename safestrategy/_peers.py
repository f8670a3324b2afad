"""Which worker holds the others back: where each worker is, shared over TensorFlow's own
coordination service, and the one verdict every worker draws from it.

When one worker of a ``MultiWorkerMirroredStrategy`` stops, the others wait for it
in the same all-reduce, and each one's own stack says only that. So at each
sample the watchdog publishes this worker's whereabouts (:class:`Beat`: a
counter, where its threads are, for how long, at which line of the user's code)
to the coordination service's key-value store, which MWMS starts and which
answers while this worker's own threads are blocked in an all-reduce (TF 2.21: a
peer's fresh heartbeat read in < 0.01 s). Nothing after the build uses a channel
of safestrategy's own.

- :func:`whereabouts`: where this worker is, from the watchdog's sample (pure).
- :func:`verdict`: the one verdict, from what every worker said and when each was
  last heard on this worker's own clock (pure): every worker inside the same step
  (the communication is stuck), worker k outside it (it holds the others back), or
  worker k unheard for more than two samples (it stopped answering).
- :class:`Board`: the key-value side. Every call is bounded (:data:`BOUND` s, on a
  thread of its own), and an absent or failing service never blocks the watchdog:
  the verdict then says the peers could not be seen.
"""

import contextlib
import fnmatch
import hashlib
import json
import os
import queue
import re
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

#: Keys live under one prefix per cluster: ``safestrategy/peers/<cluster id>/<task>``.
PREFIX = "safestrategy/peers"
#: Seconds any one call to the coordination service may take.
BOUND = 1.0
#: Milliseconds a read waits for a key no worker has written (a peer without safestrategy).
ABSENT_MS = 100

#: Multi-worker: the collectives were aborted because a peer is gone: TF's health check
#: ("is down"), the coordination service (a peer "stopped sending heartbeats"), or the
#: transport to a peer that died ("Socket closed" from a remote target, the coordination
#: service's leader among them).
PEER_GONE = (
    "is down",
    "check alive failed",
    "heartbeat",
    "coordination service",
    "Socket closed",
    "Connection reset by peer",
    "failed to connect to all addresses",
)

STEP = "step"  #: inside a step or ``strategy.run`` (where the all-reduce waits)
PY_FUNCTION = "py_function"  #: running the user's Python inside a ``py_function``
INPUT = "input"  #: in an iterator's ``get_next`` outside a step
CHECKPOINT = "checkpoint"  #: saving a checkpoint
OUTSIDE = "outside"  #: in no TensorFlow call: the user's Python between steps

WHERE = {
    STEP: "inside a step",
    PY_FUNCTION: "running your Python in a py_function",
    INPUT: "waiting for input data",
    CHECKPOINT: "saving a checkpoint",
    OUTSIDE: "outside any TensorFlow call",
}
#: Where a worker does not take part in the all-reduce its peers wait in.
AWAY = (INPUT, CHECKPOINT, OUTSIDE)

#: Frames that say what a thread is doing, by file (under ``tensorflow/python/``, or
#: ``tensorflow_core/python/`` on TF 1.15) and function (None: any).
_SIGNS: Tuple[Tuple[str, Optional[Tuple[str, ...]], str], ...] = (
    # a Dataset.from_generator's generator runs in a py_function: that is input, not a step
    ("data/ops/from_generator_op.py", None, INPUT),
    ("ops/script_ops.py", ("__call__",), PY_FUNCTION),
    (
        "checkpoint/*.py",
        ("save", "write", "_write", "_save_cached_when_graph_building"),
        CHECKPOINT,
    ),
    ("training/saver.py", ("save",), CHECKPOINT),
    ("training/tracking/util.py", ("save", "write"), CHECKPOINT),
)
_PATTERNS = tuple(
    (f"*/{root}/python/{path}", names, sign)
    for root in ("tensorflow", "tensorflow_core")
    for path, names, sign in _SIGNS
)
#: Keras's own saving (``model.save``, ``save_weights``, ``ModelCheckpoint``).
_KERAS_SAVING = ("*/keras/*saving*/*.py", "*/tf_keras/*saving*/*.py")


class Beat(NamedTuple):
    """What one worker says of itself at one sample."""

    task: str  #: "worker:1"
    host: str
    sample: int  #: the watchdog's counter: a beat that does not change is not heard
    where: str  #: one of :data:`WHERE`
    seconds: float  #: for how long it has been there, on its own clock (time stopped left out)
    at: str = ""  #: the user's line it is at ("train.py:40"), where known
    #: the verdict this worker drew when its own stall fired (its last beat): peers whose
    #: collectives TensorFlow aborts as it ends take the same one
    said: str = ""
    kind: str = ""  #: that verdict's kind

    def to_json(self) -> str:
        return json.dumps(self._asdict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Optional["Beat"]:
        try:
            data = json.loads(text)
            return cls(**{name: data[name] for name in cls._fields if name in data})
        except (ValueError, TypeError, KeyError):
            return None


class Heard(NamedTuple):
    """A worker as this one last heard it: its beat, and how long ago on this worker's clock
    its counter last changed (None: never heard)."""

    beat: Optional[Beat]
    ago: Optional[float]


class Verdict(NamedTuple):
    """What holds the workers back, the same on every worker."""

    kind: str  #: "stuck", "held", "gone" or "unseen"
    task: Optional[str]  #: the worker it names ("held", "gone")
    line: str  #: the sentence every worker says


STUCK, HELD, GONE, UNSEEN = "stuck", "held", "gone", "unseen"


def _sign(filename: str, name: str) -> Optional[str]:
    filename = filename.replace(os.sep, "/")
    for pattern, names, sign in _PATTERNS:
        if (names is None or name in names) and fnmatch.fnmatchcase(filename, pattern):
            return sign
    if name in ("save", "save_weights", "save_model") and any(
        fnmatch.fnmatchcase(filename, pattern) for pattern in _KERAS_SAVING
    ):
        return CHECKPOINT
    return None


def _stack(frame: Any) -> List[Any]:
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames  # innermost first


def _line(frames: Sequence[Any], is_library: Callable[[str], bool]) -> str:
    """The innermost frame of the user's code, as ``file.py:line``."""
    for frame in frames:
        if not is_library(frame.f_code.co_filename):
            return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    return ""


class Where(NamedTuple):
    """Where this worker is (one of :data:`WHERE`), at which user line, and the frame
    that marks the one call it is in: the same object on the next sample is the same call
    still running (None outside any call)."""

    where: str
    at: str
    call: Any = None


def whereabouts(
    frames: Mapping[int, Any],
    calls: Mapping[int, Tuple[Any, str]],
    main: Optional[int],
    is_library: Callable[[str], bool],
) -> Where:
    """Where this worker is: ``frames`` every thread's innermost frame, ``calls`` the
    outermost TF call each thread is in and its kind (the watchdog's sample: ``step``/
    ``op``/``session``/``input``), ``main`` the main thread. A py_function's or a
    checkpoint's or an input generator's thread speaks first (it is what the step waits
    on), then a step, then input; with no thread in a TF call, the main thread's line."""
    found: Dict[str, Tuple[str, Any]] = {}
    for frame in frames.values():
        stack = _stack(frame)
        for candidate in stack:
            sign = _sign(candidate.f_code.co_filename, candidate.f_code.co_name)
            if sign is not None:
                found.setdefault(sign, (_line(stack, is_library), candidate))
                break
    for sign in (PY_FUNCTION, CHECKPOINT, INPUT):
        if sign in found:
            return Where(sign, *found[sign])
    # a step first (an op and session.run are steps too), then input; the lowest thread
    in_calls = sorted((kind == "input", thread) for thread, (_, kind) in calls.items())
    for is_input, thread in in_calls:
        if thread in frames:
            line = _line(_stack(frames[thread]), is_library)
            return Where(INPUT if is_input else STEP, line, calls[thread][0])
    return Where(OUTSIDE, _line(_stack(frames[main]), is_library) if main in frames else "")


def _name(heard: Heard, task: str) -> str:
    beat = heard.beat
    if beat is None:
        return f"{task} was never heard from (no safestrategy factory, or its watchdog off)"
    return f"{task} stopped answering {heard.ago:.0f} s ago"


def verdict(
    me: str,
    heard: Mapping[str, Heard],
    interval: float,
    seen: bool = True,
    leader: Optional[str] = None,
    hold: float = 0.0,
) -> Verdict:
    """The verdict from every worker's last beat (``heard``, by task, this worker's
    included), judged alike on every worker. ``interval``: seconds between samples; a
    worker not heard for more than two of them has stopped answering. ``seen``: whether
    the coordination service answered this worker's latest look; ``leader``: the worker
    that serves it, once it has answered (a service that answered and then stopped is its
    leader gone: killed, frozen, its host lost). ``hold``: how long a worker must have been
    away to hold the others back (one that left its step a moment ago is between steps)."""
    late = 2 * interval + 1.0
    if not seen and leader is not None and leader != me:
        one = heard.get(leader, Heard(None, None))
        if one.beat is None or one.ago is None or one.ago > late:
            ago = f" {one.ago:.0f} s ago" if one.ago is not None else ""
            line = f"{leader} stopped answering{ago} (it serves TensorFlow's coordination service)"
            return Verdict(GONE, leader, line)
        seen = True  # it went a moment ago (it may have just ended on its own stall): the
        # beats heard until then still say what held the workers
    if not seen:
        return Verdict(UNSEEN, None, "the other workers could not be seen (TensorFlow's "
                       "coordination service did not answer)")  # fmt: skip
    for task, one in heard.items():
        if task != me and (one.beat is None or (one.ago is not None and one.ago > late)):
            return Verdict(GONE, task, _name(one, task))
    beats = {task: one.beat for task, one in heard.items() if one.beat is not None}
    waiting = [task for task, beat in beats.items() if beat.where in (STEP, PY_FUNCTION)]
    away = [task for task, b in beats.items() if b.where in AWAY and b.seconds >= hold]
    python = [task for task, b in beats.items() if b.where == PY_FUNCTION and b.seconds >= hold]
    stepping = [task for task, beat in beats.items() if beat.where == STEP]
    if not stepping:  # all in a py_function: the step every worker is inside is stuck
        python = []
    if waiting and not away and not (python and stepping):
        return Verdict(STUCK, None, "every worker is inside the same step: the communication "
                       "(or a device) is stuck")  # fmt: skip
    culprits = away or (python if stepping else [])
    if not culprits:  # no one in the all-reduce, and no one away for long: between steps
        return Verdict(UNSEEN, None, "the workers' beats do not show what holds them")
    task = culprits[0]
    beat = beats[task]
    at = f" ({beat.at})" if beat.at else ""
    what = f"{WHERE[beat.where]} for {beat.seconds:.0f} s{at}"
    if not waiting:
        return Verdict(HELD, task, f"no worker is in the all-reduce: {task} is {what}")
    return Verdict(HELD, task, f"{task} holds the others back: {what}")


def table(me: str, heard: Mapping[str, Heard]) -> str:
    """Every worker: task, host, where, since, last heard."""
    rows = [("task", "host", "where", "since", "last heard")]
    for task, one in heard.items():
        beat = one.beat
        if beat is None:
            rows.append((task, "?", "never heard", "", ""))
            continue
        where = WHERE[beat.where] + (f" ({beat.at})" if beat.at else "")
        last = "this worker" if task == me else f"{one.ago:.0f} s ago"
        rows.append((task, beat.host, where, f"{beat.seconds:.0f} s", last))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "\n".join(
        "  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
        for row in rows
    )


#: Where TensorFlow's error names the worker that is gone: its coordination service's list
#: of unhealthy tasks, the remote target a transport error came from, a task "is down".
_GONE_TASK = re.compile(
    r"(?:unhealthy[^\n]*\n\s*|remote target |task )/job:(\w+)(?:/replica:\d+)?/task:(\d+)"
)


def gone_in(error: str, me: str) -> Optional[str]:
    """The worker an abort's text says is gone (``"worker:1"``; never ``me``), if it
    says one and it is an abort for a peer gone (:data:`PEER_GONE`)."""
    if not any(word in error for word in PEER_GONE):
        return None
    for job, index in _GONE_TASK.findall(error):
        task = f"{job}:{index}"
        if task != me:
            return task
    return None


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
        heard = self.heard()
        found = verdict(self.me, heard, interval, self.seen, leader, hold)
        said = self._said_by(found.task) if found.kind == GONE and found.task else None
        if said is not None and said.kind == GONE and said.task in heard and said.task != self.me:
            # it ended because it saw that one gone first (the leader's exit ends them all)
            line = f"{_name(heard[said.task], said.task)} ({found.task} saw it first)"
            return Verdict(GONE, said.task, line)
        return found
