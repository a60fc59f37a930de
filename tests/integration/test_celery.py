"""Celery on the embedded-stack broker: kombu's SQLAlchemy transport over the test Postgres, a real
worker process, and the configuration every area's tasks rely on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from app.core.settings import get_settings


def test_config_is_read_lazily_and_follows_settings(monkeypatch):
    from app.worker.celery_app import celery_config, create_celery_app

    monkeypatch.delenv("FLYWHEEL_DATABASE_URL", raising=False)
    app = create_celery_app()
    assert not app.configured, "creating the app (importing a task module) reads no settings"

    monkeypatch.setenv("FLYWHEEL_DATABASE_URL", "postgresql://u@db.example:5432/fw")
    get_settings.cache_clear()
    assert app.conf.broker_url == "sqla+postgresql+psycopg://u@db.example:5432/fw"
    assert {"ops.tasks", "trainer.tasks", "app.outbox.tasks"} <= set(app.conf.include)
    conf = celery_config()
    assert conf["broker_url"] == "sqla+postgresql+psycopg://u@db.example:5432/fw"
    assert conf["result_backend"] == "db+postgresql+psycopg://u@db.example:5432/fw"
    assert conf["task_acks_late"] is True and conf["worker_prefetch_multiplier"] == 1
    assert "purge-broker-messages" in conf["beat_schedule"]

    monkeypatch.setenv("FLYWHEEL_REDIS_URL", "redis://127.0.0.1:6379/3")
    get_settings.cache_clear()
    conf = celery_config()
    assert conf["broker_url"] == conf["result_backend"] == "redis://127.0.0.1:6379/3"
    assert "purge-broker-messages" not in conf["beat_schedule"]


def test_beat_schedule_comes_from_settings(monkeypatch):
    from app.worker.schedule import beat_schedule

    monkeypatch.setenv("FLYWHEEL_TRAIN_INTERVAL", "60")
    monkeypatch.setenv("FLYWHEEL_OUTBOX_INTERVAL", "0.5")
    get_settings.cache_clear()
    schedule = beat_schedule()
    by_task = {entry["task"]: entry for entry in schedule.values()}
    assert by_task["flywheel.trainer.run_cycle"]["schedule"] == 60.0
    assert by_task["flywheel.outbox.relay"]["schedule"] == 0.5
    assert by_task["flywheel.evals.scan_candidates"]["schedule"] == get_settings().celery.eval_scan_interval
    assert all(entry["options"]["expires"] >= entry["schedule"] for entry in schedule.values())
    assert schedule["refresh-mined-suite"]["task"] == "flywheel.evals.refresh_mined_suite"
    assert schedule["refresh-mined-suite"]["schedule"] == 3600.0  # hourly by default
    monkeypatch.setenv("FLYWHEEL_EVAL_MINE_INTERVAL", "0")
    get_settings.cache_clear()
    assert "refresh-mined-suite" not in beat_schedule()
    monkeypatch.setenv("FLYWHEEL_OUTBOX_BEAT_RELAY", "false")  # flywheel up: the relay is a process
    get_settings.cache_clear()
    assert "relay-outbox" not in beat_schedule() and "train" in beat_schedule()


def test_beat_skips_tasks_whose_module_is_missing(monkeypatch):
    import app.worker.schedule as schedule

    monkeypatch.setitem(schedule.TASK_MODULES, "flywheel.trainer.run_cycle", "trainer.no_such_module")
    assert "train" not in schedule.beat_schedule()


@pytest.fixture
def celery_worker(db, tmp_path):
    """A real ``celery worker --pool=solo`` on the SQL transport over the test database."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(FLYWHEEL_DATABASE_URL=db, FLYWHEEL_HOME=str(tmp_path), FLYWHEEL_TELEMETRY_EXPORTER="none")
    log = open(tmp_path / "worker.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "app.worker.celery_app",
            "worker",
            "--pool=solo",
            "--loglevel=INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.integration
def test_task_sent_to_a_real_worker_runs_and_returns(celery_worker, db, tmp_path):
    import psycopg

    from app.worker.celery_app import create_celery_app

    app = create_celery_app()
    t0 = time.monotonic()
    result = app.send_task("flywheel.ops.ping", args=[{"hello": "worker"}])
    try:
        value = result.get(timeout=90)
    except Exception:
        print((tmp_path / "worker.log").read_text()[-4000:])
        raise
    assert value["pong"] is True and value["payload"] == {"hello": "worker"}
    assert value["pid"] == celery_worker.pid, "the solo pool runs the task in the worker process"
    assert time.monotonic() - t0 < 90

    # The SQL transport stored the message in the flywheel database and marked it delivered;
    # the purge task removes delivered rows.
    with psycopg.connect(db) as conn:
        delivered, last_id = conn.execute(
            "SELECT count(*), max(id) FROM kombu_message WHERE visible = false"
        ).fetchone()
    assert delivered >= 1
    purged = app.send_task("flywheel.ops.purge_broker_messages", kwargs={"older_than_s": 0})
    assert purged.get(timeout=60) >= delivered
    with psycopg.connect(db) as conn:
        left = conn.execute("SELECT count(*) FROM kombu_message WHERE id <= %s", (last_id,)).fetchone()[0]
    assert left == 0
