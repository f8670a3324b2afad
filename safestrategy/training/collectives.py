"""Does the call a thread is in run the strategy's collectives? Read from the call itself.

A stack that sits in a ``tf.function`` says nothing of what the function does:
a step's all-reduce, a checkpoint's ``ON_READ`` reduction and a worker's own
evaluation all wait "in one TensorFlow call". So the answer is read from the
``tf.function`` objects on the stack: their concrete graphs, library functions
included, hold a collective or NCCL op (0.4 ms for a custom loop's step, 5-6.5
ms for Keras 3 ``fit``'s: shared/notes/canary.md). An eager collective (the
strategy's reductions outside a function, a checkpoint's) is a frame of
TensorFlow's collective code. Never from a function's name. Asked only while a
stall is judged, never in a healthy step.
"""

import os
from typing import Any, Set

#: The ops by which TensorFlow's strategies communicate.
OPS = frozenset(
    {
        "CollectiveReduce",
        "CollectiveReduceV2",
        "CollectiveReduceV3",
        "CollectiveGather",
        "CollectiveGatherV2",
        "CollectiveBcastSend",
        "CollectiveBcastRecv",
        "CollectiveBcastSendV2",
        "CollectiveBcastRecvV2",
        "CollectiveAllToAllV2",
        "CollectiveAllToAllV3",
        "NcclAllReduce",
        "NcclReduce",
        "NcclBroadcast",
    }
)
#: TensorFlow's files whose frames are an eager collective under way.
EAGER = (
    "ops/collective_ops.py",
    "ops/gen_collective_ops.py",
    "distribute/cross_device_utils.py",
    "ops/nccl_ops.py",
    "ops/gen_nccl_ops.py",
)


def runs_collectives(frame: Any, graphs: bool = True) -> bool:
    """Whether the stack ending at ``frame`` is in a call that runs collectives: an eager
    collective, or (with ``graphs``) a ``tf.function`` on it whose graphs hold one of
    :data:`OPS`."""
    while frame is not None:
        filename = frame.f_code.co_filename.replace(os.sep, "/")
        if "/python/" in filename and filename.endswith(EAGER):
            return True
        if not graphs:
            frame = frame.f_back
            continue
        owner = frame.f_locals.get("self")
        # asked of the type: an instance's own __getattr__ (a SyncOnRead variable's reads
        # its value, an all-reduce) must never run here
        listed = getattr(type(owner), "_list_all_concrete_functions", None)
        if callable(listed) and _ops(listed(owner)) & OPS:
            return True
        frame = frame.f_back
    return False


def _ops(functions: Any) -> Set[str]:
    """Every op type in ``functions``' graphs, their library functions included."""
    found: Set[str] = set()
    for function in functions:
        graph = function.graph.as_graph_def()
        found.update(node.op for node in graph.node)
        for library in graph.library.function:
            found.update(node.op for node in library.node_def)
    return found
