"""The bubblewrap command line of one sandboxed run, and whether bubblewrap works on this host.

Why bubblewrap: Debian packages it (``apt-get install bubblewrap``, 0.8 on bookworm), it is the
unprivileged sandbox Flatpak uses, it runs without setuid where unprivileged user namespaces are
allowed (as a fresh uid here), and one flag (``--unshare-all``) gives fresh user, mount, pid, net,
ipc, uts and cgroup namespaces. nsjail does the same with a config language and is not packaged.

The mount namespace (:func:`bwrap_argv`) holds only:
- ``/task``: the task's working folder, the one writable place besides the scratch space: ``/tmp``
  (with ``$HOME``, ``/home/sandbox``, a link to ``/tmp/home``) is one tmpfs of ``scratch_bytes``,
  ``/dev/shm`` another; both gone after the run;
- read-only: ``/usr`` (with the ``/bin``, ``/lib``, ``/lib64`` links of a merged-/usr system), the
  interpreter's ``bin/``, ``lib/`` and ``pyvenv.cfg`` (:func:`interpreter_mounts`; not its
  ``share/``, ``include/`` or other data), with every site-packages folder of it and of the system's
  Pythons replaced (:func:`site_packages_dirs`): the first by the run's allow-listed environment
  (:func:`evals.harness.environment.allowed_environment`), the others by an empty folder, so no
  installed package outside the allow-list shows (no eval data set, no flywheel); a few files of
  ``/etc`` that programs need (``ld.so.cache``, ``alternatives``, ``localtime``), and ``SITE_DIR``
  (the audit hook, ``evals/harness/sandbox_site``);
- ``/proc`` of the sandbox's own pid namespace, a minimal ``/dev`` (read-only but for its devices);
- ``DENIALS_DIR``: the folder the audit hook writes to (writable; the harness reads it after).
Nothing else of the host exists inside: not the project, ``$FLYWHEEL_HOME``, checkpoints, other
sessions' folders, ``/root`` beyond the interpreter's own path, nor other processes.
"""

from __future__ import annotations

import importlib.util
import os
import py_compile
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

TASK_DIR = "/task"
HOME_DIR = "/home/sandbox"
HOME_TARGET = "/tmp/home"  # $HOME lives in the scratch tmpfs (one bound for both)
SITE_DIR = "/opt/flywheel-sandbox"
DENIALS_DIR = "/run/flywheel-sandbox"
DENIALS_FILE = f"{DENIALS_DIR}/denials.jsonl"


@dataclass(frozen=True)
class SandboxMounts:
    """What a run's mounts depend on besides its folders.

    Attributes:
        site_packages: host folder mounted over the interpreter's site-packages (the allow-list's).
        empty_dir: an empty host folder mounted over the other site-packages folders.
        scratch_bytes: size of the ``/tmp`` tmpfs and of the ``/dev/shm`` one (bytes).
    """

    site_packages: Path
    empty_dir: Path
    scratch_bytes: int


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
def interpreter_mounts() -> tuple[str, ...]:
    """What of each interpreter root the sandbox binds: ``bin/``, ``lib/`` (the standard library,
    ``libpython``, the site-packages folders that :func:`site_packages_dirs` replaces) and a venv's
    ``pyvenv.cfg``, those that exist. A root's other folders (``share/``, ``include/``, ``opt/``: data
    distributions install there) are not bound."""
    out = []
    for root in interpreter_roots():
        for name in ("bin", "lib", "pyvenv.cfg"):
            path = os.path.join(root, name)
            if os.path.exists(path):
                out.append(path)
    return tuple(out)


@lru_cache(maxsize=1)
def site_packages_dirs() -> tuple[str, ...]:
    """Every site-packages (or Debian dist-packages) folder the sandbox would otherwise show: this
    interpreter's (its ``purelib`` first: the allow-listed environment goes there), its base
    interpreter's, and the system's Pythons' under ``/usr`` (resolved, existing, deduplicated)."""
    candidates = [sysconfig.get_path("purelib"), sysconfig.get_path("platlib"), *site.getsitepackages()]
    for base in (sys.base_prefix, sys.prefix):
        for key in ("purelib", "platlib"):
            candidates.append(sysconfig.get_path(key, vars={"base": base, "platbase": base}))
    for parent in ("/usr/lib", "/usr/local/lib"):
        for pattern in ("python3*/site-packages", "python3*/dist-packages", "python3/dist-packages"):
            candidates += [str(p) for p in sorted(Path(parent).glob(pattern))]
    out: list[str] = []
    for c in candidates:
        real = os.path.realpath(c)
        if os.path.isdir(real) and real not in out:
            out.append(real)
    return tuple(out)


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
        *interpreter_mounts(),
        *(e for e in _ETC_FILES if os.path.exists(e)),
    ]


def bwrap_argv(
    task_dir: Path,
    denials_dir: Path,
    site_dir: Path,
    env: SandboxMounts,
    bwrap: str = "bwrap",
    info_fd: int | None = None,
) -> list[str]:
    """The ``bwrap`` arguments (up to the ``--`` before the command) for a run in ``task_dir``.

    Args:
        task_dir: host folder bound writable at :data:`TASK_DIR`.
        denials_dir: host folder bound writable at :data:`DENIALS_DIR` (the audit hook's output).
        site_dir: host folder from :func:`install_site`, bound read-only at :data:`SITE_DIR`.
        env: the allow-listed environment, an empty folder, and the scratch size (:class:`SandboxMounts`).
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
    for path in interpreter_mounts():
        argv += ["--ro-bind", path, path]
    for i, path in enumerate(site_packages_dirs()):
        argv += ["--ro-bind", str(env.site_packages if i == 0 else env.empty_dir), path]
    for etc in _ETC_FILES:
        if os.path.exists(etc):
            argv += ["--ro-bind", etc, etc]
    argv += ["--ro-bind", str(site_dir), SITE_DIR, "--bind", str(denials_dir), DENIALS_DIR]
    size = str(env.scratch_bytes)
    argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev", "--size", size, "--tmpfs", "/dev/shm"]
    argv += ["--size", size, "--tmpfs", "/tmp", "--dir", HOME_TARGET, "--symlink", HOME_TARGET, HOME_DIR]
    argv += ["--bind", str(task_dir), TASK_DIR]
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
        "PYTHONNOUSERSITE": "1",
        "SANDBOX_SITE_PACKAGES": ":".join(site_packages_dirs()),
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
        for sub in ("task", "denials", "empty"):
            os.mkdir(os.path.join(d, sub))
        install_site(Path(d) / "site")
        kwargs: dict[str, Any] = {}
        if uid is not None:
            for dirpath, _, _ in os.walk(d):
                os.chown(dirpath, uid, uid)
            kwargs = {"user": uid, "group": uid, "extra_groups": []}
        empty = Path(d) / "empty"
        mounts = SandboxMounts(site_packages=empty, empty_dir=empty, scratch_bytes=16 * 1024 * 1024)
        argv = bwrap_argv(Path(d) / "task", Path(d) / "denials", Path(d) / "site", mounts, exe) + [
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
