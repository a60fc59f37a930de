"""Run untrusted commands (the agent's ``run`` tool, hidden tests) in a contained subprocess.

Invariants:
- The command runs with ``cwd`` = the task directory, in its own session (process group), with
  rlimits on CPU time, address space, file size and open files, and a wall-clock timeout after
  which the whole group (and every process of the sandbox uid) is SIGKILLed.
- When the harness runs as root, each run gets a fresh unprivileged uid (random, unnamed): the
  process cannot write outside the task directory and its own scratch directory except in
  world-writable places (``/tmp``, sticky: it cannot touch anyone's files there, and what it
  leaves is swept after the run), and
  ``RLIMIT_NPROC`` actually bounds a fork bomb (root is exempt from it). That uid works on a copy
  of the task directory in its scratch directory, synced back after the run
  (``evals.harness.tree_sync``). Not as root, the process-count limit is relative to the user's
  current process count.
- No network when the kernel allows a new network namespace (``unshare -rn``, probed once per
  process by ``evals.harness.sandbox_host``); otherwise the run proceeds with the host network and
  ``SandboxResult.network_isolated`` says so.
- stdout/stderr go to files in the scratch directory, so huge output is bounded by
  ``RLIMIT_FSIZE`` (never by the harness's memory) and truncated (head + tail) in the result.
- The child gets a minimal environment (no ``FLYWHEEL_*`` settings, credentials or proxies).
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.core.metrics import SANDBOX_DENIALS
from evals.harness.sandbox_host import (
    closed_interpreter_dirs,
    fresh_uid,
    interpreter_reachable,
    is_root,
    network_isolation_available,
)
from evals.harness.tree_sync import chown_tree, sync_tree, tree_entries

_MB = 1024 * 1024


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed command.

    Attributes:
        timeout_s: wall-clock limit (seconds); the process group is killed after it.
        cpu_s: CPU-time limit (seconds, ``RLIMIT_CPU``); default ``timeout_s`` rounded up + 1.
        memory_mb: address-space limit (MiB, ``RLIMIT_AS``).
        file_size_mb: largest file the command may write (MiB, ``RLIMIT_FSIZE``), output included.
        max_processes: processes/threads of the sandbox (``RLIMIT_NPROC``).
        max_open_files: ``RLIMIT_NOFILE``.
        output_bytes: bytes of stdout and of stderr kept in the result (head and tail halves).
        network: allow network access (default: isolated where the kernel allows).
    """

    timeout_s: float = 30.0
    cpu_s: int | None = None
    memory_mb: int = 2048
    file_size_mb: int = 64
    max_processes: int = 64
    max_open_files: int = 256
    output_bytes: int = 16_000
    network: bool = False


@dataclass
class SandboxResult:
    """Outcome of one sandboxed command.

    Attributes:
        exit_code: the process's exit status; ``-N`` when killed by signal N.
        stdout, stderr: decoded (UTF-8, replacement) and truncated output.
        timed_out: the wall-clock limit fired.
        killed_reason: None, or ``timeout`` | ``cpu_time`` | ``file_size`` | ``memory`` | ``signal:<N>``.
        duration_s: wall-clock seconds.
        truncated: stdout or stderr was cut to ``output_bytes``.
        network_isolated: the command ran in its own (empty) network namespace.
        extra: details, e.g. ``uid`` (the sandbox uid when run as root).
    """

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    killed_reason: str | None = None
    duration_s: float = 0.0
    truncated: bool = False
    network_isolated: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Exited 0 within the limits."""
        return self.exit_code == 0 and not self.timed_out and self.killed_reason is None

    def observation(self, max_chars: int = 4000) -> str:
        """A compact text for the agent: exit status, reason, then output (stderr last)."""
        head = f"exit code {self.exit_code}"
        if self.killed_reason:
            head += f" (killed: {self.killed_reason})"
        body = self.stdout + (("\n[stderr]\n" + self.stderr) if self.stderr.strip() else "")
        if len(body) > max_chars:
            body = body[: max_chars // 2] + "\n...[truncated]...\n" + body[-max_chars // 2 :]
        return f"{head}\n{body}".rstrip()


class SandboxUnavailableError(RuntimeError):
    """The unprivileged sandbox user cannot run this Python interpreter (see
    ``evals.harness.sandbox_host.grant_interpreter_access``); untrusted code is never run as root instead."""


def _user_process_count() -> int:
    uid, n = os.getuid(), 0
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if p.stat().st_uid == uid:
                    n += 1
            except OSError:
                continue
    return n


def _env(scratch: Path) -> dict[str, str]:
    path = os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"])
    env = {
        "PATH": path,
        "HOME": str(scratch / "home"),
        "TMPDIR": str(scratch / "tmp"),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        "MPLBACKEND": "Agg",
        "MPLCONFIGDIR": str(scratch / "mpl"),
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "NUMEXPR_MAX_THREADS": "1",
        "USER": "sandbox",
        "LOGNAME": "sandbox",
    }
    return env


def _read_capped(path: Path, limit: int) -> tuple[str, bool]:
    size = path.stat().st_size if path.exists() else 0
    with open(path, "rb") as f:
        if size <= limit:
            return f.read().decode("utf-8", "replace"), False
        head = f.read(limit // 2)
        f.seek(size - limit // 2)
        tail = f.read()
    cut = size - len(head) - len(tail)
    return (
        head.decode("utf-8", "replace") + f"\n...[{cut} bytes truncated]...\n" + tail.decode("utf-8", "replace")
    ), True


def _live_pids(uid: int) -> list[int]:
    """Pids of ``uid``'s processes that are not zombies (a killed orphan is a zombie until reaped)."""
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if p.stat().st_uid != uid:
                continue
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            pids.append(int(p.name))
    return pids


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` (a fork bomb may escape its process group with setsid)."""
    for _ in range(50):
        subprocess.run(["kill", "-KILL", "-1"], user=uid, group=uid, extra_groups=[], capture_output=True, timeout=10)
        if not _live_pids(uid):
            return
        time.sleep(0.05)


_WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")


def _sweep_world_writable(uid: int, keep: tuple[Path, ...]) -> None:
    """Remove what the sandbox uid left in world-writable directories (it can write nowhere else),
    except ``keep`` (the task directory and the scratch directory)."""
    kept = {str(k) for k in keep}
    for top in _WORLD_WRITABLE:
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.path in kept or entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                continue


def run_in_sandbox(cmd: str | list[str], cwd: Path, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``cmd`` (a shell string, or an argv list) in ``cwd`` under ``limits``.

    Returns:
        The :class:`SandboxResult`; a limit that fires is reported there, never raised.

    Raises:
        FileNotFoundError: ``cwd`` does not exist.
        ValueError: ``cwd`` is ``/``, a home or a world-writable top directory, or too large.
        SandboxUnavailableError: running as root, and the sandbox uid cannot start this interpreter.
    """
    limits = limits or SandboxLimits()
    cwd = Path(cwd).resolve()
    if not cwd.is_dir():
        raise FileNotFoundError(f"sandbox directory {cwd} does not exist")
    if str(cwd) in ("/", str(Path.home()), *_WORLD_WRITABLE):
        raise ValueError(f"refusing to sandbox {cwd}: give the task's own directory")
    argv = ["/bin/bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
    isolated = not limits.network and network_isolation_available()
    if isolated:
        argv = ["unshare", "-rn", "--"] + argv
    as_root = is_root()
    if as_root and not interpreter_reachable():
        raise SandboxUnavailableError(
            f"the sandbox user cannot reach the interpreter under {sys.prefix} (closed directories: "
            f"{[str(d) for d in closed_interpreter_dirs()]}); run `python -m evals.harness.sandbox_host --grant` "
            "(ops/install.sh does) to give others search permission on them"
        )
    uid = fresh_uid() if as_root else None
    nproc = limits.max_processes if as_root else _user_process_count() + limits.max_processes
    cpu_s = limits.cpu_s or int(limits.timeout_s) + 1

    def set_limits() -> None:  # runs in the child between fork and exec: only C-level calls
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * _MB,) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size_mb * _MB,) * 2)
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    scratch = Path(tempfile.mkdtemp(prefix="flywheel-sbx-"))
    for sub in ("home", "tmp", "mpl"):
        (scratch / sub).mkdir()
    out_path, err_path = scratch / "stdout", scratch / "stderr"
    user_kwargs = {}
    run_cwd = cwd
    if as_root:
        # The sandbox uid works on a copy of the repository inside its own scratch directory: the
        # task directory's ancestors may be closed to it (e.g. 0700 temp dirs), and the harness's
        # files never change owner. The copy is synced back after the run.
        run_cwd = scratch / "repo"
        before = tree_entries(cwd)
        shutil.copytree(cwd, run_cwd, symlinks=True)
        chown_tree(scratch, uid)
        user_kwargs = {"user": uid, "group": uid, "extra_groups": []}
    started = time.perf_counter()
    timed_out = False
    try:
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                argv,
                cwd=run_cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=_env(scratch),
                start_new_session=True,
                preexec_fn=set_limits,
                close_fds=True,
                **user_kwargs,
            )
            try:
                proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        if as_root:
            _kill_uid(uid)  # stragglers: background jobs, setsid escapes
        else:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        duration = time.perf_counter() - started
        stdout, cut_out = _read_capped(out_path, limits.output_bytes)
        stderr, cut_err = _read_capped(err_path, limits.output_bytes)
    finally:
        if as_root:
            _sweep_world_writable(uid, keep=(scratch,))
            if run_cwd.is_dir():
                sync_tree(run_cwd, cwd, before)
        shutil.rmtree(scratch, ignore_errors=True)
    code = proc.returncode
    reason = _reason(code, timed_out, stderr)
    if reason is not None:
        SANDBOX_DENIALS.add(1, {"reason": reason})
    return SandboxResult(
        exit_code=code,
        stdout=stdout,
        stderr=stderr,
        timed_out=timed_out,
        killed_reason=reason,
        duration_s=duration,
        truncated=cut_out or cut_err,
        network_isolated=isolated,
        extra={"uid": uid} if uid is not None else {},
    )


def _reason(code: int, timed_out: bool, stderr: str) -> str | None:
    if timed_out:
        return "timeout"
    if code == -signal.SIGXCPU or code == 128 + signal.SIGXCPU:
        return "cpu_time"
    if code == -signal.SIGXFSZ or code == 128 + signal.SIGXFSZ:
        return "file_size"
    if code != 0 and ("MemoryError" in stderr or "Cannot allocate memory" in stderr):
        return "memory"
    if code < 0:
        return f"signal:{-code}"
    return None
