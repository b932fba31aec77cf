"""A model family is one descriptor (models/family.py) beside its module, listed once in
models/registry.py: every model class is some family's, every name resolves to one
family, and no other module keeps a table of family names."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from tandem.models import registry
from tandem.models.registry import FAMILIES, family_for, gguf_family

PACKAGE = Path(registry.__file__).resolve().parents[1]


def test_every_name_resolves_to_one_family():
    names = [name for family in FAMILIES for name in family.architectures]
    assert len(names) == len(set(names))
    gguf = [(f.gguf_architecture, f.gguf_has_experts) for f in FAMILIES if f.gguf_architecture]
    assert len(gguf) == len(set(gguf))
    for family in FAMILIES:
        for name in family.architectures:
            assert family_for({"architectures": [name]}) is family
        if family.gguf_architecture:
            assert gguf_family(family.gguf_architecture, family.gguf_has_experts) is family


def test_every_model_class_is_a_familys_and_lives_beside_its_descriptor():
    classes = {family.model_class for family in FAMILIES}
    defined = set()
    for path in sorted((PACKAGE / "models").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name != "CausalLM":  # (the protocol)
                methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                if "parse_config" in methods:  # (CausalLM's; subclasses inherit the rest)
                    defined.add((path.stem, node.name))
    assert {(Path(inspect.getfile(c)).stem, c.__name__) for c in classes} == defined
    for family in FAMILIES:
        module = inspect.getmodule(family.model_class)
        assert any(value is family for value in vars(module).values()), (
            f"{family.name}'s descriptor is not beside its model class"
        )


def test_no_other_module_names_a_familys_architecture():
    """A family's config.json names are its descriptor's alone: a table of them
    elsewhere (a loader's, the sharder's, the exporter's) is how facts drift apart."""
    names = {name for family in FAMILIES for name in family.architectures}
    homes = {Path(inspect.getfile(f.model_class)).resolve() for f in FAMILIES}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.resolve() in homes:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value}")
    assert not found, "family names outside their descriptors:\n" + "\n".join(found)
