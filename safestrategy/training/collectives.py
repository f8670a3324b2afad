"""Does the call a thread is in run the strategy's collectives? Read from the call itself.

A stack that sits in a ``tf.function`` says nothing of what the function does:
a step's all-reduce, a checkpoint's ``ON_READ`` reduction and a worker's own
evaluation all wait "in one TensorFlow call". So the answer is read from the
``tf.function`` objects on the stack (or a TF 1.x session's graph): their
concrete graphs, library functions included, hold a collective or NCCL op, or
run on two devices at once, as a one-machine mirror's in-graph all-reduce does
(0.4 ms for a custom loop's step, 5-6.5 ms for Keras 3 ``fit``'s:
shared/notes/canary.md). An eager collective (the strategy's reductions outside
a function, a checkpoint's) is a frame of TensorFlow's collective code. Never
from a function's name. Asked as a stall is judged, and under ``run`` at each sample
(its heartbeat says whether the call runs them): each graph is read once.
"""

import os
import weakref
from typing import Any, List, MutableMapping, Tuple

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
        if callable(listed) and any(_communicates(f.graph) for f in listed(owner)):
            return True
        session = filename.endswith("client/session.py") and frame.f_code.co_name == "run"
        if session and _communicates(owner.graph):  # TF 1.x: the session's graph
            return True
        frame = frame.f_back
    return False


#: Each graph read, by graph: the version it was read at, and whether it communicates
#: (a function's graph is final once traced; a TF 1.x graph grows: read again).
_read: MutableMapping[Any, Tuple[int, bool]] = weakref.WeakKeyDictionary()


def _communicates(graph: Any) -> bool:
    """Whether ``graph`` (its library functions included) communicates: it holds one of
    :data:`OPS`, or runs on two devices at once (a mirror's in-graph all-reduce,
    hierarchical copy or reduction to one device, is copies and adds between its
    replicas' devices; a function of the user's own runs on one)."""
    version = getattr(graph, "version", 0)
    known = _read.get(graph)
    if known is not None and known[0] == version:
        return known[1]
    nodes = _nodes(graph.as_graph_def())
    found = any(node.op in OPS for node in nodes)
    found = found or len({_device(node.device) for node in nodes if node.device}) > 1
    _read[graph] = version, found
    return found


def _nodes(definition: Any) -> List[Any]:
    """Every node of a ``GraphDef``, its library functions' included."""
    found = list(definition.node)
    for library in definition.library.function:
        found.extend(library.node_def)
    return found


def _device(name: str) -> str:
    """A node's device, however spelt: ``/job:localhost/replica:0/task:0/device:CPU:1``,
    ``/device:CPU:1`` and ``/cpu:1`` are one device (``CPU:1``)."""
    return name.rstrip("/").rsplit("/", 1)[-1].split("device:")[-1].upper()
