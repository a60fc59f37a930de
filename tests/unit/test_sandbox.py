"""Sandbox limits: each abuse is contained and reported, never raised, and leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from evals.harness.sandbox import SandboxLimits, run_in_sandbox
from evals.harness.sandbox_host import network_isolation_available
from evals.harness.workspace import PathEscapeError, resolve_inside

LIMITS = SandboxLimits(timeout_s=5, memory_mb=1024, file_size_mb=8, max_processes=32, output_bytes=4000)


@pytest.fixture
def box(tmp_path) -> Path:
    d = tmp_path / "repo"
    d.mkdir()
    (d / "a.py").write_text("print(sum(range(10)))\n")
    return d


def test_runs_python_in_the_directory_and_keeps_its_changes(box):
    (box / "old.txt").write_text("old")
    r = run_in_sandbox("python a.py && mkdir -p out && echo new > out/new.txt && rm old.txt", box, LIMITS)
    assert r.ok and r.stdout == "45\n"
    assert (box / "out" / "new.txt").read_text() == "new\n" and not (box / "old.txt").exists()


def test_infinite_loop_is_killed_at_the_wall_clock(box):
    r = run_in_sandbox("while true; do :; done", box, SandboxLimits(timeout_s=1.5))
    assert r.timed_out and r.killed_reason == "timeout" and not r.ok and r.duration_s < 5


def test_cpu_limit_fires_before_the_wall_clock(box):
    r = run_in_sandbox("python -c 'while True: pass'", box, SandboxLimits(timeout_s=20, cpu_s=1))
    assert r.killed_reason == "cpu_time" and not r.timed_out and r.duration_s < 10


def test_fork_bomb_is_contained_and_cleaned_up(box):
    r = run_in_sandbox(":(){ :|:& };:", box, SandboxLimits(timeout_s=3, max_processes=32))
    assert r.duration_s < 20
    if os.geteuid() == 0:  # every process of the sandbox uid was killed (zombies await their reaper)
        ps = subprocess.run(["ps", "-eo", "uid=,stat="], capture_output=True, text=True).stdout.splitlines()
        assert [
            line for line in ps if line.split()[0] == str(r.extra["uid"]) and not line.split()[1].startswith("Z")
        ] == []


def test_background_process_does_not_outlive_the_run(box):
    marker = f"sleep {6000 + os.getpid() % 1000}"  # others on this machine run this test too
    r = run_in_sandbox(f"{marker} & echo started", box, LIMITS)
    assert r.ok and "started" in r.stdout
    ps = subprocess.run(["ps", "-eo", "args="], capture_output=True, text=True).stdout
    assert marker not in ps


def test_memory_limit(box):
    r = run_in_sandbox("python -c 'x = bytearray(4 * 1024**3)'", box, LIMITS)
    assert not r.ok and r.killed_reason == "memory"


def test_huge_output_is_bounded_and_truncated(box):
    r = run_in_sandbox("yes flywheel", box, LIMITS)
    assert not r.ok and r.killed_reason == "file_size" and r.truncated
    assert len(r.stdout) < 5000 and "truncated" in r.stdout


def test_writing_outside_the_directory_is_refused(box):
    outside = box.parent / "escaped.txt"
    r = run_in_sandbox(f"echo x > {outside}; echo x > ../escaped2.txt; echo ok > inside.txt", box, LIMITS)
    assert (box / "inside.txt").read_text() == "ok\n"
    if os.geteuid() == 0:  # the sandbox uid owns only the repository
        assert not outside.exists() and not (box.parent / "escaped2.txt").exists()
        assert "No such file or directory" in r.stderr and "Read-only file system" in r.stderr
    assert (box / "inside.txt").stat().st_uid == os.geteuid()  # synced back, owned by the harness


def test_no_network_when_the_kernel_allows(box):
    r = run_in_sandbox("python -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)\"", box, LIMITS)
    if network_isolation_available():
        assert r.network_isolated and not r.ok and "unreachable" in r.stderr.lower()


def test_environment_is_scrubbed(box, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_DATABASE_URL", "postgresql://secret")
    r = run_in_sandbox("env", box, LIMITS)
    assert "FLYWHEEL" not in r.stdout and "secret" not in r.stdout


@pytest.mark.parametrize("path", ["../x.py", "/etc/passwd", "a/../../x", "link/passwd"])
def test_tool_paths_cannot_escape(box, path):
    (box / "link").symlink_to("/etc")
    with pytest.raises(PathEscapeError):
        resolve_inside(box, path)


def test_tool_paths_inside_are_allowed(box):
    assert resolve_inside(box, "pkg/../a.py") == box / "a.py"
    assert resolve_inside(box, str(box / "a.py")) == box / "a.py"


def test_sync_back_touches_only_what_the_sandbox_saw(box):
    import threading
    import time as _time

    def writer():  # the harness (or anyone) writes into the directory while the command runs
        _time.sleep(0.3)
        (box / "late.txt").write_text("kept")

    t = threading.Thread(target=writer)
    t.start()
    r = run_in_sandbox("sleep 1; rm a.py", box, LIMITS)
    t.join()
    assert r.ok and not (box / "a.py").exists()  # the sandbox's deletion is applied
    assert (box / "late.txt").read_text() == "kept"  # an entry it never saw is left alone


@pytest.mark.parametrize("where", ["/", "/tmp"])
def test_refuses_shared_directories(where):
    with pytest.raises(ValueError, match="refusing"):
        run_in_sandbox("true", Path(where), LIMITS)


def test_refuses_to_run_as_root_when_the_sandbox_user_cannot_start_python(box, monkeypatch):
    from evals.harness import sandbox

    if os.geteuid() != 0:
        pytest.skip("only root switches to a sandbox uid")
    monkeypatch.setattr(sandbox, "interpreter_reachable", lambda: False)
    with pytest.raises(sandbox.SandboxUnavailableError, match="--grant"):
        run_in_sandbox("python a.py", box, LIMITS)
    assert not (box / "escaped").exists()


def test_the_sandbox_uid_can_start_this_interpreter():
    from evals.harness.sandbox_host import closed_interpreter_dirs, interpreter_reachable

    # ops/install.sh grants the sandbox group search permission on closed ancestors
    assert interpreter_reachable(), f"closed to the sandbox: {closed_interpreter_dirs()}"


def test_refuses_where_bubblewrap_is_missing_unless_the_operator_opts_out(box, monkeypatch, caplog):
    from evals.harness import sandbox

    monkeypatch.setenv("FLYWHEEL_SANDBOX_BWRAP", "flywheel-no-such-bwrap")
    with pytest.raises(sandbox.SandboxUnavailableError, match="bubblewrap .* is not installed"):
        run_in_sandbox("python a.py", box, LIMITS)
    monkeypatch.setenv("FLYWHEEL_SANDBOX_ALLOW_UNISOLATED", "true")
    with caplog.at_level("WARNING", logger="evals.harness.sandbox"):
        r = run_in_sandbox("python a.py", box, LIMITS)
    assert r.ok and r.stdout == "45\n" and r.isolation == "none" and not r.network_isolated
    assert any("WITHOUT isolation" in m and "not installed" in m for m in caplog.messages)


def test_the_box_hides_the_host_and_counts_what_was_refused(box):
    code = "import os\ntry: os.listdir('/var/lib')\nexcept OSError: print('refused')\nprint(sorted(os.listdir('/')))"
    r = run_in_sandbox(["python", "-c", code], box, LIMITS)
    assert r.ok and r.isolation == "bwrap" and r.stdout.startswith("refused")
    assert "task" in r.stdout and "work" not in r.stdout and "var" not in r.stdout
    assert r.denials[0] == {"kind": "read", "event": "os.listdir", "target": "/var/lib"}
