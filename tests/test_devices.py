"""What the factory mirrors over by default: TensorFlow's own ``MirroredStrategy()`` rule,
per release, from hand-built facts, and through the factory with the GPU listing faked
(the real comparison with stock is in test_strategy_tf2.py / test_strategy_tf1.py)."""

import pytest

import safestrategy
from safestrategy._devices import Device, mirrored_default
from safestrategy._tf import mirrors_every_cpu

CPU0, CPU1, CPU2 = (Device("CPU", i) for i in range(3))
GPU0, GPU1 = Device("GPU", 0), Device("GPU", 1)


@pytest.mark.parametrize(
    "version, every_cpu",
    [
        ("1.12.3", False),
        ("1.15.5", False),
        ("2.0.4", False),
        ("2.1.0rc1", True),
        ("2.1.0", True),
        ("2.10.1", True),
        ("2.21.0", True),
    ],
)
def test_every_logical_cpu_from_2_1_else_cpu_0_where_there_is_no_gpu(version, every_cpu):
    rule = mirrors_every_cpu(version)
    assert rule is every_cpu
    expected = (CPU0, CPU1, CPU2) if every_cpu else (CPU0,)
    assert mirrored_default((), (CPU0, CPU1, CPU2), rule) == expected
    assert mirrored_default((GPU0, GPU1), (CPU0, CPU1, CPU2), rule) == (GPU0, GPU1)


def test_every_logical_gpu_and_no_cpu_through_the_factory(fake):
    # the fake TensorFlow lists logical GPUs 0-3; this process also has logical CPUs (TF2)
    fake("ok")
    report = safestrategy.probe(backend="nccl")
    assert report.devices == tuple(f"/device:GPU:{i}" for i in range(4))
    assert report.backend == "nccl"
