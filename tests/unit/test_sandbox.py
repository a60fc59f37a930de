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


def test_the_sandbox_process_runs_as_its_uid_without_capabilities_and_with_the_limits(box):
    r = run_in_sandbox(
        "grep -E '^(Uid|Gid|Groups|CapPrm|CapEff|CapBnd):' /proc/self/status; ulimit -u -n -v -c", box, LIMITS
    )
    assert r.ok, r.observation()
    status = dict(line.split(":", 1) for line in r.stdout.splitlines() if ":" in line)
    assert all(int(status[cap], 16) == 0 for cap in ("CapPrm", "CapEff", "CapBnd")) and not status["Groups"].strip()
    if "uid" in r.extra:  # root: real, effective, saved and filesystem uid/gid are all the fresh uid
        assert status["Uid"].split() == [str(r.extra["uid"])] * 4 == status["Gid"].split()
    limits = [
        line.split()[-1]
        for line in r.stdout.splitlines()
        if line.startswith(("max user", "open files", "virt", "core"))
    ]
    nproc = str(32 + (8 if r.containment != "rlimits" else 0))  # with a pids cgroup, RLIMIT_NPROC is the belt
    assert limits == ["0", "256", str(LIMITS.memory_mb * 1024), nproc] or limits == [
        nproc,
        "256",
        str(LIMITS.memory_mb * 1024),
        "0",
    ]


def _hook_denials(tmp_path, code: str) -> tuple[list[dict], str]:
    """Run ``code`` in a plain Python process with the sandbox's audit hook on ``PYTHONPATH`` (no
    bubblewrap: the hook alone), visible roots ``/usr``, the interpreter and ``tmp_path/task``."""
    import json
    import sys

    from evals.harness.sandbox_bwrap import install_site, interpreter_roots

    site, log = install_site(tmp_path / "site"), tmp_path / "denials.jsonl"
    task = tmp_path / "task"
    task.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(site),
        "SANDBOX_DENIALS": str(log),
        "SANDBOX_VISIBLE": ":".join(["/usr", str(task), *interpreter_roots()]),
        "SANDBOX_WRITABLE": str(task),
    }
    p = subprocess.run([sys.executable, "-c", code], cwd=task, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = log.read_text().splitlines() if log.exists() else []
    return [json.loads(line) for line in lines], p.stdout


def test_the_audit_hook_fast_paths_still_deny_what_the_box_refuses(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    code = (
        "import os, socket, sys\n"
        "import email.mime.text, decimal  # imports: thousands of events the hook lets through\n"
        "print('json' in sys.modules)\n"
        f"open({str(outside)!r}).read()\n"
        "os.listdir('/etc')\n"
        "for p in ('/usrx/y', '/usr/flywheel-nope'):  # a sibling of /usr is not under it\n"
        "    try: open(p, 'rb' if p.startswith('/usrx') else 'w')\n"
        "    except OSError: pass\n"
        "open('inside.txt', 'w').write('ok')\n"
        "os.symlink('/etc/hostname', 'link'); open('link').read()\n"
        "s = socket.socket(); s.settimeout(0.01)\n"
        "try: s.connect(('127.0.0.1', 9))\n"
        "except OSError: pass\n"
    )
    denials, stdout = _hook_denials(tmp_path, code)
    assert stdout.strip() == "False"  # json is imported only when a denial is written
    assert [(d["kind"], d["event"], d["target"]) for d in denials] == [
        ("read", "open", str(outside)),
        ("read", "os.listdir", "/etc"),
        ("read", "open", "/usrx/y"),
        ("write", "open", "/usr/flywheel-nope"),
        ("write", "os.symlink", "/etc/hostname"),
        ("read", "open", "/etc/hostname"),  # a symlink out of the folder is resolved
        ("network", "socket.connect", "127.0.0.1:9"),
    ]


def test_the_audit_hook_ships_compiled(tmp_path):
    import importlib.util

    from evals.harness.sandbox_bwrap import install_site

    site = install_site(tmp_path / "site")
    pyc = (site / importlib.util.cache_from_source("sitecustomize.py")).read_bytes()
    source = (site / "sitecustomize.py").read_bytes()
    assert int.from_bytes(pyc[4:8], "little") == 0b11  # a checked-hash .pyc: a stale one is never run
    assert pyc[8:16] == importlib.util.source_hash(source)


def test_the_init_pid_bwrap_reports_counts_only_while_it_runs_as_the_sandbox_uid():
    from evals.harness.sandbox_wait import sandbox_init as _sandbox_init

    me = f'{{"child-pid": {os.getpid()}}}'.encode()
    assert _sandbox_init(me, os.getuid() + 1) is None  # a pid of another uid (e.g. reused) never counts
    assert _sandbox_init(b"{", 1) is None and _sandbox_init(b'{"child-pid": 0}', 1) is None
    fd = _sandbox_init(me, os.getuid())
    assert fd is not None
    os.close(fd)
