"""Late signals, relabel and replay on a real broker and Postgres.

Sessions are consumed without their late signals; their windows close (finalized by the sweep in
the consume loop); the late signals then arrive and are stored but recorded as late. Replay
rebuilds identical rows; relabel (from event_log only) picks the late signals up and reports how
the distribution moved.
"""

from __future__ import annotations

import json
import time
import uuid

import psycopg
import pytest
from typer.testing import CliRunner

from consumers.testing import generate_stream, kafka_record, produce

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _own_consumer_group(monkeypatch):
    """A consumer group per test: the session's broker keeps every group's membership, and a group
    whose members were SIGKILLed by an earlier test must not slow this test's join."""
    monkeypatch.setenv("FLYWHEEL_KAFKA_CONSUMER_GROUP", f"ingest-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def short_window(monkeypatch):
    from consumers.settings import get_consumer_settings

    monkeypatch.setenv("FLYWHEEL_CONSUMER_SIGNAL_WINDOW_S", "2")
    monkeypatch.setenv("FLYWHEEL_CONSUMER_FINALIZE_INTERVAL_S", "0.3")
    monkeypatch.setenv("FLYWHEEL_CONSUMER_FINALIZE_GRACE_S", "0.2")
    get_consumer_settings.cache_clear()
    yield
    get_consumer_settings.cache_clear()


def _split_late(events):
    """(on-time events, late signals): a session's events after its session.ended are held back."""
    ended, on_time, late = set(), [], []
    for e in events:
        (late if e.session_id in ended else on_time).append(e)
        if e.type == "session.ended":
            ended.add(e.session_id)
    return on_time, late


def _dump(db):
    from app.core.db import session_scope
    from consumers.replay import dump_projection

    with session_scope() as s:
        return dump_projection(s)


def test_late_signals_replay_and_relabel(db, topics, kafka_bootstrap, short_window):
    from consumers.ingest import IngestConsumer

    events = generate_stream(2500, seed=10, withhold_fraction=0.2)
    on_time, late = _split_late(events)
    assert len(late) > 30
    produce(kafka_bootstrap, topics["interactions"], [kafka_record(e) for e in on_time])
    first = IngestConsumer().run(idle_exit_s=3.0)  # the in-loop sweep closes the 2 s windows
    assert first.finalized["window"] > 0

    produce(kafka_bootstrap, topics["interactions"], [kafka_record(e) for e in late])
    time.sleep(0.5)
    second = IngestConsumer().run(idle_exit_s=1.5)
    assert second.stored == len(late)

    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM event_log").fetchone()[0] == len(events)
        status = dict(conn.execute("SELECT finalized_by, count(*) FROM trajectory GROUP BY 1").fetchall())
        late_ids = [i for (ids,) in conn.execute("SELECT late_event_ids FROM trajectory") for i in ids]
        labels = dict(
            conn.execute(
                "SELECT t.session_id, r.reward FROM reward_label r JOIN trajectory t "
                "ON t.id = r.trajectory_id WHERE r.spec = 'implicit@1'"
            ).fetchall()
        )
    assert set(status) <= {"window", "signals"} and status.get("window", 0) > 0
    assert sorted(late_ids) == sorted(e.event_id for e in late)  # stored, flagged late, not folded
    assert len(labels) == sum(status.values())

    # replay into a shadow schema, then in place: every column of every row is the same
    from app.core.db import session_scope
    from consumers.ingest import projector_from_settings
    from consumers.replay import compare_projections, drop_schema, dump_projection, replay

    live = _dump(db)
    report = replay(projector_from_settings(), grace_s=0.2, schema="replay_check")
    assert report.events == len(events) and report.trajectories == len(live["trajectory"])
    with session_scope() as s:
        shadow = dump_projection(s, "replay_check")
        drop_schema(s, "replay_check")
    assert compare_projections(live, shadow) == []
    replay(projector_from_settings(), grace_s=0.2)
    assert compare_projections(live, _dump(db)) == []

    runner = CliRunner()
    from ops.cli import app

    out = runner.invoke(app, ["relabel", "--spec", "implicit@1", "--json"])
    assert out.exit_code == 0, out.output
    rep = json.loads(out.output.strip().splitlines()[-1])
    assert rep["late_signals_used"] == len(late) and rep["changed"] > 0
    assert rep["relabeled"] == len(labels) and rep["before"]["n"] == rep["after"]["n"] == len(labels)
    with psycopg.connect(db) as conn:
        relabeled = dict(
            conn.execute(
                "SELECT t.session_id, r.reward FROM reward_label r JOIN trajectory t "
                "ON t.id = r.trajectory_id WHERE r.spec = 'implicit@1'"
            ).fetchall()
        )
    late_sessions = {e.session_id for e in late}
    assert any(relabeled[s] != labels[s] for s in late_sessions)
    assert all(relabeled[s] == labels[s] for s in labels if s not in late_sessions)

    out = runner.invoke(app, ["relabel", "--spec", "implicit@2"])
    assert out.exit_code == 0, out.output
    assert "implicit@1" in out.output and "implicit@2" in out.output and "p50" in out.output
    with psycopg.connect(db) as conn:
        n2, with_tests = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE components ? 'test_outcome') "
            "FROM reward_label WHERE spec = 'implicit@2'"
        ).fetchone()
    assert n2 == with_tests == len(labels)

    # an in-place replay rebuilds what the consumers write: implicit@2's labels (a relabel's) are not
    # part of it, and it says so rather than drop them silently
    out = runner.invoke(app, ["replay"])
    assert out.exit_code == 0, out.output
    rep = json.loads(out.output.strip().splitlines()[-1])
    assert rep["labels_not_rebuilt"] == {"implicit@2": len(labels)}
    assert "run `flywheel relabel --spec implicit@2` again" in out.output
    assert compare_projections(live, _dump(db)) == []  # implicit@1 as the consumers labelled it, again


@pytest.mark.parametrize("spec", ["implicit@1", "implicit@3"])
def test_an_erasure_while_a_relabel_scans_is_not_held_up_and_its_trajectories_get_no_label(db, monkeypatch, spec):
    """The operator relabels while the group ingests; a user's erasure arrives after the relabel has
    labelled that user's trajectory. The erasure must not wait for the relabel's transaction (it holds
    up every ingest batch while it waits): here it runs with a 5 s lock timeout. The relabel then
    completes without a foreign-key error and writes no label for the erased trajectories. implicit@3
    (it reads the tasks' histories) behaves the same."""
    from app.core.db import session_scope
    from app.repositories.events import raw_connection
    from consumers.batch import apply_batch
    from consumers.classify import Message, classify
    from consumers.erasure import erase_now
    from consumers.ingest import projector_from_settings
    from consumers.projection import Projector
    from consumers.relabel import relabel

    events = generate_stream(600, seed=41)
    msgs = [Message("t", 0, i, *kafka_record(e)) for i, e in enumerate(events)]
    with session_scope() as s:
        apply_batch(s, "g", [classify(m, 1 << 20) for m in msgs], projector_from_settings())
    with psycopg.connect(db) as conn:
        finalized = conn.execute(
            "SELECT id, user_id FROM trajectory WHERE status = 'finalized' ORDER BY session_id"
        ).fetchall()
    assert len(finalized) >= 6
    victim = finalized[0][1]  # the relabel scans sessions in this order: it labels this one first
    erased = {tid for tid, user in finalized if user == victim}
    assert len(erased) < len(finalized)

    real_label, labelled, erasures = Projector.label, [], []

    def label_then_erase(self, t, *rest):
        labelled.append(t.id)
        if len(labelled) == 4:  # with chunk=2, the first two labels are written by now
            with session_scope() as s:
                raw_connection(s).execute("SET LOCAL lock_timeout = '5s'")
                erasures.append(erase_now(s, victim, "erasure-during-relabel"))
        return real_label(self, t, *rest)

    monkeypatch.setattr(Projector, "label", label_then_erase)
    report = relabel(spec, chunk=2)

    assert erasures and erasures[0].trajectories_deleted >= 1
    assert finalized[0][0] in labelled[:2]
    assert report.relabeled == report.after["n"] == len(finalized) - len(erased)
    with psycopg.connect(db) as conn:
        labels = {r[0] for r in conn.execute("SELECT trajectory_id FROM reward_label WHERE spec = %s", (spec,))}
    assert labels == {tid for tid, _ in finalized} - erased


def test_replay_verify_compares_one_snapshot_beside_a_live_group(db, monkeypatch, short_window):
    """``flywheel replay --verify`` while the group ingests: a batch committed after the verify read
    the event log must not show up on the live side only, and a trajectory whose window closed that
    the live sweep has not reached yet (the replay's sweep finalizes it) is not a difference but is
    counted as ``due_unswept``. A real difference still fails the verify."""
    from app.core.db import session_scope
    from consumers import replay as replay_mod
    from consumers.batch import apply_batch
    from consumers.classify import Message, classify
    from consumers.ingest import projector_from_settings
    from ops.cli import app

    events = generate_stream(900, seed=43, withhold_fraction=0.3)
    msgs = [Message("t", 0, i, *kafka_record(e)) for i, e in enumerate(events)]
    decoded = [classify(m, 1 << 20) for m in msgs]
    with session_scope() as s:
        apply_batch(s, "g", decoded[:600], projector_from_settings())
    time.sleep(2.5)  # past the 2 s window and the grace: due, and no sweep ran

    real_rebuild = replay_mod.rebuild

    def rebuild_then_a_batch_commits(*args, **kwargs):
        out = real_rebuild(*args, **kwargs)
        with session_scope() as s:  # another member's batch, committed while the verify compares
            apply_batch(s, "g", decoded[600:], projector_from_settings())
        return out

    monkeypatch.setattr(replay_mod, "rebuild", rebuild_then_a_batch_commits)
    out = CliRunner().invoke(app, ["replay", "--verify"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.output.strip().splitlines()[-1])
    assert result["identical"] and result["due_unswept"] > 0 and result["finalized_by_window"] >= result["due_unswept"]
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM event_log").fetchone()[0] == len(events)
        assert conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'replay_verify_%'").fetchone()[0] == 0

    monkeypatch.setattr(replay_mod, "rebuild", real_rebuild)
    with psycopg.connect(db) as conn:  # a projection row no replay would write
        conn.execute(
            "UPDATE trajectory SET num_turns = num_turns + 1 WHERE id = "
            "(SELECT id FROM trajectory WHERE status = 'finalized' LIMIT 1)"
        )
    out = CliRunner().invoke(app, ["replay", "--verify"])
    assert out.exit_code == 1, out.output
    result = json.loads(out.output.strip().splitlines()[-1])
    assert not result["identical"] and len(result["differences"]) == 1
    assert result["differences"][0].startswith("trajectory id=")
    assert result["differences"][0].endswith(": num_turns differ")

    with psycopg.connect(db) as conn:  # a label missing, and a segment's tokens and event ids changed
        label = conn.execute(
            "DELETE FROM reward_label WHERE (trajectory_id, spec) = (SELECT min(trajectory_id::text)::uuid, "
            "'implicit@1' FROM reward_label) RETURNING trajectory_id, spec"
        ).fetchone()
        segment = conn.execute(
            "UPDATE trajectory_segment SET token_ids = token_ids || '\\x00'::bytea, "
            "event_ids = event_ids[2:] WHERE (trajectory_id, segment_index) = (SELECT "
            "trajectory_id, segment_index FROM trajectory_segment ORDER BY 1, 2 LIMIT 1) "
            "RETURNING trajectory_id, segment_index"
        ).fetchone()
    out = CliRunner().invoke(app, ["replay", "--verify"])
    assert out.exit_code == 1, out.output
    assert set(json.loads(out.output.strip().splitlines()[-1])["differences"]) == {
        result["differences"][0],
        f"trajectory_segment trajectory_id={segment[0]}, segment_index={segment[1]}: token_ids, event_ids differ",
        f"reward_label: 1 row(s) only in the replay, e.g. trajectory_id={label[0]}, spec={label[1]}",
    }

    out = CliRunner().invoke(app, ["replay", "--verify", "--schema", "x"])
    assert out.exit_code == 2 and "--schema" in out.output


def test_a_shadow_schema_is_named_checked_and_dropped_from_the_cli(db):
    """``replay --schema`` refuses a name it would not create and an existing schema with a usage
    error (exit 2) naming the way out; ``--drop-schema`` drops a replay's shadow and nothing else."""
    from app.core.errors import ConflictError, NotFoundError
    from ops.cli import app

    cli = CliRunner()
    for bad in ("Bad-Name", "shadow_1\n", "1shadow", "s" * 64):  # "$" would have let the newline through
        out = cli.invoke(app, ["replay", "--schema", bad])
        assert out.exit_code == 2 and "lower-case letters" in out.output, bad
    assert cli.invoke(app, ["replay", "--schema", "shadow_1"]).exit_code == 0
    out = cli.invoke(app, ["replay", "--schema", "shadow_1"])
    assert out.exit_code == 2 and "--drop-schema shadow_1" in " ".join(out.output.split()), out.output
    out = cli.invoke(app, ["replay", "--drop-schema", "public"])
    assert isinstance(out.exception, ConflictError) and "left alone" in out.exception.message
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT to_regclass('public.event_log') IS NOT NULL").fetchone()[0]
    out = cli.invoke(app, ["replay", "--drop-schema", "shadow_1"])
    assert out.exit_code == 0 and json.loads(out.output) == {"dropped": "shadow_1"}
    assert isinstance(cli.invoke(app, ["replay", "--drop-schema", "shadow_1"]).exception, NotFoundError)


def test_relabel_of_an_empty_store_reports_nulls_not_nan(db):
    """Nothing finalized yet: the JSON report is valid JSON (``null``, not ``NaN``) and the table
    says there was nothing to relabel."""
    from ops.cli import app

    out = CliRunner().invoke(app, ["relabel", "--spec", "implicit@2", "--json"])
    assert out.exit_code == 0 and "NaN" not in out.stdout
    report = json.loads(out.stdout, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert report["relabeled"] == 0 and report["after"] == {"n": 0, **{k: None for k in report["after"] if k != "n"}}
    out = CliRunner().invoke(app, ["relabel", "--spec", "implicit@2"])
    assert out.exit_code == 0 and "no finalized trajectories to relabel yet" in out.stderr and "nan" not in out.stdout
