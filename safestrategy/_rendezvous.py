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
nobody sends to a port that TensorFlow already owns. The sender closes each
connection first, so no TIME_WAIT is left on the listening port.

Every message carries the decision's ``session`` (the how-many-th
``make_multiworker_strategy()`` call this is in this process, the same on
every worker) and its round name. A message from an earlier session is
acked and dropped (a peer retrying after a lost ack); one from a later
session is refused, so the sender retries until this worker gets there.
Messages from later rounds of the current session are kept until needed.

Everything is bounded: a round that has not completed by its deadline
raises :class:`MissingWorkersError` naming the workers not heard from.
"""

import contextlib
import json
import os
import socket
import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ._cluster import Address

PROTOCOL = "safestrategy-rendezvous-1"
#: Seconds one connection may take to connect, or to answer once connected.
IO_TIMEOUT = 5.0
#: Longest message read; anything longer is not ours.
MAX_MESSAGE = 1 << 20


class MissingWorkersError(TimeoutError):
    """Some workers did not answer in time; ``missing`` names them ("worker:1", ...)."""

    def __init__(self, message: str, missing: Sequence[str], task: str) -> None:
        super().__init__(message)
        self.missing = tuple(missing)
        self.task = task


def _reason(error: BaseException) -> str:
    if isinstance(error, socket.timeout):
        return "no answer"
    if isinstance(error, ConnectionRefusedError):
        return "connection refused: nothing listens there"
    if isinstance(error, ValueError):
        return "something else answers on that port (not safestrategy)"
    return f"{type(error).__name__}: {error}"


class Rendezvous:
    """One decision's rounds between this worker and its peers; a context manager that
    listens on this worker's port while it is open."""

    def __init__(self, me: Address, peers: Sequence[Address], session: int) -> None:
        self.me, self.peers, self.session = me, tuple(peers), session
        self._mailbox: Dict[Tuple[str, str], Any] = {}
        self._acked: Dict[Tuple[str, str], bool] = {}
        self._why: Dict[str, str] = {}  #: by peer: why the last send to it failed
        self._changed = threading.Condition()
        self._closed = threading.Event()
        self._listener: Optional[socket.socket] = None
        self._threads: List[threading.Thread] = []

    def __enter__(self) -> "Rendezvous":
        self.open()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

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
            raise OSError(
                error.errno,
                f"cannot listen on port {self.me.port}, {self.me.task}'s port in TF_CONFIG "
                f"({error.strerror or error}); is another program, or an earlier TensorFlow "
                "server in this process, using it?",
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
                    reply = self._receive(message)
                    connection.sendall((json.dumps(reply) + "\n").encode("utf-8"))
                    connection.settimeout(2.0)
                    stream.read(MAX_MESSAGE)  # until the sender hangs up: it closes first
            except (OSError, ValueError):
                return

    def _receive(self, message: Mapping[str, Any]) -> Dict[str, Any]:
        """Keep a peer's message and say whether it was taken (the sender retries if not)."""
        sender, session = message.get("from"), message.get("session")
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
        if session > self.session:
            return {"ack": False, "why": f"{self.me.task} is not there yet"}
        if session == self.session:
            with self._changed:
                self._mailbox.setdefault((str(message.get("round")), sender), message.get("body"))
                self._changed.notify_all()
        return {"ack": True}

    def _send(self, peer: Address, round_name: str, data: bytes, deadline: float) -> None:
        """Deliver ``data`` to ``peer`` until it acks or the deadline passes."""
        delay, why = 0.05, "no answer"
        while not self._closed.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                with socket.create_connection((peer.host, peer.port), min(IO_TIMEOUT, left)) as s:
                    s.sendall(data)
                    with s.makefile("rb") as stream:
                        line = stream.readline(MAX_MESSAGE)
                reply = json.loads(line.decode("utf-8")) if line else None
                if isinstance(reply, dict) and reply.get("ack"):
                    with self._changed:
                        self._acked[(round_name, peer.task)] = True
                        self._changed.notify_all()
                    return
                why = str(reply.get("why")) if isinstance(reply, dict) else "hung up"
            except (OSError, ValueError) as error:
                why = _reason(error)
            with self._changed:
                self._why[peer.task] = why
            self._closed.wait(min(delay, max(deadline - time.monotonic(), 0)))
            delay = min(delay * 2, 1.0)

    def exchange(
        self, round_name: str, body: Any, timeout: float, waiting_for: str
    ) -> Dict[str, Any]:
        """Send ``body`` to every peer and collect theirs: ``{task: body}``, this one's included.

        Raises :class:`MissingWorkersError` when the round is not complete within
        ``timeout`` seconds; ``waiting_for`` says what for, in its message.
        """
        deadline = time.monotonic() + timeout
        for peer in self.peers:
            message = {
                "protocol": PROTOCOL,
                "session": self.session,
                "round": round_name,
                "from": self.me.task,
                "to": peer.task,
                "body": body,
            }
            data = (json.dumps(message) + "\n").encode("utf-8")
            self._start(self._send, peer, round_name, data, deadline)

        def missing() -> List[Address]:
            return [
                peer
                for peer in self.peers
                if (round_name, peer.task) not in self._mailbox
                or not self._acked.get((round_name, peer.task))
            ]

        with self._changed:
            while missing() and time.monotonic() < deadline:
                self._changed.wait(min(0.5, max(deadline - time.monotonic(), 0.01)))
            absent = missing()
            if not absent:
                return {
                    self.me.task: body,
                    **{p.task: self._mailbox[(round_name, p.task)] for p in self.peers},
                }
            details = []
            for peer in absent:
                heard = (round_name, peer.task) in self._mailbox
                why = "its message came, but it did not take ours" if heard else "nothing from it"
                if not self._acked.get((round_name, peer.task)):
                    why += f"; sending to it: {self._why.get(peer.task, 'no answer')}"
                details.append(f"{peer.task} at {peer} ({why})")
        names = [peer.task for peer in absent]
        raise MissingWorkersError(
            f"{self.me.task} gave up after {timeout:g} s {waiting_for}: "
            f"no answer from {', '.join(names)}. Details: {'; '.join(details)}. Start the "
            "same program on every worker in TF_CONFIG within SAFESTRATEGY_PROBE_TIMEOUT "
            "seconds of each other (or raise it); see docs/multiworker.md",
            names,
            self.me.task,
        )

    def close(self) -> None:
        """Stop listening and sending; when this returns, the port is free again."""
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join(IO_TIMEOUT + 3)
        self._threads = []
