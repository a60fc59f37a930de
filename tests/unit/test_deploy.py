"""The production compose file parses, and every flywheel service runs a command the CLI has."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
import typer.main
import yaml

from app.cli import app

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
    options = {opt for p in cmd.params if getattr(p, "param_type_name", "") == "option"
               for opt in list(p.opts) + list(getattr(p, "secondary_opts", []))}
    for token in rest:
        if token.startswith("-"):
            assert token.split("=")[0] in options, f"`flywheel {' '.join(args)}`: unknown option {token}"
    return cmd


def test_compose_has_the_production_services():
    services = _compose()["services"]
    for required in ("kafka", "postgres", "redis", "vllm", "migrate", "consumer", "worker", "beat", "api",
                     "relay", "watcher"):
        assert required in services, required
    kafka_env = services["kafka"]["environment"]
    assert "controller" in kafka_env["KAFKA_PROCESS_ROLES"]  # KRaft, no ZooKeeper
    assert "zookeeper" not in services


@pytest.mark.parametrize("name", sorted(_flywheel_services(yaml.safe_load(COMPOSE.read_text()))))
def test_every_flywheel_service_command_exists_in_the_cli(name):
    svc = _flywheel_services(_compose())[name]
    group = typer.main.get_command(app)
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
