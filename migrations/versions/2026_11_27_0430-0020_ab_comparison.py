"""ab_comparison: every flywheel ab result (the fresh-traffic learning curve)

One row per completed ``flywheel ab BASE FINAL``, inserted and never changed; the API lists them
newest first for the dashboard.

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-27 04:30:00
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0020'
down_revision: Union[str, None] = '0019'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table('ab_comparison',
    sa.Column('id', sa.BigInteger(), autoincrement=True, nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('label', sa.String(length=128), nullable=True, comment='free text naming the run, e.g. cycle-2'),
    sa.Column('base_id', sa.String(length=128), nullable=False, comment="the baseline arm's checkpoint"),
    sa.Column('checkpoint_id', sa.String(length=128), nullable=False,
              comment="the compared arm's checkpoint (the served one on a curve)"),
    sa.Column('pairs', sa.Integer(), nullable=False, comment='(task, sample) pairs both arms completed'),
    sa.Column('tasks', sa.Integer(), nullable=False, comment='distinct tasks among the pairs'),
    sa.Column('samples', sa.Integer(), nullable=False, comment='sessions per task and arm asked for'),
    sa.Column('confidence', sa.Float(), nullable=False, comment='level of every interval'),
    sa.Column('base_pass_rate', sa.Float(), nullable=True),
    sa.Column('pass_rate', sa.Float(), nullable=True),
    sa.Column('pass_rate_diff', sa.Float(), nullable=True, comment='pass_rate - base_pass_rate'),
    sa.Column('diff_ci_low', sa.Float(), nullable=True),
    sa.Column('diff_ci_high', sa.Float(), nullable=True),
    sa.Column('pass_rate_lower_bound', sa.Float(), nullable=True,
              comment='one-sided lower bound of pass_rate_diff at confidence'),
    sa.Column('metrics', postgresql.JSONB(astext_type=sa.Text()), nullable=False,
              comment='metric -> {base, final, diff, ci, base_ci, final_ci, higher_is_better} (ops.ab.METRICS)'),
    sa.Column('config', postgresql.JSONB(astext_type=sa.Text()), nullable=False,
              comment='the A/B settings: mix, seed, budgets (ops.ab.ABConfig)'),
    sa.Column('detail', postgresql.JSONB(astext_type=sa.Text()), nullable=False,
              comment='source, split, tasks_by_difficulty, sessions ran/reused, errors'),
    sa.Column('report_path', sa.Text(), nullable=True, comment='the JSON report flywheel ab wrote'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_ab_comparison'))
    )
    op.create_index('ix_ab_comparison_checkpoint_id', 'ab_comparison', ['checkpoint_id'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_ab_comparison_checkpoint_id', table_name='ab_comparison')
    op.drop_table('ab_comparison')
