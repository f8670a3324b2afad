"""Pure decision logic: (setting, devices, check results) -> which backend.

Nothing here imports TensorFlow or runs anything; the smoke check is passed in
as a function, so every path can be tested from hand-built inputs.
"""

from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

from ._devices import Device
from ._env import ENV_BACKEND, Setting
from .backends import get_backend
from .report import NOT_TRIED, OK, SKIPPED, CandidateResult

SINGLE_DEVICE_REASON = "one device: there is nothing to all-reduce, so nothing was checked"


class Planned(NamedTuple):
    """A candidate in the order to try, and why it is skipped (None: try it)."""

    name: str
    skip: Optional[str] = None


class Decision(NamedTuple):
    """The outcome: the chosen backend (None: nothing works), why, and every result."""

    backend: Optional[str]
    reason: str
    results: Tuple[CandidateResult, ...]

    @property
    def fallbacks(self) -> Tuple[CandidateResult, ...]:
        """Candidates that were tried and failed before the chosen one."""
        return tuple(r for r in self.results if r.status not in (OK, SKIPPED, NOT_TRIED))


def plan(setting: Setting, devices: Sequence[Device]) -> Tuple[Planned, ...]:
    """The candidates to try. ``auto`` skips what cannot apply; a list or a name skips nothing."""
    if setting.mode != "auto" or any(device.kind == "GPU" for device in devices):
        return tuple(Planned(name) for name in setting.names)
    return tuple(
        Planned(name, "no GPU among the devices" if get_backend(name).needs_gpu else None)
        for name in setting.names
    )


def _single_device_choice(setting: Setting, devices: Sequence[Device]) -> str:
    if setting.mode != "auto":
        return setting.names[0]
    # Never NCCL: older TensorFlow still builds the op for one device.
    return "reduce_to_gpu" if devices[0].kind == "GPU" else "reduce_to_cpu"


def decide(
    setting: Setting, devices: Sequence[Device], check: Callable[[str], CandidateResult]
) -> Decision:
    """Walk the plan, calling ``check(name)`` until one candidate passes."""
    if len(devices) < 2:
        chosen = _single_device_choice(setting, devices)
        results = tuple(
            CandidateResult(name, NOT_TRIED, SINGLE_DEVICE_REASON) for name in setting.names
        )
        return Decision(chosen, SINGLE_DEVICE_REASON, results)
    results: List[CandidateResult] = []
    chosen = None
    for candidate in plan(setting, devices):
        if candidate.skip is not None:
            results.append(CandidateResult(candidate.name, SKIPPED, candidate.skip))
        elif chosen is not None:
            results.append(CandidateResult(candidate.name, NOT_TRIED, f"{chosen} was chosen"))
        else:
            result = check(candidate.name)
            results.append(result)
            if result.status == OK:
                chosen = result.name
    return Decision(chosen, _why(setting, chosen, results), tuple(results))


def _why(setting: Setting, chosen: Optional[str], results: Sequence[CandidateResult]) -> str:
    if chosen is None:
        return "no candidate passed its smoke check"
    failed = [r.name for r in results if r.status not in (OK, SKIPPED, NOT_TRIED)]
    passed = "passed its all-reduce smoke check"
    if setting.mode == "forced":
        return f"forced, and {passed}"
    if failed:
        return f"first candidate that {passed} (after {', '.join(failed)} failed)"
    return f"first candidate that {passed}"


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
