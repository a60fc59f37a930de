"""``flywheel stack up|status|down`` as a user runs it: embedded Postgres and the tansu broker on
free ports, healthy, idempotent, and nothing left running after ``down``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from app.core.pids import pid_alive

pytestmark = pytest.mark.integration


def flywheel(home, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run the CLI in a fresh interpreter with only the embedded stack configured."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(FLYWHEEL_HOME=str(home), FLYWHEEL_TELEMETRY_EXPORTER="none", COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-c", "from ops.cli import main; main()", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def home():
    # Not under pytest's basetemp: a concurrent pytest run resets /tmp/pytest-of-<user> to 0700,
    # which locks out the unprivileged user embedded Postgres runs as when we are root.
    import shutil
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix="flywheel-stack-test-"))
    yield path / "home"
    shutil.rmtree(path, ignore_errors=True)


def test_stack_up_status_down(home):
    up = flywheel(home, "stack", "up", "--partitions", "2")
    try:
        assert up.returncode == 0, up.stdout + up.stderr[-3000:]
        state = json.loads((home / "stack.json").read_text())
        pg_pid, broker_pid = state["postgres_pid"], state["broker_pid"]
        assert pid_alive(pg_pid) and pid_alive(broker_pid)
        env_file = (home / "stack.env").read_text()
        assert "FLYWHEEL_DATABASE_URL=postgresql://" in env_file and "FLYWHEEL_KAFKA_BOOTSTRAP=127.0.0.1:" in env_file

        status = flywheel(home, "stack", "status")
        assert status.returncode == 0, status.stdout + status.stderr[-2000:]
        rows = [line for line in status.stdout.splitlines() if "postgres" in line or "kafka" in line]
        assert len(rows) == 2 and all("yes" in row for row in rows), status.stdout

        # Topics exist with the requested partitions, and the schema is migrated.
        from kafka import KafkaConsumer

        consumer = KafkaConsumer(bootstrap_servers=state["kafka_bootstrap"])
        try:

            def partitions(topic: str) -> set[int]:
                for _ in range(50):  # empty when a metadata fetch timed out on a busy machine
                    if found := consumer.partitions_for_topic(topic):
                        return found
                    time.sleep(0.2)
                return set()

            assert partitions("editor.interactions") == {0, 1}
            assert partitions("editor.interactions.dlq") == {0}
            assert partitions("flywheel.lifecycle") == {0}
        finally:
            consumer.close()
        import psycopg

        with psycopg.connect(state["database_url"]) as conn:
            assert conn.execute("SELECT version_num FROM alembic_version").fetchone()

        again = flywheel(home, "stack", "up")  # idempotent: reuses the running services
        assert again.returncode == 0, again.stderr[-2000:]
        state2 = json.loads((home / "stack.json").read_text())
        assert (state2["postgres_pid"], state2["broker_pid"]) == (pg_pid, broker_pid)
    finally:
        down = flywheel(home, "stack", "down")
    assert down.returncode == 0, down.stderr[-2000:]
    assert "postgres" in down.stdout and "broker" in down.stdout
    assert not pid_alive(pg_pid) and not pid_alive(broker_pid)
    assert not (home / "stack.json").exists() and not (home / "stack.env").exists()

    status = flywheel(home, "stack", "status")
    assert status.returncode == 1, "status reports a stopped stack as unhealthy"


def test_a_command_whose_database_does_not_answer_says_so_in_one_error(tmp_path):
    """A one-shot command (here ``flywheel relabel``) run against a Postgres that is not up: the
    reason and what to check on stderr, exit code 3 (infrastructure unreachable), no traceback."""
    from app.core.net import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(
        FLYWHEEL_HOME=str(tmp_path),
        FLYWHEEL_TELEMETRY_EXPORTER="none",
        FLYWHEEL_DATABASE_URL=f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/flywheel",
    )
    out = subprocess.run(
        [sys.executable, "-c", "from ops.cli import main; main()", "relabel", "--spec", "implicit@1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 3, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith("error: the database does not answer: connection failed")
    assert "Traceback" not in out.stderr
    assert "FLYWHEEL_DATABASE_URL" in lines[1] and len(lines) == 2


def test_a_command_on_a_database_without_the_schema_says_to_migrate_it(empty_database, tmp_path):
    """A command run against a database never migrated to this release (a new server, a deploy that
    skipped ``flywheel db upgrade``): what is missing and the command that fixes it on stderr,
    exit code 3 (infrastructure unreachable), no traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(FLYWHEEL_HOME=str(tmp_path), FLYWHEEL_TELEMETRY_EXPORTER="none", FLYWHEEL_DATABASE_URL=empty_database)
    out = subprocess.run(
        [sys.executable, "-c", "from ops.cli import main; main()", "relabel", "--spec", "implicit@1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 3, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith("error: the database lacks this release's schema: relation"), lines
    assert lines[1].strip() == "- migrate it: flywheel db upgrade" and len(lines) == 2
