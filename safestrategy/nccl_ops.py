"""Drop-in for TensorFlow's ``nccl_ops`` that also works where NCCL does not.

Custom multi-device optimizers (StyleGAN's ``dnnlib/tflib/optimizer.py`` and
its many copies) call ``nccl_ops.all_sum(grads)`` themselves; on a build
without NCCL (native Windows, CPU devices, many custom builds) that dies with
``No OpKernel was registered to support Op 'NcclAllReduce'``. Change the import::

    from tensorflow.python.ops import nccl_ops      # or tensorflow.contrib.nccl
    from safestrategy import nccl_ops               # instead

and the rest of the code stays as it is. The six functions keep TensorFlow's
signatures, argument checks, errors and output placement (result *i* on the
device of input *i*). For each set of input devices the module decides once
per process:

* NCCL, through TensorFlow's own ops, when every input is on a different GPU
  and NCCL's smoke check (a real all-reduce in a child process, so a hanging
  NCCL cannot hang you) passes on exactly those GPUs;
* otherwise an equivalent that reduces on one device (the first input's) and
  copies the result back to each input's device. A failed smoke check is
  logged once as a WARNING on the ``safestrategy`` logger; inputs on CPUs,
  shared GPUs or a single device cannot use NCCL, which is logged at INFO.

``SAFESTRATEGY_BACKEND`` steers the choice as it steers the factory's:
``auto`` (the default) and lists starting with ``nccl`` use NCCL where its
check passes; ``nccl`` alone forces it, still checked: where it cannot work
the call raises ``NoWorkingBackendError`` instead of failing inside
TensorFlow; a value that does not start with ``nccl`` means never NCCL, and
one whose first non-NCCL name is ``reduce_to_cpu`` reduces on
``/device:CPU:0`` instead of the first input's device. NCCL's verdict comes
from the same mechanism as the factory's (kernel count, on-disk cache, probe
process, remedies such as ``NCCL_P2P_DISABLE=1``, which is then set in
``os.environ``).

Where TensorFlow's would crash or hang at run time, these raise at once:
mixed dtypes or shapes are a ``ValueError``. Zero-sized tensors, which NCCL
has no use for, always take the equivalent. ``broadcast`` always does too
(see its docstring).

NumPy inputs are taken as TensorFlow's take them: an array without a
``device`` attribute (NumPy < 2) raises TensorFlow's ``AttributeError``; one
with a device (NumPy 2: ``"cpu"``) becomes a constant there, so on CPUs the
equivalent sums it, and ``reduce_sum`` raises TensorFlow's ``ValueError``
(``"cpu"`` is never the current device).

Code that cannot be edited can get this module under TensorFlow's name
(``sys.modules["tensorflow.python.ops.nccl_ops"]``, see docs/migrating.md):
it never takes itself for TensorFlow's module (see ``_tf.tf_nccl_ops``).

Importing this module imports no TensorFlow. TensorFlow's ``nccl_ops`` is
imported on first use, which registers its gradients for the ``Nccl*`` ops
(once: registering them again would raise ``KeyError``); the equivalent is
made of ordinary ops with the same gradients as NCCL's, placed as NCCL's:
the gradient of input *i* is on input *i*'s device (summed where the forward
sum is, then copied back), in graph mode with or without
``colocate_gradients_with_ops``, eagerly and in ``tf.function``. Like NCCL's,
``all_prod``, ``all_min`` and ``all_max`` have none: asking raises
``LookupError``.
"""

import logging
import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from . import choose
from ._devices import Device, parse_device
from ._env import ENV_BACKEND, Setting, resolve_backend
from ._tf import import_tf, tf_nccl_ops
from .backends import COLLECTIVE, CPU_DEVICE, NCCL
from .checks import nccl
from .report import FAILED, OK, CandidateResult, NoWorkingBackendError

__all__ = ["all_max", "all_min", "all_prod", "all_sum", "broadcast", "reduce_sum"]

logger = logging.getLogger("safestrategy")

#: Marks this module as a stand-in for TensorFlow's (``_tf.DROP_IN``): aliased under
#: TensorFlow's name, it is never taken for the module it replaces.
_safestrategy_drop_in = True

#: The dtypes TensorFlow's Nccl* ops accept (their ``T`` attribute; the same in TF 1.12-2.21).
NCCL_DTYPES = ("float16", "float32", "float64", "int32", "int64")

#: TensorFlow's message when an NCCL reduction other than sum is differentiated.
NO_GRADIENT = 'No gradient defined for NcclAllReduce except for reduction="sum".'


class _Decision(NamedTuple):
    """How one device set is reduced: NCCL or reduce-and-copy, and why."""

    nccl: bool
    reason: str
    #: Where reduce-and-copy reduces; None: on the first input's device.
    reduce_on: Optional[str] = None
    #: NCCL's smoke check, when one ran (a failed one is logged as a WARNING).
    check: Optional[CandidateResult] = None


_decisions: Dict[Tuple[Tuple[str, ...], Setting], _Decision] = {}
_lock = threading.Lock()


def all_sum(tensors: Sequence[Any]) -> List[Any]:
    """The sum of ``tensors``, one result on each input's device.

    Args:
      tensors: one tensor per device, all of one shape and dtype, each with a
        device assigned.

    Returns:
      A list of tensors, each the sum of the inputs, where tensor *i* has the
      same device as ``tensors[i]``. Differentiable: the gradient of input *i*
      is the sum of the gradients of all outputs, as with NCCL.
    """
    return _apply_all_reduce("sum", tensors)


def all_prod(tensors: Sequence[Any]) -> List[Any]:
    """The element-wise product of ``tensors``, one result on each input's device."""
    return _apply_all_reduce("prod", tensors)


def all_min(tensors: Sequence[Any]) -> List[Any]:
    """The element-wise minimum of ``tensors``, one result on each input's device."""
    return _apply_all_reduce("min", tensors)


def all_max(tensors: Sequence[Any]) -> List[Any]:
    """The element-wise maximum of ``tensors``, one result on each input's device."""
    return _apply_all_reduce("max", tensors)


def reduce_sum(tensors: Sequence[Any]) -> Any:
    """The sum of ``tensors`` as one tensor on the current device.

    As with TensorFlow's, the current device (the enclosing ``tf.device``)
    must be the device of one of the inputs, else ``ValueError``. Eagerly
    this is always the equivalent: TensorFlow's ``NcclReduce`` kernel is a
    stub that its graph optimization replaces, so it cannot run op by op.
    """
    if not tensors:
        raise ValueError("Must pass >0 tensors to reduce operations")
    given = list(tensors)
    tensors = _checked(given, "reduce_sum")
    tf = import_tf()
    if not tf.executing_eagerly() and _decision(tensors).nccl:
        return _tf_nccl_ops().reduce_sum(given)
    with tf.name_scope("reduce_sum"):
        result = tf.add_n(tensors) if len(tensors) > 1 else tf.identity(tensors[0])
    # TensorFlow compares the devices of the inputs as given: a NumPy array's
    # device ("cpu") is never the current device, so NumPy inputs raise here.
    if not any(t.device == result.device for t in given):
        raise ValueError("One input tensor must be assigned to current device")
    return result


def broadcast(tensor: Any) -> Any:
    """``tensor`` on its own device, to be used as input to ops on other devices.

    Always the plain equivalent, an identity that TensorFlow copies to each
    consumer's device: the receiving devices are not known here, so there is
    no device set to check NCCL on, and TensorFlow's ``NcclBroadcast`` kernel
    is a stub that only its graph optimization replaces (eagerly it fails).
    """
    (tensor,) = _checked([tensor], "broadcast")
    tf = import_tf()
    with tf.device(tensor.device):
        return tf.identity(tensor)


def _tf_nccl_ops() -> Any:
    """TensorFlow's own ``nccl_ops`` module (run, and its gradients registered, once),
    never this one, even where this one is aliased under TensorFlow's name."""
    return tf_nccl_ops()


def _checked(tensors: Sequence[Any], function: str) -> List[Any]:
    """``tensors`` as a list of tensors, checked as TensorFlow checks them and then some.

    First TensorFlow's checks, in its order and with its errors: each input's
    device (``ValueError``; ``AttributeError`` for an input without a
    ``device``, such as a NumPy array before NumPy 2), then its conversion
    and dtype (``TypeError``). NumPy inputs that have a device (NumPy 2:
    ``"cpu"``) become constants on it, as TensorFlow's ops convert them.
    Eagerly, TensorFlow's ``all_*`` check inside the ``tf.function`` they wrap
    their ops in, which rewrites the message; there, where a check fails,
    theirs is called to raise its own error (it fails while the function is
    traced, before any op runs). Then ours: mixed dtypes or shapes, which NCCL
    would not notice before reading the wrong number of bytes, are a
    ``ValueError``.
    """
    tensors = list(tensors)
    tf_nccl_ops = _tf_nccl_ops()
    converted = []
    try:
        if function == "reduce_sum":  # theirs checks every device, then converts the list
            for tensor in tensors:
                tf_nccl_ops._check_device(tensor)
        for tensor in tensors:
            if function != "reduce_sum":  # theirs checks and builds one input at a time
                tf_nccl_ops._check_device(tensor)
            tensor = _as_tensor(tensor)
            dtype = tensor.dtype.base_dtype.name
            if dtype not in NCCL_DTYPES:
                raise TypeError(
                    f"Value passed to parameter 'input' has DataType {dtype} not in list of "
                    f"allowed values: {', '.join(NCCL_DTYPES)}"
                )
            converted.append(tensor)
    except (AttributeError, TypeError, ValueError):
        if function.startswith("all_") and import_tf().executing_eagerly():
            getattr(tf_nccl_ops, function)(tensors)
        raise
    first = converted[0]
    for index, tensor in enumerate(converted):
        dtype = tensor.dtype.base_dtype
        if dtype != first.dtype.base_dtype:
            raise ValueError(
                f"{function} needs tensors of one dtype: tensor 0 is "
                f"{first.dtype.base_dtype.name} but tensor {index} is {dtype.name}"
            )
        if not tensor.shape.is_compatible_with(first.shape):
            raise ValueError(
                f"{function} needs tensors of one shape: tensor 0 has shape {first.shape} "
                f"but tensor {index} has shape {tensor.shape}"
            )
    return converted


def _as_tensor(value: Any) -> Any:
    """``value``, or for a NumPy array or scalar a constant on its ``device``.

    TensorFlow's ops convert NumPy inputs inside ``tf.device(value.device)``;
    this does the same, so the constant (and result) lands where theirs would.
    """
    import numpy as np

    if not isinstance(value, (np.ndarray, np.generic)):
        return value
    tf = import_tf()
    with tf.device(value.device):
        return tf.convert_to_tensor(value)


def _apply_all_reduce(reduction: str, tensors: Sequence[Any]) -> List[Any]:
    """``all_<reduction>`` of ``tensors``: NCCL or reduce-and-copy, as decided for their devices."""
    if not tensors:
        raise ValueError("Must pass >0 tensors to all reduce operations")
    given = list(tensors)
    tensors = _checked(given, f"all_{reduction}")
    decision = _decision(tensors)
    if decision.nccl:
        return getattr(_tf_nccl_ops(), f"all_{reduction}")(given)
    tf = import_tf()
    reduce_on = decision.reduce_on or tensors[0].device
    # Eagerly, ops run one by one: unlike NCCL's, these need no tf.function
    # around them (TensorFlow's wraps and retraces a new one on every call).
    with tf.name_scope(f"all_{reduction}"):
        if reduction == "sum":
            totals = _sum(tensors, reduce_on)
        else:
            reduce = {"prod": tf.reduce_prod, "min": tf.reduce_min, "max": tf.reduce_max}
            with tf.device(reduce_on):
                totals = [_no_gradient(reduce[reduction](tf.stack(tensors), axis=0))]
            totals *= len(tensors)
        results = []
        for tensor, total in zip(tensors, totals):
            with tf.device(tensor.device):
                results.append(tf.identity(total))
    return results


def _sum(tensors: Sequence[Any], reduce_on: str) -> List[Any]:
    """The sum of ``tensors`` on ``reduce_on``, once per input, with NCCL's gradient placement.

    Differentiated as ordinary ops, every input's gradient would be the one
    gradient of the sum, on ``reduce_on``. NCCL's gradient of input *i* is an
    all-reduce on input *i*'s device; this gradient mirrors the forward pass:
    the outputs' gradients are summed on ``reduce_on`` and a copy goes to each
    input's device, whatever device or colocation scope ``tf.gradients``
    (``colocate_gradients_with_ops``) or the tape runs it in.

    ``tf.custom_gradient`` passes the results through one op (graph mode: an
    ``IdentityN`` on a single device), so they come back on ``reduce_on`` and
    the caller copies each to its input's device.
    """
    tf = import_tf()
    from tensorflow.python.framework import ops

    devices = [tensor.device for tensor in tensors]

    def gradient(*upstream: Any) -> List[Any]:
        with ops.colocate_with(None, ignore_existing=True):
            dense = []
            for device, grad in zip(devices, upstream):
                if grad is not None:
                    with tf.device(device):
                        dense.append(tf.convert_to_tensor(grad))
            if not dense:  # no output feeds what is differentiated
                return [None] * len(devices)
            with tf.device(reduce_on):
                total = tf.add_n(dense) if len(dense) > 1 else dense[0]
            grads = []
            for device in devices:
                with tf.device(device):
                    grads.append(tf.identity(total))
        return grads

    @tf.custom_gradient
    def sum_with_gradient(*inputs: Any) -> Tuple[List[Any], Callable[..., List[Any]]]:
        total = tf.add_n(list(inputs))
        return [total] * len(inputs), gradient

    with tf.device(reduce_on):
        return list(sum_with_gradient(*tensors))


def _no_gradient(tensor: Any) -> Any:
    """``tensor``, differentiating which raises ``LookupError`` as NCCL's non-sum reductions do."""
    from tensorflow.python.ops import array_ops

    return array_ops.prevent_gradient(tensor, message=NO_GRADIENT)


def _is_empty(tensor: Any) -> bool:
    """True when the static shape has a zero dimension (NCCL has nothing to do)."""
    return tensor.shape.ndims is not None and 0 in tensor.shape.as_list()


def _parse(name: str) -> Optional[Device]:
    """The local device ``name`` names, or None (a remote or partial name)."""
    try:
        return parse_device(name)
    except ValueError:
        return None


def _decision(tensors: Sequence[Any]) -> _Decision:
    """The decision for the tensors' device set, made once per process and logged once."""
    if any(_is_empty(t) for t in tensors):
        return _Decision(False, "zero-sized tensors: there is nothing to reduce")
    devices = [t.device for t in tensors]
    setting = resolve_backend(None)
    key = (tuple(sorted(str(_parse(name) or name) for name in devices)), setting)
    with _lock:
        decision = _decisions.get(key)
        if decision is None:
            decision = _decide(devices, setting, _smoke_check)
            _decisions[key] = decision
            _log(decision, key[0])
            if len(_decisions) == 1:
                logger.info(
                    "nccl_ops: its all-reduces are not checked during training (the "
                    "factories' strategies are)"
                )
    return decision


#: Why a candidate other than NCCL always "passes" here: it is made of ordinary ops.
REDUCE_AND_COPY = "reduce on one device and copy back: ordinary ops, nothing to check"


def _reduce_on(backend: Optional[str]) -> Optional[str]:
    """Where the equivalent reduces for the setting's chosen fallback (None: the first
    input's device): ``reduce_to_cpu`` reduces on the CPU."""
    return CPU_DEVICE if backend == "reduce_to_cpu" else None


def _not_for_nccl(devices: Sequence[str], parsed: Sequence[Optional[Device]]) -> Optional[str]:
    """Why NCCL cannot apply to tensors on ``devices`` (None: it can; check it)."""
    local = [device for device in parsed if device is not None]
    not_gpu = next((device for device in local if device.kind != "GPU"), None)
    if len(local) < len(parsed):
        return f"NCCL needs local GPUs, and {devices[list(parsed).index(None)]} is not one"
    if not_gpu is not None:
        return f"NCCL needs every tensor on a GPU, and one is on {not_gpu}"
    if len(set(local)) < len(local):
        return "NCCL needs each tensor on its own GPU, and two share one"
    return None


def _decide(
    devices: Sequence[str],
    setting: Setting,
    check: Callable[[Tuple[Device, ...]], CandidateResult],
) -> _Decision:
    """NCCL or reduce-and-copy for tensors on ``devices``, given the setting: the chooser
    (:func:`safestrategy.choose.decide`) takes the first of the setting's names that
    passes, in its order (``auto``: the documented order; ``collective``, a strategy's
    all-reduce, is no candidate here). Only NCCL is checked: ``check(devices)`` runs its
    smoke check, called only when every input is on its own GPU; every other name is the
    equivalent, which always works. A forced ``nccl`` that cannot work raises
    ``NoWorkingBackendError``.
    """
    names = ",".join(setting.names)
    candidates = tuple(name for name in setting.names if name != COLLECTIVE)
    starts = candidates[:1] == (NCCL,)
    parsed = [_parse(name) for name in devices]
    local = tuple(device for device in parsed if device is not None)
    if starts and len(local) == 1 and len(parsed) == 1:
        fallback = next((name for name in candidates if name != NCCL), None)
        return _Decision(False, "one tensor: there is nothing to all-reduce", _reduce_on(fallback))
    checked: List[CandidateResult] = []

    def attempt(name: str) -> CandidateResult:
        if name != NCCL:
            return CandidateResult(name, OK, REDUCE_AND_COPY)
        why_not = _not_for_nccl(devices, parsed)
        if why_not is not None:
            return CandidateResult(NCCL, FAILED, why_not)
        checked.append(check(local))
        return checked[-1]

    decision = choose.decide(setting._replace(names=candidates), attempt, race=False)
    result = checked[0] if checked else None
    if not starts:
        reason = f"{ENV_BACKEND}={names} does not start with nccl"
        return _Decision(False, reason, _reduce_on(decision.backend))
    if decision.backend == NCCL and result is not None:
        return _Decision(True, f"NCCL smoke check passed: {result.reason}", check=result)
    failed = decision.results[0]
    reason = choose.first_line(failed.reason) or failed.status
    if decision.backend is None:  # a forced nccl
        if result is not None and result.cached:  # the timeout _smoke_check used: the key's
            reason += f" ({nccl.cached_note(local, nccl.options().timeout)})"
        raise NoWorkingBackendError(
            f"{ENV_BACKEND}=nccl forces NCCL for safestrategy.nccl_ops on {', '.join(devices)}, "
            f"but it cannot be used there: {reason}. Unset it, or list a fallback "
            f"(e.g. {ENV_BACKEND}=nccl,reduce_to_cpu).",
            None,
        )
    return _Decision(False, reason, _reduce_on(decision.backend), result)


def _smoke_check(devices: Tuple[Device, ...]) -> CandidateResult:
    """NCCL's verdict on ``devices``: the same mechanism as the factory's (see
    :mod:`safestrategy.checks.nccl`)."""
    result = nccl.verdict(import_tf(), devices, nccl.options())
    if result.status == OK and result.remedy:
        nccl.apply_remedy(result.remedy, devices)
    return result


def _log(decision: _Decision, devices: Sequence[str]) -> None:
    where = ", ".join(devices)
    if decision.nccl:
        logger.info("nccl_ops on %s: using NCCL, %s", where, decision.reason)
        return
    target = decision.reduce_on or "the first input's device"
    instead = f"reducing on {target} and copying back"
    check = decision.check
    if check is None:
        logger.info("nccl_ops on %s: not using NCCL (%s); %s", where, decision.reason, instead)
        return
    timeout = nccl.options().timeout  # the one _smoke_check used: part of the verdict's key
    if check.cached:
        again = f" ({nccl.cached_note(devices, timeout)})"
    else:
        again = f"; `{nccl.recheck_command(devices, timeout)}` checks NCCL again"
    choose.log_fallback(
        logging.WARNING,
        "NCCL",
        check.status,
        decision.reason,
        f"on {where}",
        f"safestrategy.nccl_ops is {instead}",
        f"Set {ENV_BACKEND}=reduce_to_cpu to reduce on the CPU.",
        again,
        failed="failed its smoke check",
    )
