"""Exception hooks (safestrategy.training.hooks): the user's collective timeout, reported
like a stall (a peer gone: tests/test_peers.py)."""

import logging
import sys

from safestrategy import records
from safestrategy.training import hooks

from .conftest import needs_tf, report


@needs_tf
def test_a_collective_timeout_the_user_set_is_reported_like_a_stall(tf, monkeypatch, caplog):
    """Multi-worker with CommunicationOptions(timeout_seconds=...): TensorFlow's own
    DeadlineExceededError, uncaught, gets the stall's ERROR and record, then Python's report."""
    before = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: before.append(args))
    monkeypatch.setattr(hooks, "_hooked", False)
    monkeypatch.setattr(hooks, "_timed_out", None)
    ring = report(
        backend="ring", devices=("/device:CPU:0",), candidates=(), workers=2, task="worker:1"
    )
    worker = records.on_worker(tf, ["127.0.0.1:1", "127.0.0.1:2"], "worker:1")
    hooks.report_collective_timeouts(30.0, ring, None, worker)
    try:
        raise tf.errors.DeadlineExceededError(None, None, "Collective ops is aborted by: timeout")
    except tf.errors.DeadlineExceededError as error:
        caught = error
    with caplog.at_level(logging.ERROR, logger="safestrategy"):
        sys.excepthook(type(caught), caught, caught.__traceback__)
    assert [args[1] for args in before] == [caught]  # Python's own report still follows
    (text,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "CommunicationOptions(timeout_seconds=30) you set" in text
    assert "Collective ops is aborted by: timeout" in text
    assert "this is worker:1 of 2 workers" in text and "test_hooks.py" in text
    # a multi-worker record lives in its own key space, never read by one machine's choice
    assert records.recorded(tf, ["/device:CPU:0"]) == ()
    recorded = [(kind, stall.backend) for kind, _, stall in records.every(records.directory())]
    assert recorded == [(records.MULTIWORKER_KIND, "ring")]
    sys.excepthook(ValueError, ValueError("other"), None)  # other errors: only Python's report
    assert len(before) == 2 and len(caplog.records) == 1
