"""What beat's ``train-when-ready`` check reads from the database (``trainer.selection.trajectories_waiting``):
the finalized trajectories waiting, and the newest traffic, which includes sessions still open."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from sqlalchemy import func, select

from app.core.db import session_scope
from app.models import Trajectory
from trainer.selection import trajectories_waiting
from trainer.tasks import cycle_due

pytestmark = pytest.mark.integration


def _trajectory(status: str, **times) -> Trajectory:
    tid = uuid.uuid4()
    return Trajectory(id=tid, session_id=f"s-{tid}", user_id="u", org_id="o", status=status, **times)


def test_a_batch_is_quiet_only_when_no_session_of_it_is_still_talking(db):
    with session_scope() as session:
        now = session.scalar(select(func.now()))
        early = now - timedelta(seconds=120)  # the first wave of sessions finished two minutes ago
        session.add_all([_trajectory("finalized", finalized_at=early, last_event_at=early) for _ in range(3)])
        talking = _trajectory("provisional", last_event_at=now - timedelta(seconds=5))  # the next wave
        session.add(talking)
        session.add(_trajectory("provisional", last_event_at=now - timedelta(hours=2)))  # a session that died
    with session_scope() as session:
        waiting, newest = trajectories_waiting(session)
    assert waiting == 3 and newest == talking.last_event_at
    assert not cycle_due(waiting, newest, now, ready_at=256, quiet_s=20)
    with session_scope() as session:
        session.get(Trajectory, talking.id).status = "finalized"
        session.get(Trajectory, talking.id).finalized_at = now - timedelta(seconds=4)
    with session_scope() as session:
        waiting, newest = trajectories_waiting(session)
    assert waiting == 4 and cycle_due(waiting, newest, now + timedelta(seconds=30), ready_at=256, quiet_s=20)
