"""erasure_request.eval_tasks_deleted: mined eval tasks go with the sessions they came from

A task mined from a production session (``evals.mined``) keeps that session's request text and
test in ``eval_task.spec``. An erasure, and a privacy purge, now delete the tasks mined from the
sessions they delete; the request records how many. Rows stored before this migration count 0.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-22 04:30:00
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = '0012'
down_revision: Union[str, None] = '0011'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column('erasure_request', sa.Column('eval_tasks_deleted', sa.Integer(), nullable=False,
                                               server_default=sa.text('0'),
                                               comment='eval tasks mined from the erased sessions'))


def downgrade() -> None:
    op.drop_column('erasure_request', 'eval_tasks_deleted')
