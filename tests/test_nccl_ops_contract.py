"""safestrategy.nccl_ops beside TensorFlow's own nccl_ops: NumPy inputs, gradient placement.

Each test runs TensorFlow's module and ours on the same inputs in the same
mode and compares what comes out. Over logical CPUs TensorFlow's NCCL ops
have no kernel, so where TensorFlow's *builds* NCCL ops (and fails only when
they run, for want of a kernel), ours must give the reduction's numbers with
the same dtypes, shapes and devices; where TensorFlow's raises while building,
ours must raise the same exception with the same message.
"""

import numpy as np
import pytest

from safestrategy import nccl_ops

from .test_nccl_ops import (
    ALL_REDUCE,
    FUNCTIONS,
    compat_v1,
    cpus,
    fresh,  # noqa: F401  (autouse: each test decides afresh)
    inputs,
    mode,  # noqa: F401  (graph everywhere; eager and tf.function on TF2)
    placed,
    session,
    tf_nccl,  # noqa: F401
)

# --- NumPy inputs -------------------------------------------------------------------------

#: Inputs as a user might pass them; ``None`` marks a placed float32 tensor (graph: built in
#: the test's graph). NumPy >= 2 arrays have ``device == "cpu"``; older ones no ``device``.
NUMPY_INPUTS = {
    "float32": [np.ones((2, 3), np.float32), np.full((2, 3), 2.0, np.float32)],
    "float64": [np.ones(2), np.arange(2.0)],
    "int32": [np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int32)],
    "float16": [np.ones(2, np.float16), np.ones(2, np.float16)],
    "scalars": [np.float32(1.5), np.float32(2.0)],
    "bool": [np.ones(2, bool), np.zeros(2, bool)],
    "strings": [np.array(["a"]), np.array(["b"])],
    "tensor_then_array": [None, np.full((2, 3), 2.0, np.float32)],
    "array_then_tensor": [np.full((2, 3), 2.0, np.float32), None],
    "stacked": np.ones((2, 3), np.float32),
}
REDUCE = dict(ALL_REDUCE, reduce_sum=np.sum, broadcast=lambda arrays, axis: arrays[0])


def numpy_args(tf, case, name):
    """The arguments for ``name`` (one array for broadcast), tensors built where marked."""
    values = NUMPY_INPUTS[case]
    if isinstance(values, np.ndarray):
        return values
    args = []
    for i, value in enumerate(values):
        if value is None:
            (value,) = placed(tf, [np.full((2, 3), 1.0, np.float32)], [f"/cpu:{i}"])
        args.append(value)
    return args[0] if name == "broadcast" else args


def numbers(values):
    return [np.asarray(v.numpy() if hasattr(v, "numpy") else v) for v in values]


def outcome(tf, module, name, case, how):
    """What ``module.name`` does with NumPy inputs in mode ``how``, as comparable data.

    ``("raised", type, message)`` for an error while building (in a tf.function,
    TensorFlow rewrites the message to list the user frames, which differ by
    module, so only its last line, the original error, is kept);
    ``("kernel", type)`` for TensorFlow's runtime error of a missing NCCL kernel;
    ``("built", devices, dtypes, shapes, values)`` where the op was built and ran
    (``values`` is None where running it failed for want of a kernel).
    """
    function = on_an_inputs_device(tf, getattr(module, name), name)
    if how == "graph":
        with tf.Graph().as_default():
            args = numpy_args(tf, case, name)
            try:
                out = function(args)
            except Exception as error:
                return ("raised", type(error), str(error))
            out = out if isinstance(out, list) else [out]
            facts = ([t.device for t in out], [t.dtype for t in out], [t.shape for t in out])
            with session(tf) as sess:
                try:
                    return ("built", *facts, numbers(sess.run(out)))
                except tf.errors.OpError as error:
                    assert "Nccl" in str(error), error
                    return ("built", *facts, None)
    try:
        if how == "function":
            out = tf.function(lambda: function(numpy_args(tf, case, name)))()
        else:
            out = function(numpy_args(tf, case, name))
    except tf.errors.OpError as error:
        assert "Nccl" in str(error), error
        return ("kernel", type(error))
    except Exception as error:
        message = str(error)
        if how == "function":
            message = message.rstrip().splitlines()[-1].strip()
        return ("raised", type(error), message)
    return ("built", None, None, None, numbers(out if isinstance(out, list) else [out]))


def on_an_inputs_device(tf, function, name):
    """``function``; for reduce_sum, called under ``/cpu:0``, where a placed tensor may be."""
    if name != "reduce_sum":
        return function

    def reduce_sum(tensors):
        with tf.device("/cpu:0"):
            return function(tensors)

    return reduce_sum


def expected_values(tf, name, case):
    arrays = [np.ones((2, 3), np.float32) if v is None else v for v in NUMPY_INPUTS[case]]
    expected = REDUCE[name](np.stack(arrays), axis=0)
    count = 1 if name in ("reduce_sum", "broadcast") else len(arrays)
    return [expected] * count


@pytest.mark.parametrize(
    "name, case",
    [
        (name, case)
        for name in FUNCTIONS
        for case in sorted(NUMPY_INPUTS)
        # broadcast takes one tensor; a stacked array is just an array to it
        if not (name == "broadcast" and case == "stacked")
    ],
)
def test_numpy_inputs_as_tensorflow(tf, tf_nccl, mode, name, case):  # noqa: F811
    theirs = outcome(tf, tf_nccl, name, case, mode)
    if theirs[0] == "kernel":
        # Eagerly TensorFlow's fails for want of a kernel; where it builds ops in a
        # graph, ours computes what they would, and where its graph raises, so do we.
        theirs = outcome(tf, tf_nccl, name, case, "graph")
        if theirs[0] == "built":
            theirs = ("built", None, None, None, None)
    ours = outcome(tf, nccl_ops, name, case, mode)
    if theirs[0] == "raised":
        assert ours == theirs
        return
    assert ours[0] == "built", ours
    assert ours[1:4] == theirs[1:4], "devices, dtypes and shapes differ"
    assert theirs[4] is None, "TensorFlow's NCCL ran on CPUs: the test's premise is wrong"
    for value, expected in zip(ours[4], expected_values(tf, name, case)):
        np.testing.assert_allclose(value, expected, rtol=1e-6)


def test_numpy_inputs_under_numpy_2_are_summed_on_the_cpu(tf):
    """On NumPy >= 2 (TF 2.21 here) an array says it is on "cpu"; TF's places its op there."""
    arrays = NUMPY_INPUTS["float32"]
    if not hasattr(arrays[0], "device"):
        pytest.skip(f"NumPy {np.__version__} arrays have no device: TensorFlow's raises")
    with tf.Graph().as_default():
        out = nccl_ops.all_sum(arrays)
        assert [t.device for t in out] == ["/device:CPU:*"] * 2
        with session(tf) as sess:
            for value in sess.run(out):
                np.testing.assert_array_equal(value, arrays[0] + arrays[1])


NO_GRADIENT = "No gradient defined for NcclAllReduce except"

# --- gradient placement -------------------------------------------------------------------


def weighted_loss(tf, out, weights):
    """sum_i <w_i, out_i>, each term on its output's device (as NCCL's gradient needs)."""
    terms = []
    for w, y in zip(weights, out):
        with tf.device(y.device):
            terms.append(tf.reduce_sum(w * y))
    return tf.add_n(terms)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("colocate", [True, False])
def test_graph_gradient_of_each_input_is_on_its_device(tf, tf_nccl, n, colocate):  # noqa: F811
    arrays, weights = inputs(n, seed=1), inputs(n, seed=2)
    devices = {}
    for module in (tf_nccl, nccl_ops):
        with tf.Graph().as_default():
            tensors = placed(tf, arrays)
            out = module.all_sum(tensors)
            assert [t.device for t in out] == [t.device for t in tensors]
            loss = weighted_loss(tf, out, weights)
            if module is tf_nccl and not colocate:
                # TensorFlow's gradient insists each output's gradient is on its device.
                with pytest.raises(ValueError, match="Device assignment"):
                    compat_v1(tf).gradients(loss, tensors)
                continue
            grads = compat_v1(tf).gradients(loss, tensors, colocate_gradients_with_ops=colocate)
            devices[module] = [g.device for g in grads]
            assert devices[module] == [g.op.device for g in grads]
            assert devices[module] == [t.device for t in tensors]
            if module is nccl_ops:
                with session(tf, n) as sess:  # no soft placement: a colocation clash would fail
                    values = sess.run(grads)
                for value in values:
                    np.testing.assert_allclose(value, np.sum(weights, axis=0), rtol=1e-6)
    if colocate:
        assert devices[nccl_ops] == devices[tf_nccl]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("mode", ["eager", "function"])  # graph: the test above
def test_gradient_of_each_input_is_on_its_device_on_tf2(tf2, mode, n):  # noqa: F811
    """Eagerly: the gradient tensors' devices; in a tf.function: the traced tensors'
    devices (what it returns is copied to the default device, NCCL's results too)."""
    tf = tf2
    arrays, weights = inputs(n, seed=1), inputs(n, seed=2)
    seen = {}

    def build():
        tensors = placed(tf, arrays)
        with tf.GradientTape() as tape:
            tape.watch(tensors)
            out = nccl_ops.all_sum(tensors)
            loss = weighted_loss(tf, out, weights)
        grads = tape.gradient(loss, tensors)
        seen["devices"] = [[t.device for t in ts] for ts in (tensors, out, grads)]
        return grads

    values = tf.function(build)() if mode == "function" else build()
    inputs_on, outputs_on, grads_on = seen["devices"]
    assert outputs_on == inputs_on
    assert grads_on == inputs_on
    assert len(set(grads_on)) == n
    for value in values:
        np.testing.assert_allclose(value.numpy(), np.sum(weights, axis=0), rtol=1e-6)


def test_graph_gradient_ignores_the_device_scope_gradients_run_in(tf):
    """As NCCL's: the gradient's placement does not follow tf.gradients' device scope."""
    with tf.Graph().as_default():
        tensors = placed(tf, inputs(3))
        out = nccl_ops.all_sum(tensors)
        with tf.device("/cpu:2"):
            grads = compat_v1(tf).gradients(weighted_loss(tf, out, inputs(3, 1)), tensors)
        assert [g.device for g in grads] == [t.device for t in tensors]


def test_unused_outputs_give_their_share_of_nothing(tf, mode):  # noqa: F811
    """Only output 1 feeds the loss: every input's gradient is that output's gradient."""
    arrays = inputs(3)

    def build():
        tensors = placed(tf, arrays)
        if mode == "graph":
            out = nccl_ops.all_sum(tensors)
            return compat_v1(tf).gradients(tf.reduce_sum(out[1] * 3.0), tensors)
        with tf.GradientTape() as tape:
            tape.watch(tensors)
            out = nccl_ops.all_sum(tensors)
            loss = tf.reduce_sum(out[1] * 3.0)
        return tape.gradient(loss, tensors)

    if mode == "graph":
        with tf.Graph().as_default():
            grads = build()
            assert [g.device for g in grads] == cpus_full(tf, 3)
            with session(tf) as sess:
                values = sess.run(grads)
    else:
        values = [g.numpy() for g in (tf.function(build)() if mode == "function" else build())]
    for value in values:
        np.testing.assert_array_equal(value, np.full((2, 3), 3.0, np.float32))


def cpus_full(tf, n):
    """The graph-mode device names of ``/cpu:0`` ... ``/cpu:n-1``."""
    with tf.Graph().as_default():
        return [t.device for t in placed(tf, [np.zeros(1)] * n, cpus(n))]


@pytest.mark.parametrize("name", ["all_prod", "all_min", "all_max"])
def test_other_reductions_still_have_no_gradient(tf, tf_nccl, mode, name):  # noqa: F811
    """A LookupError, as TensorFlow's (in a tf.function autograph turns it into a
    StagingError quoting it, for both modules). The messages differ (TF 1.x says
    "except sum.", TF2 'except for reduction="sum".'); both start alike."""

    def raised(module):
        def build():
            tensors = placed(tf, inputs(2))
            if mode == "graph":
                return compat_v1(tf).gradients(getattr(module, name)(tensors)[0], tensors)
            with tf.GradientTape() as tape:
                tape.watch(tensors)
                out = getattr(module, name)(tensors)
            return tape.gradient(out[0], tensors)

        with pytest.raises(Exception, match=NO_GRADIENT) as error:
            if mode == "graph":
                with tf.Graph().as_default():
                    build()
            else:
                tf.function(build)() if mode == "function" else build()
        return error.type

    ours = raised(nccl_ops)
    assert issubclass(ours, LookupError) or mode == "function"
    if mode != "eager":  # eagerly TensorFlow's NCCL op cannot run here to be differentiated
        assert ours == raised(tf_nccl)


def test_variables_as_inputs_keep_their_gradients_and_placement(tf, mode):  # noqa: F811
    """Variables passed straight in (not read first) still work through the custom gradient."""
    arrays = inputs(2)

    def build(variables):
        if mode == "graph":
            out = nccl_ops.all_sum(variables)
            grads = compat_v1(tf).gradients(weighted_loss(tf, out, arrays), variables)
        else:
            with tf.GradientTape() as tape:
                out = nccl_ops.all_sum(variables)
                loss = weighted_loss(tf, out, arrays)
            grads = tape.gradient(loss, variables)
        assert [g.device for g in grads] == [v.device for v in variables]
        return out + grads

    def make_variables():
        v1 = compat_v1(tf)
        variables = []
        for i, (device, array) in enumerate(zip(cpus(2), arrays)):
            with tf.device(device):
                if mode == "graph":
                    variables.append(v1.get_variable(f"v{i}", initializer=array))
                else:
                    variables.append(tf.Variable(array))
        return variables

    if mode == "graph":
        with tf.Graph().as_default():
            variables = make_variables()
            fetches = build(variables)
            with session(tf, 2) as sess:
                sess.run(compat_v1(tf).global_variables_initializer())
                values = sess.run(fetches)
    else:
        variables = make_variables()
        fetches = tf.function(build)(variables) if mode == "function" else build(variables)
        values = [t.numpy() for t in fetches]
    for value in values:  # the outputs, and the gradients (the weights are the inputs)
        np.testing.assert_allclose(value, arrays[0] + arrays[1], rtol=1e-6)
