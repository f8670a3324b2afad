"""One nox session per real TensorFlow version, each on its own pyenv interpreter.

``nox`` runs lint and the default legs (what ``.ci/run`` runs); ``nox -s tf221``
runs one leg; ``SAFESTRATEGY_FULL_MATRIX=1 nox`` runs every leg. After the
legs, ``skips`` fails if a test was skipped on every leg that ran. The legs
(Python, pins, TensorFlow) are the table in ``.ci/legs.py``, which GitHub
Actions runs too; nox adds the interpreter and a fresh virtualenv per leg.
"""

import glob
import os
import runpy
import subprocess
import sys

import nox

nox.options.error_on_missing_interpreters = True
nox.options.reuse_existing_virtualenvs = True

LEGS_SCRIPT = os.path.join(".ci", "legs.py")
_legs = runpy.run_path(LEGS_SCRIPT)
LEGS, DEFAULT_LEGS, REPORTS = _legs["LEGS"], _legs["DEFAULT_LEGS"], _legs["REPORTS"]
FULL = os.environ.get("SAFESTRATEGY_FULL_MATRIX") == "1"


def pyenv_python(version):
    """The newest pyenv interpreter for ``version`` ("3.6"); the bare version if none."""
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


def make_leg(name, leg):
    @nox.session(name=name, python=pyenv_python(leg.python), venv_backend="venv")
    def run_leg(session):
        session.run("python", LEGS_SCRIPT, name, *session.posargs)

    run_leg.__doc__ = f"Tests on {' '.join(leg.requirements)} (Python {leg.python})."
    return run_leg


for _name, _leg in LEGS.items():
    make_leg(_name, _leg)


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
