"""Hostile scripts run through the real sandbox (bubblewrap, a fresh uid when root): each is refused
or killed with the reason recorded (``denials`` from the audit hook, or ``killed_reason``), and the
host is unchanged (no file appears outside the task folder, nothing keeps running, a listening
loopback server and Postgres see no connection)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import evals.tasks
from evals.harness.sandbox import SandboxLimits, run_in_sandbox
from tests.fixtures.listener import loopback_listener

pytestmark = pytest.mark.integration

LIMITS = SandboxLimits(timeout_s=10, memory_mb=1024, file_size_mb=8, max_processes=32, output_bytes=4000)
SECRET = "flywheel-planted-secret-7f3a"


def py(code: str) -> list[str]:
    """An argv that runs ``code`` with the sandbox's python (no shell quoting to get wrong)."""
    return ["python", "-c", code]


@pytest.fixture
def host(tmp_path) -> dict[str, Path]:
    """A task folder, a planted secret beside it, and another session's folder."""
    box = tmp_path / "session-a" / "repo"
    box.mkdir(parents=True)
    (box / "solution.py").write_text("def f():\n    return 1\n")
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    secret.chmod(0o644)  # world-readable: the old sandbox's uid could read it
    other = tmp_path / "session-b" / "repo"
    other.mkdir(parents=True)
    (other / "solution.py").write_text(f"ANSWER = {SECRET!r}\n")
    return {"box": box, "secret": secret, "other": other, "root": tmp_path}


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def kinds(r) -> set[str]:
    return {d["kind"] for d in r.denials}


def outside_unchanged(host, before):
    after = {k: v for k, v in tree(host["root"]).items() if not k.startswith("session-a/")}
    assert after == before


@pytest.fixture
def before(host):
    return {k: v for k, v in tree(host["root"]).items() if not k.startswith("session-a/")}


def test_reading_a_planted_secret_outside_the_folder_is_refused(host, before):
    code = f"print(open({str(host['secret'])!r}).read())"
    r = run_in_sandbox(py(code), host["box"], LIMITS)
    assert r.exit_code != 0 and SECRET not in r.stdout and "No such file" in r.stderr
    assert "read" in kinds(r) and any(d["target"] == str(host["secret"]) for d in r.denials)
    shell = run_in_sandbox(f"cat {host['secret']}", host["box"], LIMITS)  # not Python: refused, not counted
    assert shell.exit_code != 0 and SECRET not in shell.stdout
    outside_unchanged(host, before)


def test_the_task_package_is_neither_listed_read_nor_importable(host, before):
    package = Path(evals.tasks.__file__).resolve().parent
    reference = package / "functions_basic.py"
    assert reference.is_file()
    code = (
        "import os\n"
        f"for op in (lambda: os.listdir({str(package)!r}), lambda: open({str(reference)!r}).read()):\n"
        "    try: print('LEAK', op()[:80])\n"
        "    except OSError as e: print('refused', e.errno)\n"
        "try:\n    import evals.tasks; print('LEAK import')\n"
        "except ImportError: print('refused import')\n"
    )
    r = run_in_sandbox(py(code), host["box"], LIMITS)
    assert "LEAK" not in r.stdout and r.stdout.count("refused") == 3, r.stdout + r.stderr
    assert r.denial_count >= 2 and "read" in kinds(r)
    outside_unchanged(host, before)


def test_another_sessions_folder_is_invisible(host, before):
    code = (
        f"import os\ntry: print(open({str(host['other'] / 'solution.py')!r}).read())\nexcept OSError: print('refused')"
    )
    r = run_in_sandbox(py(code), host["box"], LIMITS)
    assert r.stdout.strip() == "refused" and SECRET not in r.stdout and "read" in kinds(r)
    outside_unchanged(host, before)


def test_writes_outside_the_folder_are_refused(host, before):
    targets = [host["root"] / "escaped.txt", host["other"] / "solution.py", Path("/usr/escaped"), Path("/escaped")]
    code = "import os\n" + "".join(
        f"try: open({str(t)!r}, 'w').write('x')\nexcept OSError as e: print('refused', e.errno)\n" for t in targets
    )
    code += "open('inside.txt', 'w').write('ok')\n"
    r = run_in_sandbox(py(code), host["box"], LIMITS)
    assert r.ok and r.stdout.count("refused") == len(targets), r.stdout + r.stderr
    assert (host["box"] / "inside.txt").read_text() == "ok"
    assert sum(d["kind"] == "write" for d in r.denials) == len(targets)
    assert not Path("/usr/escaped").exists() and not Path("/escaped").exists()
    outside_unchanged(host, before)


def test_loopback_and_postgres_are_unreachable(host):
    with loopback_listener() as (port, accepted):
        code = (
            "import socket\n"
            f"for port in ({port}, 5432):\n"
            "    try: socket.create_connection(('127.0.0.1', port), timeout=2); print('LEAK', port)\n"
            "    except OSError as e: print('refused', port, e.errno)\n"
        )
        r = run_in_sandbox(py(code), host["box"], LIMITS)
    assert "LEAK" not in r.stdout and r.stdout.count("refused") == 2 and not accepted
    assert [d["target"] for d in r.denials if d["kind"] == "network"] == [f"127.0.0.1:{port}", "127.0.0.1:5432"]


def _uid_processes(uid: int) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "uid=,stat=,args="], capture_output=True, text=True).stdout.splitlines()
    return [line for line in ps if line.split()[0] == str(uid) and not line.split()[1].startswith("Z")]


def test_a_fork_bomb_is_contained_and_leaves_nothing(host):
    limits = SandboxLimits(timeout_s=3, max_processes=32)
    r = run_in_sandbox(":(){ :|:& };:; sleep 1", host["box"], limits)  # the sleep: the bomb meets its limit
    assert r.duration_s < 20 and not r.ok and r.killed_reason == "processes"
    code = (
        "import os, time\nn = 0\ntry:\n    while True:\n"
        "        if os.fork() == 0:\n            time.sleep(30); os._exit(0)\n        n += 1\n"
        "except OSError as e: print(n, e.errno)"
    )
    forks = run_in_sandbox(py(code), host["box"], limits)
    n, errno = map(int, forks.stdout.split())
    assert n < 32 and errno == 11  # EAGAIN: the process limit, and the sleepers die with the run
    if "uid" in r.extra:
        assert _uid_processes(r.extra["uid"]) == []
    ok = run_in_sandbox(py("print('still works')"), host["box"], LIMITS)
    assert ok.ok and ok.stdout.strip() == "still works"


def test_a_memory_bomb_is_killed_for_memory(host):
    r = run_in_sandbox(py("x = bytearray(8 * 1024**3)"), host["box"], LIMITS)
    assert not r.ok and r.killed_reason == "memory"


def test_a_gigabyte_of_output_is_cut_at_the_file_size_limit(host):
    r = run_in_sandbox(py("import sys\nfor _ in range(1024): sys.stdout.write('x' * (1 << 20))"), host["box"], LIMITS)
    assert not r.ok and r.killed_reason == "file_size" and r.truncated and len(r.stdout) < 5000


def test_sleeping_past_the_wall_limit_is_killed(host):
    r = run_in_sandbox(py("import time; time.sleep(60)"), host["box"], SandboxLimits(timeout_s=1.5))
    assert r.timed_out and r.killed_reason == "timeout" and r.duration_s < 10


def test_a_process_left_behind_dies_with_the_run(host):
    marker = f"sleep {4000 + os.getpid() % 1000}"
    r = run_in_sandbox(f"nohup {marker} >/dev/null 2>&1 & setsid {marker} & echo started", host["box"], LIMITS)
    assert r.ok and "started" in r.stdout
    ps = subprocess.run(["ps", "-eo", "args="], capture_output=True, text=True).stdout
    assert marker not in ps


def test_nothing_of_the_host_is_visible(host):
    code = "import os\nprint(sorted(os.listdir('/')))\nprint(len([p for p in os.listdir('/proc') if p.isdigit()]))"
    r = run_in_sandbox(py(code), host["box"], LIMITS)
    top, procs = r.stdout.splitlines()
    assert "work" not in top and "home" in top and int(procs) <= 3  # bwrap's init, python (and its parent)
    env = run_in_sandbox(["env"], host["box"], LIMITS)
    assert "FLYWHEEL" not in env.stdout.replace("flywheel-sandbox", "")
    assert sys.prefix  # the interpreter itself is there, read-only
