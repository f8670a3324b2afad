"""One nox session per real TensorFlow version, each on its own pyenv interpreter.

``nox`` runs lint and the default legs (what ``.ci/run`` runs); ``nox -s tf221``
runs one leg; ``SAFESTRATEGY_FULL_MATRIX=1 nox`` runs every leg. After the
legs, ``skips`` fails if a test was skipped on every leg that ran.
"""

import glob
import os
import subprocess
import sys

import nox

nox.options.error_on_missing_interpreters = True
nox.options.reuse_existing_virtualenvs = True

# leg: (Python, pip/build-tool pins installed first, TensorFlow requirement(s))
LEGS = {
    "tf112": ("3.6", ["pip==21.3.1", "setuptools<60", "wheel<0.38"], ["tensorflow==1.12.3"]),
    "tf113": ("3.7", [], ["tensorflow==1.13.2", "protobuf<3.21"]),
    "tf115": ("3.7", [], ["tensorflow==1.15.5", "protobuf<3.21"]),
    "tf200": ("3.7", [], ["tensorflow==2.0.4", "protobuf<3.21"]),
    "tf244": ("3.8", [], ["tensorflow-cpu==2.4.4"]),
    "tf210": ("3.8", [], ["tensorflow-cpu==2.10.1"]),
    "tf213": ("3.11", [], ["tensorflow-cpu==2.13.1"]),
    "tf216": ("3.11", [], ["tensorflow-cpu==2.16.2"]),
    "tf221": ("3.11", [], ["tensorflow-cpu==2.21.0"]),
}
DEFAULT_LEGS = ["tf112", "tf115", "tf210", "tf221"]
FULL = os.environ.get("SAFESTRATEGY_FULL_MATRIX") == "1"
REPORTS = os.path.join(".nox", "junit")


def pyenv_python(version):
    """The newest pyenv interpreter for ``version`` ("3.6"), or a clear error."""
    try:
        root = subprocess.run(
            ["pyenv", "root"], stdout=subprocess.PIPE, universal_newlines=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    found = sorted(
        glob.glob(os.path.join(root, "versions", f"{version}.*", "bin", "python")),
        key=lambda path: [int(p) for p in path.split(os.sep)[-3].split(".") if p.isdigit()],
    )
    # Missing: nox then fails the leg with "Python interpreter 3.x not found".
    return found[-1] if found else version


def make_leg(name, python, pins, requirements):
    @nox.session(name=name, python=pyenv_python(python), venv_backend="venv")
    def leg(session):
        if pins:
            session.install(*pins)
        session.install(*requirements, ".[test]")
        os.makedirs(REPORTS, exist_ok=True)
        session.run(
            "python", "-m", "pytest", f"--junitxml={REPORTS}/{name}.xml", *session.posargs
        )

    leg.__doc__ = f"Tests on {' '.join(requirements)} (Python {python})."
    return leg


for _name, (_python, _pins, _requirements) in LEGS.items():
    make_leg(_name, _python, _pins, _requirements)


@nox.session(venv_backend="none")
def skips(session):
    """Fail if any test was skipped on every leg that ran (threadpoolctl's guard)."""
    reports = glob.glob(os.path.join(REPORTS, "*.xml"))
    session.run(sys.executable, os.path.join(".ci", "skipped_everywhere.py"), *reports)


@nox.session(venv_backend="none")
def lint(session):
    """ruff check, ruff format --check, actionlint: the tools beside nox (the dev extra)."""

    def tool(name):
        return os.path.join(os.path.dirname(sys.executable), name)

    session.run(tool("ruff"), "check", ".")
    session.run(tool("ruff"), "format", "--check", ".")
    session.run(tool("actionlint"), os.path.join(".github", "workflows", "ci.yml"))


nox.options.sessions = ["lint", *(LEGS if FULL else DEFAULT_LEGS), "skips"]
