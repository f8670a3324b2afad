"""safestrategy.nccl_ops against TensorFlow's own nccl_ops, on real TensorFlow.

NcclAllReduce has no kernel for CPU devices, so over logical CPUs TensorFlow's
nccl_ops dies with the seed's error, exactly as on a GPU box without NCCL, and
ours has to give the right numbers instead. Graph mode runs everywhere (TF1,
and TF2 through ``tf.compat.v1``); eager and ``tf.function`` run on TF2.
GPU device sets are built in graph mode, where no GPU is needed until a
session runs, with the smoke check replaced where its outcome matters.
"""

import inspect
import json
import logging

import numpy as np
import pytest

import safestrategy
from safestrategy import nccl_ops
from safestrategy._devices import parse_devices
from safestrategy._env import resolve_backend
from safestrategy.checks import nccl as _nccl
from safestrategy.report import FAILED, OK, CandidateResult

from .conftest import ROOT, run_python

SEED_ERROR = "No OpKernel was registered to support Op 'NcclAllReduce'"
FUNCTIONS = ("all_sum", "all_prod", "all_min", "all_max", "reduce_sum", "broadcast")
ALL_REDUCE = {"all_sum": np.sum, "all_prod": np.prod, "all_min": np.min, "all_max": np.max}
GPUS = ["/gpu:0", "/gpu:1"]


def cpus(n):
    return [f"/cpu:{i}" for i in range(n)]


def compat_v1(tf):
    """The TF1 API: ``tf.compat.v1`` where it exists (TF >= 1.13), else ``tf``."""
    return getattr(getattr(tf, "compat", None), "v1", tf)


def session(tf, n=3, soft=False):
    """A TF1-style session with ``n`` CPU devices (soft placement: GPU ops land on CPUs)."""
    v1 = compat_v1(tf)
    config = v1.ConfigProto(device_count={"CPU": n}, allow_soft_placement=soft)
    return v1.Session(config=config)


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """Each test decides afresh, with no SAFESTRATEGY_BACKEND from the caller's shell."""
    monkeypatch.setattr(nccl_ops, "_decisions", {})
    monkeypatch.delenv("SAFESTRATEGY_BACKEND", raising=False)


@pytest.fixture(scope="session")
def tf_nccl(tf):
    """TensorFlow's own nccl_ops module (contrib on TF 1.12)."""
    return nccl_ops._tf_nccl_ops()


@pytest.fixture(params=["graph", "eager", "function"])
def mode(request, tf):
    """How ops run: graph mode in a Session everywhere; eagerly and in tf.function on TF2."""
    if request.param != "graph" and not tf.__version__.startswith("2."):
        pytest.skip(f"{request.param} mode needs TF2; this is TF {tf.__version__}")
    return request.param


def evaluate(tf, mode, build, n=3):
    """``build()``'s tensors as numpy: in a Session (graph), eagerly, or in a tf.function."""
    if mode == "graph":
        with tf.Graph().as_default():
            out = build()
            with session(tf, n) as sess:
                return sess.run(out)
    out = tf.function(build)() if mode == "function" else build()
    return [t.numpy() for t in out] if isinstance(out, (list, tuple)) else out.numpy()


def placed(tf, arrays, devices=None):
    """One constant per array, array *i* on ``/cpu:i`` (or ``devices[i]``)."""
    tensors = []
    for array, device in zip(arrays, devices or cpus(len(arrays))):
        with tf.device(device):
            tensors.append(tf.constant(array))
    return tensors


def inputs(n, seed=0):
    """``n`` float32 arrays of shape (2, 3), near 1 so that products stay tame."""
    rng = np.random.RandomState(seed)
    return [rng.uniform(0.5, 1.5, size=(2, 3)).astype(np.float32) for _ in range(n)]


# --- the contract: signatures, import cost, errors ---------------------------------------


@pytest.mark.parametrize("name", FUNCTIONS)
def test_signature_matches_tensorflow(tf_nccl, name):
    def shape(function):
        return [
            (p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()
        ]

    assert shape(getattr(nccl_ops, name)) == shape(getattr(tf_nccl, name))


def test_public_names_are_tensorflows():
    assert sorted(nccl_ops.__all__) == sorted(FUNCTIONS)


def test_import_loads_no_tensorflow():
    code = "import sys, safestrategy.nccl_ops; print('tensorflow' in sys.modules)"
    done = run_python("-c", code)
    assert (done.returncode, done.stdout.strip()) == (0, "False"), done.stderr


@pytest.mark.parametrize("name", FUNCTIONS[:5])
def test_empty_list_raises_as_tensorflow(tf_nccl, name):
    with pytest.raises(ValueError) as theirs:
        getattr(tf_nccl, name)([])
    with pytest.raises(ValueError) as ours:
        getattr(nccl_ops, name)([])
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_tensor_without_device_raises_as_tensorflow(tf, tf_nccl, name):
    with tf.Graph().as_default():
        tensor = tf.constant([1.0])
        args = tensor if name == "broadcast" else [tensor, tensor]
        with pytest.raises(ValueError) as theirs:
            getattr(tf_nccl, name)(args)
        with pytest.raises(ValueError) as ours:
            getattr(nccl_ops, name)(args)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_unsupported_dtype_raises_as_tensorflow(tf, tf_nccl, name):
    with tf.Graph().as_default():
        tensors = placed(tf, [[True], [False]])
        args = tensors[0] if name == "broadcast" else tensors
        with pytest.raises(TypeError) as theirs, tf.device("/cpu:0"):
            getattr(tf_nccl, name)(args)
        with pytest.raises(TypeError) as ours, tf.device("/cpu:0"):
            getattr(nccl_ops, name)(args)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("name", FUNCTIONS[:5])
def test_mixed_dtypes_or_shapes_are_a_clear_value_error(tf, name):
    with tf.Graph().as_default():
        mixed_dtypes = placed(tf, [np.ones(2, np.float32), np.ones(2, np.float64)])
        with pytest.raises(
            ValueError, match="one dtype: tensor 0 is float32 but tensor 1 is float64"
        ):
            getattr(nccl_ops, name)(mixed_dtypes)
        mixed_shapes = placed(tf, [np.ones(2, np.float32), np.ones(3, np.float32)])
        with pytest.raises(ValueError, match=r"one shape: tensor 0 has shape \(2,\)"):
            getattr(nccl_ops, name)(mixed_shapes)


@pytest.mark.parametrize("shape", [(0,), (2, 0)])
def test_zero_sized_tensors_give_empty_results_without_a_decision(tf, mode, shape):
    def build():
        tensors = placed(tf, [np.zeros(shape, np.float32)] * 3)
        out = nccl_ops.all_sum(tensors)
        assert [t.device for t in out] == [t.device for t in tensors]
        return out

    assert [v.shape for v in evaluate(tf, mode, build)] == [shape] * 3
    assert nccl_ops._decisions == {}


# --- the numbers, on 2 and 3 devices, in every mode ---------------------------------------


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", sorted(ALL_REDUCE))
def test_all_reduce_matches_numpy_on_each_inputs_device(tf, mode, name, n):
    arrays = inputs(n)

    def build():
        tensors = placed(tf, arrays)
        out = getattr(nccl_ops, name)(tensors)
        assert [t.device for t in out] == [t.device for t in tensors]
        return out

    expected = ALL_REDUCE[name](np.stack(arrays), axis=0)
    for value in evaluate(tf, mode, build, n):
        np.testing.assert_allclose(value, expected, rtol=1e-6)


@pytest.mark.parametrize("n", [2, 3])
def test_reduce_sum_matches_numpy_on_the_current_device(tf, mode, n):
    arrays = inputs(n)

    def build():
        tensors = placed(tf, arrays)
        with tf.device(tensors[-1].device):
            result = nccl_ops.reduce_sum(tensors)
        assert result.device == tensors[-1].device
        return result

    np.testing.assert_allclose(evaluate(tf, mode, build, n), np.sum(arrays, axis=0), rtol=1e-6)


def test_reduce_sum_off_the_inputs_devices_raises_as_tensorflow(tf, tf_nccl):
    with tf.Graph().as_default():
        tensors = placed(tf, inputs(2))
        with pytest.raises(ValueError) as theirs:
            tf_nccl.reduce_sum(tensors)
        with pytest.raises(ValueError) as ours:
            nccl_ops.reduce_sum(tensors)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("n", [2, 3])
def test_broadcast_matches_numpy_on_every_device(tf, mode, n):
    (array,) = inputs(1)

    def build():
        (tensor,) = placed(tf, [array], ["/cpu:1"])
        sent = nccl_ops.broadcast(tensor)
        assert sent.device == tensor.device
        received = []
        for device in cpus(n):
            with tf.device(device):
                received.append(tf.identity(sent))
        return received

    for value in evaluate(tf, mode, build, n):
        np.testing.assert_array_equal(value, array)


# --- gradients ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
def test_gradient_through_all_sum_is_analytic(tf, mode, n):
    """loss = sum_i <w_i, all_sum(x)_i>, so d loss / d x_j = sum_i w_i for every j."""
    arrays, weights = inputs(n, seed=1), inputs(n, seed=2)

    def loss_of(tensors):
        out = nccl_ops.all_sum(tensors)
        return tf.add_n([tf.reduce_sum(w * y) for w, y in zip(weights, out)])

    def build():
        tensors = placed(tf, arrays)
        if mode == "graph":
            return compat_v1(tf).gradients(loss_of(tensors), tensors)
        with tf.GradientTape() as tape:
            tape.watch(tensors)
            loss = loss_of(tensors)
        return tape.gradient(loss, tensors)

    for gradient in evaluate(tf, mode, build, n):
        np.testing.assert_allclose(gradient, np.sum(weights, axis=0), rtol=1e-6)


@pytest.mark.parametrize("name", ["all_prod", "all_min", "all_max"])
def test_other_reductions_have_no_gradient_as_with_nccl(tf, name):
    with tf.Graph().as_default():
        tensors = placed(tf, inputs(2))
        out = getattr(nccl_ops, name)(tensors)
        with pytest.raises(LookupError, match="except for reduction"):
            compat_v1(tf).gradients(out[0], tensors)


# --- StyleGAN's optimizer pattern, TF1 graph mode (tf.compat.v1 on TF2) -------------------

BATCH = 12
X = np.linspace(-1.0, 1.0, BATCH * 4, dtype=np.float32).reshape(BATCH, 4)
Y = (X @ np.array([[0.5], [-1.0], [2.0], [0.25]], dtype=np.float32) + 0.3).astype(np.float32)
STEPS = 5


def stylegan_weights(tf, nccl, n):
    """Train y = xW + b as dnnlib/tflib/optimizer.py does; every replica's final (W, b).

    One variable copy and one Adam per device, each device's gradients scaled
    by 1/n, summed across devices with ``nccl.all_sum``, applied per device.
    ``nccl=None`` with ``n=1`` is the single-device run (no sum, as StyleGAN).
    """
    v1 = compat_v1(tf)
    with tf.Graph().as_default():
        replicas, dev_grads = [], []
        for i, (device, rows) in enumerate(zip(cpus(n), np.split(np.arange(BATCH), n))):
            with tf.device(device), v1.variable_scope(f"replica{i}"):
                w = v1.get_variable("w", initializer=np.ones((4, 1), np.float32))
                b = v1.get_variable("b", initializer=np.zeros((1,), np.float32))
                error = tf.matmul(tf.constant(X[rows]), w) + b - tf.constant(Y[rows])
                grads = v1.gradients(tf.reduce_mean(tf.square(error)), [w, b])
                dev_grads.append([g * np.float32(1.0 / n) for g in grads])
                replicas.append([w, b])
        if nccl is not None:
            with tf.name_scope("SumAcrossGPUs"), v1.device(None):
                summed = [nccl.all_sum([grads[k] for grads in dev_grads]) for k in range(2)]
            dev_grads = [[summed[k][i] for k in range(2)] for i in range(n)]
        updates = []
        for i, device in enumerate(cpus(n)):
            with tf.device(device):
                optimizer = v1.train.AdamOptimizer(0.05, name=f"Adam{i}")
                updates.append(optimizer.apply_gradients(list(zip(dev_grads[i], replicas[i]))))
        train = tf.group(*updates)
        with session(tf, n) as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(STEPS):
                sess.run(train)
            return sess.run(replicas)


@pytest.fixture(scope="module")
def single_device_weights(tf):
    return stylegan_weights(tf, None, 1)[0]


@pytest.mark.parametrize("n", [2, 3])
def test_stylegan_optimizer_dies_with_tensorflows_nccl_ops(tf, tf_nccl, n):
    with pytest.raises(tf.errors.InvalidArgumentError, match=SEED_ERROR):
        stylegan_weights(tf, tf_nccl, n)


@pytest.mark.parametrize("n", [2, 3])
def test_stylegan_optimizer_trains_like_one_device_with_ours(tf, single_device_weights, n):
    replicas = stylegan_weights(tf, nccl_ops, n)
    for weights in replicas[1:]:
        for ours, first in zip(weights, replicas[0]):
            np.testing.assert_array_equal(ours, first)
    for ours, expected in zip(replicas[0], single_device_weights):
        np.testing.assert_allclose(ours, expected, atol=1e-6)
    assert not np.allclose(single_device_weights[0], 1.0), "training changed nothing"


# --- choosing NCCL or reduce-and-copy -----------------------------------------------------


def setting(value=None):
    return resolve_backend(value, {})


def refuse(devices):
    raise AssertionError(f"smoke check must not run for {devices}")


def test_decide_uses_nccl_where_its_smoke_check_passes():
    checked = []

    def check(devices):
        checked.append(devices)
        return CandidateResult("nccl", OK, "all 2 replicas got the right sum")

    decision = nccl_ops._decide(["/device:GPU:1", "/gpu:0"], setting(), check)
    assert decision.nccl and "smoke check passed" in decision.reason
    assert checked == [parse_devices(["/gpu:1", "/gpu:0"])]


def test_decide_falls_back_with_the_first_line_of_why():
    failure = CandidateResult("nccl", FAILED, f"InvalidArgumentError: {SEED_ERROR}\nmore")
    decision = nccl_ops._decide(GPUS, setting(), lambda devices: failure)
    assert not decision.nccl
    assert decision.reason == f"InvalidArgumentError: {SEED_ERROR}"
    assert decision.check == failure and decision.reduce_on is None


@pytest.mark.parametrize(
    ("devices", "why"),
    [
        (["/cpu:0", "/cpu:1"], "every tensor on a GPU, and one is on /device:CPU:0"),
        (["/gpu:0", "/cpu:0"], "every tensor on a GPU, and one is on /device:CPU:0"),
        (["/gpu:0"], "one tensor"),
        (["/gpu:0", "/device:GPU:0"], "its own GPU"),
        (["/job:worker/task:1/device:GPU:0", "/gpu:0"], "local GPUs"),
    ],
)
def test_decide_never_probes_where_nccl_cannot_apply(devices, why):
    decision = nccl_ops._decide(devices, setting(), refuse)
    assert not decision.nccl and why in decision.reason and decision.check is None


@pytest.mark.parametrize(
    ("value", "nccl", "reduce_on"),
    [
        ("reduce_to_cpu", False, "/device:CPU:0"),
        ("hierarchical_copy", False, None),
        ("reduce_to_gpu,nccl", False, None),
    ],
)
def test_decide_obeys_the_backend_setting_without_probing(value, nccl, reduce_on):
    decision = nccl_ops._decide(GPUS, setting(value), refuse)
    assert (decision.nccl, decision.reduce_on) == (nccl, reduce_on)


def test_a_forced_nccl_is_checked_like_the_factorys():
    passed = CandidateResult("nccl", OK, "all 2 replicas got the right sum")
    assert nccl_ops._decide(GPUS, setting("nccl"), lambda devices: passed).nccl
    failure = CandidateResult("nccl", FAILED, f"InvalidArgumentError: {SEED_ERROR}")
    with pytest.raises(safestrategy.NoWorkingBackendError, match="forces NCCL") as error:
        nccl_ops._decide(GPUS, setting("nccl"), lambda devices: failure)
    assert SEED_ERROR in str(error.value) and "nccl,reduce_to_cpu" in str(error.value)
    with pytest.raises(safestrategy.NoWorkingBackendError, match="one is on /device:CPU:0"):
        nccl_ops._decide(["/cpu:0", "/cpu:1"], setting("nccl"), refuse)


def test_a_listed_fallback_chooses_where_to_reduce():
    failure = CandidateResult("nccl", FAILED, "no NCCL")
    decision = nccl_ops._decide(GPUS, setting("nccl,reduce_to_cpu"), lambda devices: failure)
    assert (decision.nccl, decision.reduce_on) == (False, "/device:CPU:0")


def test_the_setting_comes_from_the_environment(tf, monkeypatch):
    monkeypatch.setenv("SAFESTRATEGY_BACKEND", "bogus")
    with tf.Graph().as_default(), pytest.raises(ValueError, match="SAFESTRATEGY_BACKEND"):
        nccl_ops.all_sum(placed(tf, inputs(2)))


def fake_check(monkeypatch, result):
    """Replace the smoke check; returns the list of device sets it was asked about."""
    calls = []

    def check(devices):
        calls.append(devices)
        return result

    monkeypatch.setattr(nccl_ops, "_smoke_check", check)
    return calls


def test_failed_check_warns_once_per_device_set_and_reduces_correctly(tf, monkeypatch, caplog):
    failure = CandidateResult("nccl", FAILED, f"InvalidArgumentError: {SEED_ERROR}\nmore")
    calls = fake_check(monkeypatch, failure)
    arrays = inputs(2)
    caplog.set_level(logging.INFO, logger="safestrategy")
    with tf.Graph().as_default():
        first = nccl_ops.all_sum(placed(tf, arrays, GPUS))
        again = nccl_ops.all_sum(placed(tf, arrays, GPUS[::-1]))
        assert [t.device for t in first] == ["/device:GPU:0", "/device:GPU:1"]
        with session(tf, soft=True) as sess:  # no GPU here: soft placement puts it on the CPU
            values = sess.run(first + again)
    assert len(calls) == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    for part in ("/device:GPU:0, /device:GPU:1", SEED_ERROR, "first input's device"):
        assert part in message
    assert "more" not in message and "SAFESTRATEGY_BACKEND=reduce_to_cpu" in message
    assert "--refresh" in message
    for value in values:
        np.testing.assert_allclose(value, np.sum(arrays, axis=0), rtol=1e-6)


def test_passed_check_uses_tensorflows_nccl_ops_and_its_gradient(tf, monkeypatch, caplog):
    calls = fake_check(monkeypatch, CandidateResult("nccl", OK, "all 2 replicas got the right sum"))
    caplog.set_level(logging.INFO, logger="safestrategy")
    with tf.Graph().as_default():
        tensors = placed(tf, inputs(2), GPUS)
        out = nccl_ops.all_sum(tensors)
        assert [t.op.type for t in out] == ["NcclAllReduce"] * 2
        assert [t.device for t in out] == [t.device for t in tensors]
        sums = []
        for tensor in out:  # TF's NcclAllReduce gradient wants each gradient on its device
            with tf.device(tensor.device):
                sums.append(tf.reduce_sum(tensor))
        grads = compat_v1(tf).gradients(sums, tensors, colocate_gradients_with_ops=True)
        assert {g.op.type for g in grads} == {"NcclAllReduce"}
    assert len(calls) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_forcing_nccl_on_cpus_raises_before_tensorflow_can(tf, monkeypatch):
    monkeypatch.setenv("SAFESTRATEGY_BACKEND", "nccl")
    monkeypatch.setattr(nccl_ops, "_smoke_check", refuse)
    with tf.Graph().as_default(), pytest.raises(safestrategy.NoWorkingBackendError):
        nccl_ops.all_sum(placed(tf, inputs(2)))


def test_forcing_nccl_eagerly_on_cpus_raises_before_tensorflow_can(tf2, monkeypatch):
    monkeypatch.setenv("SAFESTRATEGY_BACKEND", "nccl")
    with pytest.raises(safestrategy.NoWorkingBackendError, match="SAFESTRATEGY_BACKEND=nccl"):
        nccl_ops.all_sum(placed(tf2, inputs(2)))


def test_eager_reduce_sum_is_the_equivalent_even_when_nccl_is_forced(tf2, monkeypatch):
    """TF's NcclReduce kernel is a stub replaced by graph optimization: eagerly it cannot run."""
    monkeypatch.setenv("SAFESTRATEGY_BACKEND", "nccl")
    arrays = inputs(2)
    tensors = placed(tf2, arrays)
    with tf2.device(tensors[0].device):
        result = nccl_ops.reduce_sum(tensors)
    np.testing.assert_allclose(result.numpy(), np.sum(arrays, axis=0), rtol=1e-6)


def test_cpu_devices_fall_back_quietly_without_probing(tf, monkeypatch, caplog):
    monkeypatch.setattr(nccl_ops, "_smoke_check", refuse)
    caplog.set_level(logging.INFO, logger="safestrategy")
    with tf.Graph().as_default():
        nccl_ops.all_sum(placed(tf, inputs(2)))
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO]
    assert "not using NCCL" in caplog.records[0].getMessage()
    assert "not checked during training" in caplog.records[1].getMessage()  # said once
    with tf.Graph().as_default():
        nccl_ops.all_sum(placed(tf, inputs(3)))
    assert len([r for r in caplog.records if "not checked" in r.getMessage()]) == 1


def test_real_smoke_check_fails_where_there_is_no_nccl(tf):
    """The real NCCL verdict, for GPUs this machine lacks: an error, not a hang, no remedy.

    With zero NCCL kernels (tensorflow-cpu) it fails at once; a CUDA build with
    kernels runs the real probe process, where NCCL cannot be placed on a GPU
    that is not there, which no NCCL variable fixes, so no remedy is tried.
    """
    result = nccl_ops._smoke_check(parse_devices(GPUS))
    assert result.status == FAILED and not result.remedy
    if result.reason != _nccl.NO_KERNELS:
        assert result.reason.startswith("InvalidArgumentError: ")
        assert "also with" not in result.reason


def test_setting_is_part_of_the_cache_key(tf, monkeypatch):
    monkeypatch.setattr(nccl_ops, "_smoke_check", refuse)
    with tf.Graph().as_default():
        nccl_ops.all_sum(placed(tf, inputs(2)))
        monkeypatch.setenv("SAFESTRATEGY_BACKEND", "reduce_to_cpu")
        nccl_ops.all_sum(placed(tf, inputs(2)))
    settings = sorted((key[1].mode, key[1].names[-1]) for key in nccl_ops._decisions)
    assert settings == [("auto", "reduce_to_cpu"), ("forced", "reduce_to_cpu")]


# --- aliased under TensorFlow's name ------------------------------------------------------


@pytest.mark.parametrize("order", ["before", "after"])
def test_aliased_under_tensorflows_name_it_sums_and_tensorflows_own_code_uses_it(tf, order):
    """docs/migrating.md's alias, set before or after ``import tensorflow`` (a process of its
    own each: the alias must be in place before TensorFlow imports its modules)."""
    if tf.__version__.startswith("1.12."):
        pytest.skip("TF 1.12 has no tensorflow.python.ops.nccl_ops (tf.contrib.nccl instead)")
    done = run_python(
        str(ROOT / "tests" / "nccl_alias.py"),
        order,
        env={"PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[0][len("RESULT ") :])
    sums = [[6.0, 60.0]] * 3
    modes = ["eager", "function"] if tf.__version__.startswith("2.") else ["graph"]
    assert result["imported_ours"] and result["real_is_tensorflows"]
    assert result["all_sum"] == {mode: sums for mode in modes}
    gradient_mode = modes[0]
    assert result["gradient"] == {gradient_mode: [[3.0, 3.0]] * 3}
    # TF 1.x imports all_reduce (and its nccl_ops) with tensorflow: only the alias set first
    # reaches it there. TF 2.x imports it on demand, after either.
    assert result["all_reduce_uses_ours"] == (order == "before" or modes != ["graph"])
    if result["all_reduce_uses_ours"]:
        assert result["all_reduce"] == {mode: sums for mode in modes}


def test_collective_is_no_nccl_ops_candidate():
    """collective is a strategy's all-reduce: nccl_ops's auto still starts with NCCL, and a
    list naming collective first goes on to the next name."""

    def passes(devices):
        return CandidateResult("nccl", "ok", "right", 0.1)

    assert nccl_ops._decide(GPUS, setting(), passes).nccl
    assert nccl_ops._decide(GPUS, setting("collective,nccl"), passes).nccl
