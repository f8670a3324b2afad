"""SAFESTRATEGY_* settings and device names: parsing, precedence, errors. No TensorFlow."""

import pytest

from safestrategy import BACKEND_NAMES
from safestrategy._devices import Device, parse_devices
from safestrategy._env import (
    DEFAULT_TIMEOUT,
    ENV_BACKEND,
    ENV_CACHE,
    ENV_CACHE_DIR,
    ENV_COMMUNICATION,
    ENV_NCCL_REMEDIES,
    ENV_TIMEOUT,
    MAX_TIMEOUT,
    Setting,
    cache_dir,
    resolve_backend,
    resolve_communication,
    resolve_payload_mb,
    resolve_switch,
    resolve_timeout,
    xla_auto_jit_flag,
)


def test_default_is_auto_in_table_order():
    assert resolve_backend(None, {}) == Setting("auto", BACKEND_NAMES, "default")
    assert BACKEND_NAMES == (
        "collective",
        "nccl",
        "hierarchical_copy",
        "reduce_to_gpu",
        "reduce_to_cpu",
    )


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


def test_auto_in_a_list_says_it_cannot_be_combined():
    with pytest.raises(ValueError, match="'auto' cannot be combined with other names"):
        resolve_backend("auto,nccl", {})


def test_an_empty_argument_is_an_error_but_a_blank_env_value_is_unset():
    with pytest.raises(ValueError, match="unknown name ''"):
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


@pytest.mark.parametrize("bad", [True, False, 1e10, MAX_TIMEOUT * 2, "1e10"])
def test_timeouts_no_platform_can_wait_and_booleans_are_refused(bad):
    with pytest.raises(ValueError, match=f"up to {MAX_TIMEOUT:g}"):
        resolve_timeout(bad, {})
    assert resolve_timeout(MAX_TIMEOUT, {}) == MAX_TIMEOUT


def test_communication_has_the_backend_grammar_with_its_own_names_and_variable():
    assert resolve_communication(None, {}) == Setting("auto", ("nccl", "ring"), "default")
    env = {ENV_COMMUNICATION: " RING "}
    assert resolve_communication(None, env) == Setting("forced", ("ring",), "env")
    assert resolve_communication("nccl,ring", env).mode == "list"
    with pytest.raises(ValueError, match=f"unknown name 'gloo'.*{ENV_COMMUNICATION}") as error:
        resolve_communication(None, {ENV_COMMUNICATION: "gloo"})
    assert "auto, nccl, ring" in str(error.value)


@pytest.mark.parametrize("variable", [ENV_CACHE, ENV_NCCL_REMEDIES])
def test_switches_are_on_by_default_and_take_on_or_off_only(variable):
    assert resolve_switch(variable, None, {}) is True
    assert resolve_switch(variable, None, {variable: " OFF "}) is False
    assert resolve_switch(variable, None, {variable: ""}) is True
    assert resolve_switch(variable, False, {variable: "on"}) is False
    with pytest.raises(ValueError, match=f"'no' from the environment variable {variable}"):
        resolve_switch(variable, None, {variable: "no"})


def test_the_cache_directory_is_the_variable_else_the_user_cache(tmp_path):
    assert cache_dir({ENV_CACHE_DIR: str(tmp_path)}) == str(tmp_path)
    default = cache_dir({})
    assert default.endswith("safestrategy") and "cache" in default.lower()


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


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "lots", "99999"])
def test_a_bad_payload_size_is_a_value_error_naming_the_variable(value):
    with pytest.raises(
        ValueError,
        match=f"payload '{value}' from the environment variable "
        "SAFESTRATEGY_PAYLOAD_MB is not valid",
    ):
        resolve_payload_mb({"SAFESTRATEGY_PAYLOAD_MB": value})


def test_the_payload_size_defaults_to_32_mb_and_takes_fractions():
    assert resolve_payload_mb({}) == resolve_payload_mb({"SAFESTRATEGY_PAYLOAD_MB": " "}) == 32.0
    assert resolve_payload_mb({"SAFESTRATEGY_PAYLOAD_MB": " 0.5 "}) == 0.5


@pytest.mark.parametrize(
    "flags, on",
    [
        ("--tf_xla_auto_jit=2", True),
        ("--tf_xla_cpu_global_jit --tf_xla_auto_jit=1", True),
        ("--tf_xla_auto_jit=-1", False),
        ("--tf_xla_auto_jit=0", False),
        ("", False),
        ("--tf_xla_auto_jit=fusible", True),
    ],
)
def test_xla_auto_clustering_is_read_from_tf_xla_flags(flags, on):
    assert xla_auto_jit_flag({"TF_XLA_FLAGS": flags}) is on
