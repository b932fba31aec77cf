"""README's two commands, read out of README.md, and run from nothing.

    python scripts/readme_commands.py show test     # print one command
    python scripts/readme_commands.py run main      # run it in a new virtual environment
    python scripts/readme_commands.py refresh-pins  # rewrite constraints/ from a fresh resolve

The section "## Two commands" of README.md holds two ```bash blocks: the first installs
and runs the main job, the second installs and runs the tests. `.ci/run` runs both
through this script, so what CI proves is what a user copies, and the two cannot drift.

`run` makes a virtual environment in a temporary folder outside the checkout, puts it
first on PATH (as `source bin/activate` would), runs the command's `&&`-joined steps
one by one in the checkout, stopping at the first that fails, and removes the folder
afterwards. Nothing the machine already has installed can make the command pass;
wheels may still come from pip's cache. It prints each step's seconds and then the
install time (steps that install: `pip install ...`, `bash scripts/install_...`) and
the run time (the rest) separately.

`refresh-pins` runs the test command's install steps without their constraints in new
virtual environments and writes what pip resolved to constraints/test.txt and
constraints/clients.txt (pip freeze; torch's local build tag dropped). Run the test
command afterwards and commit the two files if it passes.

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
README = CHECKOUT / "README.md"
SECTION = "## Two commands"
NAMES = ("main", "test")
TEST_CONSTRAINTS = "constraints/test.txt"
CLIENTS_CONSTRAINTS = "constraints/clients.txt"


def readme_commands(readme_text: str) -> dict[str, str]:
    """{"main": ..., "test": ...}: the two bash blocks of README's "Two commands"."""
    start = readme_text.find(f"\n{SECTION}\n")
    if start < 0:
        raise ValueError(f"README.md has no section {SECTION!r}")
    end = readme_text.find("\n## ", start + len(SECTION) + 2)
    section = readme_text[start : end if end >= 0 else len(readme_text)]
    blocks = [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)]
    if len(blocks) != 2 or any("\n" in b for b in blocks):
        raise ValueError(f"{SECTION!r} must hold exactly two one-line ```bash blocks: {blocks}")
    return dict(zip(NAMES, blocks, strict=True))


def steps(command: str) -> list[str]:
    """The command's `&&`-joined steps (each must parse as a shell word list)."""
    parts = [part.strip() for part in command.split(" && ")]
    for part in parts:
        shlex.split(part)  # unbalanced quotes would mean a split inside a quoted string
    return parts


def installs(step: str) -> bool:
    words = shlex.split(step)
    return words[:2] == ["pip", "install"] or (
        words[:1] == ["bash"] and Path(words[1]).name.startswith("install_")
    )


def new_venv(folder: Path) -> dict[str, str]:
    """Makes a virtual environment in `folder`; returns the environment that activates it."""
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    env = dict(os.environ, VIRTUAL_ENV=str(folder))
    env["PATH"] = f"{folder / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONHOME", None)
    return env


def run_in_new_venv(name: str, command: str) -> int:
    venv = Path(tempfile.mkdtemp(prefix=f"tandem-{name}-venv-"))
    seconds = {"install": 0.0, "run": 0.0}
    try:
        started = time.monotonic()
        env = new_venv(venv)
        seconds["install"] += time.monotonic() - started
        for step in steps(command):
            print(f"[{name}] $ {step}", flush=True)
            started = time.monotonic()
            code = subprocess.run(["bash", "-c", step], cwd=CHECKOUT, env=env).returncode
            elapsed = time.monotonic() - started
            seconds["install" if installs(step) else "run"] += elapsed
            print(f"[{name}] {elapsed:.0f} s, exit {code}: {step}", flush=True)
            if code != 0:
                return code
        return 0
    finally:
        shutil.rmtree(venv, ignore_errors=True)
        print(
            f"[{name}] install {seconds['install']:.0f} s, run {seconds['run']:.0f} s "
            f"(new virtual environment {venv}, removed)",
            flush=True,
        )


def write_pins(venv: Path, path: str, what: str) -> None:
    frozen = subprocess.run(
        [str(venv / "bin" / "pip"), "freeze", "--exclude-editable"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    pins = [re.sub(r"^(torch==[^+]+)\+\S+$", r"\1", line) for line in frozen.splitlines()]
    header = [
        f"# {what} as a fresh install resolved it (Python {sys.version_info.major}."
        f"{sys.version_info.minor}, {sys.platform}).",
        "# Rewritten by `python scripts/readme_commands.py refresh-pins`.",
    ]
    (CHECKOUT / path).write_text("\n".join(header + pins) + "\n")
    print(f"wrote {path}: {len(pins)} pins")


def refresh_pins(command: str) -> int:
    work = Path(tempfile.mkdtemp(prefix="tandem-pins-"))
    try:
        env = new_venv(work / "test")
        env.update(CLIENTS_VENV=str(work / "clients"), CLIENTS_CONSTRAINTS="")
        for step in filter(installs, steps(command)):
            step = step.replace(f" -c {TEST_CONSTRAINTS}", "")
            print(f"$ {step}", flush=True)
            subprocess.run(["bash", "-c", step], cwd=CHECKOUT, env=env, check=True)
        write_pins(work / "test", TEST_CONSTRAINTS, "The test environment")
        write_pins(work / "clients", CLIENTS_CONSTRAINTS, "The third-party clients' environment")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str]) -> int:
    commands = readme_commands(README.read_text())
    if argv == ["refresh-pins"]:
        return refresh_pins(commands["test"])
    if len(argv) != 2 or argv[0] not in ("show", "run") or argv[1] not in NAMES:
        print(__doc__, file=sys.stderr)
        return 2
    action, name = argv
    command = commands[name]
    if action == "show":
        print(command)
        return 0
    return run_in_new_venv(name, command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
