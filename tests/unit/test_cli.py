"""The thin CLI: ``--help`` stays light, ``events schema`` writes a usable JSON Schema, and the
worker/beat commands build the right Celery invocation."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from ops.cli import app

HEAVY = ("torch", "transformers", "fastapi", "celery", "vllm", "triton")


def test_help_imports_no_heavy_module():
    code = (
        "import sys\nfrom ops.cli import app\ntry:\n    app(['--help'])\nexcept SystemExit:\n    pass\n"
        f"bad = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))\n"
        "print('HEAVY', bad, file=sys.stderr)\nsys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for command in ("stack", "worker", "beat", "events", "db"):
        assert command in proc.stdout


def test_events_schema_is_valid_json_schema_that_accepts_a_real_event(tmp_path):
    import jsonschema

    from producers.events import encode_event
    from producers.events.types import ModelResponded, ModelRespondedEvent

    out = tmp_path / "events.schema.json"
    result = CliRunner().invoke(app, ["events", "schema", "--out", str(out)])
    assert result.exit_code == 0, result.output
    schema = json.loads(out.read_text())
    validator_cls = jsonschema.validators.validator_for(schema)
    validator_cls.check_schema(schema)
    event = ModelRespondedEvent(
        session_id="s",
        user_id="u",
        payload=ModelResponded(
            request_id="r",
            segment_index=0,
            turn_index=0,
            checkpoint_id="base",
            prompt_token_ids=[1],
            completion_token_ids=[2, 3],
            completion_logprobs=[-0.1, -0.2],
            latency_s=0.1,
        ),
    )
    validator = validator_cls(schema)
    assert not list(validator.iter_errors(json.loads(encode_event(event))))
    bad = json.loads(encode_event(event))
    bad["type"] = "model.exploded"
    assert list(validator.iter_errors(bad)), "an unknown event type must not validate"


def test_worker_and_beat_pass_the_right_celery_arguments(monkeypatch):
    from app.worker.celery_app import celery_app

    calls = []
    monkeypatch.setattr(celery_app, "worker_main", lambda argv: calls.append(("worker", argv)))
    monkeypatch.setattr(celery_app, "start", lambda argv: calls.append(("start", argv)))
    monkeypatch.setenv("FLYWHEEL_LOG_FORMAT", "text")
    runner = CliRunner()
    assert runner.invoke(app, ["worker"]).exit_code == 0
    assert runner.invoke(app, ["worker", "-c", "3", "-Q", "evals", "--beat"]).exit_code == 0
    assert runner.invoke(app, ["beat", "-l", "DEBUG"]).exit_code == 0
    assert calls[0] == ("worker", ["worker", "--pool=solo", "--concurrency=1", "--loglevel=INFO"])
    assert calls[1] == (
        "worker",
        ["worker", "--pool=prefork", "--concurrency=3", "--loglevel=INFO", "--queues=evals", "--beat"],
    )
    assert calls[2] == ("start", ["beat", "--loglevel=DEBUG"])
    monkeypatch.setenv("FLYWHEEL_LOG_FORMAT", "json")  # JSON lines: Celery's banner stays off
    assert runner.invoke(app, ["worker"]).exit_code == 0 and runner.invoke(app, ["beat"]).exit_code == 0
    assert calls[3][1][:2] == ["--quiet", "worker"] and calls[4][1][:2] == ["--quiet", "beat"]
