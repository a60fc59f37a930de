"""The simulated developer's knowledge as settings: each knob changes the signals as documented
(docs/simulator.md, "Noisier developers")."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from ops.developer import DeveloperModel, DeveloperReaction

SESSIONS = 600


@dataclass
class Settings:
    developer: DeveloperModel = field(default_factory=DeveloperModel)
    run_timeout_s: float = 10.0
    persistence_delay_s: float = 5.0
    followup_delay_s: float = 2.0


RESULT = SimpleNamespace(
    edited=True,
    final_files={"solution.py": "def f(x):\n    return x\n"},
    edits=[{"edit_id": "e1", "path": "solution.py", "added": ["def f(x):", "    return x"]}],
)


def signals(outcome: str, seed: int = 0, **knobs) -> dict:
    """React to ``SESSIONS`` sessions whose true outcome is ``outcome``; tally what was emitted."""
    settings = Settings(developer=DeveloperModel(**knobs))
    emitted, scheduled, seen = [], [], []
    expected = 0
    for i in range(SESSIONS):
        dev = DeveloperReaction(
            settings,
            random.Random(seed * 1_000_003 + i),
            task=None,
            workdir=None,
            envelope=dict(session_id=f"s{i}", user_id="u", org_id="o", privacy_mode=False),
            emit=emitted.append,
            schedule=lambda delay, event: scheduled.append((delay, event)),
        )
        dev.outcome = outcome
        expected += len(dev.react(RESULT))
        seen.append(dev.seen)
    accepted = sum(e.type == "edit.accepted" for e in emitted)
    persisted = [e.payload.fraction_persisted for _, e in scheduled if e.type == "edit.persistence_measured"]
    return {
        "accept": accepted / SESSIONS,
        "followup": sum(e.type == "followup.sent" for _, e in scheduled) / SESSIONS,
        "persisted": sum(persisted) / max(len(persisted), 1),
        "late_signals": len(scheduled),
        "expected": expected,
        "delays": sorted({d for d, _ in scheduled}),
        "seen": {o: seen.count(o) / SESSIONS for o in set(seen)},
        "accepted": accepted,
    }


def test_the_default_developer_knows_the_outcome():
    for outcome in ("works", "looks_right", "broken"):
        s = signals(outcome)
        assert s["seen"] == {outcome: 1.0} and s["expected"] == s["late_signals"]
    assert signals("works")["accept"] == pytest.approx(0.95, abs=0.03)
    assert signals("looks_right")["accept"] == pytest.approx(0.5, abs=0.05)


def test_keeps_wrong_rate_makes_plausible_wrong_edits_look_like_working_ones():
    exact, fooled, half = (
        signals("looks_right"),
        signals("looks_right", keeps_wrong_rate=1.0),
        signals("looks_right", keeps_wrong_rate=0.5),
    )
    assert fooled["seen"] == {"works": 1.0}
    assert fooled["accept"] == pytest.approx(0.95, abs=0.03) and fooled["followup"] == pytest.approx(0.05, abs=0.03)
    assert exact["followup"] == pytest.approx(0.7, abs=0.05) and fooled["persisted"] > 0.8 > 0.3 > exact["persisted"]
    assert half["seen"]["works"] == pytest.approx(0.5, abs=0.06)
    assert exact["accept"] < half["accept"] < fooled["accept"]
    # Working and broken sessions are what they are: the knob fools only on plausible wrong code.
    assert signals("works", keeps_wrong_rate=1.0)["seen"] == {"works": 1.0}
    assert signals("broken", keeps_wrong_rate=1.0)["seen"] == {"broken": 1.0}


def test_untested_sessions_are_judged_by_the_visible_check_alone():
    tested, untested = signals("works"), signals("works", untested_rate=1.0)
    assert untested["seen"] == {"looks_right": 1.0}  # working code looks no different from plausible wrong code
    assert untested["accept"] == pytest.approx(0.5, abs=0.05) and untested["accept"] < tested["accept"]
    assert untested["followup"] == pytest.approx(0.7, abs=0.05) and untested["followup"] > tested["followup"]
    assert untested["persisted"] < 0.3 < 0.8 < tested["persisted"]
    # Untested, a plausible wrong session reacts exactly as a working one: the signals carry no correctness.
    wrong = signals("looks_right", untested_rate=1.0)
    assert wrong["accept"] == untested["accept"] and wrong["followup"] == untested["followup"]
    assert signals("broken", untested_rate=1.0)["seen"] == {"broken": 1.0}


def test_lost_late_signals_are_never_sent_nor_announced():
    full, lossy = signals("works"), signals("works", signal_loss_rate=0.5)
    assert lossy["expected"] == lossy["late_signals"]  # what is announced is what arrives
    assert lossy["late_signals"] / lossy["accepted"] == pytest.approx(
        0.5 * full["late_signals"] / full["accepted"], abs=0.07
    )
    assert signals("works", signal_loss_rate=1.0)["late_signals"] == 0


def test_late_signals_arrive_later():
    assert signals("broken")["delays"] == [2.0, 5.0]
    late = signals("broken", late_signal_rate=1.0, late_signal_delay_s=30.0)
    assert late["delays"] == [32.0, 35.0] and late["expected"] == late["late_signals"]
    some = signals("broken", late_signal_rate=0.3, late_signal_delay_s=30.0)
    assert some["delays"] == [2.0, 5.0, 32.0, 35.0]


def test_noise_knobs_are_bounded():
    for knob in ("keeps_wrong_rate", "untested_rate", "signal_loss_rate", "late_signal_rate"):
        with pytest.raises(ValueError):
            DeveloperModel(**{knob: 1.5})


def test_the_demos_developer_noise_reaches_flywheel_simulate_as_set():
    """``developer_args`` gives ``flywheel simulate`` the knobs that differ from the exact developer;
    the simulate command parses them back to the same values (and the exact developer adds none)."""
    import typer

    from ops.cli import app
    from ops.developer import DeveloperModel, developer_args

    assert developer_args(DeveloperModel()) == []
    noisy = DeveloperModel(keeps_wrong_rate=0.3, untested_rate=0.25, signal_loss_rate=0.2)
    args = developer_args(noisy)
    assert args == ["--keeps-wrong-rate", "0.3", "--untested-rate", "0.25", "--signal-loss-rate", "0.2"]
    simulate = typer.main.get_command(app).commands["simulate"]
    params = simulate.make_context("simulate", list(args)).params
    assert (params["keeps_wrong_rate"], params["untested_rate"], params["signal_loss_rate"]) == (0.3, 0.25, 0.2)
    assert params["late_signal_rate"] == 0.0
