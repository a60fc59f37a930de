"""The simulator's plan: which task and budget each session gets, long sessions included."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ops.simulator import (
    LONG_SESSION_MIN_TURNS,
    LONG_SESSION_SOURCE,
    PRODUCTION_MIX,
    SimulatorConfig,
    long_groups,
    plan_sessions,
)


def _rows(config: SimulatorConfig) -> list[tuple]:
    """What a plan decides per session (its session id is a fresh uuid, not part of the plan)."""
    return [
        (s.index, s.task.id, s.user_id, s.privacy, s.seed, s.rng.random(), s.max_turns, s.max_tokens)
        for s in plan_sessions(config, object())
    ]


def test_without_long_sessions_the_plan_is_the_one_before_the_setting():
    """Recorded from the simulator before ``long_session_share`` existed (commit 1462a43), the
    draws unchanged since; the tasks re-recorded when templates left ``train`` for the report and
    fresh splits (evals/functions_splits.toml, 2026-12-02): the benches' traffic stays comparable."""
    config = SimulatorConfig(sessions=10, group_size=4, source="functions", difficulty_mix=PRODUCTION_MIX, seed=7)
    assert _rows(config) == [
        (0, "FN/count_substring/0", "user-010", False, 700021, 0.8923591209280145, 6, 1024),
        (1, "FN/count_substring/0", "user-001", True, 700022, 0.6262302619591787, 6, 1024),
        (2, "FN/count_substring/0", "user-011", False, 700023, 0.395034627629794, 6, 1024),
        (3, "FN/count_substring/0", "user-006", True, 700024, 0.32261332922187136, 6, 1024),
        (4, "FN/change_case/2", "user-002", False, 700025, 0.6333405709095342, 6, 1024),
        (5, "FN/change_case/2", "user-001", False, 700026, 0.5593572608495424, 6, 1024),
        (6, "FN/change_case/2", "user-007", False, 700027, 0.8430294956140809, 6, 1024),
        (7, "FN/change_case/2", "user-001", False, 700028, 0.9899070019879793, 6, 1024),
        (8, "FN/sum_selected/0", "user-007", True, 700029, 0.06059657243155614, 6, 1024),
        (9, "FN/sum_selected/0", "user-009", False, 700030, 0.6882469798806764, 6, 1024),
    ]
    uniform = SimulatorConfig(sessions=6, group_size=2, tasks=2, source="functions", seed=3)
    assert [r[1:5] for r in _rows(uniform)] == [
        ("FN/compare_versions/2", "user-007", False, 300009),
        ("FN/compare_versions/2", "user-015", False, 300010),
        ("FN/convert_units/0", "user-000", False, 300011),
        ("FN/convert_units/0", "user-007", False, 300012),
        ("FN/compare_versions/2", "user-015", False, 300013),
        ("FN/compare_versions/2", "user-007", False, 300014),
    ]
    assert _rows(config.model_copy(update={"long_session_share": 0.0})) == _rows(config)


@pytest.mark.parametrize(("share", "groups"), [(0.25, 4), (0.1, 16), (0.5, 16), (0.01, 16), (1.0, 16)])
def test_a_share_of_whole_groups_plays_long_sessions_with_the_turns_to_summarize(share, groups):
    config = SimulatorConfig(
        sessions=4 * groups,
        group_size=4,
        source="functions",
        difficulty_mix=PRODUCTION_MIX,
        max_turns=2,  # the demo's and the bench's budget
        max_tokens=320,
        max_tokens_per_turn=160,
        long_session_share=share,
        seed=5,
    )
    rows, plain = _rows(config), _rows(config.model_copy(update={"long_session_share": 0.0}))
    long = [r for r in rows if r[1].startswith("FNL/")]
    n_long = max(1, round(share * groups))
    assert len(long) == 4 * n_long == 4 * len(long_groups(config))
    assert all(r[1].split("/")[1] == "train" for r in long)  # functions_long's train split only
    assert len({r[1] for r in long}) == n_long  # one task per group, whole groups
    for g in range(groups):
        group = rows[4 * g : 4 * g + 4]
        assert len({r[1] for r in group}) == 1
    for r, p in zip(rows, plain):
        assert r[2:6] == p[2:6]  # users, privacy, seeds: as without long sessions
        if r[1].startswith("FNL/"):
            assert r[6:] == (LONG_SESSION_MIN_TURNS, LONG_SESSION_MIN_TURNS * 160)
        else:
            assert r[1] == p[1] and r[6:] == (2, 320)  # the other groups keep their task and budget
    assert rows == _rows(config)  # seeded: the same plan again
    assert _rows(config.model_copy(update={"seed": 6})) != rows


def test_long_sessions_keep_a_budget_that_already_reaches_the_summary():
    config = SimulatorConfig(sessions=4, group_size=2, source="functions", max_turns=6, long_session_share=0.5)
    long = [s for s in plan_sessions(config, object()) if s.task.source == LONG_SESSION_SOURCE]
    assert len(long) == 2 and {(s.max_turns, s.max_tokens) for s in long} == {(6, 1024)}


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan")])
def test_a_share_outside_0_to_1_is_refused(share):
    with pytest.raises(ValidationError, match="long_session_share"):
        SimulatorConfig(long_session_share=share)


@pytest.mark.parametrize("command", [["simulate"], ["demo"]])
def test_the_cli_refuses_a_share_outside_0_to_1_before_running(command):
    from typer.testing import CliRunner

    from ops.cli import app

    result = CliRunner().invoke(app, [*command, "--long-sessions", "1.5"])
    assert result.exit_code == 2 and "--long-sessions" in result.output, result.output


def test_the_demo_keeps_long_segments_in_training_only_when_its_traffic_has_long_sessions(tmp_path):
    from ops.demo import LONG_SEGMENT_TOKENS, DemoOptions, trainer_toml
    from trainer.config import load_config

    plain = load_config(trainer_toml(DemoOptions(), tmp_path / "plain"))
    long = load_config(trainer_toml(DemoOptions(long_session_share=0.25), tmp_path / "long"))
    assert plain.data.max_seq_len == load_config(None).data.max_seq_len < LONG_SEGMENT_TOKENS
    assert long.data.max_seq_len == LONG_SEGMENT_TOKENS and long.data.min_new_trajectories == 4  # 16 sessions
    bench = load_config(trainer_toml(DemoOptions(sessions=256), tmp_path / "bench"))
    assert (
        bench.data.min_new_trajectories == 64
        and load_config(trainer_toml(DemoOptions(sessions=3), tmp_path)).data.min_new_trajectories == 1
    )


def test_the_demos_placebo_shuffles_within_task_groups_unless_told_otherwise(tmp_path):
    from ops.demo import DemoOptions, trainer_toml
    from trainer.config import load_config

    assert not load_config(trainer_toml(DemoOptions(), tmp_path / "real")).data.placebo
    default = load_config(trainer_toml(DemoOptions(placebo="within_group"), tmp_path / "placebo")).data
    assert default.placebo and default.placebo_mode == "within_group"
    old = DemoOptions(placebo="across_cycle")
    assert load_config(trainer_toml(old, tmp_path / "old")).data.placebo_mode == "across_cycle"
