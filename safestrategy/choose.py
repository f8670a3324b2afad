"""The one chooser: (setting, check, timer) -> which backend, and the words that explain it.

It serves ``make_mirrored_strategy``, ``make_multiworker_strategy`` and
``nccl_ops``: each passes in how a candidate is checked, which candidates
cannot apply (and why), and how ``auto`` picks. Nothing here imports
TensorFlow or runs anything, so every path can be tested from hand-built
inputs. A racing ``auto`` (one machine) checks every candidate and takes the
fastest that sums right (the 3 % rule in :func:`fastest`); a list, a forced
name, or an ``auto`` that does not race (multi-worker, ``nccl_ops``) takes
the first that passes. :func:`log_fallback` writes the one fallback WARNING
all three log.
"""

import logging
from typing import (
    Callable,
    Collection,
    Dict,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    Union,
)

from . import records
from ._devices import Device
from ._env import ENV_BACKEND, Setting
from .backends import BACKEND_NAMES
from .report import FAILED, NOT_TRIED, OK, SKIPPED, TIMEOUT, CandidateResult, Report

logger = logging.getLogger("safestrategy")

SINGLE_DEVICE_REASON = "one device: there is nothing to all-reduce, so nothing was checked"
LAST_RESORT_REASON = (
    "every candidate that passed its check has a record of trouble during training: the "
    "last of them in the order is used anyway, rather than none"
)


#: ``auto`` keeps an earlier candidate in the documented order over a faster one when
#: the earlier is within this fraction of the fastest median: a stable, deterministic choice.
MARGIN = 0.03

Check = Callable[[str], CandidateResult]
#: Times the candidates that passed: for each, the median milliseconds of its payload
#: all-reduce, or why it could not be timed (a str; None: no reason known).
Timer = Callable[[Sequence[str]], Mapping[str, Union[float, str, None]]]
#: Why a candidate won without a race, in the caller's words: (setting, chosen, results).
Why = Callable[[Setting, Optional[str], Sequence[CandidateResult]], str]


class Planned(NamedTuple):
    """A candidate in the order to try, and why it is skipped (None: try it)."""

    name: str
    skip: Optional[str] = None


class Decision(NamedTuple):
    """The outcome: the chosen backend (None: nothing works), why, and every result."""

    backend: Optional[str]
    reason: str
    results: Tuple[CandidateResult, ...]
    timed: bool = False  #: timings were measured now (worth keeping)
    warm: bool = False  #: taken from remembered timings, only the winner checked

    @property
    def fallbacks(self) -> Tuple[CandidateResult, ...]:
        """Candidates that were tried and failed before the chosen one."""
        return tuple(r for r in self.results if r.status not in (OK, SKIPPED, NOT_TRIED))


def plan(setting: Setting, unavailable: Optional[Mapping[str, str]] = None) -> Tuple[Planned, ...]:
    """The candidates to try. ``auto`` skips what cannot apply (``unavailable``: name ->
    why, e.g. a GPU backend without a GPU, ``collective`` where it is not TF's default);
    a list or a name skips nothing."""
    unavailable = unavailable if setting.mode == "auto" and unavailable else {}
    return tuple(Planned(name, unavailable.get(name)) for name in setting.names)


def single_device(setting: Setting, device: Device) -> Decision:
    """One device: nothing to all-reduce, so nothing is checked. ``auto`` takes the
    reduction on that device, never NCCL (older TensorFlow still builds the op for one
    device); a list or a forced name, its first."""
    if setting.mode != "auto":
        chosen = setting.names[0]
    else:
        chosen = "reduce_to_gpu" if device.kind == "GPU" else "reduce_to_cpu"
    results = tuple(
        CandidateResult(name, NOT_TRIED, SINGLE_DEVICE_REASON) for name in setting.names
    )
    return Decision(chosen, SINGLE_DEVICE_REASON, results)


#: What a warm decision adds to the remembered reason: its times are not this run's.
CACHED_TIMINGS = (
    "timed on an earlier run and cached; only the winner checked now; --refresh times again"
)


def _ms(value: float) -> str:
    return f"{value:.1f} ms"


def fastest(timed: Sequence[Tuple[str, float]]) -> Tuple[str, str]:
    """The 3 % rule on ``(name, median ms)`` pairs: the winner and why, in the report's words.

    F is the fastest median; of the candidates within :data:`MARGIN` of F, the one
    earliest in the documented order wins (so the choice is at most 1.03x the fastest,
    and near-equal backends do not swap from run to run).
    """
    best_name, best = min(timed, key=lambda pair: (pair[1], BACKEND_NAMES.index(pair[0])))
    near = [pair for pair in timed if pair[1] <= best * (1 + MARGIN)]
    name, ms = min(near, key=lambda pair: BACKEND_NAMES.index(pair[0]))
    others = [pair for pair in sorted(timed, key=lambda pair: pair[1]) if pair[0] != name]
    if name == best_name:
        why = f"fastest: {_ms(ms)}"
    else:
        why = f"{_ms(ms)}, within 3 % of {best_name} {_ms(best)}, earlier in the order"
        others = [pair for pair in others if pair[0] != best_name]
    if others:
        why += "; " + ", ".join(f"{other} {_ms(value)}" for other, value in others)
    return name, why


def _ms_or_none(value: Union[float, str, None]) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) else None


def _untimed(name: str, value: Union[float, str, None]) -> str:
    """How the reason names a candidate that passed but could not be timed."""
    return f"{name} passed but could not be timed" + (f": {value}" if value else "")


def _auto_choice(results: List[CandidateResult], time: Optional[Timer]) -> Decision:
    """Of the candidates that passed, the fastest by the 3 % rule (timed when two or more
    passed: one alone needs no race); untimed ones rank after every timed one and are
    named in the reason. A decision with an untimed candidate is not kept as timings
    (``timed`` False): the next launch races again."""
    passed = [r.name for r in results if r.status == OK]
    if len(passed) < 2 or time is None:
        chosen = passed[0] if passed else None
        return Decision(chosen, _why("only", chosen, results), tuple(results))
    timings = time(passed)
    results = [
        r._replace(ms=_ms_or_none(timings[r.name])) if r.name in timings else r for r in results
    ]
    timed = [(name, ms) for name, ms in timings.items() if _ms_or_none(ms) is not None]
    untimed = [_untimed(name, value) for name, value in timings.items() if name not in dict(timed)]
    if not timed:
        why = _why("first", passed[0], results) + "; none could be timed"
        return Decision(passed[0], "; ".join([why, *untimed]), tuple(results))
    chosen, why = fastest([(name, float(ms)) for name, ms in timed])
    return Decision(chosen, "; ".join([why, *untimed]), tuple(results), not untimed)


def _warm(
    remembered: Decision, check: Check, recorded: Collection[str] = ()
) -> Tuple[Optional[Decision], Dict[str, CandidateResult]]:
    """Remembered timings: only the winner is checked again, and its result confirms the
    remembered decision (everything else marked cached). Where the winner has a record of
    trouble during training (``recorded``: a relaunch after a stall or a crash), the next
    candidates by the remembered timings are checked in turn, timing nothing, and the
    first that passes wins. Otherwise: None, and the results checked, to reuse."""
    timed = sorted(
        (r for r in remembered.results if r.status == OK and r.ms is not None), key=lambda r: r.ms
    )
    order = [remembered.backend] if remembered.backend is not None else []
    if remembered.backend in recorded:
        order += [r.name for r in timed if r.name not in order]
    checked: Dict[str, CandidateResult] = {}
    for name in order:
        result = checked[name] = check(name)
        if result.status == OK:
            break
        if name not in recorded:  # it fails now for another reason: decide afresh
            return None, checked
    else:
        return None, checked
    winner = remembered.backend
    reason = f"{remembered.reason} ({CACHED_TIMINGS})"
    if name != winner:
        reason = (
            f"next fastest by the cached timings, {_ms(remembered_ms(remembered, name))}, "
            f"after {winner} {first_line(checked[str(winner)].reason)}"
        )
    results = tuple(
        checked[r.name]._replace(ms=r.ms) if r.name in checked else r._replace(cached=True)
        for r in remembered.results
    )
    return Decision(name, reason, results, warm=True), {}


def remembered_ms(decision: Decision, name: str) -> float:
    """``name``'s remembered median ms in ``decision``."""
    return next(float(r.ms) for r in decision.results if r.name == name and r.ms is not None)


def decide(
    setting: Setting,
    check: Check,
    time: Optional[Timer] = None,
    unavailable: Optional[Mapping[str, str]] = None,
    remembered: Optional[Decision] = None,
    *,
    race: bool = True,
    why: Optional[Why] = None,
    recorded: Collection[str] = (),
    anyway: Optional[Check] = None,
) -> Decision:
    """The decision, calling ``check(name)`` for smoke checks and ``time(names)`` to time.

    With ``race`` (one machine), ``auto`` checks every applicable candidate and takes the
    fastest that passed (:func:`fastest`); given ``remembered`` (an earlier ``auto``
    decision for the same machine, devices and payload) it checks only that winner and
    times nothing, and decides afresh if the winner fails now. A list, a forced name, or
    an ``auto`` that does not race takes the first that passes in order, timing nothing,
    and says why in ``why``'s words (default :func:`explain`).

    No record leaves a machine without a backend: when nothing passed and some candidates
    failed on a record of trouble during training (``recorded``), ``anyway(name)`` checks
    them with the record set aside, the last in the order first, and the first of them
    that passes is used (:func:`_last_resort`).
    """
    decision = _decide(setting, check, time, unavailable, remembered, race, why, recorded)
    if decision.backend is None and anyway is not None:
        return _last_resort(decision, recorded, anyway)
    return decision


def _last_resort(decision: Decision, recorded: Collection[str], anyway: Check) -> Decision:
    """``decision`` (nothing passed), unless a candidate that failed on its record passes
    with the record set aside: then the last such in the order, with its result."""
    results = list(decision.results)
    for name in records.set_aside(results, list(recorded)):
        result = anyway(name)
        if result.status == OK:
            results[[r.name for r in results].index(name)] = result
            return Decision(result.name, LAST_RESORT_REASON, tuple(results))
    return decision


def _decide(
    setting: Setting,
    check: Check,
    time: Optional[Timer],
    unavailable: Optional[Mapping[str, str]],
    remembered: Optional[Decision],
    race: bool,
    why: Optional[Why],
    recorded: Collection[str],
) -> Decision:
    """:func:`decide` without its last resort."""
    racing = race and setting.mode == "auto"
    known: Dict[str, CandidateResult] = {}
    if racing and remembered is not None:
        warm, known = _warm(remembered, check, recorded)
        if warm is not None:
            return warm
    results: List[CandidateResult] = []
    chosen = None
    for candidate in plan(setting, unavailable):
        if candidate.skip is not None:
            results.append(CandidateResult(candidate.name, SKIPPED, candidate.skip))
        elif chosen is not None:
            results.append(CandidateResult(candidate.name, NOT_TRIED, f"{chosen} was chosen"))
        else:
            result = known.get(candidate.name) or check(candidate.name)
            results.append(result)
            if result.status == OK and not racing:
                chosen = result.name
    if racing:
        return _auto_choice(results, time)
    return Decision(chosen, (why or explain)(setting, chosen, results), tuple(results))


def explain(setting: Setting, chosen: Optional[str], results: Sequence[CandidateResult]) -> str:
    """Why a listed or forced backend won: the one machine's words (see :func:`_why`)."""
    return _why("forced" if setting.mode == "forced" else "first", chosen, results)


def _why(lead: str, chosen: Optional[str], results: Sequence[CandidateResult]) -> str:
    """Why ``chosen`` won without a race: ``lead`` is "forced", "first" or "only"."""
    if chosen is None:
        return "no candidate passed its smoke check"
    passed = "passed its all-reduce smoke check"
    if lead == "forced":
        return f"forced, and {passed}"
    failed = [r.name for r in results if r.status not in (OK, SKIPPED, NOT_TRIED)]
    why = f"{'the only' if lead == 'only' else 'first'} candidate that {passed}"
    return f"{why} (after {', '.join(failed)} failed)" if failed else why


def override_hint(
    setting: Setting,
    argument: str = "backend",
    variable: str = ENV_BACKEND,
    example: str = "reduce_to_cpu",
) -> str:
    """How the caller chooses another candidate, given who chose this time."""
    if setting.source == "argument":
        return f"pass another {argument}= (e.g. {argument}={example!r})"
    return f"set {variable} (e.g. {variable}={example}) or pass {argument}="


def listing(headline: str, results: Sequence[CandidateResult], advice: str) -> str:
    """A ``NoWorkingBackendError`` message: the headline, every candidate and why, advice."""
    lines = [headline, *(f"  {r.name}: {r.status}: {r.reason}" for r in results), advice]
    return "\n".join(lines)


def first_line(text: str) -> str:
    """The first line of a reason ("" when there is none)."""
    return text.strip().splitlines()[0] if text.strip() else ""


def log_fallback(
    level: int,
    subject: str,
    status: str,
    reason: str,
    where: str,
    instead: str,
    advice: str,
    note: str = "",
    failed: str = "failed",
) -> None:
    """The one fallback WARNING (at ``level``): ``subject`` (e.g. "all-reduce backend nccl")
    timed out or ``failed`` ``where`` ("on /gpu:0, /gpu:1"), why (the first line of
    ``reason``, then ``note``), what is used ``instead``, and ``advice``: how to choose."""
    logger.log(
        level,
        "%s %s %s (%s)%s; %s instead. %s",
        subject,
        "timed out" if status == TIMEOUT else failed,
        where,
        first_line(reason),
        note,
        instead,
        advice,
    )


def log_fallbacks(
    report: Report,
    level: int,
    what: str,
    where: str,
    hint: str,
    note: Callable[[CandidateResult], str] = lambda result: "",
) -> None:
    """:func:`log_fallback` for each candidate of ``report`` that failed or timed out:
    ``what`` names the kind ("all-reduce backend"), ``hint`` how to choose yourself."""
    for result in report.candidates:
        if result.status in (FAILED, TIMEOUT):
            log_fallback(
                level,
                f"{what} {result.name}",
                result.status,
                result.reason,
                where,
                f"using {report.backend}",
                f"To choose yourself, {hint}.",
                note(result),
            )


def failure_message(
    devices: Sequence[Device], results: Sequence[CandidateResult], setting: Setting
) -> str:
    """The ``NoWorkingBackendError`` message: every candidate and why it failed."""
    return listing(
        f"no all-reduce backend works on {', '.join(map(str, devices))}:",
        results,
        f"To choose another, {override_hint(setting)}; or pass devices= with fewer or other "
        "devices. Run `python -m safestrategy` for the full report.",
    )
