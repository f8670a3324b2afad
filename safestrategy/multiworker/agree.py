"""The multi-worker rules, pure: (setting, every worker's facts and verdicts) -> what they agree.

Every worker runs these functions on the same messages (see
:mod:`safestrategy.multiworker.rendezvous`), so every worker reaches the same
answer. They are the inputs the one chooser (:mod:`safestrategy.choose`) takes
for multi-worker training: NCCL only where every worker has GPUs and kernels
(:func:`gate`) and its check passed on every worker (:func:`combine`), else
RING, in the words of :func:`why`. Nothing here imports TensorFlow or touches
the network: each path is tested from hand-built inputs.
"""

from typing import Any, Dict, List, Mapping, Optional, Sequence

from .. import choose, records
from .._env import ENV_COMMUNICATION, ENV_STALL_TIMEOUT, REMEDIES, Setting, untried
from ..backends import NCCL, NO_GPU, RING
from ..checks.allreduce import from_reply, wrong_sums
from ..checks.nccl import NO_KERNELS
from ..report import FAILED, NOT_TRIED, OK, SKIPPED, TIMEOUT, CandidateResult

RING_REASON = (
    "used without a check: RING is TensorFlow's collective over the gRPC connections "
    "between the workers, which cannot hang on NCCL's P2P/SHM/driver faults"
)


def shown(result: CandidateResult) -> CandidateResult:
    """``result`` as the report and the CLI show it: RING passes by rule for the chooser
    (:data:`RING_REASON`), but nothing was run, so it is ``not_tried`` (no time, no "ok")."""
    if result.name == RING and result.status == OK:
        return result._replace(status=NOT_TRIED)
    return result


#: Facts each worker sends in the first round (its "hello").
Hello = Mapping[str, Any]


def disagreement(hellos: Mapping[str, Hello]) -> Optional[str]:
    """Why the workers cannot agree (different TF_CONFIG clusters or settings), or None."""
    for field, what in (
        ("cluster", "the cluster (from a resolver, TF_CONFIG or Slurm)"),
        ("setting", f"the communication setting (communication= or {ENV_COMMUNICATION})"),
        ("stall_timeout", f"the stall timeout ({ENV_STALL_TIMEOUT}; None: off)"),
    ):
        values = {task: hello.get(field) for task, hello in hellos.items()}
        if len({repr(value) for value in values.values()}) > 1:
            each = "; ".join(f"{task}: {value}" for task, value in sorted(values.items()))
            return (
                f"the workers disagree on {what}, so they cannot make the same choice: {each}. "
                "Give every worker the same"
            )
    return None


def shared_gpus(hellos: Mapping[str, Hello], me: str) -> Optional[str]:
    """The WARNING for tasks on one host that see the same GPUs (each then mirrors over
    all of them, and they contend), said by the first of them only (``me``); else None.
    Hellos of 0.5 and earlier carry no host: nothing is said of them."""
    groups: Dict[Any, List[str]] = {}
    for task, hello in hellos.items():
        if hello.get("gpus") and hello.get("host") is not None:
            groups.setdefault((hello["host"], hello.get("visible_gpus")), []).append(task)
    for (host, visible), tasks in sorted(groups.items(), key=lambda item: repr(item[0])):
        if len(tasks) > 1 and me == tasks[0]:
            seen = (
                "CUDA_VISIBLE_DEVICES unset"
                if visible is None
                else f"CUDA_VISIBLE_DEVICES={visible}"
            )
            return (
                f"{' and '.join(tasks)} run on {host} and see the same GPUs ({seen} on each): "
                "every one of them trains on all of those GPUs, and they contend for them. Give "
                "each task its own (Slurm: srun --gpus-per-task=1; else CUDA_VISIBLE_DEVICES "
                "per task)"
            )
    return None


def gate(setting: Setting, hellos: Mapping[str, Hello]) -> Optional[CandidateResult]:
    """NCCL's result when it is known without running it, or None: run the check.

    Workers without GPUs: NCCL there proves nothing (TensorFlow quietly runs RING
    underneath), so ``auto`` skips it and a listed or forced ``nccl`` fails.
    """
    without = sorted(task for task, hello in hellos.items() if not hello.get("gpus"))
    if without:
        have = "has" if len(without) == 1 else "have"
        reason = f"{NO_GPU} ({', '.join(without)} {have} none)"
        return CandidateResult(NCCL, SKIPPED if setting.mode == "auto" else FAILED, reason)
    kernels = sorted(task for task, hello in hellos.items() if hello.get("nccl_kernels") == 0)
    if kernels:
        return CandidateResult(NCCL, FAILED, f"{NO_KERNELS} (on {', '.join(kernels)})")
    return None


def recorded(hellos: Mapping[str, Hello]) -> Dict[str, str]:
    """The communications some worker has a record of trouble for (only those a record
    fails: :data:`safestrategy.records.READ`), and what it says: the choice every worker
    makes avoids them together."""
    found: Dict[str, str] = {}
    for task, hello in sorted(hellos.items()):
        for record in hello.get("records") or ():
            name = record.get("backend")
            if name in records.READ and name not in found:
                remedy = _remedy(record)
                made = "".join(f" with {var}={value}" for var, value in remedy.items())
                found[name] = f"{task} recorded it: {record.get('happened')}{made}"
    return found


def _remedy(record: Mapping[str, Any]) -> Dict[str, str]:
    """The NCCL remedy a hello's record was made under (``{}``: none, or a worker of 0.4.0
    whose hello did not say)."""
    remedy = record.get("remedy")
    return {str(k): str(v) for k, v in remedy.items()} if isinstance(remedy, dict) else {}


def after_records(hellos: Mapping[str, Hello]) -> List[Dict[str, str]]:
    """The remedies NCCL is retried with after the workers' NCCL records, in order: those
    after the furthest any record was made under (so a remedy that stalled is never tried
    again), as :func:`remedy_attempts` allows them; none left: RING."""
    tried: Dict[str, str] = {}
    for hello in hellos.values():
        for record in hello.get("records") or ():
            if record.get("backend") == NCCL:
                tried.update(_remedy(record))
    allowed = remedy_attempts(hellos)[1:]
    return [remedy for remedy in untried(tried, {}) if remedy in allowed]


def expected_replicas(hellos: Mapping[str, Hello]) -> int:
    """The replicas MultiWorkerMirroredStrategy makes: one per GPU on every worker."""
    return sum(int(hello.get("gpus") or 0) for hello in hellos.values())


def remedy_attempts(hellos: Mapping[str, Hello]) -> List[Dict[str, str]]:
    """The environments to try NCCL's check in, in order: none, then each remedy.

    A remedy is tried only when every worker allows remedies
    (``SAFESTRATEGY_NCCL_REMEDIES``) and no worker's user set its variable.
    """
    attempts: List[Dict[str, str]] = [{}]
    if all(hello.get("remedies", True) for hello in hellos.values()):
        taken = {name for hello in hellos.values() for name in hello.get("user_nccl") or ()}
        attempts.extend({name: value} for name, value in REMEDIES if name not in taken)
    return attempts


def combine(
    verdicts: Mapping[str, Mapping[str, Any]], remedy: Mapping[str, str]
) -> CandidateResult:
    """One result from every worker's verdict on the same attempt: ok only if all passed."""
    results = {task: CandidateResult(**verdict) for task, verdict in verdicts.items()}
    seconds = max((r.seconds for r in results.values()), default=0.0)
    bad = {task: r for task, r in sorted(results.items()) if r.status != OK}
    if not bad:
        return CandidateResult(
            NCCL,
            OK,
            f"the cross-worker all-reduce summed right on all {len(results)} workers",
            seconds,
            remedy=dict(remedy),
        )
    status = TIMEOUT if any(r.status == TIMEOUT for r in bad.values()) else FAILED
    reason = "; ".join(f"{task}: {r.status}: {r.reason}" for task, r in bad.items())
    return CandidateResult(NCCL, status, reason, seconds)


def remediable(result: CandidateResult) -> bool:
    """A hang, a crash or an NCCL error: not a missing kernel, which no variable fixes."""
    return result.status in (FAILED, TIMEOUT) and "No OpKernel was registered" not in result.reason


def why(setting: Setting, chosen: Optional[str], results: Sequence[CandidateResult]) -> str:
    """Why the workers chose ``chosen``: the multi-worker words for the chooser."""
    if chosen is None:
        return "no communication passed its check on every worker"
    if chosen == NCCL:
        passed = "NCCL's cross-worker all-reduce passed its numeric check on every worker"
        return f"forced, and {passed}" if setting.mode == "forced" else passed
    if setting.mode == "forced":
        return "forced"
    before = [r for r in results if r.name != chosen and r.status != NOT_TRIED]
    if not before:
        return f"{chosen} first in the list"
    nccl = before[0]
    return f"nccl {nccl.status}: {nccl.reason.splitlines()[0] if nccl.reason else ''}"


def override_hint(setting: Setting) -> str:
    """How the caller chooses another communication, given who chose this time."""
    return choose.override_hint(setting, "communication", ENV_COMMUNICATION, RING)


def failure_message(
    workers: Sequence[str], results: Sequence[CandidateResult], setting: Setting
) -> str:
    """The ``NoWorkingBackendError`` message: every candidate and why it failed."""
    return choose.listing(
        f"no communication works across the workers {', '.join(workers)}:",
        results,
        f"To choose another, {override_hint(setting)}. Run `python -m safestrategy` on every "
        "worker (TF_CONFIG set) for the full report.",
    )


def judge(reply: Mapping[str, Any], replicas: int, seconds: float) -> CandidateResult:
    """This worker's verdict on its probe process's cross-worker all-reduce reply,
    ``replicas`` being expected."""
    seconds = round(seconds, 3)
    if "values" not in reply:
        return from_reply(NCCL, reply, replicas, seconds)
    if reply.get("replicas") != replicas:
        reason = f"{reply.get('replicas')} replicas in sync, expected {replicas} (one per GPU)"
        return CandidateResult(NCCL, FAILED, reason, seconds)
    local = len(reply["values"])
    wrong = wrong_sums(reply["values"], replicas, local or 1)
    if wrong:
        return CandidateResult(NCCL, FAILED, wrong, seconds)
    expected = replicas * (replicas + 1) / 2
    return CandidateResult(NCCL, OK, f"{local} local replicas got {expected:g}", seconds)
