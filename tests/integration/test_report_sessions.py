"""The loop report counts the sessions whose agent self-summarized (trajectories of several segments)."""

from __future__ import annotations

import json

import pytest

from ops.report import collect_report, write_report
from trainer.testing import insert_trajectory, make_segment

pytestmark = pytest.mark.integration


def test_the_report_counts_sessions_with_more_than_one_segment(session, tmp_path):
    one = make_segment([1, 2, 3], [4, 5])
    insert_trajectory(session, segments=[one], reward=1.0)
    insert_trajectory(session, segments=[one, make_segment([6, 7], [8])], reward=0.0)
    insert_trajectory(session, segments=[one, one, one], reward=0.5, status="provisional")
    session.commit()
    assert collect_report(session).multi_segment_sessions == 2
    write_report(session, tmp_path)
    assert json.loads((tmp_path / "report.json").read_text())["multi_segment_sessions"] == 2
