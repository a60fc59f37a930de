"""Unit tests of the promotion area's pure parts: intervals, cursors, the serving watcher's plan and
dedupe (checkpoint directories on disk, a recording engine; no database, no broker)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.checkpoints.store import CheckpointStore
from app.core.intervals import newcombe_diff_interval, wilson_interval
from app.lifecycle.messages import CheckpointRejected, LineageEntry, ProductionChanged
from app.promotion.queries import InvalidCursorError, decode_cursor, encode_cursor
from serving.moves import plan_move
from serving.watcher import Deduper, ProductionFollower


def test_wilson_interval_matches_reference_values():
    # Newcombe (1998), Table I: 81/263 -> 0.2553..0.3662; 0/10 -> 0..0.2775.
    low, high = wilson_interval(81, 263)
    assert low == pytest.approx(0.2553, abs=1e-4) and high == pytest.approx(0.3662, abs=1e-4)
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)
    for n in (1, 7, 112, 263, 1000):  # the interval holds its own point estimate, exactly
        for k in range(n + 1):
            low, high = wilson_interval(k, n)
            assert 0.0 <= low <= k / n <= high <= 1.0, (k, n)


def test_newcombe_difference_interval_matches_reference_values():
    # Newcombe (1998), Table II, example (a): 56/70 - 48/80 -> 0.0524..0.3339 (method 10).
    low, high = newcombe_diff_interval(56, 70, 48, 80)
    assert low == pytest.approx(0.0524, abs=1e-4) and high == pytest.approx(0.3339, abs=1e-4)
    # Example (e): 0/10 - 0/20 -> -0.1611..0.2775.
    low, high = newcombe_diff_interval(0, 10, 0, 20)
    assert low == pytest.approx(-0.1611, abs=1e-4) and high == pytest.approx(0.2775, abs=1e-4)
    assert newcombe_diff_interval(1, 0, 1, 2) == (-1.0, 1.0)


def test_cursor_round_trip_and_rejects_foreign_cursors():
    c = encode_cursor(["2026-11-21T10:00:00+00:00", "ckpt-0001"])
    assert decode_cursor(c, 2) == ["2026-11-21T10:00:00+00:00", "ckpt-0001"]
    for bad in ("garbage!", encode_cursor([1]), encode_cursor({"a": 1})):
        with pytest.raises(InvalidCursorError):
            decode_cursor(bad, 2)


class RecordingEngine:
    """The engine interface the watcher drives: it records each full load."""

    def __init__(self, checkpoint_id: str) -> None:
        self.checkpoint_id = checkpoint_id
        self.calls: list[tuple[str, str]] = []

    def load_checkpoint(self, checkpoint_id: str, path: Path) -> None:
        assert (path / "STABLE").exists()
        self.calls.append(("full", checkpoint_id))
        self.checkpoint_id = checkpoint_id


@pytest.fixture
def chain(tmp_path) -> tuple[CheckpointStore, dict[str, dict]]:
    """base <- c1 <- c2, and a sibling s1 of c1."""
    store = CheckpointStore(tmp_path / "ckpts")
    parents = {"base": None, "c1": "base", "c2": "c1", "s1": "base"}
    for cid, parent in parents.items():
        with store.writer(cid) as d:
            (d / "manifest.json").write_text(json.dumps({"parent_id": parent}))

    def payload(cid: str, outbox_id: int, kind: str = "checkpoint.promoted") -> ProductionChanged:
        lineage, cur = [], cid
        while cur:
            lineage.append(LineageEntry(id=cur, path=str(store.path(cur))))
            cur = parents[cur]
        return ProductionChanged(
            type=kind,
            event_id=f"ev-{outbox_id}",
            outbox_id=outbox_id,
            checkpoint_id=cid,
            path=str(store.path(cid)),
            lineage=lineage,
        )

    return store, payload


def test_plan_move_loads_the_target_folder_unless_it_serves(chain):
    store, payload = chain
    move = plan_move("base", payload("c2", 1), store)
    assert move.method == "full" and move.path == store.stable_path("c2")
    assert plan_move("c2", payload("c2", 1), store).method == "noop"
    assert plan_move("c2", payload("c1", 1), store).method == "full"  # rollback to an ancestor
    assert plan_move(None, payload("c1", 1), store).method == "full"


def test_follower_dedupes_and_jumps_to_the_newest_change(chain, tmp_path):
    store, payload = chain
    engine = RecordingEngine("base")
    follower = ProductionFollower(engine, store=store, home=tmp_path)
    move = follower.handle_batch(
        [
            (payload("c1", 1), None),
            (payload("c2", 2), None),
            (CheckpointRejected(checkpoint_id="s1", previous_status="candidate"), None),
        ]
    )
    assert move.method == "full" and engine.calls == [("full", "c2")]
    # A re-published copy (same event id) and a stale change (older outbox id) do nothing.
    assert follower.handle_batch([(payload("c1", 1), None), (payload("c2", 2), None)]) is None
    stale = payload("c1", 1).model_copy(update={"event_id": "ev-other"})
    assert follower.handle_batch([(stale, None)]) is None
    follower.handle_batch([(payload("c1", 3, "checkpoint.rolled_back"), None)])
    assert engine.calls[-1] == ("full", "c1")
    state = json.loads((tmp_path / "serving.json").read_text())
    assert state["checkpoint_id"] == "c1" and state["applied_outbox_id"] == 3 and state["method"] == "full"
    # A restarted follower remembers what it applied.
    again = ProductionFollower(engine, store=store, home=tmp_path)
    assert again.handle_batch([(payload("c2", 2), None), (payload("c1", 3), None)]) is None


def test_deduper_is_bounded():
    d = Deduper(capacity=3)
    assert all(d.first_time(i) for i in "abcd")
    assert d.ids() == ["b", "c", "d"] and not d.first_time("d") and d.first_time("a")
    assert d.first_time(None) and d.first_time(None)


def test_a_failed_move_is_retried_not_forgotten(chain, tmp_path):
    from app.core.errors import CheckpointError

    store, payload = chain
    msg = payload("c1", 1, "checkpoint.rolled_back")
    engine = RecordingEngine("c2")
    follower = ProductionFollower(engine, store=store, home=tmp_path)
    (store.path("c1") / "STABLE").rename(store.path("c1") / "STABLE.hidden")  # not synced to this node yet
    with pytest.raises(CheckpointError):
        follower.handle_batch([(msg, None)])
    assert engine.calls == []
    (store.path("c1") / "STABLE.hidden").rename(store.path("c1") / "STABLE")
    assert follower.handle_batch([(msg, None)]).method == "full" and engine.checkpoint_id == "c1"


def test_follower_logs_and_reports_a_full_reload(chain, tmp_path, caplog):
    store, payload = chain
    engine = RecordingEngine("base")
    follower = ProductionFollower(engine, store=store, home=tmp_path)
    with caplog.at_level("INFO", logger="flywheel.watcher"):
        move = follower.handle_batch([(payload("c2", 1), None)])
    assert move.method == "full" and engine.calls == [("full", "c2")]
    assert json.loads((tmp_path / "serving.json").read_text())["method"] == "full"
    assert "serving c2 by a full reload" in caplog.text
