"""The demo's fresh-traffic curve: a point per cycle from ``flywheel ab``, its picture, its verdict."""

from __future__ import annotations

from ops.demo_report import curve_conclusion, curve_point, render_curve_png


def _ab(final: str, pass_final: float, diff_ci: list[float], persistence: float | None) -> dict:
    metric = lambda v, ci=None: {"base": 0.2, "final": v, "diff": None, "ci": ci, "final_ci": ci}  # noqa: E731
    return {
        "final": final,
        "pairs": 48,
        "metrics": {
            "pass_rate": {**metric(pass_final, [0.1, 0.4]), "diff": pass_final - 0.2, "ci": diff_ci},
            "edit_persistence": metric(persistence),
            "dissatisfied_followup_rate": metric(0.6, [0.4, 0.8]),
            "mean_completion_tokens": metric(96.0, [80.0, 110.0]),
        },
    }


def test_points_carry_the_served_checkpoint_its_interval_and_signals():
    p = curve_point(2, _ab("ckpt-2", 0.25, [-0.05, 0.15], 0.4))
    assert p["cycle"] == 2 and p["checkpoint_id"] == "ckpt-2" and p["pairs"] == 48
    assert p["pass_rate"] == 0.25 and p["pass_rate_ci"] == [0.1, 0.4] and p["diff_vs_base_ci"] == [-0.05, 0.15]
    assert set(p["signals"]) == {"edit_persistence", "dissatisfied_followup_rate", "mean_completion_tokens"}


def test_the_verdict_says_what_the_run_can_and_cannot_conclude():
    same = [curve_point(c, _ab("base", 0.2, [0.0, 0.0], 0.4)) for c in (1, 2, 3)]
    assert curve_conclusion(same).startswith("production stayed base")
    better = same[:2] + [curve_point(3, _ab("ckpt-3", 0.5, [0.1, 0.4], 0.5))]
    assert "beats base" in curve_conclusion(better)
    unclear = same[:2] + [curve_point(3, _ab("ckpt-3", 0.25, [-0.1, 0.2], 0.5))]
    assert "cannot be told apart" in curve_conclusion(unclear)
    assert all("too small to conclude" in curve_conclusion(c) for c in (same, better, unclear))
    assert curve_conclusion([]) == "no checkpoint was measured on fresh traffic."


def test_the_picture_skips_undefined_signals(tmp_path):
    curve = [curve_point(1, _ab("base", 0.0, [0.0, 0.0], None)), curve_point(2, _ab("ckpt-2", 0.5, [0.1, 0.4], 0.4))]
    path = render_curve_png(curve, tmp_path / "fresh_traffic.png")
    assert path.stat().st_size > 10_000


def test_the_demos_loop_mines_no_eval_tasks_from_its_own_training_traffic(tmp_path):
    """Beat's hourly mined-suite refresh is off in the demo's (and so the bench's) loop: a task mined
    from the simulated traffic would be held out of the cycles being measured."""
    from ops.demo import DemoOptions, loop_env

    assert loop_env(DemoOptions(), tmp_path, 8000)["FLYWHEEL_EVAL_MINE_INTERVAL"] == "0"
