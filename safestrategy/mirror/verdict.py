"""What one check of the mirror shows: the numbers a step's check computed, judged purely.

A check hands over, for each output of one all-reduce batch, two kinds of
fingerprint (:mod:`~safestrategy.mirror.instep` computes them in the step):

- **copies**: an exact fingerprint of each replica's copy of the output (a
  position-weighted sum of its bits, in int64). Copies that differ name the
  replica whose copy is not the others' (3+ replicas: the odd one out by
  majority; 2: the pair, as nothing can tell which of two is wrong).
- **sum**: a linear fingerprint ``fp(x) = sum(x * w)`` of each replica's input
  and of the output. The all-reduce sums, so ``fp(out)`` must equal the sum of
  the inputs' within a float tolerance of the inputs' scale (``sum(|x| * w)``).
  This catches a sum that is wrong the same way on every replica, where copies
  still agree; when leaving out exactly one replica's share explains it, that
  replica is named (a dropped contribution).

Pure: numbers in, a :class:`Finding` (or None) out; the words for it here too.
"""

import math
from collections import Counter
from typing import NamedTuple, Optional, Sequence, Tuple

#: The two checks, as the ERROR and the records name them.
COPIES = "copies agree"
SUM = "the sum is right"
#: The relative tolerance of the sum check for float32 and wider: float32 sums of the same
#: numbers in another order differ by far less (a dropped share of 2+ replicas is ~50 %).
SUM_TOLERANCE = 1e-5
#: Machine epsilon of the float dtypes an all-reduce carries: a half-precision output is
#: rounded, so its tolerance is a few of its epsilons.
EPSILON = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}
#: The word the step's error text starts with (how TensorFlow's UnknownError carries it).
NAME = "MirrorBrokenError"


class Finding(NamedTuple):
    """A check that failed: which, on which replicas, at which all-reduce of the process."""

    check: str  #: :data:`COPIES` or :data:`SUM`
    replicas: Tuple[int, ...]  #: the replicas named (indices into the strategy's devices)
    step: int  #: the all-reduce batch, counted from 1 in this process
    detail: str  #: what was seen, in words


class MirrorBrokenError(RuntimeError):
    """The strategy's all-reduce returned wrong numbers during training: the step that saw
    it stops before its update (see API.md, "The mirror stays checked")."""

    def __init__(
        self,
        message: str,
        *,
        step: int = 0,
        backend: str = "",
        replicas: Tuple[int, ...] = (),
        devices: Tuple[str, ...] = (),
        check: str = "",
    ) -> None:
        super().__init__(message)
        self.step = step  #: the all-reduce batch that was checked, counted from 1
        self.backend = backend
        self.replicas = replicas
        self.devices = devices  #: the named replicas' devices
        self.check = check  #: which check caught it (:data:`COPIES`, :data:`SUM`)


def tolerance(dtype: str) -> float:
    """The sum check's relative tolerance for an output of ``dtype`` (TensorFlow's name)."""
    return max(SUM_TOLERANCE, 4 * EPSILON.get(dtype, 2.0**-7))


def odd_ones(row: Sequence[int]) -> Tuple[int, ...]:
    """The replicas whose fingerprint is not the majority's (all of them without a strict
    majority: with 2 replicas that differ, the pair)."""
    value, count = Counter(row).most_common(1)[0]
    if count * 2 <= len(row):
        return tuple(range(len(row)))
    return tuple(index for index, fingerprint in enumerate(row) if fingerprint != value)


def _copies(copies: Sequence[Sequence[int]]) -> Tuple[int, ...]:
    named = set()
    for row in copies:
        named.update(odd_ones(row))
    return tuple(sorted(named))


def _wrong(out: float, expected: float, scale: float, tolerance: float) -> bool:
    """The output's fingerprint is not the inputs' sum. Inputs that are not finite (loss
    scaling overflowed: the step is skipped) have no right sum to hold it to; from finite
    inputs, a NaN or infinite output is wrong."""
    if not (math.isfinite(expected) and math.isfinite(scale)):
        return False
    return not abs(out - expected) <= tolerance * scale


def _dropped(
    ins: Sequence[Sequence[float]],
    out: Sequence[float],
    scale: Sequence[float],
    tolerance: Sequence[float],
    wrong: Sequence[int],
) -> Tuple[int, ...]:
    """The one replica whose share, left out, explains every wrong output (else all)."""
    replicas = len(ins[0])
    explains = [
        replica
        for replica in range(replicas)
        if all(
            not _wrong(out[i], sum(ins[i]) - ins[i][replica], scale[i], tolerance[i]) for i in wrong
        )
    ]
    return tuple(explains) if len(explains) == 1 else tuple(range(replicas))


def judge(
    step: int,
    copies: Sequence[Sequence[int]],
    ins: Sequence[Sequence[float]],
    out: Sequence[float],
    scale: Sequence[float],
    tolerance: Sequence[float],
) -> Optional[Finding]:
    """The finding of one check (None: the mirror is sound). Per output ``i`` of the batch:
    ``copies[i][r]`` replica r's exact fingerprint of its copy, ``ins[i][r]`` the linear
    fingerprint of its input, ``out[i]`` that of the output (replica 0's copy), ``scale[i]``
    the inputs' scale and ``tolerance[i]`` the relative tolerance for its dtype."""
    differ = _copies(copies)
    if differ:
        return Finding(COPIES, differ, step, "the replicas' copies of the result differ")
    wrong = [i for i in range(len(out)) if _wrong(out[i], sum(ins[i]), scale[i], tolerance[i])]
    if not wrong:
        return None
    named = _dropped(ins, out, scale, tolerance, wrong)
    if len(named) == 1:
        detail = f"the sum leaves out replica {named[0]}'s share"
    else:
        detail = "the sum is not the sum of the replicas' inputs"
    return Finding(SUM, named, step, f"{detail} ({len(wrong)} of {len(out)} outputs)")


def short(device: str) -> str:
    """``/job:localhost/replica:0/task:0/device:GPU:2`` as ``/device:GPU:2``; a multi-worker
    device keeps its task (``/job:worker/task:1/device:GPU:0``)."""
    job, _, tail = device.partition("/device:")
    if not tail:
        return device
    parts = [part for part in job.split("/") if part.startswith(("job:", "task:"))]
    local = not parts or parts[0] == "job:localhost"
    return ("" if local else "/" + "/".join(parts)) + "/device:" + tail


def named(replicas: Sequence[int], devices: Sequence[str]) -> str:
    """``replica 2 (/device:GPU:2)``, or ``replicas 0 and 1 (/device:CPU:0, /device:CPU:1)``."""
    where = ", ".join(short(devices[r]) for r in replicas if r < len(devices))
    if len(replicas) == 1:
        return f"replica {replicas[0]} ({where})"
    numbers = [str(r) for r in replicas]
    listed = ", ".join(numbers[:-1]) + " and " + numbers[-1]
    return f"replicas {listed} ({where})"


def where(finding: Finding, devices: Sequence[str]) -> str:
    """Where it went wrong, as records and ``run`` say it:
    ``replica 2 (/device:GPU:2) at step 18,400``."""
    return f"{named(finding.replicas, devices)} at step {finding.step:,}"


def _gpu_index(device: str) -> Optional[int]:
    kind, _, index = short(device).rpartition("/device:")[2].partition(":")
    return int(index) if kind == "GPU" and index.isdigit() else None


def take_out(finding: Finding, devices: Sequence[str], visible: Optional[str]) -> str:
    """What to take out when no other backend is left: the named GPUs, by the
    ``CUDA_VISIBLE_DEVICES`` that keeps the others (``visible``: its value now, None when
    unset), else the named devices from those the strategy mirrors over."""
    bad = ", ".join(short(devices[r]) for r in finding.replicas)
    gpus = [_gpu_index(device) for device in devices]
    named_gpus = {gpus[r] for r in finding.replicas}
    if None in gpus or None in named_gpus:
        return f"take {bad} out of the devices the strategy mirrors over"
    listed = [part.strip() for part in visible.split(",")] if visible else None
    keep = [
        listed[i] if listed and i < len(listed) else str(i)
        for i in sorted(set(gpus) - named_gpus)  # type: ignore[type-var]
    ]
    return f"take {bad} out: CUDA_VISIBLE_DEVICES={','.join(keep)}"


def _what(finding: Finding, devices: Sequence[str]) -> str:
    who = named(finding.replicas, devices)
    if finding.check == SUM:
        return finding.detail.replace(f"replica {finding.replicas[0]}'s", f"{who}'s", 1)
    if len(finding.replicas) == 1:
        return f"{who}'s copy of the result is not the other replicas'"
    return f"{who} hold copies of the result that differ"


def message(
    finding: Finding,
    backend: str,
    devices: Sequence[str],
    passed: Optional[Tuple[int, str]],
    then: str,
) -> str:
    """The ERROR (and the error's text): the step, the backend, the replicas and their
    devices, the check, the last check that passed (``passed``: its step and clock time)
    and ``then``, what follows (recorded or not, and what the next decision does)."""
    if passed is None:
        since = (
            "No check had passed yet in this process: the last checkpoint written before it "
            "started is the last one known good"
        )
    else:
        since = (
            f"The last check that passed was at step {passed[0]:,} ({passed[1]}): resume from "
            "the last checkpoint written before then, as later ones may hold updates made "
            "from wrong numbers"
        )
    return (
        f"training's all-reduce returned wrong numbers at step {finding.step:,} on backend "
        f"{backend} (check: {finding.check}): {_what(finding, devices)}. The step stopped "
        f"before its update. {since}. {then}"
    )
