"""The dependency order docs/ARCHITECTURE.md states, checked on the source.

Every import counts (function-level ones too: they run when called; only ``if
TYPE_CHECKING:`` blocks are left out). A room is a sub-package or top-level module of
``tandem``; ``ROOMS`` lists them from the top floor down, and a room may import only
rooms below it. Inside every package the same holds for its files and sub-packages: no
two of them reach each other. And the engine and the step contract stay torch-free, so
a simulator or another process can drive the scheduler."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tandem"

# From the top floor down: a room imports only rooms after it.
ROOMS = [
    "__main__", "cli", "plan", "train", "eval", "bench",
    "server",       # the HTTP face: one router module per API
    "serving",      # the engine core in its own process or thread, data-parallel cores
    "llm", "trace",
    "engine",       # torch-free: scheduler, KV manager, input and output processing
    "disagg",       # KV transfer agents
    "executor",     # who runs each step: this process, or tensor-parallel ranks
    "worker",       # a rank's device, loading, KV sizing, proposer
    "spec_decode",  # proposers
    "runner",       # the forward and sampling
    "models", "quant", "kernels",
    "step",         # the engine <-> executor contract
    "outputs", "sampling", "config", "host_memory", "errors",
]  # fmt: skip

TORCH_FREE = ("engine", "step", "outputs", "sampling", "config", "errors")
# The engine is handed an executor; it never reaches for what runs one.
ENGINE_NEVER = ("executor", "worker", "spec_decode", "runner", "models", "quant", "kernels")


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    hidden = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden.update(id(inner) for inner in ast.walk(node))
    return hidden


def imported_modules(path: Path) -> list[tuple[str, int]]:
    """Every module a file may import, with its line: ``from a.b import c`` gives both
    ``a.b`` and ``a.b.c`` (c may be a module); relative imports made absolute."""
    tree = ast.parse(path.read_text())
    hidden = _type_checking_nodes(tree)
    here = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if path.name == "__init__.py":
        here = here[:-1]
    found = []
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = here[: len(here) - node.level] if path.name != "__init__.py" else (
                    here[: len(here) - node.level + 1])  # fmt: skip
                base = ".".join([*parent, *([node.module] if node.module else [])])
            found.append((base, node.lineno))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _room(module: str, depth: int) -> str | None:
    """The room ``module`` lies in at ``depth`` (1: tandem's children), or None when it
    is no module of tandem's that deep."""
    parts = module.split(".")
    if parts[0] != "tandem" or len(parts) <= depth:
        return None
    path = PACKAGE.parent.joinpath(*parts[: depth + 1])
    return parts[depth] if path.is_dir() or path.with_suffix(".py").exists() else None


def _edges(package: Path) -> dict[tuple[str, str], list[str]]:
    """Imports between the rooms (files and sub-packages) directly inside ``package``."""
    depth = len(package.relative_to(PACKAGE.parent).parts)
    prefix = ".".join(package.relative_to(PACKAGE.parent).parts)
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in package.rglob("*.py"):
        source = path.relative_to(package).parts[0].removesuffix(".py")
        for module, line in imported_modules(path):
            if not module.startswith(prefix + "."):
                continue
            target = _room(module, depth)
            if target is not None and target != source and target != "__init__":
                edges[(source, target)].append(f"{path.relative_to(PACKAGE)}:{line} {module}")
    return edges


def test_every_room_of_tandem_is_placed():
    rooms = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert rooms - {"__init__"} == set(ROOMS)


def test_rooms_import_only_rooms_below_them():
    floor = {room: index for index, room in enumerate(ROOMS)}
    upward = [
        f"{source} -> {target}: {where[0]}"
        for (source, target), where in _edges(PACKAGE).items()
        if source != "__init__" and floor[target] <= floor[source]
    ]
    assert not upward, "imports that run up the order:\n" + "\n".join(upward)


def _reaches(edges) -> dict[str, set[str]]:
    graph = defaultdict(set)
    for source, target in edges:
        graph[source].add(target)
    reached = {}
    for start in list(graph):
        seen, stack = set(), [start]
        while stack:
            for nxt in graph[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        reached[start] = seen
    return reached


@pytest.mark.parametrize(
    "package",
    sorted(str(p.parent.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("__init__.py")),
)
def test_no_two_rooms_of_a_package_reach_each_other(package):
    edges = _edges(PACKAGE.parent / package)
    reached = _reaches(edges)
    knots = sorted(
        f"{a} <-> {b}: {edges.get((a, b), ['(through others)'])[0]}"
        for a in reached for b in reached[a] if a < b and a in reached.get(b, ())
    )  # fmt: skip
    assert not knots, f"rooms of {package} that reach each other:\n" + "\n".join(knots)


@pytest.mark.parametrize("room", TORCH_FREE)
def test_the_engine_side_is_torch_free(room):
    path = PACKAGE / room
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    found = [
        f"{f.relative_to(PACKAGE)}:{line}"
        for f in files
        for module, line in imported_modules(f)
        if module == "torch" or module.startswith("torch.")
    ]
    assert not found, f"tandem/{room} imports torch: {found}"


def test_the_engine_is_handed_its_executor():
    reached = [
        f"{target}: {where[0]}"
        for (source, target), where in _edges(PACKAGE).items()
        if source == "engine" and target in ENGINE_NEVER
    ]
    assert not reached, f"tandem/engine reaches what runs the model: {reached}"
