"""The one place that imports TensorFlow, and what can be known without importing it.

Importing TensorFlow costs seconds and may touch devices, so nothing here runs
at ``import safestrategy``; :func:`tf_version` reads the installed version from
package metadata, and :func:`import_tf` imports it when it is really needed.
"""

import sys
from typing import Any, Dict, List, Optional, Tuple

from packaging.version import InvalidVersion, Version

from ._devices import Device, Visible, parse_device

try:  # Python >= 3.8
    from importlib import metadata as _metadata
except ImportError:  # pragma: no cover - Python 3.6/3.7
    import importlib_metadata as _metadata  # type: ignore[no-redef]

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
    for distribution in TF_DISTRIBUTIONS:
        try:
            return _metadata.version(distribution)
        except _metadata.PackageNotFoundError:
            continue
    return None


def _release(version: str) -> Version:
    try:
        return Version(Version(version).base_version)
    except InvalidVersion:
        return Version("2")  # an unparseable (vendor) version: assume current TensorFlow


def tf_api(version: str) -> str:
    """Which MirroredStrategy API a version has: "tf1-contrib", "tf1" or "tf2"."""
    release = _release(version)
    if release < Version("1.13"):
        return "tf1-contrib"
    return "tf1" if release < Version("2") else "tf2"


def era(version: str) -> str:
    """Where the cross-device-ops classes live (see :data:`safestrategy.backends.ERAS`)."""
    release = _release(version)
    if release < Version("1.13"):
        return "contrib-tower"
    return "contrib-device" if release < Version("1.14") else "distribute"


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


def default_devices(tf: Any, visible: Visible) -> Tuple[Device, ...]:
    """What ``MirroredStrategy()`` mirrors over by default: every GPU, else the CPU.

    Where the GPUs are not known (TF 1.12/1.13), they are counted as TF's own
    ``MirroredStrategy()`` counts them, through its eager context.
    """
    if visible.gpus_known:
        gpus = tuple(d for d in visible.devices if d.kind == "GPU")
    else:
        from tensorflow.python.eager import context

        gpus = tuple(Device("GPU", i) for i in range(context.num_gpus()))
    return gpus or (Device("CPU", 0),)


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


def xla_auto_jit(tf: Any) -> bool:
    """XLA auto-clustering is known to be on: ``TF_XLA_FLAGS`` has ``--tf_xla_auto_jit``
    with a value that turns it on, or ``tf.config.optimizer.get_jit()`` says so (TF2).
    (A Keras ``jit_compile`` is set later, on the model: it cannot be known here.)"""
    from ._env import xla_auto_jit_flag

    if xla_auto_jit_flag():
        return True
    try:
        return bool(tf.config.optimizer.get_jit())
    except Exception:
        return False
