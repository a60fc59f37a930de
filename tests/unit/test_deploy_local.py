"""The test hosts' override (``ops/deploy/compose.local.yaml``) changes only what those hosts lack, and
the graders' seccomp profile (``ops/deploy/seccomp-sandbox.json``) is Docker's default plus the one
rule bubblewrap needs.

The override may set images (stand-ins), host networking with loopback names, listen addresses,
vLLM's CPU command line and telemetry off; it never touches a flywheel setting that changes what the
loop does, the graders' security options, or any address beyond loopback. Its vLLM command line is
``serving.vllm_command.server_command``'s for a CPU host, flag for flag (what the tests run).
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import yaml

from app.core.settings import ServingSettings
from serving.vllm_command import server_command

DEPLOY = Path(__file__).resolve().parents[2] / "ops" / "deploy"
BASE = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
LOCAL = yaml.safe_load((DEPLOY / "compose.local.yaml").read_text())["services"]
ALLOWED_KEYS = {
    "image",
    "entrypoint",
    "command",
    "network_mode",
    "extra_hosts",
    "environment",
    "healthcheck",
    "profiles",
}
ALLOWED_ENV = {
    "FLYWHEEL_TELEMETRY_EXPORTER",  # no collector image on these hosts
    "FLYWHEEL_METRICS_HOST",  # each process's own loopback address
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "VLLM_SERVER_DEV_MODE",
    "VLLM_BIND_HOST",
}


def test_every_service_is_on_host_networking_or_not_started():
    assert set(LOCAL) == set(BASE)
    for name, svc in LOCAL.items():
        assert set(svc) <= ALLOWED_KEYS, (name, set(svc) - ALLOWED_KEYS)
        assert svc.get("network_mode") == "host" or svc.get("profiles"), name


def test_it_changes_no_setting_of_the_loop():
    for name, svc in LOCAL.items():
        assert set(svc.get("environment") or {}) <= ALLOWED_ENV, (name, set(svc["environment"]) - ALLOWED_ENV)


def test_every_address_is_loopback_and_each_name_has_its_own():
    hosts = dict(entry.split(":") for entry in LOCAL["postgres"]["extra_hosts"])
    assert all(ipaddress.ip_address(a).is_loopback for a in hosts.values())
    for name, svc in LOCAL.items():
        if "extra_hosts" in svc:
            assert svc["extra_hosts"] == LOCAL["postgres"]["extra_hosts"], name
    listeners = {h: a for h, a in hosts.items() if h != "otel-collector"}
    assert len(set(listeners.values())) == len(listeners)  # a port can repeat, an address cannot
    for name, svc in LOCAL.items():
        for value in [*map(str, svc.get("command") or []), *map(str, (svc.get("environment") or {}).values())]:
            if value.count(".") == 3 and value.split(":")[0].replace(".", "").isdigit():
                assert ipaddress.ip_address(value.split(":")[0]).is_loopback, (name, value)


def test_the_vllm_servers_run_the_cpu_command_the_tests_run():
    tested = server_command(Path("/checkpoints/base"), 8000, "float32", ServingSettings(), cuda=False)
    tested = tested[tested.index("--model") :]
    host = tested.index("--host")
    del tested[host : host + 2]  # each server binds its own address (VLLM_BIND_HOST)
    for name in ("vllm", "vllm-eval", "vllm-canary"):
        svc = LOCAL[name]
        assert "--host" in svc["entrypoint"][2] and svc["environment"]["VLLM_BIND_HOST"].startswith("127.")
        args = [a.replace("${FLYWHEEL_VLLM_DTYPE:-float32}", "float32") for a in svc["command"]]
        assert args == tested, name


def test_the_graders_keep_their_security_options():
    for name in ("worker", "eval-worker"):
        assert "security_opt" not in LOCAL[name] and BASE[name]["security_opt"]


def test_the_seccomp_profile_is_dockers_default_plus_the_namespace_rule():
    profile = json.loads((DEPLOY / "seccomp-sandbox.json").read_text())
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    ours = [r for r in profile["syscalls"] if "flywheel" in r.get("comment", "")]
    assert len(ours) == 1
    rule = ours[0]
    assert rule["action"] == "SCMP_ACT_ALLOW" and "includes" not in rule and "args" not in rule
    assert set(rule["names"]) == {"clone", "unshare", "setns", "mount", "umount2", "pivot_root"}
    # what stays refused: allowed only under capabilities the container does not have, or never
    unconditional = {
        n
        for r in profile["syscalls"]
        if r["action"] == "SCMP_ACT_ALLOW" and not r.get("includes", {}).get("caps")
        for n in r["names"]
    }
    for name in ("kexec_load", "init_module", "finit_module", "delete_module", "open_by_handle_at", "reboot",
                 "swapon", "bpf", "perf_event_open", "iopl", "ioperm", "mount_setattr", "fsopen", "keyctl"):  # fmt: skip
        assert name not in unconditional, name
