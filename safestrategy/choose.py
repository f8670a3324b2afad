"""Pure decision logic: (setting, devices, check results, timings) -> which backend.

Nothing here imports TensorFlow or runs anything; the smoke check and the
timer are passed in as functions, so every path can be tested from hand-built
inputs. ``auto`` takes the fastest candidate that sums right (the 3 % rule in
:func:`fastest`); a list or a forced name, the first that passes.
"""

from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

from ._devices import Device
from ._env import ENV_BACKEND, Setting
from .backends import BACKEND_NAMES, get_backend
from .report import NOT_TRIED, OK, SKIPPED, CandidateResult

SINGLE_DEVICE_REASON = "one device: there is nothing to all-reduce, so nothing was checked"


#: ``auto`` keeps an earlier candidate in the documented order over a faster one when
#: the earlier is within this fraction of the fastest median: a stable, deterministic choice.
MARGIN = 0.03

#: Before the full timing, each candidate that passed runs the payload once; only those
#: within this factor of the fastest such run are run again (see :func:`contenders`).
SCREEN = 2.0

Check = Callable[[str], CandidateResult]
#: Times the candidates that passed: for each, the median milliseconds of its payload
#: all-reduce, or None when it could not be timed.
Timer = Callable[[Sequence[str]], Mapping[str, Optional[float]]]


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


def plan(
    setting: Setting, devices: Sequence[Device], unavailable: Optional[Mapping[str, str]] = None
) -> Tuple[Planned, ...]:
    """The candidates to try. ``auto`` skips what cannot apply (``unavailable``: name ->
    why, e.g. ``collective`` where it is not TF's default); a list or a name skips nothing."""
    if setting.mode != "auto":
        return tuple(Planned(name) for name in setting.names)
    gpu = any(device.kind == "GPU" for device in devices)
    unavailable = unavailable or {}

    def skip(name: str) -> Optional[str]:
        if get_backend(name).needs_gpu and not gpu:
            return "no GPU among the devices"
        return unavailable.get(name)

    return tuple(Planned(name, skip(name)) for name in setting.names)


def _single_device_choice(setting: Setting, devices: Sequence[Device]) -> str:
    if setting.mode != "auto":
        return setting.names[0]
    # Never NCCL: older TensorFlow still builds the op for one device.
    return "reduce_to_gpu" if devices[0].kind == "GPU" else "reduce_to_cpu"


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


def contenders(first_runs: Mapping[str, float]) -> Set[str]:
    """The candidates worth timing in full, given one timed run of each (milliseconds):
    those within :data:`SCREEN` of the fastest. The others cannot win by the 3 % rule
    unless a run is more than twice as slow as the next by chance; their one run stands
    as their time, which spares a cold start their slow runs."""
    if not first_runs:
        return set()
    best = min(first_runs.values())
    return {name for name, ms in first_runs.items() if ms <= best * SCREEN}


def _auto_choice(results: List[CandidateResult], time: Optional[Timer]) -> Decision:
    """Of the candidates that passed, the fastest by the 3 % rule (timed when two or more
    passed: one alone needs no race); untimed ones rank after every timed one."""
    passed = [r.name for r in results if r.status == OK]
    if len(passed) < 2 or time is None:
        chosen = passed[0] if passed else None
        return Decision(chosen, _why("only", chosen, results), tuple(results))
    timings = time(passed)
    results = [r._replace(ms=timings[r.name]) if r.name in timings else r for r in results]
    timed = [(name, ms) for name, ms in timings.items() if ms is not None]
    if not timed:
        why = _why("first", passed[0], results) + "; none could be timed"
        return Decision(passed[0], why, tuple(results), True)
    chosen, why = fastest(timed)
    return Decision(chosen, why, tuple(results), True)


def _warm(
    remembered: Decision, check: Check
) -> Tuple[Optional[Decision], Optional[CandidateResult]]:
    """Remembered timings: only the winner is checked again. Its result either confirms
    the remembered decision (everything else marked cached) or is returned to reuse."""
    winner = remembered.backend
    result = check(winner) if winner is not None else None
    if result is None or result.status != OK:
        return None, result
    results = tuple(
        result._replace(ms=r.ms) if r.name == winner else r._replace(cached=True)
        for r in remembered.results
    )
    return Decision(winner, remembered.reason, results, warm=True), None


def decide(
    setting: Setting,
    devices: Sequence[Device],
    check: Check,
    time: Optional[Timer] = None,
    unavailable: Optional[Mapping[str, str]] = None,
    remembered: Optional[Decision] = None,
) -> Decision:
    """The decision, calling ``check(name)`` for smoke checks and ``time(names)`` to time.

    ``auto`` checks every applicable candidate and takes the fastest that passed
    (:func:`fastest`); given ``remembered`` (an earlier ``auto`` decision for the same
    machine, devices and payload) it checks only that winner and times nothing, and
    decides afresh if the winner fails now. A list or a forced name takes the first
    that passes in the user's order, timing nothing.
    """
    if len(devices) < 2:
        chosen = _single_device_choice(setting, devices)
        results = tuple(
            CandidateResult(name, NOT_TRIED, SINGLE_DEVICE_REASON) for name in setting.names
        )
        return Decision(chosen, SINGLE_DEVICE_REASON, results)
    auto = setting.mode == "auto"
    known: Dict[str, CandidateResult] = {}
    if auto and remembered is not None:
        warm, failed = _warm(remembered, check)
        if warm is not None:
            return warm
        if failed is not None:
            known[failed.name] = failed
    results: List[CandidateResult] = []
    chosen = None
    for candidate in plan(setting, devices, unavailable):
        if candidate.skip is not None:
            results.append(CandidateResult(candidate.name, SKIPPED, candidate.skip))
        elif chosen is not None:
            results.append(CandidateResult(candidate.name, NOT_TRIED, f"{chosen} was chosen"))
        else:
            result = known.get(candidate.name) or check(candidate.name)
            results.append(result)
            if result.status == OK and not auto:
                chosen = result.name
    if auto:
        return _auto_choice(results, time)
    return Decision(chosen, _why(setting.mode, chosen, results), tuple(results))


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
