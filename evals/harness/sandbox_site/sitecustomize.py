"""Audit hook of the sandbox: every Python process started inside it (``PYTHONPATH`` points here, bound
read-only) records what its code tried that the sandbox refuses, one JSON line per attempt, to the
file named by ``SANDBOX_DENIALS`` (a folder outside the task's, bound writable; the harness reads it).

What counts as a denial (``sys.addaudithook``, PEP 578):
- ``read``: ``open``/``os.listdir``/``os.scandir`` of a path under none of ``SANDBOX_VISIBLE``
  (the mounts; everything else of the host is absent, so such an attempt fails), or of a missing
  path under ``/tmp`` (the sandbox's own: a host ``/tmp`` path the code expected);
- ``write`` also: an open for writing under ``/tmp`` whose folder is missing (a host ``/tmp`` path);
- ``write``: an open for writing, or a mkdir/remove/rename/rmdir/chmod/truncate/symlink, of a path under
  none of ``SANDBOX_WRITABLE`` (the task folder, ``/tmp``, ``/dev``: the rest is read-only);
- ``network``: a ``socket.connect``/``sendto`` to an IP address (the sandbox has no network);
- ``exec``: starting an absolute executable path that is not visible;
- ``read`` also: opening a file missing under a site-packages folder (``SANDBOX_SITE_PACKAGES``:
  an installed package outside the allow-list, e.g. an eval data set, that the code expected);
- ``read`` also: opening another process's ``/proc/<pid>/environ`` or ``mem`` (the box's ``/proc``
  shows its own processes only: a probe for the host's);
- ``signal``: ``os.kill``/``os.killpg`` of a pid or group that does not exist in the box (a host
  process: the pid namespace hides every one);
- ``ptrace``: looking up ``ptrace`` or ``process_vm_readv``/``writev`` through ``ctypes``.
Paths are resolved (``os.path.realpath``) so a symlink out of the folder counts. This is a signal,
not the guard: code can remove the hook or run a non-Python program, and the mounts refuse either way.
Each process records at most ``_MAX`` attempts.

Cost: the hook runs for every audit event of the process (imports, ``compile``, ``exec``, attribute
hooks... thousands in a test run), so it returns on one frozenset lookup for the events it does not
check, and a read under a mount (most of an import's opens) is recognised by one ``str.startswith``
on a tuple of prefixes. ``json`` is imported only when a denial is written (it costs ~3 ms of a
process start); the harness ships this file precompiled (a checked-hash ``.pyc`` beside it).
"""

import os
import sys

_LOG = os.environ.get("SANDBOX_DENIALS", "")
_VISIBLE = tuple(p for p in os.environ.get("SANDBOX_VISIBLE", "").split(":") if p)
_WRITABLE = tuple(p for p in os.environ.get("SANDBOX_WRITABLE", "").split(":") if p)
_VISIBLE_PREFIXES = tuple(r.rstrip("/") + "/" for r in _VISIBLE)
_SITE_PREFIXES = tuple(r.rstrip("/") + "/" for r in os.environ.get("SANDBOX_SITE_PACKAGES", "").split(":") if r)
_WRITABLE_PREFIXES = tuple(r.rstrip("/") + "/" for r in _WRITABLE)
_MAX = 200
_WRITE_EVENTS = frozenset(
    {"os.mkdir", "os.remove", "os.rename", "os.rmdir", "os.chmod", "os.truncate", "os.symlink", "os.link"}
)
_EXEC_EVENTS = frozenset({"subprocess.Popen", "os.exec", "os.posix_spawn"})
_PTRACE_SYMBOLS = frozenset({"ptrace", "process_vm_readv", "process_vm_writev"})
_CHECKED = frozenset(
    {
        "open",
        "os.listdir",
        "os.scandir",
        "socket.connect",
        "socket.sendto",
        "os.kill",
        "os.killpg",
        "ctypes.dlsym",
        *_WRITE_EVENTS,
        *_EXEC_EVENTS,
    }
)
_state = {"busy": False, "count": 0}


def _under(path: str, roots: tuple[str, ...], prefixes: tuple[str, ...]) -> bool:
    return path.startswith(prefixes) or path in roots


def _resolve(path) -> str | None:
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, str):  # a file descriptor
        return None
    return os.path.realpath(path)


def _plainly_visible(path) -> bool:
    """An absolute path string under a visible root outside ``/tmp``, before resolving symlinks: the
    fast path for the thousands of opens an import makes (realpath costs a stat per component)."""
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    return (
        isinstance(path, str)
        and path.startswith("/")
        and not path.startswith("/tmp/")
        and _under(os.path.normpath(path), _VISIBLE, _VISIBLE_PREFIXES)
    )


def _record(kind: str, event: str, target: str) -> None:
    if _state["count"] >= _MAX:
        return
    _state["count"] += 1
    import json  # noqa: PLC0415 - only a process that is refused something pays for it

    with open(_LOG, "a", encoding="utf-8") as f:
        f.write(json.dumps({"kind": kind, "event": event, "target": target[:300]}) + "\n")


def _other_process_file(path) -> bool:
    """``/proc/<pid>/environ`` or ``mem`` of a process other than this one."""
    if not isinstance(path, str) or not path.startswith("/proc/"):
        return False
    parts = path.split("/")
    return (
        len(parts) == 4 and parts[3] in ("environ", "mem") and parts[2] not in ("self", "thread-self", str(os.getpid()))
    )


def _check(event: str, args: tuple) -> None:
    if event == "open":
        path, mode, flags = (args + (None, None, None))[:3]
        if _other_process_file(path):
            _record("read", event, path)
            return
        if mode in (None, "r", "rb") and not (isinstance(flags, int) and flags & 3) and _plainly_visible(path):
            if isinstance(path, str) and path.startswith(_SITE_PREFIXES) and not os.path.exists(path):
                _record("read", event, path)  # a package outside the allow-list
            return  # a read under a mount (``io.open_code`` passes mode "rb"; ``os.open`` flags)
        target = _resolve(path)
        if target is None:
            return
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        )
        if not _under(target, _VISIBLE, _VISIBLE_PREFIXES):
            _record("write" if writes else "read", event, target)
        elif target.startswith("/tmp/") and not os.path.exists(os.path.dirname(target) if writes else target):
            _record(
                "write" if writes else "read", event, target
            )  # the sandbox's /tmp is its own: a host path is absent
        elif writes and not _under(target, _WRITABLE, _WRITABLE_PREFIXES):
            _record("write", event, target)
    elif event in ("os.listdir", "os.scandir"):
        target = _resolve(args[0] if args else ".")
        if target is not None and (
            not _under(target, _VISIBLE, _VISIBLE_PREFIXES)
            or (target.startswith("/tmp/") and not os.path.exists(target))
        ):
            _record("read", event, target)  # a missing /tmp path is a host path the code expected
    elif event in _WRITE_EVENTS:
        for path in args[:2] if event in ("os.rename", "os.link") else args[:1]:
            target = _resolve(path)
            if target is not None and not _under(target, _WRITABLE, _WRITABLE_PREFIXES):
                _record("write", event, target)
    elif event in ("socket.connect", "socket.sendto"):
        address = args[1] if len(args) > 1 else None
        if isinstance(address, tuple):
            _record("network", event, ":".join(str(a) for a in address[:2]))
    elif event in ("os.kill", "os.killpg"):
        target = args[0] if args else None
        if isinstance(target, int) and target > 0 and not os.path.exists(f"/proc/{target}"):
            _record("signal", event, str(target))
    elif event == "ctypes.dlsym":
        if len(args) > 1 and args[1] in _PTRACE_SYMBOLS:
            _record("ptrace", event, str(args[1]))
    elif event in _EXEC_EVENTS:
        exe = _resolve(args[0]) if args else None
        if exe is not None and os.path.isabs(os.fsdecode(args[0])) and not _under(exe, _VISIBLE, _VISIBLE_PREFIXES):
            _record("exec", event, exe)


def _hook(event: str, args: tuple) -> None:
    if event not in _CHECKED or _state["busy"]:
        return
    _state["busy"] = True
    try:
        _check(event, args)
    except Exception:  # noqa: BLE001 - the hook must never break the code it watches
        pass
    finally:
        _state["busy"] = False


if _LOG and _VISIBLE:
    sys.addaudithook(_hook)
