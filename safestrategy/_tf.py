"""The one place that imports TensorFlow, and what can be known without importing it.

Importing TensorFlow costs seconds and may touch devices, so nothing here runs
at ``import safestrategy``; :func:`tf_version` reads the installed version from
package metadata, and :func:`import_tf` imports it when it is really needed.
"""

import sys
from typing import Any, List, Optional

from packaging.version import InvalidVersion, Version

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
    """Split TF2's physical CPU into ``n`` logical devices; only before the runtime starts."""
    config = tf.config
    setter = getattr(config, "set_logical_device_configuration", None)
    if setter is None:  # TF 2.0
        setter = config.experimental.set_virtual_device_configuration
        logical = config.experimental.VirtualDeviceConfiguration
    else:
        logical = config.LogicalDeviceConfiguration
    setter(list_physical_devices(tf, "CPU")[0], [logical() for _ in range(n)])


def import_tf() -> Any:
    """Import TensorFlow, or raise ``ImportError`` that says how to install it."""
    try:
        import tensorflow as tf
    except ImportError as error:
        raise ImportError(f"{INSTALL_HINT} ({error})") from error
    return tf
