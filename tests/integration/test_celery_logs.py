"""The Celery worker and beat log like every flywheel service: under ``FLYWHEEL_LOG_FORMAT=json``
each line of their log stream (stderr) is one JSON object naming its service, and a task's lines
carry the trace id of the span the task ran in (OpenTelemetry's Celery instrumentation). Celery's
banner is off; its one shutdown notice goes to stdout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _start(command: str, db: str, home: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(
        FLYWHEEL_DATABASE_URL=db,
        FLYWHEEL_HOME=str(home),
        FLYWHEEL_TELEMETRY_EXPORTER="none",
        FLYWHEEL_LOG_FORMAT="json",
    )
    out, log = open(home / f"{command}.out", "wb"), open(home / f"{command}.log", "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "ops.cli", command], env=env, cwd=REPO, stdout=out, stderr=log, start_new_session=True
    )


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _lines(path: Path) -> list[dict]:
    """Every non-empty line of a service's output, parsed (a plain-text line fails the test)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_worker_and_beat_log_json_lines_and_a_task_carries_its_trace_id(db, tmp_path):
    from app.worker.celery_app import create_celery_app

    worker, beat = _start("worker", db, tmp_path), _start("beat", db, tmp_path)
    try:
        result = create_celery_app().send_task("flywheel.ops.ping", args=["logs"])
        assert result.get(timeout=120)["pong"] is True
        deadline = time.monotonic() + 60
        while not any("Starting" in line.get("message", "") for line in _lines(tmp_path / "beat.log")):
            assert time.monotonic() < deadline and beat.poll() is None, (tmp_path / "beat.log").read_text()[-3000:]
            time.sleep(0.5)
    finally:
        _stop(worker)
        _stop(beat)
    worker_lines, beat_lines = _lines(tmp_path / "worker.log"), _lines(tmp_path / "beat.log")
    assert worker_lines and {line["service"] for line in worker_lines} == {"flywheel-worker"}
    assert beat_lines and {line["service"] for line in beat_lines} == {"flywheel-beat"}
    ping = [line for line in worker_lines if line["message"].startswith("ping answered")]
    assert len(ping) == 1 and ping[0]["logger"] == "flywheel.ops.tasks"
    assert ping[0]["trace_id"] and len(ping[0]["trace_id"]) == 32 and ping[0]["span_id"]
