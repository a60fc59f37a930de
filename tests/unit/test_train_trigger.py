"""When beat's ``train-when-ready`` check starts a cycle (``trainer.tasks.cycle_due``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from trainer.tasks import cycle_due

NOW = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)


def test_enough_waiting_trajectories_start_a_cycle():
    assert cycle_due(12, NOW, NOW, ready_at=12, quiet_s=None)
    assert not cycle_due(11, NOW, NOW, ready_at=12, quiet_s=None)


def test_fewer_start_one_only_once_the_batch_has_been_quiet():
    recent, old = NOW - timedelta(seconds=5), NOW - timedelta(seconds=31)
    assert not cycle_due(3, recent, NOW, ready_at=12, quiet_s=30)
    assert cycle_due(3, old, NOW, ready_at=12, quiet_s=30)
    assert not cycle_due(3, old, NOW, ready_at=12, quiet_s=None)


def test_nothing_waiting_or_no_threshold_never_starts_one():
    old = NOW - timedelta(hours=1)
    assert not cycle_due(0, None, NOW, ready_at=12, quiet_s=30)
    assert not cycle_due(50, old, NOW, ready_at=None, quiet_s=30)


def test_a_quiet_straggler_below_the_cycles_minimum_waits_for_the_next_batch():
    """Seen in the seed-31 bench: one trajectory finalized after its batch's cycle had selected its
    data started a cycle of its own on the quiet rule (a candidate trained on 1 trajectory)."""
    old = NOW - timedelta(seconds=31)
    assert not cycle_due(1, old, NOW, ready_at=256, quiet_s=30, min_waiting=64)
    assert cycle_due(64, old, NOW, ready_at=256, quiet_s=30, min_waiting=64)
    assert cycle_due(256, NOW, NOW, ready_at=256, quiet_s=30, min_waiting=300)  # a full batch always starts
