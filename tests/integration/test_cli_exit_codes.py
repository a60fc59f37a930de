"""The exit-code table (docs/operations.md) command by command, against real Postgres and the real
broker: 0 done, 1 a negative answer, 2 a usage error, 3 a service unreachable.

``flywheel gate``'s sessions are stubbed per checkpoint as in ``test_eval_gating.py`` (the harness
path has its own tests); the decision, its rows and the exit code are real.
"""

from __future__ import annotations

import json

import pytest

from app.core.db import reset_engines, session_scope
from app.core.failures import ExitCode
from app.core.net import free_port
from app.models.checkpoints import CheckpointStatus
from app.repositories.checkpoints import add_checkpoint
from evals import gating, runner
from ops.cli import run
from tests.integration.test_eval_gating import CONFIG, TASKS, Engine, Policies

pytestmark = pytest.mark.integration

# Commands that read or write the database, with arguments that would otherwise run.
DATABASE_COMMANDS = [
    ["tokens", "list"],
    ["tokens", "create", "--role", "viewer", "--name", "n"],
    ["tokens", "revoke", "n"],
    ["canary", "status"],
    ["canary", "start", "good", "--fraction", "0.1", "--reason", "r"],
    ["canary", "stop", "--reason", "r"],
    ["canary", "evaluate"],
    ["deadletters", "stats"],
    ["deadletters", "list"],
    ["erasures", "list"],
    ["eval", "mine"],
    ["eval", "contamination", "--no-static"],
    ["db", "upgrade"],
    ["relabel", "--spec", "implicit@1"],
    ["replay", "--verify"],
    ["erase", "someone"],
    ["finalize"],
]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("argv", DATABASE_COMMANDS, ids=" ".join)
def test_a_database_that_does_not_answer_exits_3(argv, home, monkeypatch, capsys):
    monkeypatch.setenv("FLYWHEEL_DATABASE_URL", f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/flywheel")
    reset_engines()
    assert run(argv) == ExitCode.UNREACHABLE
    err = capsys.readouterr().err
    assert "error: the database does not answer" in err and "Traceback" not in err


def test_a_database_without_the_schema_exits_3(empty_database, home, monkeypatch, capsys):
    monkeypatch.setenv("FLYWHEEL_DATABASE_URL", empty_database)
    reset_engines()
    assert run(["tokens", "list"]) == ExitCode.UNREACHABLE
    assert "flywheel db upgrade" in capsys.readouterr().err


def test_no_database_configured_is_a_usage_error(home, monkeypatch, capsys):
    monkeypatch.delenv("FLYWHEEL_DATABASE_URL", raising=False)
    assert run(["tokens", "list"]) == ExitCode.USAGE
    assert "FLYWHEEL_DATABASE_URL" in capsys.readouterr().err


def test_a_broker_that_does_not_answer_exits_3(home, monkeypatch, capsys):
    monkeypatch.setenv("FLYWHEEL_KAFKA_BOOTSTRAP", f"127.0.0.1:{free_port()}")
    assert run(["stack", "topics"]) == ExitCode.UNREACHABLE
    assert "the Kafka broker does not answer" in capsys.readouterr().err


def test_topics_without_a_broker_configured_is_a_usage_error(home, monkeypatch, capsys):
    monkeypatch.delenv("FLYWHEEL_KAFKA_BOOTSTRAP", raising=False)
    assert run(["stack", "topics"]) == ExitCode.USAGE
    assert "FLYWHEEL_KAFKA_BOOTSTRAP" in capsys.readouterr().err


def test_stack_status_json_answers_healthy_with_0_and_down_with_1(db, kafka_bootstrap, home, monkeypatch, capsys):
    monkeypatch.setenv("FLYWHEEL_KAFKA_BOOTSTRAP", kafka_bootstrap)
    assert run(["stack", "status", "--json"]) == ExitCode.OK
    up = json.loads(capsys.readouterr().out)
    assert up["healthy"] and up["services"]["postgres"]["healthy"] and up["services"]["kafka"]["healthy"]

    monkeypatch.setenv("FLYWHEEL_KAFKA_BOOTSTRAP", f"127.0.0.1:{free_port()}")
    assert run(["stack", "status", "--json"]) == ExitCode.NEGATIVE
    down = json.loads(capsys.readouterr().out)
    assert not down["healthy"] and down["services"]["postgres"]["healthy"] and not down["services"]["kafka"]["healthy"]


def test_refusals_and_unknown_entities_exit_1_and_bad_arguments_2(db, home, capsys):
    with session_scope() as s:
        add_checkpoint(s, checkpoint_id="base", path="/x/base", status=CheckpointStatus.PRODUCTION)
        add_checkpoint(s, checkpoint_id="cand", path="/x/cand", parent_id="base", generation=1)
    assert run(["tokens", "revoke", "nobody"]) == ExitCode.NEGATIVE
    assert "no live token" in capsys.readouterr().err
    assert run(["canary", "start", "cand", "--fraction", "0.1", "--reason", "r"]) == ExitCode.NEGATIVE
    assert "refused" in capsys.readouterr().err
    assert run(["tokens", "create", "--role", "emperor", "--name", "n"]) == ExitCode.USAGE
    assert "unknown role" in capsys.readouterr().err

    assert run(["tokens", "create", "--role", "viewer", "--name", "n", "--json"]) == ExitCode.OK
    created = json.loads(capsys.readouterr().out)
    assert created["name"] == "n" and created["token"]
    assert run(["tokens", "list", "--json"]) == ExitCode.OK
    assert [json.loads(line)["name"] for line in capsys.readouterr().out.splitlines()] == ["n"]
    assert run(["canary", "status", "--json"]) == ExitCode.OK
    assert json.loads(capsys.readouterr().out) == {"canary": None}
    assert run(["eval", "contamination", "--no-static", "--json"]) == ExitCode.OK
    assert json.loads(capsys.readouterr().out)["clean"] is True


def test_gate_exits_0_when_it_passes_and_1_when_it_does_not(db, home, monkeypatch, capsys):
    with session_scope() as s:
        add_checkpoint(s, checkpoint_id="base", path="/x/base", status=CheckpointStatus.PRODUCTION)
        for cid in ("good", "bad"):
            add_checkpoint(s, checkpoint_id=cid, path=f"/x/{cid}", parent_id="base", generation=1)
    monkeypatch.setattr(runner, "run_sample", Policies())
    real = gating.gate_candidate

    def stubbed(cid, **kw):
        kw.update(config=CONFIG, suites=sorted(TASKS), overrides={"samples_per_task": 1}, workers=2)
        return real(cid, tasks=TASKS, engine_factory=Engine, **kw)

    monkeypatch.setattr(gating, "gate_candidate", stubbed)

    assert run(["gate", "good", "--json"]) == ExitCode.OK
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["passed"] is True
    assert run(["gate", "bad", "--json"]) == ExitCode.NEGATIVE
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["decision"] == "fail"
    assert run(["gate", "bad", "--strict"]) == ExitCode.NEGATIVE  # the old flag is accepted, changes nothing
