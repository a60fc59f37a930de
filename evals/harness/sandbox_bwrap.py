"""The bubblewrap command line of one sandboxed run, and whether bubblewrap works on this host.

Why bubblewrap: Debian packages it (``apt-get install bubblewrap``, 0.8 on bookworm), it is the
unprivileged sandbox Flatpak uses, it runs without setuid where unprivileged user namespaces are
allowed (as a fresh uid here), and one flag (``--unshare-all``) gives fresh user, mount, pid, net,
ipc, uts and cgroup namespaces. nsjail does the same with a config language and is not packaged.

The mount namespace (:func:`bwrap_argv`) holds only:
- ``/task``: the task's working folder, the one writable place besides a fresh ``/tmp`` and
  ``/home/sandbox`` (``$HOME``; both tmpfs, gone after the run);
- read-only: ``/usr`` (with the ``/bin``, ``/lib``, ``/lib64`` links of a merged-/usr system), the
  interpreter's installation (``sys.base_prefix`` and ``sys.prefix``) with flywheel's own
  distribution masked (its packages, editable finder and ``.pth``: task definitions and hidden tests
  never show), a few files of ``/etc`` that programs need (``ld.so.cache``, ``alternatives``,
  ``localtime``), and ``SITE_DIR`` (the audit hook, ``evals/harness/sandbox_site``);
- ``/proc`` of the sandbox's own pid namespace, a minimal ``/dev``;
- ``DENIALS_DIR``: the folder the audit hook writes to (writable; the harness reads it after).
Nothing else of the host exists inside: not the project, ``$FLYWHEEL_HOME``, checkpoints, other
sessions' folders, ``/root`` beyond the interpreter's own path, nor other processes.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import py_compile
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

TASK_DIR = "/task"
HOME_DIR = "/home/sandbox"
SITE_DIR = "/opt/flywheel-sandbox"
DENIALS_DIR = "/run/flywheel-sandbox"
DENIALS_FILE = f"{DENIALS_DIR}/denials.jsonl"
_ETC_FILES = ("/etc/ld.so.cache", "/etc/alternatives", "/etc/localtime")
_MERGED_USR_LINKS = {"/bin": "usr/bin", "/sbin": "usr/sbin", "/lib": "usr/lib", "/lib64": "usr/lib64"}


def interpreter_roots() -> list[str]:
    """The interpreter's installation directories (resolved, deduplicated, outside ``/usr``)."""
    return list(_interpreter_roots())


@lru_cache(maxsize=1)
def _interpreter_roots() -> tuple[str, ...]:
    roots: list[str] = []
    for p in (sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable))):
        real = os.path.realpath(p)
        if real.startswith("/usr/") or real == "/usr" or any(real == r or real.startswith(r + "/") for r in roots):
            continue
        roots.append(real)
    return tuple(roots)


@lru_cache(maxsize=1)
def flywheel_entries() -> tuple[tuple[str, bool], ...]:
    """Paths of flywheel's own installed distribution inside the interpreter's installation (its
    top-level packages, ``.pth`` files, editable finder, dist-info), as ``(path, is_dir)``, to mask."""
    try:
        dist = importlib.metadata.distribution("flywheel")
    except importlib.metadata.PackageNotFoundError:
        return ()
    roots, seen = interpreter_roots(), {}
    for f in dist.files or ():
        top = f.parts[0]
        if top == "..":
            continue
        # the shared __pycache__ stays; only flywheel's own compiled files in it are masked
        path = os.path.realpath(str(dist.locate_file(f if top == "__pycache__" else top)))
        if any(path.startswith(r + "/") for r in roots) and os.path.lexists(path):
            seen[path] = os.path.isdir(path)
    return tuple(sorted(seen.items()))


_SITE_SOURCE = Path(__file__).resolve().parent / "sandbox_site" / "sitecustomize.py"


@lru_cache(maxsize=2)
def _site_files(mtime_ns: int, size: int) -> tuple[bytes, bytes]:
    """The audit hook's source and its checked-hash ``.pyc`` (compiled once per version of the file:
    the sandbox's interpreter never writes bytecode, so without it every Python process of every run
    would compile the hook again, ~3 ms; a checked hash makes a stale ``.pyc`` recompile, never run)."""
    source = _SITE_SOURCE.read_bytes()
    with tempfile.TemporaryDirectory(prefix="flywheel-sbx-site-") as d:
        src, cfile = Path(d) / "sitecustomize.py", Path(d) / "sitecustomize.pyc"
        src.write_bytes(source)
        py_compile.compile(
            str(src), cfile=str(cfile), doraise=True, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH
        )
        return source, cfile.read_bytes()


def install_site(dest: Path) -> Path:
    """Write the audit hook (``evals/harness/sandbox_site/sitecustomize.py``) and its compiled
    ``__pycache__`` entry into ``dest`` (created), a folder the sandbox uid can reach, to be bound
    read-only at :data:`SITE_DIR`. Returns ``dest``."""
    st = _SITE_SOURCE.stat()
    source, pyc = _site_files(st.st_mtime_ns, st.st_size)
    (dest / "__pycache__").mkdir(parents=True, exist_ok=True)
    (dest / "sitecustomize.py").write_bytes(source)
    (dest / importlib.util.cache_from_source("sitecustomize.py")).write_bytes(pyc)
    return dest


def visible_roots() -> list[str]:
    """Every path the sandbox can read (what the audit hook calls visible)."""
    return [
        TASK_DIR,
        "/tmp",
        HOME_DIR,
        "/usr",
        *_MERGED_USR_LINKS,
        "/proc",
        "/dev",
        SITE_DIR,
        DENIALS_DIR,
        *interpreter_roots(),
        *(e for e in _ETC_FILES if os.path.exists(e)),
    ]


def bwrap_argv(
    task_dir: Path, denials_dir: Path, site_dir: Path, bwrap: str = "bwrap", info_fd: int | None = None
) -> list[str]:
    """The ``bwrap`` arguments (up to the ``--`` before the command) for a run in ``task_dir``.

    Args:
        task_dir: host folder bound writable at :data:`TASK_DIR`.
        denials_dir: host folder bound writable at :data:`DENIALS_DIR` (the audit hook's output).
        site_dir: host folder from :func:`install_site`, bound read-only at :data:`SITE_DIR`.
        bwrap: the bubblewrap executable.
        info_fd: a file descriptor (passed to bwrap) it writes a JSON object to and closes, outside
            the sandbox, with ``child-pid``: the host pid of the sandbox's init.
    """
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr"]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    for link, target in _MERGED_USR_LINKS.items():
        if os.path.islink(link):
            argv += ["--symlink", target, link]
        elif os.path.isdir(link):
            argv += ["--ro-bind", link, link]
    for root in interpreter_roots():
        argv += ["--ro-bind", root, root]
    for path, is_dir in flywheel_entries():
        argv += ["--tmpfs", path] if is_dir else ["--ro-bind", "/dev/null", path]
    for etc in _ETC_FILES:
        if os.path.exists(etc):
            argv += ["--ro-bind", etc, etc]
    argv += ["--ro-bind", str(site_dir), SITE_DIR, "--bind", str(denials_dir), DENIALS_DIR]
    argv += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--tmpfs",
        "/tmp",
        "--tmpfs",
        HOME_DIR,
        "--bind",
        str(task_dir),
        TASK_DIR,
    ]
    argv += ["--remount-ro", "/", "--chdir", TASK_DIR, "--"]  # the root's own tmpfs: read-only too
    return argv


def sandbox_env() -> dict[str, str]:
    """The whole environment of a sandboxed command: no ``FLYWHEEL_*`` settings, credentials or
    proxies; ``PYTHONPATH`` points at the audit hook; one thread per numeric library."""
    path = os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"])
    return {
        "PATH": path,
        "HOME": HOME_DIR,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        "PYTHONPATH": SITE_DIR,
        "MPLBACKEND": "Agg",
        "MPLCONFIGDIR": f"{HOME_DIR}/.mpl",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "NUMEXPR_MAX_THREADS": "1",
        "USER": "sandbox",
        "LOGNAME": "sandbox",
        "SANDBOX_DENIALS": DENIALS_FILE,
        "SANDBOX_VISIBLE": ":".join(visible_roots()),
        "SANDBOX_WRITABLE": ":".join([TASK_DIR, "/tmp", HOME_DIR, "/dev", DENIALS_DIR]),
    }


@lru_cache(maxsize=4)
def bwrap_missing(bwrap: str = "bwrap", uid: int | None = None) -> str | None:
    """Why bubblewrap cannot isolate a run here, or None when it can (probed once per argument pair:
    the interpreter started in a full sandbox, as ``uid`` when given; callers pass one fixed probe uid).

    Returns:
        A sentence naming what is missing (the executable, or the kernel's refusal as bwrap said it).
    """
    exe = shutil.which(bwrap)
    if exe is None:
        return f"bubblewrap ({bwrap!r}) is not installed: apt-get install bubblewrap (ops/install.sh does)"
    with tempfile.TemporaryDirectory(prefix="flywheel-sbx-probe-") as d:
        for sub in ("task", "denials"):
            os.mkdir(os.path.join(d, sub))
        install_site(Path(d) / "site")
        kwargs: dict[str, Any] = {}
        if uid is not None:
            for dirpath, _, _ in os.walk(d):
                os.chown(dirpath, uid, uid)
            kwargs = {"user": uid, "group": uid, "extra_groups": []}
        argv = bwrap_argv(Path(d) / "task", Path(d) / "denials", Path(d) / "site", exe) + [
            sys.executable,
            "-c",
            "import encodings",
        ]
        try:
            probe = subprocess.run(argv, capture_output=True, timeout=30, cwd="/", env=sandbox_env(), **kwargs)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"bubblewrap could not start: {exc}"
    if probe.returncode != 0:
        said = probe.stderr.decode("utf-8", "replace").strip()[-300:]
        return f"bubblewrap cannot build the sandbox here (user namespaces refused?): {said}"
    return None
