"""Building the CPU kernels never hangs: a build lock left by a killed process is
removed, a live builder is waited for only so long, and then torch ops are used.

The reproducer (issue 15): a process killed while compiling left torch's ``lock`` in
the shared build folder and every later tandem process waited on it forever."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.kernels import cpu


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_dead_builders_locks_are_removed(tmp_path, capsys):
    (tmp_path / "lock").write_text("")  # torch's, left by the killed build
    (tmp_path / "tandem.lock").write_text(str(dead_pid()))
    start = time.monotonic()
    with cpu.build_lock(tmp_path, wait_s=30):
        assert not (tmp_path / "lock").exists()
        assert (tmp_path / "tandem.lock").read_text() == str(__import__("os").getpid())
    assert time.monotonic() - start < 5
    assert not (tmp_path / "tandem.lock").exists()
    assert "stale kernel-build lock" in capsys.readouterr().err


@pytest.mark.parametrize("holder_builds", [True, False])
def test_a_live_builder_is_waited_for_only_so_long(tmp_path, capsys, holder_builds):
    """A live holder is waited for, and named as building only when it is: a holder
    loading a module already built (several processes starting at once) holds the
    lock a second or so, and the waiters say nothing (CI of 8b9b502: a CLI error line came
    after "waiting for process ... to finish building")."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        mark = " building" if holder_builds else ""
        (tmp_path / "tandem.lock").write_text(f"{holder.pid}{mark}")
        start = time.monotonic()
        with (
            pytest.raises(TimeoutError, match="building the CPU kernels"),
            cpu.build_lock(tmp_path, wait_s=0.5),
        ):
            pass
        assert time.monotonic() - start < 5
        assert ("waiting for process" in capsys.readouterr().err) == holder_builds
        assert (tmp_path / "tandem.lock").exists()  # the live holder's, untouched
    finally:
        holder.kill()


def test_the_holder_says_when_it_builds(tmp_path):
    with cpu.build_lock(tmp_path, wait_s=30) as building:
        assert (tmp_path / "tandem.lock").read_text() == str(os.getpid())
        building()
        assert (tmp_path / "tandem.lock").read_text() == f"{os.getpid()} building"
    assert not (tmp_path / "tandem.lock").exists()


def test_a_build_that_cannot_finish_falls_back_to_torch_ops(monkeypatch, capsys):
    def stuck(directory, wait_s):
        raise TimeoutError("another process has been building for too long")

    monkeypatch.setattr(cpu, "build_lock", stuck)
    cpu.load.cache_clear()
    try:
        assert cpu.load() is None
        assert "using torch ops" in capsys.readouterr().err
    finally:
        cpu.load.cache_clear()


def test_each_install_builds_in_its_own_folder(monkeypatch):
    first = cpu.build_directory("tandem_cpu_ops_x")
    monkeypatch.setattr(sys, "prefix", "/another/venv")
    assert cpu.build_directory("tandem_cpu_ops_x") != first


def test_loading_again_in_one_process_keeps_the_built_module():
    """A second build in one process (after ``load.cache_clear``, as the test above
    does) must hash as the first: a changed hash makes torch name the module ..._v1
    and rewrite the build folder, and every later process compiled it again."""
    if cpu.load() is None:
        pytest.skip("no compiler here: nothing is built")
    name = cpu.load().__name__
    cpu.load.cache_clear()
    try:
        assert cpu.load().__name__ == name == f"tandem_cpu_ops_{cpu._cpu_tag()}"
    finally:
        cpu.load.cache_clear()


def test_another_installs_module_is_taken_only_for_the_same_torch_and_python(tmp_path, monkeypatch):
    name = "tandem_cpu_ops_x"
    mine, other = tmp_path / f"{name}_mine", tmp_path / f"{name}_other"
    mine.mkdir()
    other.mkdir()
    assert cpu.built_elsewhere(name, mine) is None  # nothing built anywhere
    (other / f"{name}.so").write_bytes(b"")
    (other / cpu.STAMP).write_text(f"torch 0.0.1, {sys.implementation.cache_tag}\n{name}.so\n")
    assert cpu.built_elsewhere(name, mine) is None  # another torch
    (other / cpu.STAMP).write_text(f"{cpu.install_stamp()}\n{name}.so\n")
    with monkeypatch.context() as patch:
        patch.setattr(cpu, "COMPILE_FLAGS", (*cpu.COMPILE_FLAGS, "-O0"))
        assert cpu.built_elsewhere(name, mine) is None  # built with other flags
    (other / cpu.STAMP).write_text(f"{cpu.install_stamp()}\n{name}_v1.so\n")
    assert cpu.built_elsewhere(name, mine) is None  # the stamp names a file that is not there
    (other / cpu.STAMP).write_text(f"{cpu.install_stamp()}\n{name}.so\n")
    assert cpu.built_elsewhere(name, mine) == other / f"{name}.so"
    assert cpu.built_elsewhere(name, other) is None  # an install never takes its own


def test_a_new_environment_loads_the_module_another_one_built(tmp_path, monkeypatch):
    """A second virtual environment of the same torch and Python (CI's test job after
    its main job) loads the module the first built, and compiles nothing: here no
    compiler can run (CXX=false), so a build would fall back to torch ops."""
    if cpu.load() is None:
        pytest.skip("no compiler here: nothing is built")
    built = cpu.load()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(sys, "prefix", "/the/first/venv")
    first = cpu.build_directory(built.__name__)
    first.mkdir(parents=True)
    (first / Path(built.__file__).name).write_bytes(Path(built.__file__).read_bytes())
    cpu._stamp(first, first / Path(built.__file__).name)
    monkeypatch.undo()
    probe = (
        "import torch\n"
        "from tandem.kernels import cpu\n"
        "m = cpu.load()\n"
        "x = torch.randn(4, 50)\n"
        "out = torch.empty(4, dtype=torch.long)\n"
        "m.argmax_rows(out, x)\n"
        "assert torch.equal(out, x.argmax(1))\n"
        "print(m.__file__)\n"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "false"}
    result = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(first / Path(built.__file__).name)
    assert "compiling" not in result.stderr and "unavailable" not in result.stderr
