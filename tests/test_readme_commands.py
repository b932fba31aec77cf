"""README's two commands are what CI runs, and the pins they install with hold what
pyproject.toml asks for: CI reads the commands out of README.md (scripts/readme_commands.py),
so these tests check that the README still has the shape that reading relies on."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
from packaging.requirements import Requirement

CHECKOUT = Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib")


def load_script():
    spec = importlib.util.spec_from_file_location(
        "readme_commands", CHECKOUT / "scripts" / "readme_commands.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


readme_commands = load_script()


def pins(path: str) -> dict[str, str]:
    lines = (CHECKOUT / path).read_text().splitlines()
    found = {}
    for line in lines:
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.]*)", line)
        assert match, f"{path}: not a plain name==version pin: {line!r}"
        found[match[1].lower().replace("_", "-")] = match[2]
    return found


def test_ci_runs_both_readme_commands_in_new_environments():
    ci = (CHECKOUT / ".ci" / "run").read_text()
    runs = re.findall(r"^python3 scripts/readme_commands\.py run (\w+)$", ci, flags=re.M)
    assert runs == ["main", "test"]
    assert "pip install" not in ci and "pytest" not in ci  # nothing beside the README's


def test_readme_has_the_two_commands():
    commands = readme_commands.readme_commands((CHECKOUT / "README.md").read_text())
    main, test = commands["main"], commands["test"]
    assert main.startswith("pip install torch==") and "tandem chat" in main
    assert test.startswith("pip install torch==") and test.endswith("python -m pytest -n auto")
    assert f"-c {readme_commands.TEST_CONSTRAINTS}" in test
    for command in (main, test):
        steps = readme_commands.steps(command)
        assert " && ".join(steps) == command
        # CI's install / run split: every install comes before the first step that runs
        kinds = [readme_commands.installs(step) for step in steps]
        assert kinds == sorted(kinds, reverse=True) and kinds[0] and not kinds[-1], steps


def test_a_readme_without_the_section_is_refused():
    with pytest.raises(ValueError, match="Two commands"):
        readme_commands.readme_commands("# tandem\n\n```bash\npip install tandem\n```\n")
    three = "\n## Two commands\n\n```bash\na\n```\n```bash\nb\n```\n```bash\nc\n```\n"
    with pytest.raises(ValueError, match="exactly two"):
        readme_commands.readme_commands(three)


def test_the_test_pins_satisfy_pyproject():
    project = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["project"]
    locked = pins(readme_commands.TEST_CONSTRAINTS)
    wanted = project["dependencies"] + project["optional-dependencies"]["test"]
    for requirement in map(Requirement, wanted):
        name = requirement.name.lower().replace("_", "-")
        assert name in locked, f"{name} is not pinned in {readme_commands.TEST_CONSTRAINTS}"
        assert requirement.specifier.contains(locked[name], prereleases=True), (
            f"{name}=={locked[name]} does not satisfy pyproject's {requirement}"
        )
    torch = re.search(r"torch==(\S+)", readme_commands.readme_commands(
        (CHECKOUT / "README.md").read_text())["test"])[1]  # fmt: skip
    assert locked["torch"] == torch


def test_the_clients_pins_hold_what_the_script_installs():
    script = (CHECKOUT / "scripts" / "install_test_clients.sh").read_text()
    assert readme_commands.CLIENTS_CONSTRAINTS in script
    locked = pins(readme_commands.CLIENTS_CONSTRAINTS)
    requested = re.findall(r"([a-z0-9-]+)==(\S+)", " ".join(shlex.split(script, comments=True)))
    assert {name for name, _ in requested} >= {"torch", "litellm", "guidellm", "mcp"}
    for name, version in requested:
        assert locked[name] == version, f"{name}: script asks {version}, pinned {locked[name]}"
