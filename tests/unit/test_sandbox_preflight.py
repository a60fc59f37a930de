"""A process that cannot build the graders' sandbox says so when it starts, not at its first gate:
``flywheel worker`` refuses to start (naming what bubblewrap said and what to grant) and never
reaches Celery, and ``flywheel eval sandbox-check`` (a container's readiness probe) answers 1. The
environment without user namespaces is a stand-in ``bwrap`` that answers as bubblewrap does under
Docker's default seccomp profile (measured: ENVIRONMENT.md, "Docker")."""

from __future__ import annotations

import shutil
import stat
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ops.cli import app

REFUSAL = (
    "bwrap: No permissions to create new namespace, likely because the kernel does not allow "
    "non-privileged user namespaces."
)


@pytest.fixture
def no_user_namespaces(monkeypatch):
    # in a folder the probe's unprivileged uid can enter (pytest's own temp root is owner-only)
    with tempfile.TemporaryDirectory(prefix="flywheel-fake-bwrap-") as d:
        Path(d).chmod(0o755)
        fake = Path(d) / "bwrap"
        fake.write_text(f"#!/bin/sh\necho '{REFUSAL}' >&2\nexit 1\n")
        fake.chmod(0o755 | stat.S_IEXEC)
        monkeypatch.setenv("FLYWHEEL_SANDBOX_BWRAP", str(fake))
        monkeypatch.delenv("FLYWHEEL_SANDBOX_ALLOW_UNISOLATED", raising=False)
        yield fake


def test_a_worker_that_cannot_build_the_sandbox_refuses_to_start(no_user_namespaces, monkeypatch):
    from app.worker.celery_app import celery_app

    started = []
    monkeypatch.setattr(celery_app, "worker_main", lambda argv: started.append(argv))
    result = CliRunner().invoke(app, ["worker"])
    assert result.exit_code != 0 and started == []
    message = str(result.exception)
    assert "cannot grade" in message and "No permissions to create new namespace" in message
    assert "seccomp-sandbox.json" in message and "hostUsers: false" in message

    check = CliRunner().invoke(app, ["eval", "sandbox-check", "--json"])
    assert check.exit_code == 1 and '"ready": false' in check.output


def test_the_operator_may_choose_unisolated_grading_and_is_told(no_user_namespaces, monkeypatch):
    from app.worker.celery_app import celery_app

    monkeypatch.setenv("FLYWHEEL_SANDBOX_ALLOW_UNISOLATED", "true")
    started = []
    monkeypatch.setattr(celery_app, "worker_main", lambda argv: started.append(argv))
    assert CliRunner().invoke(app, ["worker"]).exit_code == 0 and len(started) == 1
    check = CliRunner().invoke(app, ["eval", "sandbox-check"])
    assert check.exit_code == 0 and "UNISOLATED" in check.output


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_where_bubblewrap_works_the_check_passes(monkeypatch):
    monkeypatch.delenv("FLYWHEEL_SANDBOX_BWRAP", raising=False)
    check = CliRunner().invoke(app, ["eval", "sandbox-check"])
    assert check.exit_code == 0, check.output
    assert "cgroup" in check.output or "rlimits" in check.output  # what bounds each run is said


def test_the_simulator_refuses_to_start_where_its_developer_cannot_grade(no_user_namespaces):
    # each simulated session ends in a graded run: without the sandbox none could end, so nothing is sent
    result = CliRunner().invoke(app, ["simulate", "--sessions", "1", "--front-url", "http://127.0.0.1:9"])
    assert result.exit_code == 3, result.output
    assert "grades each session in the sandbox" in result.output and "No permissions" in result.output
