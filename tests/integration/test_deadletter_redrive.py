"""Dead letters after the fact: stats, listing and redrive, through the real broker and consumer."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import numpy as np
import psycopg
import pytest
from typer.testing import CliRunner

from consumers.testing import generate_session, kafka_record, produce

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _own_consumer_group(monkeypatch):
    """A consumer group per test (see test_erasure)."""
    monkeypatch.setenv("FLYWHEEL_KAFKA_CONSUMER_GROUP", f"ingest-{uuid.uuid4().hex[:8]}")


def _consume():
    from consumers.ingest import IngestConsumer

    return IngestConsumer().run(idle_exit_s=1.5)


def _cli(*args: str) -> str:
    from ops.cli import app

    out = CliRunner().invoke(app, list(args))
    assert out.exit_code == 0, out.output
    return out.output


def test_redrive_publishes_dead_letters_back_for_the_consumer_to_decide_again(db, topics, kafka_bootstrap):
    rng = np.random.default_rng(11)
    start = datetime.now(UTC) - timedelta(minutes=5)
    stored = generate_session(rng, session_id="s-ok", user_id="u-1", start=start)
    produce(
        kafka_bootstrap,
        topics["interactions"],
        [kafka_record(e) for e in stored]
        + [
            (
                b"s-bad",
                b'{"user_id": "u-2", "type": "nope"}',
                [("traceparent", b"00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01")],
            ),
            (b"s-bad", b'{"user_id": "u-2", "type": "session.st', []),
        ],
    )
    assert _consume().dead_letters == {"unknown_type": 1, "bad_json": 1}

    # Records a consumer bug had dead-lettered as processing_error (since fixed), and one whose
    # bytes an erasure removed.
    fixed = generate_session(rng, session_id="s-fixed", user_id="u-3", start=start)
    with psycopg.connect(db, autocommit=True) as conn:
        for i, (key, value, headers) in enumerate(kafka_record(e) for e in fixed):
            conn.execute(
                'INSERT INTO dead_letter (topic, partition, "offset", key, raw, headers, reason, detail) '
                "VALUES (%s, 0, %s, %s, %s, %s, 'processing_error', 'RuntimeError: a bug')",
                (topics["interactions"], 100_000 + i, key, value, json.dumps([[k, v.decode()] for k, v in headers])),
            )
        conn.execute(
            'INSERT INTO dead_letter (topic, partition, "offset", reason, detail, user_id) '
            "VALUES (%s, 1, 100000, 'unknown_type', 'raw bytes not kept: ...', 'u-9')",
            (topics["interactions"],),
        )

    stats = {r["reason"]: r for r in map(json.loads, _cli("deadletters", "stats").splitlines())}
    assert {k: (v["count"], v["pending"]) for k, v in stats.items()} == {
        "processing_error": (len(fixed), len(fixed)),
        "unknown_type": (2, 2),
        "bad_json": (1, 1),
    }
    listed = [json.loads(line) for line in _cli("deadletters", "list", "--reason", "unknown_type").splitlines()]
    assert [r["bytes"] is None for r in listed] == [False, True]

    dry = json.loads(_cli("deadletters", "redrive", "--reason", "processing_error", "--dry-run"))
    assert dry["published"] == len(fixed) and dry["dry_run"]
    report = json.loads(_cli("deadletters", "redrive", "--reason", "processing_error"))
    assert (report["selected"], report["published"], report["skipped"]) == (len(fixed), len(fixed), {})
    assert json.loads(_cli("deadletters", "redrive", "--reason", "processing_error"))["selected"] == 0
    report = json.loads(_cli("deadletters", "redrive", "--reason", "unknown_type"))
    assert (report["published"], report["skipped"]) == (1, {"no_bytes": 1})

    stats = _consume()
    assert stats.stored == len(fixed) and stats.dead_letters == {"unknown_type": 1}
    with psycopg.connect(db) as conn:
        q = lambda sql, *p: conn.execute(sql, p).fetchall()  # noqa: E731
        assert q("SELECT count(*) FROM event_log WHERE session_id = 's-fixed'") == [(len(fixed),)]
        assert q("SELECT status FROM trajectory WHERE session_id = 's-fixed'") == [("finalized",)]
        assert q("SELECT count(*) FROM dead_letter WHERE reason = 'processing_error' AND redriven_at IS NULL") == [(0,)]
        # the record still invalid is a new dead letter that names the one it came from
        (original,) = q(
            "SELECT topic, partition, \"offset\" FROM dead_letter WHERE reason = 'unknown_type' "
            "AND raw IS NOT NULL AND redriven_at IS NOT NULL"
        )
        (headers,) = q(
            "SELECT headers FROM dead_letter WHERE reason = 'unknown_type' AND redriven_at IS NULL AND raw IS NOT NULL"
        )
        assert ["flywheel-redrive-of", "{}:{}:{}".format(*original)] in headers[0]
        assert ["traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01"] in headers[0]

    # Again, on purpose: stored events are duplicates, nothing is stored twice.
    assert json.loads(_cli("deadletters", "redrive", "--reason", "processing_error", "--again"))["published"] == len(
        fixed
    )
    stats = _consume()
    assert stats.stored == 0 and stats.duplicates == len(fixed)
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM event_log").fetchone()[0] == len(stored) + len(fixed)


def test_redrive_needs_a_selection(db):
    from ops.cli import app

    out = CliRunner().invoke(app, ["deadletters", "redrive"])
    assert out.exit_code == 2 and "choose what to redrive" in out.output


def test_a_reason_no_dead_letter_has_is_named_with_those_stored(db):
    """``--reason`` with a typo lists nothing; stderr says so and which reasons are stored."""
    from ops.cli import app

    with psycopg.connect(db) as conn:
        conn.execute(
            'INSERT INTO dead_letter (topic, partition, "offset", raw, reason, detail) '
            "VALUES ('t', 0, 1, 'x', 'bad_json', 'not JSON')"
        )
    out = CliRunner().invoke(app, ["deadletters", "list", "--reason", "bad-json"])
    assert out.exit_code == 0 and out.stdout == ""
    assert "no dead letter has reason bad-json; reasons stored: bad_json" in out.stderr
    out = CliRunner().invoke(app, ["deadletters", "list", "--reason", "bad_json"])
    assert json.loads(out.stdout)["reason"] == "bad_json" and out.stderr == ""
