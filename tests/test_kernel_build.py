"""Building the CPU kernels never hangs: a build lock left by a killed process is
removed, a live builder is waited for only so long, and then torch ops are used.

The reproducer (issue 15): a process killed while compiling left torch's ``lock`` in
the shared build folder and every later tandem process waited on it forever."""

from __future__ import annotations

import os
import subprocess
import sys
import time

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
