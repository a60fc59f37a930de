"""implicit@3, the difficulty-aware length penalty, on trajectories the consumers' own fold and
finalization built on Postgres, labelled by ``flywheel relabel`` from ``event_log``.

Sessions on an easy task (its sessions nearly always solve it: edits accepted, tests passing) and on
a hard one (nearly never) are ingested round by round, one batch transaction per round, so each
round is finalized at a later instant than the last. Sessions drawn from one seed have the same
turns and tokens whatever their outcome: twins on the easy, the hard and an unseen task have equal
token counts.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta

import numpy as np
import psycopg
import pytest
from typer.testing import CliRunner

from consumers.testing import generate_session, kafka_record

pytestmark = pytest.mark.integration

EASY, HARD, UNSEEN = "FN/easy_template/0", "FN/hard_template/0", "FN/unseen_template/0"
START = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=3)


class Feed:
    """Applies events as a consumer group's batches: one transaction per call, offsets running on."""

    def __init__(self, group: str = "g") -> None:
        self.group, self.offset = group, 0

    def apply(self, events, session=None) -> None:
        """One batch of ``events``, in ``session``'s transaction if given, else in its own."""
        from app.core.db import session_scope
        from consumers.batch import apply_batch
        from consumers.classify import Message, classify
        from consumers.ingest import projector_from_settings

        decoded = [classify(Message("t", 0, self.offset + i, *kafka_record(e)), 1 << 20) for i, e in enumerate(events)]
        self.offset += len(events)
        if session is not None:
            apply_batch(session, self.group, decoded, projector_from_settings())
            return
        with session_scope() as s:
            apply_batch(s, self.group, decoded, projector_from_settings())


def _session(seed: int, task: str, p: float, name: str, at_s: int | None = None, **kw):
    """A session on ``task`` whose tool calls succeed and edits are accepted with probability ``p``,
    starting ``at_s`` seconds (default ``seed``) after ``START`` (event ids come from the seed and
    the clock: twins need distinct starts)."""
    rng = np.random.default_rng(seed)
    return generate_session(
        rng,
        session_id=name,
        user_id=f"u-{seed % 7}",
        start=START + timedelta(seconds=seed if at_s is None else at_s),
        task_id=task,
        p_tool_ok=p,
        p_accept=p,
        **kw,
    )


def _labels(db: str, spec: str) -> dict[str, tuple[float, dict, int]]:
    """session id -> (reward, components, completion tokens) of every label under ``spec``."""
    with psycopg.connect(db) as conn:
        rows = conn.execute(
            "SELECT t.session_id, r.reward, r.components, t.completion_tokens FROM reward_label r "
            "JOIN trajectory t ON t.id = r.trajectory_id WHERE r.spec = %s",
            (spec,),
        ).fetchall()
    return {sid: (reward, components, tokens) for sid, reward, components, tokens in rows}


def _weight(three: dict, one: dict, sid: str) -> float:
    """implicit@3's difficulty weight of a trajectory: its length component over implicit@1's,
    halved (implicit@3's coef is twice implicit@1's)."""
    return 0.5 * three[sid][1]["length"] / one[sid][1]["length"]


def _expected_weight(db: str, sessions: list[str]) -> float:
    """The weight a trajectory whose history is ``sessions`` should get: ``max((solved + 1) /
    (attempts + 2), 0.1)``, outcomes read from their stored signals."""
    from consumers.rewards.difficulty import trajectory_outcome

    with psycopg.connect(db) as conn:
        signals = [r[0] for r in conn.execute("SELECT signals FROM trajectory WHERE session_id = ANY(%s)", (sessions,))]
    assert len(signals) == len(sessions)
    outcomes = [o for o in map(trajectory_outcome, signals) if o is not None]
    return max((sum(outcomes) + 1.0) / (len(outcomes) + 2.0), 0.1)


def test_easy_tasks_pay_more_per_token_than_hard_ones_and_relabels_agree(db):
    from consumers.ingest import projector_from_settings
    from consumers.relabel import relabel
    from consumers.replay import replay
    from ops.cli import app

    feed, rounds, seed = Feed(), [], 0
    for _ in range(4):
        events, names = [], {EASY: [], HARD: []}
        for task, p in ((EASY, 0.95), (HARD, 0.05)):
            for _ in range(4):
                seed += 1
                names[task].append(f"{task}-{seed}")
                events += _session(seed, task, p, names[task][-1])
        feed.apply(events)
        rounds.append(names)
    twins = {EASY: "twin-easy", HARD: "twin-hard", UNSEEN: "twin-unseen"}
    feed.apply(
        [
            e
            for i, (task, name) in enumerate(twins.items())
            for e in _session(100, task, 0.95 if task == EASY else 0.05, name, at_s=100 + 10 * i)
        ]
    )
    with psycopg.connect(db) as conn:
        assert conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'finalized'), count(*) FROM trajectory"
        ).fetchone() == (
            35,
            35,
        )

    out = CliRunner().invoke(app, ["relabel", "--spec", "implicit@3", "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output.strip().splitlines()[-1])
    assert report["baseline"] == "implicit@1" and report["relabeled"] == 35
    one, three = _labels(db, "implicit@1"), _labels(db, "implicit@3")
    assert one.keys() == three.keys() and len(three) == 35

    # equal tokens: the easy task's penalty is the largest, the hard task's the smallest, an unseen
    # task's exactly implicit@1's
    e, h, u = twins[EASY], twins[HARD], twins[UNSEEN]
    assert three[e][2] == three[h][2] == three[u][2] > 0
    assert one[e][1]["length"] == one[h][1]["length"] == one[u][1]["length"] == three[u][1]["length"] < 0
    assert three[e][1]["length"] < three[u][1]["length"] < three[h][1]["length"] < 0
    # and the weights are the solve rates of each task's earlier trajectories, under the Beta(1, 1) prior
    history = {task: [s for r in rounds for s in r[task]] for task in (EASY, HARD)}
    assert _weight(three, one, e) == pytest.approx(_expected_weight(db, history[EASY]), abs=1e-6)
    assert _weight(three, one, h) == pytest.approx(_expected_weight(db, history[HARD]), abs=1e-6)
    assert _weight(three, one, e) > 0.8 and _weight(three, one, h) < 0.2
    # the first round had no history (its trajectories were finalized together): the prior's 0.5;
    # by the last round every easy trajectory pays more per token than every hard one
    assert all(_weight(three, one, s) == pytest.approx(0.5, abs=1e-6) for s in rounds[0][EASY] + rounds[0][HARD])
    assert (
        min(_weight(three, one, s) for s in rounds[-1][EASY])
        > 0.75
        > 0.25
        > max(_weight(three, one, s) for s in rounds[-1][HARD])
    )
    # only the length component differs from implicit@1
    for sid in three:
        assert {k: v for k, v in three[sid][1].items() if k != "length"} == {
            k: v for k, v in one[sid][1].items() if k != "length"
        }

    # relabeling again, and after an in-place replay, gives the same rewards, to the bit
    assert relabel("implicit@3").changed == 0
    assert _labels(db, "implicit@3") == three
    rebuilt = replay(projector_from_settings(), grace_s=0.0)
    assert rebuilt.labels_not_rebuilt == {"implicit@3": 35} and _labels(db, "implicit@3") == {}
    assert relabel("implicit@3").relabeled == 35
    assert _labels(db, "implicit@3") == three

    # a label reads only what was finalized before it: later sessions of the task change no earlier label
    feed.apply([e for s in range(200, 204) for e in _session(s, EASY, 0.05, f"late-{s}")])
    report = relabel("implicit@3")
    assert report.relabeled == 39 and report.changed == 0
    after = _labels(db, "implicit@3")
    assert {k: v for k, v in after.items() if k in three} == three
    assert _weight(after, _labels(db, "implicit@1"), "late-200") == pytest.approx(
        _expected_weight(db, history[EASY] + [e]), abs=1e-6
    )


def test_relabel_waits_for_a_batch_in_flight_that_finalized_an_earlier_trajectory(db):
    """Another member's batch began (its ingestion instant) before a trajectory that has committed,
    and finalized a trajectory of the same task, but has not committed when the relabel starts: the
    relabel waits for it, so the later trajectory's label counts it, as every later relabel will."""
    from app.core.db import session_scope
    from app.repositories.events import raw_connection
    from consumers.relabel import relabel

    result: dict = {}

    def run() -> None:
        try:
            result["report"] = relabel("implicit@3")
        except BaseException as exc:  # reported by the assertion below
            result["error"] = exc

    with session_scope() as in_flight:
        began = raw_connection(in_flight).execute("SELECT now()").fetchone()[0]
        Feed("g-later").apply(_session(2, EASY, 1.0, "later"))  # commits, finalized after `began`
        Feed("g-earlier").apply(_session(1, EASY, 1.0, "earlier"), session=in_flight)  # finalized at `began`
        relabeling = threading.Thread(target=run)
        relabeling.start()
        relabeling.join(2.0)
        assert relabeling.is_alive(), result  # waiting for the batch in flight
    relabeling.join(60)
    assert not relabeling.is_alive() and "error" not in result, result
    with psycopg.connect(db) as conn:
        finalized = dict(conn.execute("SELECT session_id, finalized_at FROM trajectory").fetchall())
    assert finalized["earlier"] == began < finalized["later"]
    assert result["report"].relabeled == 1  # "earlier" was not visible when the relabel read what to label
    first = _labels(db, "implicit@3")
    one = _labels(db, "implicit@1")
    assert _weight(first, one, "later") == pytest.approx(_expected_weight(db, ["earlier"]), abs=1e-6)
    assert _weight(first, one, "later") == pytest.approx(2 / 3, abs=1e-6)  # one earlier success

    assert relabel("implicit@3").relabeled == 2
    again = _labels(db, "implicit@3")
    assert again["later"] == first["later"] and _weight(again, one, "earlier") == pytest.approx(0.5, abs=1e-6)


@pytest.fixture
def one_second_window(monkeypatch):
    from consumers.settings import get_consumer_settings

    monkeypatch.setenv("FLYWHEEL_CONSUMER_SIGNAL_WINDOW_S", "1")
    get_consumer_settings.cache_clear()
    yield
    get_consumer_settings.cache_clear()


def test_a_trajectory_whose_window_closed_counts_before_the_sweep_stores_it(db, one_second_window):
    """A session that waits for a signal that never comes is finalized when its window closes, with
    the signals it had; until the sweep stores that, it is provisional. A trajectory finalized after
    the close counts it either way: the label does not depend on when the sweep ran."""
    from consumers.finalize import finalize_due
    from consumers.ingest import projector_from_settings
    from consumers.relabel import relabel

    feed = Feed()
    feed.apply(_session(3, EASY, 1.0, "waiting", withhold_signal=True))
    time.sleep(1.5)
    feed.apply(_session(4, EASY, 1.0, "after"))
    with psycopg.connect(db) as conn:
        status = dict(conn.execute("SELECT session_id, status FROM trajectory").fetchall())
    assert status == {"waiting": "provisional", "after": "finalized"}

    assert relabel("implicit@3").relabeled == 1
    before_sweep = _labels(db, "implicit@3")
    one = _labels(db, "implicit@1")
    assert _weight(before_sweep, one, "after") == pytest.approx(_expected_weight(db, ["waiting"]), abs=1e-6)
    assert _weight(before_sweep, one, "after") > 0.5

    assert sum(finalize_due(projector_from_settings(), grace_s=0.0).values()) == 1
    assert relabel("implicit@3").relabeled == 2
    after_sweep = _labels(db, "implicit@3")
    assert after_sweep["after"] == before_sweep["after"]
    assert _weight(after_sweep, _labels(db, "implicit@1"), "waiting") == pytest.approx(0.5, abs=1e-6)
