"""What one check of the mirror shows (safestrategy.mirror.verdict): pure, from numbers."""

import pytest

from safestrategy import _env
from safestrategy.mirror import verdict
from safestrategy.mirror.verdict import COPIES, SUM, Finding

GPUS = tuple(f"/job:localhost/replica:0/task:0/device:GPU:{i}" for i in range(4))
FLOAT32 = verdict.tolerance("float32")


def judged(copies, ins, out, scale=None):
    scale = scale or [sum(abs(x) for x in row) for row in ins]
    return verdict.judge(7, copies, ins, out, scale, [FLOAT32] * len(out))


def test_copies_name_the_odd_one_out_and_two_replicas_name_the_pair():
    assert judged([[5, 5, 5]], [[1.0, 2.0, 3.0]], [6.0]) is None
    assert judged([[5, 9, 5], [3, 3, 3]], [[1.0, 2.0, 3.0]] * 2, [6.0] * 2) == Finding(
        COPIES, (1,), 7, "the replicas' copies of the result differ"
    )
    assert judged([[5, 9]], [[1.0, 2.0]], [3.0]).replicas == (0, 1)
    assert judged([[1, 2, 3]], [[1.0, 2.0, 3.0]], [6.0]).replicas == (0, 1, 2)  # no majority
    assert verdict.odd_ones([4, 4, 4, 8]) == (3,)


def test_a_sum_wrong_the_same_way_everywhere_names_the_share_left_out():
    dropped = judged([[5, 5, 5]], [[1.0, 2.0, 3.0]], [3.0])  # replica 2's 3.0 is missing
    assert (dropped.check, dropped.replicas) == (SUM, (2,))
    assert dropped.detail == "the sum leaves out replica 2's share (1 of 1 outputs)"
    wrong = judged([[5, 5]], [[1.0, 2.0]], [30.0])
    assert (wrong.check, wrong.replicas) == (SUM, (0, 1))
    assert judged([[5, 5]], [[1.0, 2.0]], [float("nan")]).check == SUM
    # loss scaling overflowed (the step is skipped): no sum to hold the output to
    assert judged([[5, 5]], [[float("inf"), 2.0]], [float("nan")]) is None
    # float32 reassociation is far inside the tolerance; a half-precision output gets more
    assert judged([[5, 5]], [[1.0, 2.0]], [3.0 * (1 + 1e-6)]) is None
    assert verdict.tolerance("float16") > verdict.tolerance("bfloat16") / 10 > FLOAT32


def test_the_words_name_step_backend_replicas_devices_check_and_what_follows():
    finding = Finding(COPIES, (2,), 18400, "x")
    assert verdict.where(finding, GPUS) == "replica 2 (/device:GPU:2) at step 18,400"
    text = verdict.message(finding, "nccl", GPUS, (18300, "10:04:05"), "Recorded.")
    assert text.startswith(
        "training's all-reduce returned wrong numbers at step 18,400 on backend nccl "
        "(check: copies agree): replica 2 (/device:GPU:2)'s copy of the result is not the "
        "other replicas'. The step stopped before its update. The last check that passed "
        "was at step 18,300 (10:04:05)"
    )
    assert text.endswith("Recorded.")
    pair = verdict.message(Finding(COPIES, (0, 1), 3, "x"), "nccl", GPUS, None, "")
    assert "replicas 0 and 1 (/device:GPU:0, /device:GPU:1) hold copies" in pair
    assert "No check had passed yet" in pair
    left_out = Finding(SUM, (1,), 3, "the sum leaves out replica 1's share (2 of 9 outputs)")
    assert "the sum leaves out replica 1 (/device:GPU:1)'s share" in verdict.message(
        left_out, "nccl", GPUS, None, ""
    )
    assert verdict.short("/job:worker/replica:0/task:1/device:GPU:0") == (
        "/job:worker/task:1/device:GPU:0"
    )


def test_the_last_resort_names_what_to_take_out():
    finding = Finding(COPIES, (2,), 3, "x")
    assert verdict.take_out(finding, GPUS, None) == (
        "take /device:GPU:2 out: CUDA_VISIBLE_DEVICES=0,1,3"
    )
    assert verdict.take_out(finding, GPUS, "3,5,6,7").endswith("CUDA_VISIBLE_DEVICES=3,5,7")
    cpus = ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]
    assert verdict.take_out(finding, cpus, None) == (
        "take /device:CPU:2 out of the devices the strategy mirrors over"
    )


def test_the_frequency_setting():
    assert _env.resolve_verify_every({}) == _env.DEFAULT_VERIFY_EVERY == 100
    assert _env.resolve_verify_every({_env.ENV_VERIFY_EVERY: " 25 "}) == 25
    assert _env.resolve_verify_every({_env.ENV_VERIFY_EVERY: "OFF"}) is None
    for bad in ("0", "-3", "2.5", "often", "2000000"):
        with pytest.raises(ValueError, match=f"{bad!r} from the environment variable "):
            _env.resolve_verify_every({_env.ENV_VERIFY_EVERY: bad})
