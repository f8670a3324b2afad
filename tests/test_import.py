"""``import safestrategy`` is free: no TensorFlow, no devices, no environment changes."""

from .conftest import run_python

SCRIPT = """
import os, sys
before = dict(os.environ)
sys.modules["tensorflow"] = None  # as if TensorFlow were not installed
import safestrategy
assert "tensorflow" not in [m for m in sys.modules if sys.modules[m] is not None], "TF imported"
assert dict(os.environ) == before, "environment changed"
assert sorted(safestrategy.__all__) == safestrategy.__all__
# the multi-worker factory (sockets and all) loads on first use, where Python allows
assert sys.version_info < (3, 7) or "safestrategy.multiworker" not in sys.modules
assert callable(safestrategy.make_multiworker_strategy)
try:
    safestrategy.make_mirrored_strategy()
except ImportError as error:
    print(error)
else:
    raise AssertionError("no ImportError")
"""


def test_import_touches_nothing_and_missing_tensorflow_says_how_to_install():
    done = run_python("-c", SCRIPT)
    assert done.returncode == 0, done.stderr
    assert "pip install 'safestrategy[cpu]'" in done.stdout


def test_the_package_and_its_metadata_agree_on_the_version():
    import re

    import safestrategy

    from .conftest import ROOT

    pyproject = (ROOT / "pyproject.toml").read_text()
    (declared,) = re.findall(r'(?m)^version = "([^"]+)"$', pyproject)
    assert safestrategy.__version__ == declared
