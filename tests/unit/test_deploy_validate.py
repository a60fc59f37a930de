"""The deploy files parse and validate offline, and name only what they define: the compose file
against the compose specification (``docker compose config -q`` where the compose plugin is
installed, else the compose-spec JSON schema that check-jsonschema vendors), the Kubernetes
manifests against Kubernetes' OpenAPI schemas (kubernetes-validate, ``--strict``). Each validator is
also shown a broken file, so a pass means it validated. A test whose tool is missing is skipped
with the reason (both come with ``pip install -e ".[dev]"``, the README's install)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import pytest
import typer.main
import yaml

from ops.cli import app
from tests.unit.test_deploy import _resolve
from trainer.config import TrainerConfig, _merge

DEPLOY = Path(__file__).resolve().parents[2] / "ops" / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
K8S = sorted((DEPLOY / "k8s").glob("*.yaml"))
ENV = {
    "POSTGRES_PASSWORD": "x",
    "FLYWHEEL_SERVING_API_KEY": "i",
    "FLYWHEEL_SERVING_ADMIN_KEY": "a",
    "FLYWHEEL_SERVING_EVAL_ADMIN_KEY": "e",
    "PATH": "/usr/local/bin:/usr/bin:/bin",
}


def _docker_compose() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return None


def _compose_validator():
    """A function of a compose file's path to the command that validates it."""
    if (compose := _docker_compose()) is not None:
        return lambda path: [*compose, "-p", "check", "-f", str(path), "config", "-q"]
    if (tool := shutil.which("check-jsonschema")) is not None:
        return lambda path: [tool, "--builtin-schema", "vendor.compose-spec", str(path)]
    pytest.skip("no compose validator: neither `docker compose` nor check-jsonschema (pip install -e '.[dev]')")


def _kubernetes_validate() -> str:
    tool = shutil.which("kubernetes-validate")
    if tool is None:
        pytest.skip("kubernetes-validate is not installed (pip install -e '.[dev]')")
    return tool


def _run(args: list[str], path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*args, str(path)], capture_output=True, text=True, env=ENV, timeout=120)


def _validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(_compose_validator()(path), capture_output=True, text=True, env=ENV, timeout=120)


def test_compose_file_validates_and_a_broken_one_does_not(tmp_path):
    ok = _validate(COMPOSE)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = yaml.safe_load(COMPOSE.read_text())
    broken["services"]["front"]["depends_on"] = "vllm"  # a string where a list or mapping goes
    (tmp_path / "seccomp-sandbox.json").write_text((DEPLOY / "seccomp-sandbox.json").read_text())
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(broken))
    assert _validate(tmp_path / "compose.yaml").returncode != 0


@pytest.mark.parametrize("override", ["compose.local.yaml", "compose.gpu.yaml"])
def test_each_override_resolves_with_the_compose_file(override, tmp_path):
    """``docker compose config`` of the compose file with the override, where Compose v2 is installed
    (as the deploy is started); else the override alone against the compose-spec schema."""
    if (compose := _docker_compose()) is not None:
        args = [*compose, "-p", "check", "-f", str(COMPOSE), "-f", str(DEPLOY / override), "config", "-q"]
        out = subprocess.run(args, capture_output=True, text=True, env=ENV, cwd=DEPLOY, timeout=120)
    else:
        out = _validate(DEPLOY / override)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_name_the_compose_file_uses_is_a_service_it_defines():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, svc in services.items():
        for dep in svc.get("depends_on") or {}:
            assert dep in services, f"{name} depends on undefined {dep}"
        for key, value in (svc.get("environment") or {}).items():
            if isinstance(value, str) and re.match(r"^[a-z]+://", value) and key != "FLYWHEEL_DATABASE_URL":
                host = urlparse(value).hostname
                assert host in services, f"{name}: {key} points at undefined {host}"
    for needed in ("otel-collector", "vllm-canary", "front"):
        assert needed in services, needed
    assert services["front"]["command"][services["front"]["command"].index("--port") + 1] == "8100"
    # the collector's config is a file beside the compose file, mounted read-only
    assert any(v.startswith("./otel-collector.yaml:") for v in services["otel-collector"]["volumes"])


def test_kubernetes_manifests_validate_and_a_broken_one_does_not(tmp_path):
    tool = _kubernetes_validate()
    for path in K8S:
        ok = _run([tool, "--strict", "--quiet"], path)
        assert ok.returncode == 0, f"{path.name}: {ok.stdout}{ok.stderr}"
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "app.yaml").read_text()))
    docs[0]["spec"]["replicas"] = "two"  # not an integer
    (tmp_path / "app.yaml").write_text(yaml.safe_dump_all(docs))
    assert _run([tool, "--strict", "--quiet"], tmp_path / "app.yaml").returncode != 0


def _k8s_docs() -> list[dict]:
    return [d for path in K8S for d in yaml.safe_load_all(path.read_text()) if d]


def _containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", [])


def test_kubernetes_runs_the_compose_services_with_the_same_settings():
    docs = _k8s_docs()
    compose = yaml.safe_load(COMPOSE.read_text())["services"]
    settings = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "flywheel-settings")
    env = compose["api"]["environment"]
    # Values compose requires from the deployer's environment (${VAR:?...}) are Secrets in Kubernetes.
    secret = {k for k, v in env.items() if k == "FLYWHEEL_DATABASE_URL" or str(v).startswith("${")}
    assert settings["data"] == {k: v for k, v in env.items() if k not in secret}
    for c in (c for d in docs for c in _containers(d) if c["image"] == "flywheel:latest"):
        from_secrets = {e["name"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
        assert secret <= from_secrets, (c["name"], sorted(secret - from_secrets))
    workloads = {d["metadata"]["name"] for d in docs if d["kind"] in ("Deployment", "Job")}
    wanted = {n for n in compose if n not in ("postgres", "kafka", "redis")} | {"trainer"}
    assert wanted <= workloads, sorted(wanted - workloads)
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    for key, value in settings["data"].items():  # every URL in the settings is a Service (or outside)
        if value.startswith("http://"):
            assert urlparse(value).hostname in services, key
    vllm = {d["metadata"]["name"]: _containers(d)[0]["args"] for d in docs if d["kind"] == "Deployment"}
    for name in ("vllm", "vllm-canary", "vllm-eval"):
        assert vllm[name] == compose[name]["command"], name


# Who holds which serving key (serving/vllm_auth.py): every flywheel service the inference key; the
# production and canary servers' admin key only the watcher; the eval server's only the workers.
ADMIN_KEY_HOLDERS = {
    "FLYWHEEL_SERVING_ADMIN_KEY": {"watcher"},
    "FLYWHEEL_SERVING_EVAL_ADMIN_KEY": {"worker", "eval-worker"},
}
SERVER_ADMIN_KEY = {  # the server -> the setting (compose) / Secret key (Kubernetes) of its admin key
    "vllm": ("FLYWHEEL_SERVING_ADMIN_KEY", "admin-key"),
    "vllm-canary": ("FLYWHEEL_SERVING_ADMIN_KEY", "admin-key"),
    "vllm-eval": ("FLYWHEEL_SERVING_EVAL_ADMIN_KEY", "eval-admin-key"),
}


def test_only_the_watcher_and_the_eval_runner_hold_an_admin_key():
    compose = yaml.safe_load(COMPOSE.read_text())["services"]
    for setting, holders in ADMIN_KEY_HOLDERS.items():
        assert {n for n, svc in compose.items() if setting in (svc.get("environment") or {})} == holders, setting
    for name, (setting, _) in SERVER_ADMIN_KEY.items():
        env = compose[name]["environment"]
        assert env["FLYWHEEL_VLLM_ADMIN_KEY"].startswith(f"${{{setting}:?"), name
        assert env["VLLM_API_KEY"].startswith("${FLYWHEEL_SERVING_API_KEY:?"), name
    deployments = {d["metadata"]["name"]: d for d in _k8s_docs() if d["kind"] in ("Deployment", "Job")}
    secret_keys = {
        name: {
            e["name"]: e["valueFrom"]["secretKeyRef"]["key"]
            for c in _containers(d)
            for e in c.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})
        }
        for name, d in deployments.items()
    }
    for setting, holders in ADMIN_KEY_HOLDERS.items():
        assert {n for n, env in secret_keys.items() if setting in env} == holders, setting
    for name, (_, key) in SERVER_ADMIN_KEY.items():
        assert secret_keys[name]["FLYWHEEL_VLLM_ADMIN_KEY"] == key and secret_keys[name]["VLLM_API_KEY"] == "api-key"


def test_every_kubernetes_flywheel_command_exists_in_the_cli():
    group = typer.main.get_command(app)
    commands = [c for d in _k8s_docs() for c in _containers(d) if c["image"] == "flywheel:latest"]
    assert commands
    for c in commands:
        if c.get("command", [None])[0] == "torchrun":  # torchrun ... -m ops.cli ARGS
            assert c["command"][-2:] == ["-m", "ops.cli"]
        if c["args"][0] == "front" and "front" not in group.list_commands(None):
            continue  # `flywheel front` is added with the serving front (test_deploy skips it the same way)
        _resolve(group, c["args"])


def test_the_trainer_job_config_is_a_valid_fsdp_config_and_the_collector_config_is_one_copy():
    docs = _k8s_docs()
    trainer = next(d for d in docs if d["metadata"]["name"] == "flywheel-trainer")

    config = TrainerConfig.model_validate(_merge({}, tomllib.loads(trainer["data"]["trainer.toml"])))
    assert config.parallel.mode == "fsdp"
    collector = next(d for d in docs if d["metadata"]["name"] == "flywheel-otel-collector")
    assert collector["data"]["config.yaml"] == (DEPLOY / "otel-collector.yaml").read_text()


def test_the_image_installs_as_the_readme_does():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "bash ops/install.sh" in dockerfile
    assert "bash ops/install.sh" in (DEPLOY.parents[1] / "README.md").read_text()
    # the CPU trainer's memory stays near its floor only with jemalloc (docs/trainer.md)
    assert "libjemalloc2" in dockerfile and "ENV LD_PRELOAD=/usr/local/lib/libjemalloc.so.2" in dockerfile
