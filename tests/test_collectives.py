"""Whether the call a thread is in runs the strategy's collectives, read from real frames
of real TensorFlow calls (safestrategy/training/collectives.py): what ``run``'s heartbeat
says, and so whether a silence or a crash there is the all-reduce's (0.5.2, 2b)."""

import sys
import threading

import pytest

from safestrategy.training.collectives import runs_collectives

from .conftest import cpus

#: Seconds a test waits for a thread to be inside its call (bounded).
WAIT = 60


def frame_inside(call, wrap):
    """``call(held)`` on a thread of its own, where ``held(x)`` is ``x`` through
    ``wrap(function, x)`` (a ``py_function``) that waits: the frame that thread is at while
    it waits inside its TF call, and a function that frees it."""
    there, free = threading.Event(), threading.Event()

    def wait(x):
        there.set()
        free.wait(WAIT)
        return x

    thread = threading.Thread(target=call, args=(lambda x: wrap(wait, x),))
    thread.start()
    assert there.wait(WAIT), "the call never reached its py_function"
    frame = sys._current_frames()[thread.ident]

    def release():
        free.set()
        thread.join(WAIT)

    return frame, release


@pytest.mark.parametrize("ops", ["HierarchicalCopyAllReduce", "ReductionToOneDevice"])
def test_a_mirrors_step_communicates_and_a_function_of_the_users_own_does_not(tf2, ops):
    """A one-machine mirror's all-reduce is copies and adds between the replicas' devices
    (no collective op): read from the step's graph running on both. The user's own
    function (an evaluation of its own, a file read) runs on one device."""
    tf = tf2
    strategy = tf.distribute.MirroredStrategy(
        cpus(2), cross_device_ops=getattr(tf.distribute, ops)()
    )
    with strategy.scope():
        total = tf.Variable(0.0)

    def step_call(held):
        @tf.function
        def step():
            def replica():
                mine = held(tf.constant(1.0))
                total.assign_add(tf.distribute.get_replica_context().all_reduce("sum", mine))

            strategy.run(replica)

        step()

    def own_call(held):
        tf.function(lambda: tf.reduce_sum(held(tf.ones([3]))))()

    def wrap(function, x):
        return tf.py_function(function, [x], x.dtype)

    for call, communicates in ((step_call, True), (own_call, False)):
        frame, release = frame_inside(call, wrap)
        try:
            assert runs_collectives(frame) is communicates, call.__name__
            assert runs_collectives(frame) is communicates  # read again: from what was read
        finally:
            release()
    assert float(total.numpy()) == 2.0  # the step ran through, all-reduced


def test_a_tf1_sessions_graph_is_read_as_a_functions_is(tf1):
    """TF 1.x: ``session.run``'s graph, on two devices (a mirror's) or on one."""
    tf = tf1

    def wrap(function, x):
        return tf.py_func(function, [x], x.dtype)

    for devices, communicates in ((cpus(2), True), (cpus(1), False)):
        with tf.Graph().as_default() as graph:
            values = []
            for device in devices:
                with tf.device(device):
                    values.append(tf.constant(1.0))
            summed = tf.add_n(values)
            config = tf.ConfigProto(device_count={"CPU": 2})
            with tf.Session(graph=graph, config=config) as session:

                def call(held, summed=summed, session=session):
                    with graph.as_default():
                        out = held(summed)
                    session.run(out)

                frame, release = frame_inside(call, wrap)
                try:
                    assert runs_collectives(frame) is communicates, devices
                finally:
                    release()
