"""The words of a stall: the ERROR's headline, where, which backend, what to try (pure).

Everything a user reads about a stall is built here from the stall, the report of
the strategy that stalled and where its record went: which backends to try
instead (never one that failed or was skipped on these devices, never another
NCCL when NCCL stalled), NCCL's own fixes only where NCCL is in use, and whether
a record was written that a next decision reads (:mod:`safestrategy.records`).
"""

from typing import List, Mapping, Optional, Sequence, Tuple

from .. import _env, records
from ..backends import BACKEND_NAMES, COLLECTIVE, COMMUNICATION_NAMES, NCCL, get_backend
from ..report import NOT_TRIED, OK, Report
from .canary import ANSWERED, NONE, Answer
from .peers import A_WORKERS_DOING, CHECKPOINT, GONE, HELD, INPUT, PY_FUNCTION, STOPPED, Verdict
from .peers import WHERE as PEER_WHERE
from .sampler import WHERE

#: The command that lists (and with ``--forget`` forgets) every record in the cache directory.
RECORDS_COMMAND = "python -m safestrategy records"

#: What to try for a stall outside the all-reduce, where no backend helps.
OUTSIDE_TIP = (
    "look where the stack waits: the input pipeline (a reader, a generator, a remote file "
    "system) or your own code, not the all-reduce"
)


#: What to try when another worker holds this one back.
PEER_TIP = (
    "look at the worker the verdict names: its own log, its stack (py-spy dump), whether "
    "it still runs"
)


def _on_nccl(report: Report, name: str) -> bool:
    """Backend ``name`` of ``report`` all-reduces with NCCL: ``nccl``, or a ``collective``
    that requested NCCL (the report says which it requested), or one not checked here (a
    forced or listed setting without it) on GPUs, where TF's collective runs NCCL."""
    if name in (NCCL, "NcclAllReduce"):
        return True
    if name != COLLECTIVE:
        return False
    result = next((c for c in report.candidates if c.name == name), None)
    if result is None or result.status == NOT_TRIED:
        return any("GPU" in device.upper() for device in report.devices)
    return "(NCCL requested)" in result.reason


def _alternatives(report: Report) -> List[str]:
    """The backends to suggest instead of ``report``'s: those that passed on these devices,
    then those not checked here (not tried, or absent from a listed or forced setting);
    never one that failed or was skipped here, one that needs a GPU where there is none,
    nor another NCCL when NCCL stalled."""
    names = COMMUNICATION_NAMES if report.task is not None else BACKEND_NAMES
    status = {c.name: c.status for c in report.candidates}
    stuck_on_nccl = _on_nccl(report, report.backend)
    gpu = any("GPU" in device.upper() for device in report.devices)
    if report.task is not None:  # a worker's devices are its GPUs, else its CPU
        names = tuple(name for name in names if name != NCCL or gpu)

    def fits(name: str) -> bool:
        if name == report.backend or (stuck_on_nccl and _on_nccl(report, name)):
            return False
        return gpu or name not in BACKEND_NAMES or not get_backend(name).needs_gpu

    passed = [n for n in names if status.get(n) == OK and fits(n)]
    unchecked = [n for n in names if status.get(n, NOT_TRIED) == NOT_TRIED and fits(n)]
    return passed + unchecked


def _tips(report: Optional[Report], nccl: Mapping[str, str]) -> List[str]:
    """What to try, from what ``report`` shows of these devices (None: not known)."""
    tips = []
    if report is not None and _on_nccl(report, report.backend):
        fixes = [f"{n}=1" for n, _ in _env.REMEDIES if n not in nccl]
        if fixes:
            tips.append(f"NCCL's own fixes, one at a time: {', then '.join(fixes)}")
        tips.append("NCCL_DEBUG=INFO shows where NCCL waits")
    if report is not None and report.task is None and not report.candidates:
        tips.append(  # the caller's own cross_device_ops: no setting of ours applies
            f"your own cross_device_ops ({report.backend}) is used as given, and "
            f"{_env.ENV_BACKEND} is ignored while you pass one: pass another "
            "cross_device_ops=, or none and let safestrategy choose"
        )
    elif report is not None and (report.task is not None or len(report.devices) > 1):
        variable = _env.ENV_COMMUNICATION if report.task is not None else _env.ENV_BACKEND
        others = _alternatives(report)
        if others:
            tips.append(
                f"another backend: {variable}={others[0]}"
                + (f" (or {', '.join(others[1:])})" if others[1:] else "")
            )
        elif report.task is not None:  # multi-worker RING: nothing safer to switch to
            tips.append("check that every worker still runs: one that died or hangs stops the rest")
    tips.append(
        f"if one call is simply long (a long first compile, Keras steps_per_execution=N): "
        f"raise {_env.ENV_STALL_TIMEOUT}"
    )
    return tips


def _recorded(report: Report, place: Optional[records.Place]) -> Optional[str]:
    """What the ERROR says of the record it writes (None: none is written)."""
    if place is None:
        return None
    if place.kind == records.MULTIWORKER_KIND:
        listed = (
            f"The stall is recorded for this worker (`{RECORDS_COMMAND}` lists it, "
            f"`{RECORDS_COMMAND} --forget` forgets it)"
        )
        return f"{listed}: {records.after_record(report, place)}."
    return (
        f"The stall is recorded: {records.after_record(report, place)} on these devices "
        f"(`{records.refresh_command(report.devices)}` re-allows it)."
    )


def message(
    seconds: float,
    kind: str,
    thread: str,
    stack: str,
    report: Optional[Report],
    nccl: Mapping[str, str],
    settings: _env.StallSettings,
    place: Optional[records.Place] = None,
    suspects: Sequence[Report] = (),
    outside: bool = False,
    peers: Optional[Tuple[Verdict, str]] = None,
    canary: Optional[Answer] = None,
    where: str = "",
) -> str:
    """The ERROR for a stall: how long, where, which backend and devices, what to try, and
    whether it is recorded (``place``: where; None: nothing is). ``report`` None with
    ``suspects``: the stuck call's strategy could not be told among these. ``outside``:
    the call is outside the all-reduce (input, no strategy's call), which no backend cures.
    ``peers``: multi-worker, the verdict every worker draws and the table of workers.
    ``canary``: what the known-sum all-reduce run during the stall showed (None: none was
    asked), and ``where`` the step waits (:func:`stuck_where`)."""
    line = headline(seconds, kind, thread, settings)
    if canary is not None and canary.kind != NONE:
        answered = canary.kind == ANSWERED
        line = (
            line[:-1]
            + f"; {canary.said()}"
            + (f": the step is stuck outside it: {where}" if answered and where else "")
            + "."
        )
    if settings.action == "exit":
        closing = (
            f"{_env.ENV_STALL_ACTION}=exit: ending the process with exit code {_env.EXIT_STALL}."
        )
    elif place is not None:
        closing = "Still waiting: if the call finishes after all, the record is withdrawn."
    else:
        closing = "Still waiting."
    held = peers is not None and peers[0].kind in A_WORKERS_DOING
    against = f"Not recorded against {report.backend if report else 'a backend'}"
    answered = canary is not None and canary.kind == ANSWERED
    if held:
        closing = f"Not recorded: {_NOT_THE_COMMUNICATION[peers[0].kind]}. " + closing
    elif outside:
        closing = (
            f"{against}: the call is outside the all-reduce, and another backend would wait "
            "the same way. " + closing
        )
    elif answered:
        closing = (
            f"{against}: its all-reduce answers, so the step is stuck in the program, and "
            "another backend would wait the same way. " + closing
        )
    elif canary is not None and canary.kind == NONE and report is not None:
        closing = (
            f"{against}: {canary.said()}, and a stall is recorded only when the all-reduce "
            "itself is shown stuck. " + closing
        )
    if peers is not None:
        line += f"\n{peers[0].line}.\nworkers:\n{peers[1]}"
    return _explained(
        line, stack, report, nccl, closing, place, suspects, not (outside or held or answered), held
    )


def headline(seconds: float, kind: str, thread: str, settings: _env.StallSettings) -> str:
    """A stall's first line: how long, which thread, what kind of call."""
    return (
        f"training has made no progress for {seconds:.0f} s: thread {thread!r} has been in "
        f"one TensorFlow call for that long ({_env.ENV_STALL_TIMEOUT}={settings.timeout:g}), "
        f"{WHERE[kind]}."
    )


def stuck_where(sign: str, at: str) -> str:
    """Where a step whose all-reduce answers waits, from what its threads show (``sign``:
    :func:`~safestrategy.training.peers.whereabouts`' kind, ``at`` the user's line)."""
    if sign in (PY_FUNCTION, CHECKPOINT, INPUT):
        what = PEER_WHERE[sign]
    else:  # no thread shows more than the step: a native op inside it
        what = "in a TensorFlow op of the step (a native op, a file read)"
    return f"{what} ({at})" if at else what


#: Why a multi-worker verdict records nothing against the communication.
#: Why nothing is recorded, by :data:`~safestrategy.training.peers.A_WORKERS_DOING` verdict.
_NOT_THE_COMMUNICATION = {
    HELD: "a worker outside the all-reduce holds the others back, and another "
    "communication would wait for it the same way",
    GONE: "a worker stopped answering (a peer gone), which no communication cures",
    STOPPED: "a worker its user stopped is no communication's fault",
}


def _explained(
    headline: str,
    stack: str,
    report: Optional[Report],
    nccl: Mapping[str, str],
    closing: str,
    place: Optional[records.Place] = None,
    suspects: Sequence[Report] = (),
    backends: bool = True,
    peer: bool = False,
) -> str:
    """A stall's headline with where, which backend and devices, what to try, ``closing``.
    ``backends``: whether another backend is worth trying (not for a stall outside it);
    ``peer``: another worker is the cause (look there)."""
    lines = [headline, "where (most recent call last):", stack]
    if report is not None:
        task = f"; this is {report.task} of {report.workers} workers" if report.task else ""
        lines.append(
            f"backend {report.backend} ({report.mode}) on {', '.join(report.devices)}{task}"
        )
    elif suspects:
        lines.append(
            f"backend unknown: {len(suspects)} strategies are watched in this process and the "
            "stuck call does not show which one it runs:"
        )
        lines.extend(
            f"  - backend {r.backend} ({r.mode}) on {', '.join(r.devices)}" for r in suspects
        )
    settings_text = " ".join(f"{n}={v}" for n, v in sorted(nccl.items())) or "none set"
    lines.append(f"NCCL variables: {settings_text}")
    lines.append("what to try:")
    tips = _tips(report, nccl) if backends else [OUTSIDE_TIP, *_tips(None, nccl)]
    if peer:
        tips = [PEER_TIP, *_tips(None, nccl)]
    lines.extend(f"  - {tip}" for tip in tips)
    said = _recorded(report, place) if report is not None else None
    if said is not None:
        lines.append(said)
    elif suspects:
        lines.append(
            "Nothing is recorded: a record against the wrong one would demote a backend that works."
        )
    lines.append(closing)
    return "\n".join(lines)


def collective_timeout_message(
    timeout: float,
    error: BaseException,
    stack: str,
    report: Optional[Report],
    nccl: Mapping[str, str],
    place: Optional[records.Place] = None,
) -> str:
    """The ERROR for the user's own ``CommunicationOptions(timeout_seconds=...)`` ending a
    collective that waited too long: a stall that TensorFlow itself cut short."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    headline = (
        f"training stopped: a collective all-reduce waited longer than the "
        f"CommunicationOptions(timeout_seconds={timeout:g}) you set ({type(error).__name__}: "
        f"{first}); most likely a worker stopped taking part."
    )
    closing = "TensorFlow's error follows."
    return _explained(headline, stack, report, nccl, closing, place)
