"""trajectory_segment.routed_experts: MoE routes kept with the completion tokens they routed

The projection stores the serving engine's routed experts (``model.responded.routed_experts``) per
segment, aligned with its completion tokens, one or two bytes per layer x top-k entry, so the trainer
can replay them (router replay, R3). Segments stored before this migration have no routes.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-24 04:30:00
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0014'
down_revision: Union[str, None] = '0013'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column('trajectory_segment', sa.Column(
        'routed_experts', sa.LargeBinary(), nullable=False, server_default=sa.text("''::bytea"),
        comment='MoE expert ids per completion token x layer x top-k (empty: no routes)'))
    op.add_column('trajectory_segment', sa.Column(
        'routed_experts_shape', postgresql.ARRAY(sa.Integer()), nullable=True,
        comment='[layers, top_k] of routed_experts; NULL when it is empty'))
    op.add_column('trajectory_segment', sa.Column(
        'routed_experts_itemsize', sa.Integer(), nullable=True,
        comment='bytes per expert id in routed_experts (1 or 2); NULL when it is empty'))


def downgrade() -> None:
    op.drop_column('trajectory_segment', 'routed_experts_itemsize')
    op.drop_column('trajectory_segment', 'routed_experts_shape')
    op.drop_column('trajectory_segment', 'routed_experts')
