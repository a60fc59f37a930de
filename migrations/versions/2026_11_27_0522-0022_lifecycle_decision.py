"""lifecycle_decision: the gate's decision as a column, checkpoint statuses held to their enum

``gate_decision.decision`` stores what each gate decided (pass | fail | insufficient_evidence |
not_gated) and ``checkpoint.decision`` what the latest gate found for a checkpoint, or
``overridden`` when a release manager promoted over it. Both are backfilled from what was stored
before: the decision in each gate's report JSON (a report without one reads as pass or fail by its
``passed`` flag), the latest gate per checkpoint, and the ``gate.overridden`` audit entries.
CHECK constraints keep ``checkpoint.status`` and both decisions inside their enums.

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-27 05:22:00
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = '0022'
down_revision: Union[str, None] = '0021'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

STATUSES = "('candidate', 'gate_passed', 'gate_failed', 'production', 'retired', 'rejected')"
VERDICTS = "('pass', 'fail', 'insufficient_evidence', 'not_gated', 'overridden')"
GATED = "('pass', 'fail', 'insufficient_evidence', 'not_gated')"


def upgrade() -> None:
    op.add_column('gate_decision', sa.Column(
        'decision', sa.String(length=32), nullable=True,
        comment='pass | fail | insufficient_evidence | not_gated (evals.gate)'))
    op.execute(
        "UPDATE gate_decision SET decision = CASE WHEN report->>'decision' IN " + GATED + " "
        "THEN report->>'decision' WHEN passed THEN 'pass' ELSE 'fail' END"
    )
    op.alter_column('gate_decision', 'decision', nullable=False)
    op.add_column('checkpoint', sa.Column(
        'decision', sa.String(length=32), nullable=True,
        comment="the latest gate's decision (GateVerdict), or overridden; NULL until gated"))
    op.execute(
        "UPDATE checkpoint c SET decision = g.decision FROM ("
        " SELECT DISTINCT ON (candidate_id) candidate_id, decision FROM gate_decision"
        " ORDER BY candidate_id, created_at DESC, id DESC) g WHERE g.candidate_id = c.id"
    )
    op.execute(
        "UPDATE checkpoint c SET decision = 'overridden' FROM audit_log a"
        " WHERE a.action = 'gate.overridden' AND a.target = 'checkpoint:' || c.id"
    )
    op.create_check_constraint('status_known', 'checkpoint', 'status IN ' + STATUSES)
    op.create_check_constraint('decision_known', 'checkpoint', 'decision IS NULL OR decision IN ' + VERDICTS)
    op.create_check_constraint('decision_known', 'gate_decision', 'decision IN ' + GATED)


def downgrade() -> None:
    # the metadata's naming convention expands each name to ck_<table>_<name>, as on creation
    op.drop_constraint('decision_known', 'gate_decision', type_='check')
    op.drop_constraint('decision_known', 'checkpoint', type_='check')
    op.drop_constraint('status_known', 'checkpoint', type_='check')
    op.drop_column('checkpoint', 'decision')
    op.drop_column('gate_decision', 'decision')
