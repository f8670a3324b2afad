"""The TensorFlow legs: one table for nox, .ci/run and GitHub Actions.

    python .ci/legs.py LEG [PYTEST ARGS ...]

installs LEG's build-tool pins, its TensorFlow and this project (with the
``test`` extra) into the *running* interpreter, then runs the test suite with a
JUnit report in ``.nox/junit/LEG.xml`` (what ``.ci/skipped_everywhere.py``
reads). nox calls it inside each leg's virtualenv; CI calls it on an
interpreter that setup-python or a container provides (outside a virtualenv
it refuses unless ``CI`` is set). ``--pythons`` prints
the Python versions the legs need. Standard library only: it runs on 3.6.
"""

import os
import subprocess
import sys
from typing import NamedTuple, Tuple


class Leg(NamedTuple):
    python: str  #: "3.6": the interpreter's major.minor
    pins: Tuple[str, ...]  #: installed first (build tools old pips get wrong)
    requirements: Tuple[str, ...]  #: TensorFlow and the pins it needs
    #: installed last with ``--no-deps``, as the docs tell users: tf_keras requires the
    #: ``tensorflow`` package, and would pull a second TensorFlow over ``tensorflow-cpu``
    no_deps: Tuple[str, ...] = ()


# Every requirement installs the same way on Linux and Windows: from 2.10 to
# 2.16 the Windows tensorflow-cpu wheel is a stub that pulls tensorflow-intel.
LEGS = {
    "tf112": Leg("3.6", ("pip==21.3.1", "setuptools<60", "wheel<0.38"), ("tensorflow==1.12.3",)),
    "tf113": Leg("3.7", (), ("tensorflow==1.13.2", "protobuf<3.21")),
    "tf115": Leg("3.7", (), ("tensorflow==1.15.5", "protobuf<3.21")),
    "tf200": Leg("3.7", (), ("tensorflow==2.0.4", "protobuf<3.21")),
    "tf244": Leg("3.8", (), ("tensorflow-cpu==2.4.4",)),
    "tf210": Leg("3.8", (), ("tensorflow-cpu==2.10.1",)),
    "tf213": Leg("3.11", (), ("tensorflow-cpu==2.13.1",)),
    "tf216": Leg("3.11", (), ("tensorflow-cpu==2.16.2",), ("tf_keras~=2.16.0",)),
    "tf221": Leg("3.11", (), ("tensorflow-cpu==2.21.0",), ("tf_keras~=2.21.0",)),
}
#: What ``nox`` and ``.ci/run`` run unless SAFESTRATEGY_FULL_MATRIX=1.
DEFAULT_LEGS = ("tf112", "tf115", "tf210", "tf221")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORTS = os.path.join(".nox", "junit")


def pip_install(*requirements: str) -> None:
    subprocess.check_call([sys.executable, "-m", "pip", "install", *requirements], cwd=ROOT)


def run(name: str, pytest_args: Tuple[str, ...]) -> int:
    leg = LEGS[name]
    in_venv = getattr(sys, "real_prefix", None) or sys.prefix != getattr(sys, "base_prefix", None)
    if not in_venv and not os.environ.get("CI"):
        print(
            f"legs.py: {sys.executable} is not in a virtualenv and CI is not set; "
            "refusing to install TensorFlow into it (nox runs this in a fresh virtualenv)",
            file=sys.stderr,
        )
        return 2
    running = "{}.{}".format(*sys.version_info[:2])
    if running != leg.python:
        print(
            f"legs.py: {name} needs Python {leg.python}, this is {running} ({sys.executable})",
            file=sys.stderr,
        )
        return 2
    if leg.pins:
        pip_install(*leg.pins)
    pip_install(*leg.requirements, ".[test]")
    if leg.no_deps:
        pip_install("--no-deps", *leg.no_deps)
    os.makedirs(os.path.join(ROOT, REPORTS), exist_ok=True)
    report = os.path.join(REPORTS, f"{name}.xml")
    command = [sys.executable, "-m", "pytest", f"--junitxml={report}", *pytest_args]
    return subprocess.call(command, cwd=ROOT)


def main(argv: Tuple[str, ...]) -> int:
    if argv[:1] == ("--pythons",):
        pythons = {leg.python for leg in LEGS.values()}
        print(" ".join(sorted(pythons, key=lambda v: [int(part) for part in v.split(".")])))
        return 0
    if not argv or argv[0] not in LEGS:
        print(f"usage: legs.py {{{','.join(LEGS)}}} [PYTEST ARGS ...] | --pythons", file=sys.stderr)
        return 2
    return run(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main(tuple(sys.argv[1:])))
