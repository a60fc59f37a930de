"""task_environment: environments proposed for tasks and their verification, cached by content hash

``env_hash`` (sha256 of the task key and the canonical proposal) identifies one verification;
``task_key`` finds a task's verified environment without asking the model again. A mined task's
rows cascade with its ``eval_task`` row, so an erasure removes them too.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-26 04:30:00
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0019'
down_revision: Union[str, None] = '0018'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table('task_environment',
    sa.Column('env_hash', sa.String(length=64), nullable=False),
    sa.Column('task_key', sa.String(length=64), nullable=False,
              comment="sha256 of the task's code, tests, reference and the allowed list"),
    sa.Column('task_id', sa.String(length=256), nullable=False),
    sa.Column('source', sa.String(length=64), nullable=False),
    sa.Column('eval_task_id', sa.String(length=256), nullable=True, comment='set for mined tasks'),
    sa.Column('origin', sa.String(length=16), nullable=False, comment='model | fallback'),
    sa.Column('proposal', postgresql.JSONB(astext_type=sa.Text()), nullable=False,
              comment='canonical {dependencies, files}'),
    sa.Column('verified', sa.Boolean(), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True,
              comment="model rows: why verification failed; fallback rows: why the model's proposal was not used"),
    sa.Column('checkpoint_id', sa.String(length=128), nullable=True, comment='the model that proposed'),
    sa.Column('detail', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.ForeignKeyConstraint(['eval_task_id'], ['eval_task.task_id'],
                            name=op.f('fk_task_environment_eval_task_id_eval_task'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('env_hash', name=op.f('pk_task_environment'))
    )
    op.create_index('ix_task_environment_task_key_verified', 'task_environment', ['task_key', 'verified'],
                    unique=False)
    op.create_index('ix_task_environment_eval_task_id', 'task_environment', ['eval_task_id'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_task_environment_eval_task_id', table_name='task_environment')
    op.drop_index('ix_task_environment_task_key_verified', table_name='task_environment')
    op.drop_table('task_environment')
