"""SAFESTRATEGY_* settings and device names: parsing, precedence, errors. No TensorFlow."""

import pytest

from safestrategy import BACKEND_NAMES
from safestrategy._devices import Device, parse_devices
from safestrategy._env import (
    DEFAULT_TIMEOUT,
    ENV_BACKEND,
    ENV_TIMEOUT,
    Setting,
    resolve_backend,
    resolve_timeout,
)


def test_default_is_auto_in_table_order():
    assert resolve_backend(None, {}) == Setting("auto", BACKEND_NAMES, "default")
    assert BACKEND_NAMES == ("nccl", "hierarchical_copy", "reduce_to_gpu", "reduce_to_cpu")


def test_argument_beats_env_beats_default():
    env = {ENV_BACKEND: "reduce_to_cpu"}
    assert resolve_backend("nccl", env) == Setting("forced", ("nccl",), "argument")
    assert resolve_backend(None, env) == Setting("forced", ("reduce_to_cpu",), "env")
    assert resolve_backend(None, {ENV_BACKEND: "  "}).source == "default"


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_every_name_can_be_forced(name):
    assert resolve_backend(name, {}) == Setting("forced", (name,), "argument")


def test_case_whitespace_and_lists():
    env = {ENV_BACKEND: " NCCL , Reduce_To_CPU\n"}
    assert resolve_backend(None, env) == Setting("list", ("nccl", "reduce_to_cpu"), "env")
    assert resolve_backend(" AUTO ", {}).mode == "auto"


BAD_VALUES = ["ncl", "nccl,,reduce_to_cpu", "nccl;reduce_to_cpu", "nccl reduce_to_cpu", "auto,nccl"]


@pytest.mark.parametrize("value", BAD_VALUES)
@pytest.mark.parametrize("source", ["argument", "env"])
def test_bad_values_name_source_value_and_every_valid_name(value, source):
    with pytest.raises(ValueError) as error:
        if source == "argument":
            resolve_backend(value, {})
        else:
            resolve_backend(None, {ENV_BACKEND: value})
    message = str(error.value)
    assert ("the argument" if source == "argument" else ENV_BACKEND) in message
    assert repr(value) in message
    for name in ("auto", *BACKEND_NAMES):
        assert name in message


def test_an_empty_argument_is_an_error_but_a_blank_env_value_is_unset():
    with pytest.raises(ValueError, match="unknown backend ''"):
        resolve_backend("", {})
    assert resolve_backend(None, {ENV_BACKEND: ""}).mode == "auto"


def test_a_name_listed_twice_is_an_error():
    with pytest.raises(ValueError, match="listed twice"):
        resolve_backend("nccl,nccl", {})


def test_timeout_precedence_and_validation():
    assert resolve_timeout(None, {}) == DEFAULT_TIMEOUT
    assert resolve_timeout(None, {ENV_TIMEOUT: " 2.5 "}) == 2.5
    assert resolve_timeout(7, {ENV_TIMEOUT: "2.5"}) == 7
    for bad in ("0", "-1", "soon", "nan", "inf"):
        with pytest.raises(ValueError, match=f"{ENV_TIMEOUT}.*positive number") as error:
            resolve_timeout(None, {ENV_TIMEOUT: bad})
        assert repr(bad) in str(error.value)
    with pytest.raises(ValueError, match="from the argument"):
        resolve_timeout(0, {})


def test_device_names():
    assert parse_devices(["/gpu:0", "GPU:1", "/device:CPU:0"]) == (
        Device("GPU", 0),
        Device("GPU", 1),
        Device("CPU", 0),
    )
    assert str(parse_devices(["/job:localhost/replica:0/task:0/device:GPU:3"])[0]) == (
        "/device:GPU:3"
    )
    for bad in (["gpu"], ["/job:worker/task:1/device:GPU:0"], [], ["/gpu:0", "/device:GPU:0"]):
        with pytest.raises(ValueError):
            parse_devices(bad)
    with pytest.raises(ValueError, match="list of device names"):
        parse_devices("/gpu:0")
