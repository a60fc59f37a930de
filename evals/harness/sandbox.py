"""Run untrusted commands (the agent's ``run`` tool, hidden tests) in a bubblewrap sandbox.

Invariants:
- The command runs under ``bwrap`` (:mod:`evals.harness.sandbox_bwrap`) in fresh user, mount, pid,
  network, ipc and uts namespaces: only the task's folder (at ``/task``, its cwd) and a fresh
  ``/tmp`` are writable; the interpreter and ``/usr`` are read-only; nothing else of the host is
  visible (not the project, task definitions or hidden tests of other runs, ``$FLYWHEEL_HOME``,
  checkpoints, other sessions' folders, ``/root``, other processes); there is no network.
- Python sees the standard library and the run's allow-list of distributions only
  (``SandboxLimits.packages``: an environment built once per allow-list,
  :func:`evals.harness.environment.allowed_environment`, mounted over site-packages).
- rlimits on CPU time, address space, file size (output included) and open files; a wall-clock
  timeout after which bwrap is killed, and with it (``--die-with-parent``, pid namespace) every
  process of the run, so nothing outlives it. Scratch space (``/tmp`` with ``$HOME``, and
  ``/dev/shm``) is a tmpfs of ``scratch_mb`` each. Where the host delegates a cgroup
  (:mod:`evals.harness.sandbox_cgroup`) the whole run is also in its own memory and pids cgroup
  (``SandboxResult.containment``); a bound that fires is ``killed_reason``, counted in
  ``flywheel_sandbox_denials_total``.
- The rlimits and the uid are set by util-linux's ``prlimit`` and ``setpriv`` exec'd before bwrap
  (the harness ``vfork``s; no Python runs in the child).
- When the harness runs as root, each run gets a fresh unprivileged uid (random, unnamed) so that
  ``RLIMIT_NPROC`` bounds a fork bomb (root is exempt from it); that uid works on a copy of the
  task folder in its scratch folder, synced back after the run (``evals.harness.tree_sync``). Not
  as root, the process-count limit is relative to the user's current process count.
- Where bubblewrap cannot build the sandbox, :class:`SandboxUnavailableError` names what is missing,
  unless the operator set ``FLYWHEEL_SANDBOX_ALLOW_UNISOLATED=true``: then the run has rlimits and
  the wall clock only, logs a warning, and reports ``isolation == "none"``.
- What the code tried and was refused (reads or writes outside its folder, network, hidden
  executables) is recorded by an audit hook in every Python process of the run and returned in
  ``SandboxResult.denials`` / ``denial_count``; non-Python programs are refused but not counted.
- stdout/stderr go to files in the scratch folder, so huge output is bounded by ``RLIMIT_FSIZE``
  (never by the harness's memory) and truncated (head + tail) in the result.
- The child gets a minimal environment (no ``FLYWHEEL_*`` settings, credentials or proxies).

Size: over 400 lines because the run's life (scratch folder, uid, rlimits, bwrap, the wall clock,
output capture, the sync back and the denials read) is one sequence that must clean up on every
exit; the bwrap command line, the allow-listed environment, the cgroup, the wait and the kill,
the tree sync and the audit hook live in their own modules.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from app.core.metrics import SANDBOX_DENIALS
from evals.harness.environment import allowed_environment
from evals.harness.sandbox_bwrap import SandboxMounts, bwrap_argv, bwrap_missing, install_site, sandbox_env
from evals.harness.sandbox_cgroup import RunCgroup, cgroup_host, remove_stale
from evals.harness.sandbox_host import (
    SandboxSettings,
    closed_interpreter_dirs,
    fresh_uid,
    interpreter_reachable,
    is_root,
    load_settings,
)
from evals.harness.sandbox_wait import kill_uid, killpg, read_available, sandbox_init, wait_exit, wait_init
from evals.harness.tree_sync import chown_tree, sync_tree, tree_entries

log = logging.getLogger(__name__)
_MB = 1024 * 1024
_DENIALS_KEPT = 50
_DENIALS_READ_BYTES = 256 * 1024


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
        network: ignored by the bubblewrap sandbox, which never has a network (kept so that callers'
            limits stay valid); the unisolated opt-out always has the host's.
        packages: the distributions Python may import besides the standard library (with their
            requirement closure; a suite's ``[sandbox] packages``); empty: the standard library only.
        scratch_mb: size of the scratch tmpfs (MiB); None: ``FLYWHEEL_SANDBOX_SCRATCH_MB`` (512).
            With a cgroup the run's memory bound is ``memory_mb + scratch_mb`` (tmpfs pages count).
    """

    timeout_s: float = 30.0
    cpu_s: int | None = None
    memory_mb: int = 2048
    file_size_mb: int = 64
    max_processes: int = 64
    max_open_files: int = 256
    output_bytes: int = 16_000
    network: bool = False
    packages: tuple[str, ...] = ()
    scratch_mb: int | None = None

    def with_packages(self, names: tuple[str, ...] | list[str] | None) -> SandboxLimits:
        """A copy whose allow-list also holds ``names`` (a task's environment; None adds nothing)."""
        if not names:
            return self
        return replace(self, packages=tuple(sorted({*self.packages, *names})))


@dataclass
class SandboxResult:
    """Outcome of one sandboxed command.

    Attributes:
        exit_code: the process's exit status; ``-N`` when killed by signal N.
        stdout, stderr: decoded (UTF-8, replacement) and truncated output.
        timed_out: the wall-clock limit fired.
        killed_reason: None, or ``timeout`` | ``cpu_time`` | ``file_size`` | ``memory`` (an allocation
            refused, or the cgroup's OOM kill) | ``scratch`` (a write refused: the scratch tmpfs is
            full) | ``processes`` (a fork refused by the process limit) | ``signal:<N>``.
        duration_s: wall-clock seconds.
        truncated: stdout or stderr was cut to ``output_bytes``.
        network_isolated: the command ran in its own (empty) network namespace.
        isolation: ``bwrap`` (the sandbox) or ``none`` (the operator's unisolated opt-out).
        denials: the first attempts the sandbox refused, ``{"kind": read|write|network|exec|signal|ptrace, "event",
            "target"}`` (from the audit hook, :mod:`evals.harness.sandbox_site.sitecustomize`).
        denial_count: how many attempts were refused in all (Python processes only).
        containment: what bounds the run's resources besides the sandbox: ``cgroup-v1`` or
            ``cgroup-v2`` (its own memory and pids cgroup, plus the rlimits) or ``rlimits``.
        extra: details, e.g. ``uid`` (the sandbox uid when run as root), ``cgroup`` (its counters:
            ``oom_kill``, ``pids_max``).
    """

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    killed_reason: str | None = None
    duration_s: float = 0.0
    truncated: bool = False
    network_isolated: bool = False
    isolation: str = "bwrap"
    denials: list[dict] = field(default_factory=list)
    denial_count: int = 0
    containment: str = "rlimits"
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
    """The sandbox cannot be built here (bubblewrap missing or refused, or the sandbox uid cannot
    reach the interpreter); untrusted code is never run unisolated or as root instead, unless the
    operator opted out (``FLYWHEEL_SANDBOX_ALLOW_UNISOLATED``)."""


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


def _read_denials(path: Path) -> tuple[list[dict], int]:
    """The first denials and the count of lines the audit hook wrote (read at most 256 KiB: a run
    that floods the file is counted by lines read, which is already far past any monitor bound)."""
    if not path.is_file():
        return [], 0
    with open(path, "rb") as f:
        lines = f.read(_DENIALS_READ_BYTES).splitlines()
    kept = []
    for line in lines[:_DENIALS_KEPT]:
        try:
            item = json.loads(line)
        except ValueError:
            item = {"kind": "unknown", "event": "unparsed", "target": line[:100].decode("utf-8", "replace")}
        kept.append(item if isinstance(item, dict) else {"kind": "unknown", "event": "unparsed", "target": ""})
    return kept, len(lines)


def _unisolated_env(scratch: Path) -> dict[str, str]:
    env = {k: v for k, v in sandbox_env().items() if not k.startswith(("SANDBOX_", "PYTHONPATH"))}
    return {**env, "HOME": str(scratch / "tmp"), "TMPDIR": str(scratch / "tmp"), "MPLCONFIGDIR": str(scratch / "tmp")}


_REFUSED_DIRS = ("/", "/tmp", "/var/tmp", "/dev/shm")
_PROBE_UID = fresh_uid()  # one uid for the once-per-process bubblewrap probe


def run_in_sandbox(cmd: str | list[str], cwd: Path, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``cmd`` (a shell string, or an argv list) in ``cwd`` under ``limits``, in the sandbox.

    Returns:
        The :class:`SandboxResult`; a limit that fires is reported there, never raised.

    Raises:
        FileNotFoundError: ``cwd`` does not exist.
        ValueError: ``cwd`` is ``/``, a home or a world-writable top directory, or too large.
        SandboxUnavailableError: the sandbox cannot be built here (the message names what is missing)
            and the operator did not opt out.
    """
    limits = limits or SandboxLimits()
    cwd = Path(cwd).resolve()
    if not cwd.is_dir():
        raise FileNotFoundError(f"sandbox directory {cwd} does not exist")
    if str(cwd) in (str(Path.home()), *_REFUSED_DIRS):
        raise ValueError(f"refusing to sandbox {cwd}: give the task's own directory")
    settings = load_settings()
    as_root = is_root()
    missing = _isolation_missing(settings, as_root)
    if missing is not None and not settings.allow_unisolated:
        raise SandboxUnavailableError(missing)
    if missing is not None:
        log.warning("sandbox: running %r WITHOUT isolation (FLYWHEEL_SANDBOX_ALLOW_UNISOLATED): %s", cmd, missing)
    argv = ["/bin/bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
    isolated = missing is None
    uid = fresh_uid() if as_root and isolated else None
    cgroup_ok = settings.cgroup and cgroup_host() is not None
    nproc = limits.max_processes if uid is not None else _user_process_count() + limits.max_processes
    if cgroup_ok:
        nproc += _NPROC_SLACK  # the pids cgroup refuses first, and counts it (RLIMIT_NPROC is the belt)
    cpu_s = limits.cpu_s or int(limits.timeout_s) + 1

    rlimits = {
        "cpu": (cpu_s, cpu_s + 1),
        "as": (limits.memory_mb * _MB,) * 2,
        "fsize": (limits.file_size_mb * _MB,) * 2,
        "nproc": (nproc, nproc),
        "nofile": (limits.max_open_files,) * 2,
        "core": (0, 0),
    }

    scratch_mb = limits.scratch_mb or settings.scratch_mb
    scratch = Path(tempfile.mkdtemp(prefix="flywheel-sbx-", dir=settings.scratch_root()))
    (scratch / ("denials" if isolated else "tmp")).mkdir()
    out_path, err_path = scratch / "stdout", scratch / "stderr"
    task_dir, before, info_r, info_w, counters = cwd, None, None, None, {}
    if isolated:
        if uid is not None:
            # The sandbox uid works on a copy of the repository inside its own scratch folder: the
            # task folder's ancestors may be closed to it, and the harness's files never change
            # owner. The copy is synced back after the run.
            task_dir = scratch / "task"
            before = tree_entries(cwd)
            shutil.copytree(cwd, task_dir, symlinks=True)
            chown_tree(scratch, uid)
        info_r, info_w = os.pipe()  # bwrap writes its init's host pid here (for kill_uid)
        site = install_site(scratch / "site")
        mounts = _mounts(limits.packages, settings, scratch_mb)
        argv = bwrap_argv(task_dir, scratch / "denials", site, mounts, _which(settings.bwrap), info_fd=info_w) + argv
    cgroup = _run_cgroup(settings, (limits.memory_mb + scratch_mb) * _MB, limits.max_processes)
    started = time.perf_counter()
    try:
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                (cgroup.join_argv() if cgroup is not None else []) + _drop_argv(uid, rlimits) + argv,
                cwd=cwd if not isolated else "/",
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=sandbox_env() if isolated else _unisolated_env(scratch),
                start_new_session=True,
                close_fds=True,
                pass_fds=(info_w,) if info_w is not None else (),
            )
            if info_w is not None:
                os.close(info_w)
                info_w = None
            timed_out = wait_exit(proc, limits.timeout_s)
        killpg(proc.pid)  # stragglers outside the pid namespace (the unisolated opt-out)
        init = sandbox_init(read_available(info_r), uid) if info_r is not None and uid is not None else None
        if cgroup is not None:
            counters = cgroup.counters()
            wait_init(init)
            cgroup.kill()  # what is left of the run (the namespace's processes die with its init)
        elif uid is not None:
            kill_uid(uid, init)
        duration = time.perf_counter() - started
        stdout, cut_out = _read_capped(out_path, limits.output_bytes)
        stderr, cut_err = _read_capped(err_path, limits.output_bytes)
        denials, denial_count = _read_denials(scratch / "denials" / "denials.jsonl")
    finally:
        for fd in (info_r, info_w):
            if fd is not None:
                os.close(fd)
        if cgroup is not None:
            cgroup.close()
        if before is not None and task_dir.is_dir():
            sync_tree(task_dir, cwd, before)
        shutil.rmtree(scratch, ignore_errors=True)
    code = proc.returncode
    reason = _reason(code, timed_out, stderr, counters)
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
        isolation="bwrap" if isolated else "none",
        denials=denials,
        denial_count=denial_count,
        containment=cgroup.mode if cgroup is not None else "rlimits",
        extra={**({"uid": uid} if uid is not None else {}), **({"cgroup": counters} if cgroup is not None else {})},
    )


def _mounts(packages: tuple[str, ...], settings: SandboxSettings, scratch_mb: int) -> SandboxMounts:
    """The run's allow-listed environment (built on first use), the empty one, and the scratch size."""
    root = settings.env_root()
    return SandboxMounts(
        site_packages=allowed_environment(packages, root).site_dir,
        empty_dir=allowed_environment((), root).site_dir,
        scratch_bytes=scratch_mb * _MB,
    )


def _run_cgroup(settings: SandboxSettings, memory_bytes: int, max_tasks: int) -> RunCgroup | None:
    """The run's own cgroup where the host delegates one and the operator did not turn it off, else None.

    Raises:
        OSError: the delegated cgroup refused a new child or its limits (not silently unbounded).
    """
    host = cgroup_host() if settings.cgroup else None
    if host is None:
        return None
    if host not in _SWEPT:
        _SWEPT.add(host)
        remove_stale(host)
    return RunCgroup(host, memory_bytes, max_tasks)


_SWEPT: set = set()  # cgroup hosts whose stale run cgroups this process removed
_NPROC_SLACK = 8


@lru_cache(maxsize=4)
def _which(program: str) -> str:
    """``program``'s absolute path on the harness's ``PATH`` (where the probe found it), else itself."""
    return shutil.which(program) or program


def _drop_argv(uid: int | None, rlimits: dict[str, tuple[int, int]]) -> list[str]:
    """The argv prefix that sets ``rlimits`` (``prlimit`` names: ``cpu``, ``as``...; ``(soft, hard)``)
    and, when ``uid`` is given, becomes that uid with no supplementary groups, before it execs the
    command: util-linux's ``prlimit`` and ``setpriv`` (``setpriv`` also sets the saved uid and clears
    every capability: root's permitted set does not survive into the sandbox).

    Why programs and not ``Popen(user=..., preexec_fn=...)``: either makes Python ``fork`` the
    harness (its whole address space) and run Python code in the child, where these let it ``vfork``;
    on this 2-core machine the fork and the child's Python cost ~6 ms of each run, the two ``exec``s ~3.

    Raises:
        SandboxUnavailableError: ``prlimit`` or (for a uid) ``setpriv`` is not installed.
    """
    prlimit, setpriv = _which("prlimit"), _which("setpriv")
    for name, path in (("prlimit", prlimit), ("setpriv", setpriv if uid is not None else "/")):
        if not os.path.isabs(path):
            raise SandboxUnavailableError(f"{name} (util-linux) is not installed: apt-get install util-linux")
    argv = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"] if uid is not None else []
    return argv + [prlimit, *(f"--{name}={soft}:{hard}" for name, (soft, hard) in rlimits.items()), "--"]


def _isolation_missing(settings: SandboxSettings, as_root: bool) -> str | None:
    """Why the sandbox cannot be built here, or None."""
    if as_root and not interpreter_reachable():
        return (
            f"the sandbox user cannot reach the interpreter under {sys.prefix} (closed directories: "
            f"{[str(d) for d in closed_interpreter_dirs()]}); run `python -m evals.harness.sandbox_host --grant` "
            "(ops/install.sh does) to give others search permission on them"
        )
    return bwrap_missing(settings.bwrap, _PROBE_UID if as_root else None)


def _reason(code: int, timed_out: bool, stderr: str, cgroup: dict[str, int]) -> str | None:
    """Which bound ended or cut the run, from its exit, its stderr and its cgroup's counters."""
    if timed_out:
        return "timeout"
    if code in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return "cpu_time"
    if code in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or (code != 0 and "File too large" in stderr):
        return "file_size"  # Python ignores SIGXFSZ: its write fails with EFBIG instead
    if cgroup.get("oom_kill", 0) > 0 or (code != 0 and ("MemoryError" in stderr or "Cannot allocate memory" in stderr)):
        return "memory"
    if code != 0 and "No space left on device" in stderr:
        return "scratch"  # the scratch tmpfs is full (ENOSPC)
    if code < 0:
        return f"signal:{-code}"
    if cgroup.get("pids_max", 0) > 0 or _FORK_REFUSED in stderr or "can't start new thread" in stderr:
        return "processes"  # the pids cgroup or RLIMIT_NPROC refused a fork (the run may still exit 0)
    return None


_FORK_REFUSED = "fork: retry: Resource temporarily unavailable"
