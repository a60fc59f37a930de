"""The graders' seccomp profile as each node gets it (ops/deploy/k8s/flywheel-sandbox.json, the
Kubernetes pods' ``Localhost`` ``profiles/flywheel-sandbox.json``) is the shipped Docker profile
(ops/deploy/seccomp-sandbox.json) resolved into the OCI runtime-spec form containerd reads: the
rules Docker hands runc for a container without capabilities, nothing gated on a capability, and
bubblewrap's namespace syscalls allowed."""

from __future__ import annotations

import json
from pathlib import Path

DEPLOY = Path(__file__).resolve().parents[2] / "ops" / "deploy"
NODE_PROFILE = DEPLOY / "k8s" / "flywheel-sandbox.json"  # what each node gets (RUNBOOK, Kubernetes)

NODE_ARCHES = {"amd64", "x86", "x32", "arm64", "arm"}  # the nodes' architectures and their 32-bit ones


def _keeps(rule: dict) -> bool:
    inc, exc = rule.get("includes") or {}, rule.get("excludes") or {}
    if inc.get("caps"):
        return False  # only for a container holding the capability: the graders hold none
    if "arches" in inc and not NODE_ARCHES & set(inc["arches"]):
        return False
    return not ("arches" in exc and NODE_ARCHES <= set(exc["arches"]))


def node_profile(docker_profile: dict) -> dict:
    """Docker's profile format resolved into the OCI runtime-spec one that containerd reads for a
    Localhost profile (it ignores Docker's ``archMap``, ``includes`` and ``excludes``, which would
    then apply every rule to every container): the rules Docker would hand runc for a container
    without capabilities on amd64 or arm64, in order. No ``architectures``: the node's own only."""
    keep = ("names", "action", "errnoRet", "args")
    return {
        "defaultAction": docker_profile["defaultAction"],
        "defaultErrnoRet": docker_profile["defaultErrnoRet"],
        "syscalls": [{k: r[k] for k in keep if k in r} for r in docker_profile["syscalls"] if _keeps(r)],
    }


def render_node_profile() -> str:
    """``ops/deploy/k8s/flywheel-sandbox.json`` as it must read (regenerate with
    ``python -c 'from tests.unit.test_k8s_seccomp import render_node_profile as r; print(r(), end="")'``)."""
    return json.dumps(node_profile(json.loads((DEPLOY / "seccomp-sandbox.json").read_text())), indent=2) + "\n"


def test_the_node_profile_is_the_shipped_profile_resolved_for_the_graders():
    assert NODE_PROFILE.read_text() == render_node_profile(), "regenerate it: render_node_profile's docstring"
    profile = json.loads(NODE_PROFILE.read_text())
    assert not {"archMap", "architectures"} & set(profile)
    assert all(set(r) <= {"names", "action", "errnoRet", "args"} for r in profile["syscalls"])
    unconditional = {
        n for r in profile["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" and not r.get("args") for n in r["names"]
    }
    assert {"clone", "unshare", "setns", "mount", "umount2", "pivot_root"} <= unconditional  # bubblewrap's
    assert not {"bpf", "init_module", "perf_event_open", "reboot"} & unconditional  # capability-gated in Docker's
    assert {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38} in profile["syscalls"]  # glibc falls back


def test_a_capability_rule_left_in_the_node_profile_is_caught():
    docker = json.loads((DEPLOY / "seccomp-sandbox.json").read_text())
    gated = next(r for r in docker["syscalls"] if "CAP_SYS_ADMIN" in (r.get("includes") or {}).get("caps", []))
    assert not any(r["names"] == gated["names"] for r in node_profile(docker)["syscalls"])
    gated["includes"] = {}
    assert any(r["names"] == gated["names"] for r in node_profile(docker)["syscalls"])
