"""The package's layers (docs/architecture.md), read from its imports with ``ast``.

A module may import from its own layer and the ones below, never from one above:
the map in docs/architecture.md cannot drift from the code. Every module must be
in the map, so a new one is placed on purpose.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "safestrategy"

#: Top to bottom, as docs/architecture.md draws them.
LAYERS = {
    "faces": {
        "safestrategy",
        "safestrategy.__main__",
        "safestrategy.cli",
        "safestrategy._benchmark",
        "safestrategy.run",
        "safestrategy.run.cli",
        "safestrategy.run.judge",
        "safestrategy.run.launches",
        "safestrategy.run.supervise",
        "safestrategy.multiworker.cli",
    },
    "factories": {
        "safestrategy.auto",
        "safestrategy.factory",
        "safestrategy.nccl_ops",
        "safestrategy.multiworker",
        "safestrategy.multiworker.factory",
    },
    "training": {
        "safestrategy.training",
        "safestrategy.training.board",
        "safestrategy.training.canary",
        "safestrategy.training.collectives",
        "safestrategy.training.hooks",
        "safestrategy.training.peers",
        "safestrategy.training.publish",
        "safestrategy.training.rounds",
        "safestrategy.training.sampler",
        "safestrategy.training.watchdog",
        "safestrategy.training.words",
        "safestrategy.mirror",
        "safestrategy.mirror.guard",
        "safestrategy.mirror.instep",
        "safestrategy.mirror.verdict",
    },
    "wings": {
        "safestrategy.choose",
        "safestrategy.checks",
        "safestrategy.checks.allreduce",
        "safestrategy.checks.child",
        "safestrategy.checks.nccl",
        "safestrategy.checks.probe",
        "safestrategy.checks.runner",
        "safestrategy.checks.timing",
        "safestrategy.multiworker.agree",
        "safestrategy.multiworker.cluster",
        "safestrategy.multiworker.rendezvous",
        "safestrategy.multiworker.slurm",
    },
    "settings and facts": {
        "safestrategy._cache",
        "safestrategy._devices",
        "safestrategy._env",
        "safestrategy._machine",
        "safestrategy._procs",
        "safestrategy._rundir",
        "safestrategy._tf",
        "safestrategy.backends",
        "safestrategy.records",
        "safestrategy.report",
    },
}
FLOOR = {
    module: floor for floor, layer in enumerate(reversed(list(LAYERS.values()))) for module in layer
}


def _module(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules():
    return {_module(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports(name, path, known):
    """The package modules ``name`` imports, anywhere in it (function-level imports too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            # ``from a import b``: module ``a.b`` if there is one, else names of module ``a``
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in known and target != name)
    return found


def test_every_module_is_in_the_map():
    assert set(modules()) == set(FLOOR)


def upward(name, imported):
    """The modules of ``imported`` that stand in a layer above ``name``'s."""
    return sorted(other for other in imported if FLOOR[other] > FLOOR[name])


@pytest.mark.parametrize("name", sorted(FLOOR))
def test_no_module_imports_from_a_layer_above_its_own(name):
    known = modules()
    above = upward(name, imports(name, known[name], known))
    assert not above, f"{name} imports from a layer above its own: {above}"


def test_an_upward_import_is_caught():
    """The check can fail: a fact importing a factory, or a wing a face, is named."""
    known = modules()
    assert "safestrategy.backends" in imports(
        "safestrategy._env", known["safestrategy._env"], known
    )
    assert upward("safestrategy._env", {"safestrategy.backends", "safestrategy.factory"}) == [
        "safestrategy.factory"
    ]
    assert upward("safestrategy.checks.runner", {"safestrategy.cli"}) == ["safestrategy.cli"]
