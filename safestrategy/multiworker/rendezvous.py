"""How the workers agree: a few rounds of messages over plain TCP, no TensorFlow.

Each worker listens on its own TF_CONFIG port (the port TensorFlow's server
takes over afterwards) and, in each round, sends its message to every peer
and waits for the peer's ack. A round is done on a worker when every peer
has acked its message *and* it has received (and acked) every peer's
message; so when a worker is done, every peer already holds its message.
Every worker then computes the next step from the same set of messages, so
all of them take the same decision without a leader.

The listener stays open for all the rounds of one decision and closes at the
end, before the strategy is built. The last thing a worker hears on its port
is a peer's final message, which it has received and acked before closing:
nobody sends to a port that TensorFlow already owns. The other way round, a
worker done with the rounds waits until every peer's listener is closed
(knocking until the port refuses) before it builds, so TensorFlow never
connects to a listener that then resets the connection. The sender closes each
connection first, so no TIME_WAIT is left on the listening port.

Every message carries the decision's ``session`` (the number of the
``make_multiworker_strategy()`` call this is in this process, counting only
calls that met their peers, so the same on every worker) and its round name.
A message from an earlier session is acked and dropped (a peer retrying after
a lost ack); one from a later session is refused, so the sender retries until
this worker gets there. Messages from later rounds of the current session are
kept until needed.

A call that gives up (:class:`MissingWorkersError`) may be retried: each
:class:`Rendezvous` is one *attempt*, and messages carry it. A worker keeps
only the messages of a peer's latest attempt, and a round is complete with a
peer only when the attempt that acked our message is the one we heard from,
so a peer that started again gets our message again and the retry meets the
peers still waiting. A peer that leaves a later round (it gave up, and says
so to its peers before raising, or it started again) ends this attempt at
once with the workers *it* did not hear from: nobody waits on a dead round,
and the worker named is the one that did not answer.

Everything is bounded: a round that has not completed by its deadline
raises :class:`MissingWorkersError` naming the workers not heard from.
"""

import contextlib
import itertools
import json
import os
import socket
import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from .cluster import Address

PROTOCOL = "safestrategy-rendezvous-2"  # 2: messages name their attempt
#: Seconds one connection may take to connect, or to answer once connected.
IO_TIMEOUT = 5.0
#: Longest message read; anything longer is not ours.
MAX_MESSAGE = 1 << 20
#: Seconds a worker that gives up spends telling each peer so (one try).
NOTICE_TIMEOUT = 1.0
#: How a MissingWorkersError says what a round waited, unless the caller says otherwise.
WITHIN = "SAFESTRATEGY_PROBE_TIMEOUT seconds of each other (or raise it)"

#: This process, among the processes a worker's host may run one after another.
_PROCESS = os.urandom(6).hex()
#: Numbers this process's rendezvous attempts, so a peer keeps only the latest one's messages.
_attempts = itertools.count(1)


#: The attempt an ack names when the peer is in a later session: it had our message.
LATER = "a later session"


def _newer(attempt: Any, than: Any) -> bool:
    """True when ``attempt`` ([process, number]) supersedes ``than`` (a later attempt of the
    same process, or another process: the one heard from last is the live one)."""
    return attempt != than and not (attempt[0] == than[0] and attempt[1] < than[1])


class MissingWorkersError(TimeoutError):
    """Some workers did not answer in time; ``missing`` names them ("worker:1", ...)."""

    def __init__(self, message: str, missing: Sequence[str], task: str) -> None:
        super().__init__(message)
        self.missing = tuple(missing)
        self.task = task


class PortTakenError(OSError, RuntimeError):
    """This worker's port cannot be listened on: the message names the port, the task and
    where the port came from (an ``OSError`` as before 0.6, and a ``RuntimeError``)."""


def _reason(error: BaseException) -> str:
    if isinstance(error, socket.timeout):
        return "no answer"
    if isinstance(error, ConnectionRefusedError):
        return "connection refused: nothing listens there"
    if isinstance(error, ValueError):
        return "something else answers on that port (not safestrategy)"
    return f"{type(error).__name__}: {error}"


class Rendezvous:
    """One attempt at one decision's rounds between this worker and its peers; a context
    manager that listens on this worker's port while it is open."""

    def __init__(
        self, me: Address, peers: Sequence[Address], session: int, ports: str = "TF_CONFIG"
    ) -> None:
        self.me, self.peers, self.session = me, tuple(peers), session
        self.ports = ports  #: where the ports came from, as a port's error names it
        self.attempt = [_PROCESS, next(_attempts)]
        self._mailbox: Dict[Tuple[str, str], Any] = {}
        #: (round, peer) -> the attempt of that peer that acked our message
        self._acked: Dict[Tuple[str, str], Any] = {}
        #: peer -> its attempt whose messages we keep (the latest heard from)
        self._attempt_of: Dict[str, Any] = {}
        self._finished: Set[str] = set()  #: rounds this attempt completed
        #: peer -> why this attempt cannot finish with it (it left rounds we shared)
        self._left: Dict[str, Tuple[str, Sequence[str]]] = {}
        self._why: Dict[str, str] = {}  #: by peer: why the last send to it failed
        self._changed = threading.Condition()
        self._closed = threading.Event()
        self._listener: Optional[socket.socket] = None
        self._threads: List[threading.Thread] = []

    def __enter__(self) -> "Rendezvous":
        self.open()
        return self

    def __exit__(self, error_type: Any, *exc_info: Any) -> None:
        self.close()
        if error_type is None and self._finished:
            self._until_peers_closed(IO_TIMEOUT)

    def _until_peers_closed(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until no peer's port answers as a rendezvous.

        A peer done with the last round may listen a moment longer (for the ack of its
        own message). Had this worker built its strategy meanwhile, TensorFlow's gRPC
        would connect to that listener, which resets the connection as it closes: TF
        2.10's coordination agent took that as fatal, and its peer waited for it
        forever (a CI run in three). A refused connection TensorFlow retries, so this
        waits until each peer's port refuses, or answers as something else (its
        TensorFlow server, already up).
        """
        deadline = time.monotonic() + timeout
        listening = list(self.peers)
        while listening and time.monotonic() < deadline:
            listening = [peer for peer in listening if self._listens(peer)]
            if listening:
                time.sleep(0.05)

    def _listens(self, peer: Address) -> bool:
        """Whether ``peer``'s rendezvous still listens (one knock, bounded)."""
        knock = (json.dumps({"protocol": PROTOCOL, "knock": True}) + "\n").encode("utf-8")
        try:
            with socket.create_connection((peer.host, peer.port), NOTICE_TIMEOUT) as s:
                s.sendall(knock)
                with s.makefile("rb") as stream:
                    reply = json.loads(stream.readline(MAX_MESSAGE).decode("utf-8"))
        except (OSError, ValueError):  # refused, reset as it closed, or not ours
            return False
        return isinstance(reply, dict) and reply.get("listening") is True

    def open(self) -> None:
        """Listen on this worker's port, on every interface (as TensorFlow's server will)."""
        family = socket.AF_INET6 if ":" in self.me.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            if os.name == "posix":  # on Windows it would let another socket steal the port
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("", self.me.port))
            listener.listen(64)
        except OSError as error:
            listener.close()
            raise PortTakenError(
                error.errno,
                f"cannot listen on port {self.me.port}, {self.me.task}'s port from "
                f"{self.ports} ({error.strerror or error}); is another program, or an "
                "earlier TensorFlow server in this process, using it?",
            ) from None
        listener.settimeout(0.2)
        self._listener = listener
        self._start(self._accept)

    def _start(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                connection, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # closed
            self._start(self._serve, connection)

    def _serve(self, connection: socket.socket) -> None:
        with contextlib.closing(connection):
            try:
                connection.settimeout(IO_TIMEOUT)
                with connection.makefile("rb") as stream:
                    message = json.loads(stream.readline(MAX_MESSAGE).decode("utf-8"))
                    if not isinstance(message, dict) or message.get("protocol") != PROTOCOL:
                        return  # not ours (e.g. a gRPC client): just hang up
                    knock = message.get("knock") is True  # a peer waiting for us to close
                    reply = {"listening": True} if knock else self._receive(message)
                    connection.sendall((json.dumps(reply) + "\n").encode("utf-8"))
                    connection.settimeout(2.0)
                    stream.read(MAX_MESSAGE)  # until the sender hangs up: it closes first
            except (OSError, ValueError):
                return

    def _receive(self, message: Mapping[str, Any]) -> Dict[str, Any]:
        """Keep a peer's message and say whether it was taken (the sender retries if not).

        A message from a later attempt of a peer supersedes what its earlier attempt
        sent (that attempt gave up, and lost what we sent it: ours is sent again).
        If this attempt already finished a round with the earlier one, the peer has
        left those rounds: this attempt cannot finish (see :meth:`exchange`).
        """
        sender, session = message.get("from"), message.get("session")
        attempt = message.get("attempt")
        if message.get("to") != self.me.task:
            return {
                "ack": False,
                "why": f"this port is {self.me.task}'s, not {message.get('to')}'s",
            }
        if sender not in [peer.task for peer in self.peers] or not isinstance(session, int):
            return {
                "ack": False,
                "why": f"{sender!r} is not a worker in {self.me.task}'s TF_CONFIG",
            }
        if not (isinstance(attempt, list) and len(attempt) == 2):
            return {"ack": False, "why": "not this version of the protocol"}
        if session > self.session:
            return {"ack": False, "why": f"{self.me.task} is not there yet"}
        if session < self.session:  # a retry after a lost ack: we finished that session
            return {"ack": True, "attempt": LATER}
        with self._changed:
            known = self._attempt_of.get(sender)
            if known is not None and known != attempt and not _newer(attempt, known):
                return {"ack": True, "attempt": self.attempt}  # from a dead attempt: dropped
            if known is not None and known != attempt:
                self._mailbox = {k: v for k, v in self._mailbox.items() if k[1] != sender}
                if self._finished:
                    self._left.setdefault(sender, ("started this decision again", ()))
            self._attempt_of[sender] = attempt
            gave_up = message.get("gave_up")
            if isinstance(gave_up, list):
                if self._finished:  # in the first round, its next attempt comes instead
                    self._left.setdefault(sender, (f"gave up {message.get('round')}", gave_up))
            else:
                self._mailbox.setdefault((str(message.get("round")), sender), message.get("body"))
            self._changed.notify_all()
        return {"ack": True, "attempt": self.attempt}

    def _must_send(self, round_name: str, peer: str) -> bool:
        """True until the peer's current attempt has acked our message of ``round_name``."""
        acked = self._acked.get((round_name, peer))
        current = self._attempt_of.get(peer)
        if acked == LATER:  # it finished this session, which needed our message
            return False
        return acked is None or (current is not None and current != acked)

    def _message(self, peer: Address, round_name: str, **fields: Any) -> bytes:
        message = {
            "protocol": PROTOCOL,
            "session": self.session,
            "attempt": self.attempt,
            "round": round_name,
            "from": self.me.task,
            "to": peer.task,
            **fields,
        }
        return (json.dumps(message) + "\n").encode("utf-8")

    def _deliver(self, peer: Address, data: bytes, timeout: float) -> Any:
        """One try: the peer's reply if it acked ``data``; else raises or returns the why."""
        with socket.create_connection((peer.host, peer.port), timeout) as s:
            s.sendall(data)
            with s.makefile("rb") as stream:
                line = stream.readline(MAX_MESSAGE)
        reply = json.loads(line.decode("utf-8")) if line else None
        if isinstance(reply, dict) and reply.get("ack"):
            return reply
        return str(reply.get("why")) if isinstance(reply, dict) else "hung up"

    def _send(self, peer: Address, round_name: str, data: bytes, deadline: float) -> None:
        """Deliver ``data`` to ``peer`` until its current attempt acks, the round is over or
        the deadline passes; again if the peer starts a new attempt meanwhile."""
        delay, tried = 0.05, False
        while not self._closed.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with self._changed:
                if round_name in self._finished:
                    return
                if not self._must_send(round_name, peer.task):
                    self._changed.wait(min(0.5, left))
                    continue
            if tried:  # back off between tries
                self._closed.wait(min(delay, max(deadline - time.monotonic(), 0)))
                delay = min(delay * 2, 1.0)
            tried = True
            try:
                reply = self._deliver(peer, data, min(IO_TIMEOUT, max(left, 0.01)))
            except (OSError, ValueError) as error:
                reply = _reason(error)
            with self._changed:
                if isinstance(reply, dict):
                    self._acked[(round_name, peer.task)] = reply.get("attempt")
                    self._changed.notify_all()
                else:
                    self._why[peer.task] = reply

    def exchange(
        self,
        round_name: str,
        body: Any,
        timeout: float,
        waiting_for: str,
        within: Optional[str] = None,
    ) -> Dict[str, Any]:
        """Send ``body`` to every peer and collect theirs: ``{task: body}``, this one's included.

        Raises :class:`MissingWorkersError` when the round is not complete within
        ``timeout`` seconds (``waiting_for`` says what for, and ``within`` what that
        timeout is made of, in its message; None: the probe timeout), after telling the
        peers it gave up; or at once when a peer left a round this attempt shared with it
        (it gave up, or started again), naming the workers that peer did not hear from.
        """
        deadline = time.monotonic() + timeout
        for peer in self.peers:
            data = self._message(peer, round_name, body=body)
            self._start(self._send, peer, round_name, data, deadline)

        def missing() -> List[Address]:
            return [
                peer
                for peer in self.peers
                if (round_name, peer.task) not in self._mailbox
                or self._must_send(round_name, peer.task)
            ]

        with self._changed:
            while missing() and not self._left and time.monotonic() < deadline:
                self._changed.wait(min(0.5, max(deadline - time.monotonic(), 0.01)))
            if self._left:
                raise self._peer_left(waiting_for)
            absent = missing()
            if not absent:
                self._finished.add(round_name)
                self._changed.notify_all()
                return {
                    self.me.task: body,
                    **{p.task: self._mailbox[(round_name, p.task)] for p in self.peers},
                }
            details = []
            for peer in absent:
                heard = (round_name, peer.task) in self._mailbox
                why = "its message came, but it did not take ours" if heard else "nothing from it"
                if self._must_send(round_name, peer.task):
                    why += f"; sending to it: {self._why.get(peer.task, 'no answer')}"
                details.append(f"{peer.task} at {peer} ({why})")
        names = [peer.task for peer in absent]
        self._give_up(round_name, names)
        raise MissingWorkersError(
            f"{self.me.task} gave up after {timeout:g} s {waiting_for}: "
            f"no answer from {', '.join(names)}. Details: {'; '.join(details)}. Start the "
            f"same program on every worker in TF_CONFIG within {within or WITHIN}; see "
            "docs/multiworker.md",
            names,
            self.me.task,
        )

    def _peer_left(self, waiting_for: str) -> MissingWorkersError:
        """The error when a peer left this attempt's rounds: its culprits, else the peer."""
        peer, (what, culprits) = sorted(self._left.items())[0]
        names = [str(name) for name in culprits] or [peer]
        where = {address.task: f"{address.task} at {address}" for address in self.peers}
        because = (
            f": no answer from {', '.join(where.get(n, n) for n in names)}" if culprits else ""
        )
        return MissingWorkersError(
            f"{self.me.task} stopped {waiting_for}: {peer} {what}{because}. Every worker "
            "raises, so a retry of make_multiworker_strategy() on every worker meets again; "
            "see docs/multiworker.md",
            names,
            self.me.task,
        )

    def _give_up(self, round_name: str, missing: Sequence[str]) -> None:
        """Tell every peer (one short try each) that this attempt gave up and on whom, so that
        a peer waiting in a later round does not wait for this one."""
        if not self._finished:  # nobody waits on us beyond the first round
            return

        def tell(peer: Address) -> None:
            data = self._message(peer, round_name, gave_up=list(missing))
            with contextlib.suppress(OSError, ValueError):
                self._deliver(peer, data, NOTICE_TIMEOUT)

        notices = [threading.Thread(target=tell, args=(p,), daemon=True) for p in self.peers]
        for notice in notices:
            notice.start()
        for notice in notices:
            notice.join(NOTICE_TIMEOUT + 1)

    def close(self) -> None:
        """Stop listening and sending; when this returns, the port is free again."""
        self._closed.set()
        with self._changed:
            self._changed.notify_all()
        if self._listener is not None:
            self._listener.close()
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join(IO_TIMEOUT + 3)
        self._threads = []
