"""The Kubernetes workloads (ops/deploy/k8s) are hardened: each Deployment's containers have a
readiness and a liveness probe on what the process serves (its /healthz, vLLM's /health, /metrics on
FLYWHEEL_METRICS_PORT, beat's schedule file; the graders' readiness `flywheel eval sandbox-check`),
every container has CPU and memory requests and limits (GPUs where it has them, equal on both
sides) and runs as the image's uid 10001 without root, capability, privilege escalation or a
writable root filesystem, with somewhere to write what its process writes; the graders (worker,
eval-worker) get exactly what the sandbox needs: a user namespace of their own, an unmasked /proc
and the Localhost seccomp profile. Each check is also shown a broken copy, so a pass means it
checked. The NetworkPolicies are tests/unit/test_k8s_network.py, the node's seccomp profile
tests/unit/test_k8s_seccomp.py."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import typer.main
import yaml

from ops.cli import app
from ops.processes import METRICS_SERVICES
from tests.unit.test_deploy import _resolve

DEPLOY = Path(__file__).resolve().parents[2] / "ops" / "deploy"
K8S = sorted((DEPLOY / "k8s").glob("*.yaml"))
UID = 10001  # ops/deploy/Dockerfile: useradd --uid 10001
GRADERS = {"worker", "eval-worker"}
GRADER_SECCOMP = {"type": "Localhost", "localhostProfile": "profiles/flywheel-sandbox.json"}
SANDBOX_CHECK = ["flywheel", "eval", "sandbox-check"]
# `flywheel <command>` -> its service in ops.processes (the processes that serve /metrics)
SERVICE_OF = {"consume": "consumer", "relay": "relay", "watch": "watcher", "worker": "worker", "front": "front"}


@functools.cache
def _parsed() -> tuple[dict, ...]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return tuple(d for path in K8S for d in yaml.load_all(path.read_text(), Loader=loader) if d)


def _docs() -> list[dict]:
    """The manifests' documents, a fresh copy each call (the tests mutate them)."""
    return copy.deepcopy(list(_parsed()))


def _find(docs: list[dict], kind: str, name: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def _settings(docs: list[dict]) -> dict[str, str]:
    return _find(docs, "ConfigMap", "flywheel-settings")["data"]


def _pod(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def _effective(pod: dict, container: dict) -> dict:
    """The container's security context as the kubelet applies it: the pod's fields under its own."""
    pod_sc = {
        k: v for k, v in (pod.get("securityContext") or {}).items() if k not in ("fsGroup", "fsGroupChangePolicy")
    }
    return {**pod_sc, **(container.get("securityContext") or {})}


def _ports(container: dict) -> dict[str | int, int]:
    out: dict[str | int, int] = {}
    for p in container.get("ports", []):
        out[p["containerPort"]] = p["containerPort"]
        if "name" in p:
            out[p["name"]] = p["containerPort"]
    return out


def _probe_problems(name: str, c: dict, settings: dict[str, str]) -> list[str]:
    problems = []
    for kind in ("readinessProbe", "livenessProbe"):
        probe = c.get(kind)
        if not probe:
            problems.append(f"{name}/{c['name']}: no {kind}")
            continue
        if "httpGet" in probe and probe["httpGet"]["port"] not in _ports(c):
            problems.append(f"{name}/{c['name']}: {kind} on port {probe['httpGet']['port']}, which it does not declare")
    if problems or c["image"] != "flywheel:latest":
        return problems
    command, probes = c["args"][0], (c["readinessProbe"], c["livenessProbe"])
    http = [p["httpGet"] for p in probes if "httpGet" in p]
    if command in ("api", "front"):  # their own /healthz on the port they serve
        port = int(c["args"][c["args"].index("--port") + 1])
        if len(http) != 2 or any(h["path"] != "/healthz" or _ports(c)[h["port"]] != port for h in http):
            problems.append(f"{name}: probes are not its /healthz on {port}")
    elif command in SERVICE_OF:  # /metrics on FLYWHEEL_METRICS_PORT
        assert SERVICE_OF[command] in METRICS_SERVICES, command
        live = c["livenessProbe"].get("httpGet") or {}
        if live.get("path") != "/metrics" or _ports(c).get(live.get("port")) != int(settings["FLYWHEEL_METRICS_PORT"]):
            problems.append(f"{name}: liveness is not /metrics on FLYWHEEL_METRICS_PORT")
    elif command == "beat":
        if not all("exec" in p and "$FLYWHEEL_HOME" in " ".join(p["exec"]["command"]) for p in probes):
            problems.append(f"{name}: beat's probes do not read its schedule in $FLYWHEEL_HOME")
    if name in GRADERS and c["readinessProbe"].get("exec", {}).get("command") != SANDBOX_CHECK:
        problems.append(f"{name}: readiness is not `flywheel eval sandbox-check`")
    return problems


def _container_problems(kind: str, name: str, pod: dict, c: dict, settings: dict[str, str]) -> list[str]:
    where, problems = f"{name}/{c['name']}", []
    res = c.get("resources") or {}
    for side in ("requests", "limits"):
        missing = {"cpu", "memory"} - set(res.get(side) or {})
        if missing:
            problems.append(f"{where}: no {side} for {sorted(missing)}")
    gpus = {s: (res.get(s) or {}).get("nvidia.com/gpu") for s in ("requests", "limits")}
    if gpus["limits"] != gpus["requests"]:
        problems.append(f"{where}: GPU requests {gpus['requests']} and limits {gpus['limits']} differ")
    sc = _effective(pod, c)
    wanted = {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "allowPrivilegeEscalation": False}
    wanted["readOnlyRootFilesystem"] = True
    for key, value in wanted.items():
        if sc.get(key) != value:
            problems.append(f"{where}: securityContext.{key} is {sc.get(key)!r}, not {value!r}")
    if sc.get("privileged"):
        problems.append(f"{where}: privileged")
    caps = sc.get("capabilities") or {}
    if caps.get("drop") != ["ALL"] or caps.get("add"):
        problems.append(f"{where}: capabilities {caps} (drop ALL, add none)")
    grader = kind == "Deployment" and name in GRADERS and c in pod["containers"]
    seccomp = sc.get("seccompProfile")
    if seccomp != (GRADER_SECCOMP if grader else {"type": "RuntimeDefault"}):
        problems.append(f"{where}: seccompProfile {seccomp}")
    if sc.get("procMount", "Default") != ("Unmasked" if grader else "Default"):
        problems.append(f"{where}: procMount {sc.get('procMount')}")
    mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
    writes: tuple[str, ...] = ()
    if c["image"] == "flywheel:latest" and c.get("command", ["torchrun"])[0] == "torchrun":
        writes = ("/tmp", "/home/flywheel", settings["FLYWHEEL_HOME"])  # what flywheel's processes write
    elif c["image"].startswith("vllm/"):
        home = next((e.get("value") for e in c.get("env", []) if e["name"] == "HOME"), None)
        if home is None:  # the image has no passwd entry, so no home, for uid 10001
            problems.append(f"{where}: no HOME for vLLM's caches")
        writes = ("/tmp", home or "~", "/dev/shm")  # vllm/envs.py's caches, its IPC sockets, shared memory
    problems += [f"{where}: nothing writable at {path} under a read-only root" for path in writes if path not in mounts]
    if grader and "/dev/shm" not in mounts:
        problems.append(f"{where}: no /dev/shm for the sandbox's scratch folders")
    if kind == "Deployment" and c in pod["containers"]:
        problems += _probe_problems(name, c, settings)
    return problems


def hardening_problems(docs: list[dict]) -> list[str]:
    """Every way the workloads in ``docs`` miss the hardening above, one sentence each ([] if none)."""
    settings, problems = _settings(docs), []
    if settings.get("FLYWHEEL_METRICS_HOST") != "0.0.0.0":  # else the kubelet cannot reach /metrics
        problems.append("flywheel-settings: FLYWHEEL_METRICS_HOST is not 0.0.0.0")
    for doc in (d for d in docs if d["kind"] in ("Deployment", "Job")):
        name, pod = doc["metadata"]["name"], _pod(doc)
        if (pod.get("hostUsers") is False) != (doc["kind"] == "Deployment" and name in GRADERS):
            problems.append(f"{name}: hostUsers {pod.get('hostUsers')}")
        for c in pod.get("initContainers", []) + pod["containers"]:
            problems += _container_problems(doc["kind"], name, pod, c, settings)
    return problems


def test_every_workload_is_hardened():
    docs = _docs()
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"} >= GRADERS | {"api", "front", "vllm"}
    assert hardening_problems(docs) == []
    # the Localhost profile the graders name is the file the RUNBOOK installs on each node
    assert (DEPLOY / "k8s" / Path(GRADER_SECCOMP["localhostProfile"]).name).is_file()


def test_the_probe_commands_exist_in_the_cli():
    group = typer.main.get_command(app)
    _resolve(group, SANDBOX_CHECK[1:])


def _mutate(docs: list[dict], kind: str, name: str, change) -> list[dict]:
    out = copy.deepcopy(docs)
    change(_find(out, kind, name))
    return out


def _ctr(doc: dict, i: int = 0) -> dict:
    return _pod(doc)["containers"][i]


BROKEN = {
    "no liveness": ("Deployment", "consumer", lambda d: _ctr(d).pop("livenessProbe")),
    "no readiness": ("Deployment", "vllm-eval", lambda d: _ctr(d).pop("readinessProbe")),
    "grader ready without the check": (
        "Deployment",
        "eval-worker",
        lambda d: _ctr(d).update(readinessProbe=_ctr(d)["livenessProbe"]),
    ),
    "probe on an undeclared port": ("Deployment", "relay", lambda d: _ctr(d).pop("ports")),
    "api probed elsewhere": ("Deployment", "api", lambda d: _ctr(d)["livenessProbe"]["httpGet"].update(path="/")),
    "no limits": ("Deployment", "front", lambda d: _ctr(d)["resources"].pop("limits")),
    "no memory request": ("Job", "migrate", lambda d: _ctr(d)["resources"]["requests"].pop("memory")),
    "init container unsized": ("Deployment", "vllm", lambda d: _pod(d)["initContainers"][0].pop("resources")),
    "GPU requests differ": ("Deployment", "worker", lambda d: _ctr(d)["resources"]["requests"].pop("nvidia.com/gpu")),
    "privileged": ("Deployment", "api", lambda d: _ctr(d)["securityContext"].update(privileged=True)),
    "root": ("Deployment", "beat", lambda d: _pod(d)["securityContext"].update(runAsUser=0)),
    "escalation": ("Job", "trainer", lambda d: _ctr(d)["securityContext"].update(allowPrivilegeEscalation=True)),
    "a capability": (
        "Deployment",
        "vllm-canary",
        lambda d: _ctr(d)["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
    ),
    "writable root": (
        "Deployment",
        "watcher",
        lambda d: _ctr(d)["securityContext"].update(readOnlyRootFilesystem=False),
    ),
    "no /tmp": ("Deployment", "consumer", lambda d: _ctr(d)["volumeMounts"].pop(2)),
    "grader in the host's users": ("Deployment", "eval-worker", lambda d: _pod(d).pop("hostUsers")),
    "grader under the default profile": (
        "Deployment",
        "worker",
        lambda d: _pod(d)["securityContext"].update(seccompProfile={"type": "RuntimeDefault"}),
    ),
    "grader with a masked /proc": ("Deployment", "worker", lambda d: _ctr(d)["securityContext"].pop("procMount")),
    "unmasked /proc elsewhere": (
        "Deployment",
        "front",
        lambda d: _ctr(d)["securityContext"].update(procMount="Unmasked"),
    ),
    "unconfined": (
        "Deployment",
        "otel-collector",
        lambda d: _pod(d)["securityContext"].update(seccompProfile={"type": "Unconfined"}),
    ),
    "grader without /dev/shm": ("Deployment", "eval-worker", lambda d: _ctr(d)["volumeMounts"].pop()),
    "vLLM without its HOME": ("Deployment", "vllm", lambda d: _ctr(d)["volumeMounts"].pop(3)),
    "metrics on loopback": (
        "ConfigMap",
        "flywheel-settings",
        lambda d: d["data"].update(FLYWHEEL_METRICS_HOST="127.0.0.1"),
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_manifest_is_caught(case):
    kind, name, change = BROKEN[case]
    problems = hardening_problems(_mutate(_docs(), kind, name, change))
    assert problems and all(name in p for p in problems), (case, problems)
