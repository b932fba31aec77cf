"""The dependency rule docs/ARCHITECTURE.md states, checked on the source: the engine
package imports neither torch nor model or runner code (it drives a runner it is
given), so a simulator or a separate process can run it; the runner and models never
import the executor; kernels import nothing of tandem's
outside kernels/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tandem"


def runtime_imports(path: Path) -> set[str]:
    """Modules a file imports when it runs (``if TYPE_CHECKING:`` blocks and imports
    inside functions, made only when called, are left out)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("engine", ("torch", "tandem.models", "tandem.runner", "tandem.spec_decode")),
        ("kernels", ("tandem.",)),
        # executor -> runner -> models: the runner and the models never learn how many
        # processes run them (a rank's view comes in as a TensorParallel, a ShardPlan);
        # proposers build runners (a draft's), so the executor hands the runner its own
        (
            "runner",
            (
                "tandem.executor",
                "tandem.spec_decode.proposer",
                "tandem.spec_decode.draft",
                "tandem.spec_decode.eagle",
                "tandem.spec_decode.layer_skip",
            ),
        ),
        ("models", ("tandem.executor", "tandem.runner")),
    ],
)
def test_package_imports(package, forbidden):
    offenders = {}
    for path in sorted((PACKAGE / package).glob("*.py")):
        bad = [
            name
            for name in runtime_imports(path)
            if any(name == f or name.startswith(f if f.endswith(".") else f + ".")
                   for f in forbidden)
            and not name.startswith("tandem.spec_decode.stats")
            and not name.startswith(f"tandem.{package}.")  # its own modules
        ]  # fmt: skip
        if bad:
            offenders[path.name] = bad
    assert not offenders, f"tandem/{package} imports what it must not: {offenders}"
