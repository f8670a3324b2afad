"""The report's renderings: one record, JSON-ready, readable as text."""

import json

from safestrategy import CandidateResult

from .conftest import report


def make_report(**changes):
    fields = dict(
        backend="reduce_to_cpu",
        source="env",
        mode="list",
        platform="Windows",
        tf_version="2.10.1",
        candidates=(
            CandidateResult("nccl", "failed", "InvalidArgumentError: No OpKernel", 0.5),
            CandidateResult("reduce_to_cpu", "ok", "all 2 replicas got the right sum", 0.1),
        ),
        reason="first candidate that passed",
    )
    return report(**{**fields, **changes})


def test_to_json_round_trips_to_dict():
    report = make_report()
    data = json.loads(report.to_json())
    assert data == report.to_dict()
    assert data["candidates"][0] == {
        "name": "nccl",
        "status": "failed",
        "reason": "InvalidArgumentError: No OpKernel",
        "seconds": 0.5,
        "cached": False,
        "remedy": {},
        "ms": None,
    }
    assert data["nccl_kernels"] is None


def test_text_renders_unknowns_and_every_candidate():
    text = str(make_report(wsl=True))
    assert "backend      reduce_to_cpu  (list, chosen by env)" in text
    assert "nccl kernels unknown" in text
    assert "Windows (WSL)" in text
    assert "  nccl               failed      0.50s  InvalidArgumentError: No OpKernel" in text


def test_cached_verdicts_and_remedies_are_shown():
    remedy = {"NCCL_P2P_DISABLE": "1"}
    nccl = CandidateResult("nccl", "ok", "passed", 0.0, cached=True, remedy=remedy)
    report = make_report(backend="nccl", candidates=(nccl,), workers=2, task="worker:1")
    assert "  nccl               ok         cached  passed" in str(report)
    assert "workers      2 (this is worker:1)" in str(report)
    data = json.loads(report.to_json())
    assert data["candidates"][0]["remedy"] == {"NCCL_P2P_DISABLE": "1"}
    assert (data["workers"], data["task"]) == (2, "worker:1")


def test_the_report_is_frozen():
    report = make_report()
    try:
        report.backend = "nccl"
    except AttributeError:
        return
    raise AssertionError("Report accepted an assignment")


def test_timings_payload_and_xla_are_shown():
    timed = (
        CandidateResult("hierarchical_copy", "ok", "right", 0.2, ms=11.6),
        CandidateResult(
            "reduce_to_cpu", "ok", "fastest: 5.7 ms; hierarchical_copy 11.6 ms", 0.1, ms=5.7
        ),
        CandidateResult("nccl", "skipped", "no GPU among the devices"),
    )
    report = make_report(candidates=timed, payload_mb=32.0, xla=True)
    text = str(report)
    assert "  reduce_to_cpu      ok          0.10s      5.7 ms  fastest: 5.7 ms" in text
    rows = text.splitlines()[-2:]
    assert rows[0].index("fastest") == rows[1].index("no GPU")  # reasons stay in one column
    assert "payload      32 MB" in text
    assert "xla          on: TensorFlow uses its collective all-reduce" in text
    data = json.loads(report.to_json())
    assert (data["payload_mb"], data["xla"], data["candidates"][0]["ms"]) == (32.0, True, 11.6)
