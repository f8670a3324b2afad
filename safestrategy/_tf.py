"""The one place that imports TensorFlow, and what can be known without importing it.

Importing TensorFlow costs seconds and may touch devices, so nothing here runs
at ``import safestrategy``; :func:`tf_version` reads the installed version from
package metadata, and :func:`import_tf` imports it when it is really needed.
"""

import importlib
import importlib.machinery
import importlib.util
import sys
import threading
import types
from typing import Any, Dict, List, Optional, Tuple

from packaging.version import InvalidVersion, Version

from ._devices import Device, Visible, mirrored_default, parse_device

#: Distributions that provide the ``tensorflow`` module, most common first.
TF_DISTRIBUTIONS = (
    "tensorflow",
    "tensorflow-cpu",
    "tensorflow-gpu",
    "tensorflow-intel",
    "tensorflow-macos",
    "tensorflow-directml",
    "tensorflow-rocm",
    "intel-tensorflow",
    "tf-nightly",
    "tf-nightly-cpu",
    "tf-nightly-gpu",
)

INSTALL_HINT = (
    "safestrategy needs TensorFlow, which is not installed with it so that you can pick "
    "the build: pip install 'safestrategy[cpu]' (tensorflow-cpu), 'safestrategy[gpu]' "
    "(tensorflow), or install tensorflow-gpu / tensorflow-directml yourself"
)


def tf_version() -> Optional[str]:
    """The TensorFlow version, from the loaded module or package metadata; None if absent."""
    module = sys.modules.get("tensorflow")
    if module is not None:
        return getattr(module, "__version__", None)
    # here: ~35 ms that `import safestrategy` (and a process that imported TF) need not pay
    try:  # Python >= 3.8
        from importlib import metadata as _metadata
    except ImportError:  # pragma: no cover - Python 3.6/3.7
        import importlib_metadata as _metadata  # type: ignore[no-redef]

    for distribution in TF_DISTRIBUTIONS:
        try:
            return _metadata.version(distribution)
        except _metadata.PackageNotFoundError:
            continue
    return None


def release(version: str) -> Version:
    """The release of a version string (2.21.0rc1 -> 2.21.0); an unparseable one is 2."""
    try:
        return Version(Version(version).base_version)
    except InvalidVersion:
        return Version("2")  # an unparseable (vendor) version: assume current TensorFlow


def tf_api(version: str) -> str:
    """Which MirroredStrategy API a version has: "tf1-contrib", "tf1" or "tf2"."""
    number = release(version)
    if number < Version("1.13"):
        return "tf1-contrib"
    return "tf1" if number < Version("2") else "tf2"


def era(version: str) -> str:
    """Where the cross-device-ops classes live (see :data:`safestrategy.backends.ERAS`)."""
    number = release(version)
    if number < Version("1.13"):
        return "contrib-tower"
    return "contrib-device" if number < Version("1.14") else "distribute"


def list_physical_devices(tf: Any, kind: str) -> List[Any]:
    """TF2's physical devices of ``kind``, without starting the runtime (2.0: experimental)."""
    lister = getattr(tf.config, "list_physical_devices", None)
    return (lister or tf.config.experimental.list_physical_devices)(kind)


def configure_logical_cpus(tf: Any, n: int) -> None:
    """Split TF2's physical CPU into at least ``n`` logical devices (a split into more is
    kept); only before the runtime starts."""
    config = tf.config
    setter = getattr(config, "set_logical_device_configuration", None)
    if setter is None:  # TF 2.0
        setter = config.experimental.set_virtual_device_configuration
        getter = config.experimental.get_virtual_device_configuration
        logical = config.experimental.VirtualDeviceConfiguration
    else:
        getter = config.get_logical_device_configuration
        logical = config.LogicalDeviceConfiguration
    cpu = list_physical_devices(tf, "CPU")[0]
    if len(getter(cpu) or ()) < n:
        setter(cpu, [logical() for _ in range(n)])


def import_tf() -> Any:
    """Import TensorFlow, or raise ``ImportError`` that says how to install it."""
    try:
        import tensorflow as tf
    except ImportError as error:
        raise ImportError(f"{INSTALL_HINT} ({error})") from error
    return tf


#: Set to True in a module that stands in for TensorFlow's ``nccl_ops`` (ours), so that
#: :func:`tf_nccl_ops` never takes it for TensorFlow's own.
DROP_IN = "_safestrategy_drop_in"

#: The names TensorFlow's ``nccl_ops`` has: in core, then (TF 1.12) in contrib only.
TF_NCCL_OPS = ("tensorflow.python.ops.nccl_ops", "tensorflow.contrib.nccl.python.ops.nccl_ops")

_nccl_ops: Optional[Any] = None
_nccl_ops_lock = threading.Lock()


def tf_nccl_ops() -> Any:
    """TensorFlow's own ``nccl_ops`` module, even where an alias puts ours in its place.

    Users whose code they cannot edit alias ours under TensorFlow's name
    (``sys.modules["tensorflow.python.ops.nccl_ops"]`` and the package's
    attribute), before or after TensorFlow imported its own. Importing that
    name then gives ours, and calling it from ours would recurse. TensorFlow's
    module registers the ``NcclAllReduce`` gradient when it runs, and running it
    twice raises ``KeyError``, so: where TensorFlow's module already ran, its
    namespace is the registered gradient's globals; where it never ran (the
    alias came first), its file is run once, under a private name.
    """
    global _nccl_ops
    with _nccl_ops_lock:
        if _nccl_ops is None:
            _nccl_ops = _find_tf_nccl_ops()
        return _nccl_ops


def _find_tf_nccl_ops() -> Any:
    import_tf()
    for name in TF_NCCL_OPS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if not getattr(module, DROP_IN, False):
            return module
        ran = _registered_nccl_ops()
        return ran if ran is not None else _run_privately(name)
    raise ImportError(f"this TensorFlow has none of {', '.join(TF_NCCL_OPS)}")


def _registered_nccl_ops() -> Optional[Any]:
    """TensorFlow's ``nccl_ops`` as it ran, from its registered gradient; None if it never ran."""
    from tensorflow.python.framework import ops

    try:
        gradient = ops._gradient_registry.lookup("NcclAllReduce")
    except LookupError:
        return None
    namespace = getattr(gradient, "__globals__", {})
    if "_check_device" not in namespace:  # not the module we know: do not guess
        return None
    module = types.ModuleType(namespace["__name__"], namespace.get("__doc__"))
    module.__dict__.update(namespace)
    return module


def _run_privately(name: str) -> Any:
    """Run TensorFlow's ``nccl_ops`` file (``name`` is ours in ``sys.modules``) under a private
    name: the first and only time it runs in this process."""
    parent, _, leaf = name.rpartition(".")
    found = importlib.machinery.PathFinder.find_spec(leaf, importlib.import_module(parent).__path__)
    if found is None or found.origin is None:
        raise ImportError(f"cannot find TensorFlow's own {name} behind the alias")
    spec = importlib.util.spec_from_file_location(f"{name}_behind_safestrategy", found.origin)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nccl_kernel_count(tf: Any) -> Optional[int]:
    """How many NcclAllReduce kernels are registered: a count, never TF's truthy message.

    Counted after TensorFlow's nccl ops module is loaded, which on TF 1.12/1.13
    (contrib) is what registers the kernels. None when it cannot be read.
    """
    try:
        if era(tf.__version__) == "distribute":
            from tensorflow.python.ops import nccl_ops
        else:
            from tensorflow.contrib.nccl.python.ops import nccl_ops  # noqa: F401
        from tensorflow.python.framework import kernels

        return len(kernels.get_registered_kernels_for_op("NcclAllReduce").kernel)
    except Exception:
        return None


def _parsed(names: List[str]) -> Tuple[Device, ...]:
    return tuple(parse_device(name) for name in names)


def visible_devices(tf: Any) -> Visible:
    """TF2: the logical devices (this starts TF's runtime, as any strategy does).

    TF 1.x: the physical GPUs where TF can list them without creating devices
    (1.14+); CPUs are per session. Nothing here fixes GPU memory options.
    """
    if tf.__version__.startswith("2."):
        lister = getattr(tf.config, "list_logical_devices", None)
        lister = lister or tf.config.experimental.list_logical_devices  # TF 2.0
        return Visible(_parsed([d.name for d in lister() if d.device_type in ("CPU", "GPU")]))
    cpu = (Device("CPU", 0),)
    experimental = getattr(getattr(tf, "config", None), "experimental", None)
    if hasattr(experimental, "list_physical_devices"):
        gpus = experimental.list_physical_devices("GPU")
        return Visible(cpu + tuple(Device("GPU", i) for i in range(len(gpus))), any_cpu=True)
    if not tf.test.is_built_with_cuda():
        return Visible(cpu, any_cpu=True)
    return Visible(cpu, any_cpu=True, gpus_known=False)


#: The first release whose own ``MirroredStrategy()`` falls back to every logical CPU:
#: 2.1's ``all_local_devices`` returns ``config.list_logical_devices("GPU")`` or else
#: ``config.list_logical_devices("CPU")``; 1.12-2.0 make ``/device:GPU:i`` for each of
#: ``context.num_gpus()``, else ``/device:CPU:0`` (``local_devices_from_num_gpus``).
EVERY_CPU_SINCE = Version("2.1")


def mirrors_every_cpu(version: str) -> bool:
    """Whether this release's ``MirroredStrategy()`` mirrors over every logical CPU where it
    has no GPU (TF 2.1+), rather than over ``/device:CPU:0`` alone."""
    return release(version) >= EVERY_CPU_SINCE


def _logical(tf: Any, kind: str) -> Tuple[Device, ...]:
    lister = getattr(tf.config, "list_logical_devices", None)
    lister = lister or tf.config.experimental.list_logical_devices  # TF 2.0
    return _parsed([d.name for d in lister(kind)])


def logical_gpus(tf: Any) -> Tuple[Device, ...]:
    """The GPUs TensorFlow's own ``MirroredStrategy()`` counts: its logical GPUs.

    TF2: listed (this starts TF's runtime, as any strategy does). TF 1.14/1.15:
    ``context.num_gpus()`` where the eager runtime has started; before that,
    counted as it will count them without creating a device (which would fix
    the process's GPU options): each visible GPU as many times as its
    virtual-device configuration splits it. TF 1.12/1.13: ``context.num_gpus()``.
    """
    if tf.__version__.startswith("2."):
        return _logical(tf, "GPU")
    from tensorflow.python.eager import context

    experimental = getattr(getattr(tf, "config", None), "experimental", None)
    split = getattr(experimental, "get_virtual_device_configuration", None)
    visible = getattr(experimental, "get_visible_devices", None)
    if split is None or visible is None or getattr(context.context(), "_initialized", True):
        count = context.num_gpus()
    else:
        count = sum(len(split(gpu) or [gpu]) for gpu in visible("GPU"))
    return tuple(Device("GPU", i) for i in range(count))


def default_devices(tf: Any) -> Tuple[Device, ...]:
    """What this TensorFlow's own ``MirroredStrategy()`` mirrors over by default, by its
    release's rule (:func:`safestrategy._devices.mirrored_default`)."""
    every_cpu = mirrors_every_cpu(tf.__version__)
    cpus = _logical(tf, "CPU") if every_cpu else ()
    return mirrored_default(logical_gpus(tf), cpus, every_cpu)


def build_info(tf: Any) -> Dict[str, Any]:
    """What TensorFlow was built with (CUDA, cuDNN) where it says; empty where it cannot."""
    try:
        info = dict(tf.sysconfig.get_build_info())  # TF 2.3+
    except Exception:
        try:
            return {"is_cuda_build": bool(tf.test.is_built_with_cuda())}
        except Exception:
            return {}
    return {key: str(value) for key, value in sorted(info.items())}


def gpu_names(tf: Any) -> Optional[List[str]]:
    """The physical GPUs' model names (TF 2.3+), without starting the runtime; else None."""
    try:
        details = tf.config.experimental.get_device_details
        gpus = list_physical_devices(tf, "GPU")
        return [str(details(gpu).get("device_name")) for gpu in gpus]
    except Exception:
        return None


def virtual_gpus(tf: Any) -> bool:
    """TF2: more logical GPUs than physical ones (one GPU split in several); False on TF 1.x."""
    if not tf.__version__.startswith("2."):
        return False
    lister = getattr(tf.config, "list_logical_devices", None)
    lister = lister or tf.config.experimental.list_logical_devices  # TF 2.0
    return len(lister("GPU")) > len(list_physical_devices(tf, "GPU"))


def xla_auto_jit(tf: Any, flag: bool) -> bool:
    """XLA auto-clustering is known to be on: ``flag`` (``TF_XLA_FLAGS`` turns it on, as
    :func:`safestrategy._env.xla_auto_jit_flag` reads it), or ``tf.config.optimizer.get_jit()``
    says so (TF2). (A Keras ``jit_compile`` is set later, on the model: it cannot be known
    here.)"""
    if flag:
        return True
    try:
        return bool(tf.config.optimizer.get_jit())
    except Exception:
        return False


#: TensorFlow's coordination-service key-value calls: set, get (with a timeout), delete;
#: and its peers' health probe (None where it has none).
KeyValues = Tuple[Any, Any, Any, Any]


def coordination_kv(tf: Any) -> Tuple[Optional[KeyValues], str]:
    """The coordination service's key-value calls of this process, where this TensorFlow
    has them and every read can be bounded (``get_config_key_value(key, timeout_in_ms)``);
    else None and why. Asked of the runtime, not inferred from the version."""
    import inspect

    try:
        from tensorflow.python.eager import context

        ctx = context.context()
        get = ctx.get_config_key_value
        service = getattr(ctx.coordination_service, "service_type", "")
        bounded = "timeout_in_ms" in inspect.signature(get).parameters
    except Exception as error:  # an old or stripped TF: no such calls
        return None, f"TF {tf.__version__} has no coordination-service key-value store ({error})"
    if not service:
        return None, "TensorFlow's coordination service is not running in this process"
    if not bounded:
        return None, (
            f"TF {tf.__version__}'s coordination service cannot be read with a bound "
            "(its get_config_key_value has no timeout)"
        )
    health = getattr(ctx, "check_collective_ops_peer_health", None)
    return (ctx.set_config_key_value, get, ctx.delete_config_key_value, health), ""
