"""``consumers.replay.compare_projections``: rows are matched by key, not by position."""

from consumers.replay import PROJECTION_TABLES, Rows, compare_projections

COLUMNS = {
    "trajectory": ("id", "status", "num_turns"),
    "trajectory_segment": ("trajectory_id", "segment_index", "num_tokens"),
    "reward_label": ("trajectory_id", "spec", "reward"),
}


def _dump(**rows):
    return {t: Rows(rows.get(t, []), COLUMNS[t]) for t in PROJECTION_TABLES}


def test_identical_dumps_have_no_differences():
    d = _dump(trajectory=[(1, "finalized", 3)], reward_label=[(1, "implicit@1", 0.5)])
    assert compare_projections(d, d) == []


def test_a_missing_row_is_named_once_and_does_not_misalign_the_rest():
    live = _dump(trajectory=[(1, "finalized", 3), (2, "finalized", 4), (3, "provisional", 1)])
    replay = _dump(trajectory=[(1, "finalized", 3), (3, "provisional", 1)])
    assert compare_projections(live, replay, names=("live tables", "replay")) == [
        "trajectory: 1 row(s) only in the live tables, e.g. id=2"
    ]


def test_differing_columns_are_named_under_the_full_key_and_capped_at_limit():
    live = _dump(trajectory_segment=[(1, i, 10) for i in range(8)])
    replay = _dump(trajectory_segment=[(1, i, 11) for i in range(8)])
    diffs = compare_projections(live, replay, limit=3)
    assert diffs == [f"trajectory_segment trajectory_id=1, segment_index={i}: num_tokens differ" for i in range(3)]
