"""A sandboxed run's own memory and pids cgroup, where the host delegates one to this process.

Invariants:
- Every process of a run is in its cgroup before it can fork: the run's argv starts with ``sh``
  moving itself into the cgroup (``echo 0 > cgroup.procs`` moves the writer) before it ``exec``s
  the rest (``setpriv``, ``prlimit``, bwrap), so bwrap's processes and the command's are born in it.
- The cgroup bounds the whole run, every process together: memory (resident pages, page cache and
  the tmpfs pages of its scratch space, which the kernel charges to the cgroup that wrote them; swap
  too, so swapping cannot stretch it) and the number of tasks (processes and threads).
- It is a child of this process's own cgroup (cgroup v1: of its ``memory`` and ``pids`` cgroups;
  cgroup v2: a sibling of this process's leaf in a subtree whose ``cgroup.subtree_control``
  enables ``memory`` and ``pids``), so the host's bounds on the harness still hold the runs.
- After the run its counters are read (OOM kills, refused forks), every process still in it is
  killed, and it is removed; the counters give ``killed_reason`` ``memory`` / ``processes``.
- Where no writable controller is found (a container with a read-only ``/sys/fs/cgroup``, a
  non-root harness without a delegated subtree) :func:`cgroup_host` returns None and runs keep
  their rlimits only; :class:`evals.harness.sandbox.SandboxResult` reports which
  (``containment``).
"""

from __future__ import annotations

import errno
import os
import secrets
import signal
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

_PREFIX = "flywheel-sbx-"
# Moves the shell into each cgroup.procs given (count first), then execs the run's argv.
_JOIN = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo 0 > "$1" || exit 125; shift; n=$((n - 1)); done; exec "$@"'


@dataclass(frozen=True)
class CgroupHost:
    """Where this process may make run cgroups.

    Attributes:
        mode: ``cgroup-v1`` (separate ``memory`` and ``pids`` hierarchies) or ``cgroup-v2``.
        parents: v1: ``(memory parent, pids parent)``; v2: ``(parent,)`` (folders, writable).
    """

    mode: str
    parents: tuple[Path, ...]


def _mounts() -> list[tuple[str, str, set[str]]]:
    """``(mount point, filesystem type, super options)`` of the cgroup filesystems (``/proc/self/mountinfo``)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _, options = (right.split() + ["", "", ""])[:3]
            if fstype in ("cgroup", "cgroup2"):
                out.append((left.split()[4], fstype, set(options.split(","))))
    return out


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and ``""`` for the v2 hierarchy (``/proc/self/cgroup``)."""
    out: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _writable(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def _v2_parent(mount: str, own: str) -> Path | None:
    """A writable folder under which run cgroups get ``memory`` and ``pids``: this process's own
    cgroup when it already delegates both to children, else its parent when that one does (this
    process in a leaf of a delegated subtree)."""
    here = Path(mount) / own.lstrip("/")
    for candidate in (here, here.parent):
        try:
            enabled = set((candidate / "cgroup.subtree_control").read_text().split())
        except OSError:
            continue
        if {"memory", "pids"} <= enabled and _writable(candidate):
            return candidate
        if candidate == Path(mount):
            break
    return None


@lru_cache(maxsize=1)
def cgroup_host() -> CgroupHost | None:
    """Where runs get their own cgroup here (found once per process), or None (rlimits only)."""
    try:
        mounts, own = _mounts(), _own_cgroups()
    except OSError:
        return None
    for mount, fstype, _ in mounts:
        if fstype == "cgroup2" and "" in own:
            parent = _v2_parent(mount, own[""])
            if parent is not None:
                return CgroupHost("cgroup-v2", (parent,))
    v1: dict[str, Path] = {}
    for mount, fstype, options in mounts:
        for controller in ("memory", "pids"):
            if fstype == "cgroup" and controller in options and controller in own:
                v1[controller] = Path(mount) / own[controller].lstrip("/")
    if len(v1) == 2 and all(_writable(p) for p in v1.values()):
        return CgroupHost("cgroup-v1", (v1["memory"], v1["pids"]))
    return None


def remove_stale(host: CgroupHost, older_than_s: float = 600.0) -> int:
    """Remove run cgroups a harness that died left behind: empty ones (``rmdir`` refuses the others)
    made over ``older_than_s`` seconds ago (a younger one may be a live run's, not joined yet).
    Returns how many were removed."""
    removed, now = 0, time.time()
    for parent in host.parents:
        for d in parent.glob(_PREFIX + "*"):
            try:
                if now - d.stat().st_mtime > older_than_s:
                    d.rmdir()
                    removed += 1
            except OSError:
                continue
    return removed


class RunCgroup:
    """One run's cgroup(s): made with its limits, joined by the run's first process, read and
    removed after (:meth:`close`).

    Raises:
        OSError: the cgroup cannot be made or its limits written (the folder is removed again).
    """

    def __init__(self, host: CgroupHost, memory_bytes: int, max_tasks: int) -> None:
        self.mode = host.mode
        name = _PREFIX + secrets.token_hex(6)
        self.dirs = tuple(parent / name for parent in host.parents)
        try:
            for d in self.dirs:
                d.mkdir()
            if self.mode == "cgroup-v1":
                memory, pids = self.dirs
                (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
                _write_if_present(memory / "memory.memsw.limit_in_bytes", str(memory_bytes))  # no swap beyond it
                (pids / "pids.max").write_text(str(max_tasks))
            else:
                (d,) = self.dirs
                (d / "memory.max").write_text(str(memory_bytes))
                _write_if_present(d / "memory.swap.max", "0")
                _write_if_present(d / "memory.oom.group", "1")  # an OOM kill takes the whole run
                (d / "pids.max").write_text(str(max_tasks))
        except OSError:
            self.close()
            raise

    def join_argv(self) -> list[str]:
        """The argv prefix that moves the run's first process into the cgroup(s), then execs the rest."""
        procs = [str(d / "cgroup.procs") for d in self.dirs]
        return ["/bin/sh", "-c", _JOIN, "sh", str(len(procs)), *procs]

    def counters(self) -> dict[str, int]:
        """``oom_kill`` (processes the kernel killed at the memory limit) and ``pids_max`` (forks
        refused at the task limit) so far."""
        memory_dir, pids_dir = (self.dirs[0], self.dirs[-1])
        oom_file = memory_dir / ("memory.oom_control" if self.mode == "cgroup-v1" else "memory.events")
        return {"oom_kill": _field(oom_file, "oom_kill"), "pids_max": _field(pids_dir / "pids.events", "max")}

    def kill(self) -> None:
        """SIGKILL every process still in the cgroup, until it is empty (at most ~1 s)."""
        if self.mode == "cgroup-v2" and _write_if_present(self.dirs[0] / "cgroup.kill", "1"):
            pass
        for _ in range(100):
            pids = self._pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)

    def close(self) -> None:
        """Kill what is left and remove the cgroup folder(s) (retried while killed processes are reaped)."""
        self.kill()
        for d in self.dirs:
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        raise
                    time.sleep(0.01)

    def _pids(self) -> list[int]:
        out: list[int] = []
        for d in self.dirs:
            try:
                out += [int(p) for p in (d / "cgroup.procs").read_text().split()]
            except FileNotFoundError:
                continue
        return out


def _write_if_present(path: Path, value: str) -> bool:
    """Write ``value`` to a control file the kernel may not have (swap accounting off, an older kernel)."""
    try:
        path.write_text(value)
        return True
    except FileNotFoundError:
        return False


def _field(path: Path, name: str) -> int:
    """The integer ``name`` of a flat-keyed control file (``memory.events``, ``pids.events``), 0 if absent."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
