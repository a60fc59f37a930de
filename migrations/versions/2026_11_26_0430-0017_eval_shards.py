"""eval shards: an eval run's tasks split into slices that Celery workers claim and run

``eval_shard`` is keyed by (run, shard index); ``attempts`` counts claims and fences the current
claimant; ``heartbeat_at`` tells the coordinating process whether the claimant is alive. ``tasks``
is ``json``, not ``jsonb``, so each task keeps its key order (its hash is taken over it).

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-26 04:30:00
"""

from collections.abc import Sequence
from typing import Union

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0017"
down_revision: Union[str, None] = "0016"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        "eval_shard",
        sa.Column("run_id", sa.UUID(), nullable=False),
        sa.Column("shard_index", sa.Integer(), nullable=False),
        sa.Column(
            "tasks",
            postgresql.JSON(astext_type=sa.Text()),
            nullable=False,
            comment="the shard's tasks, serialized (evals.tasks.model.Task)",
        ),
        sa.Column("status", sa.String(length=16), nullable=False, comment="pending | running | done | failed"),
        sa.Column("attempts", sa.Integer(), nullable=False, comment="claims so far"),
        sa.Column("worker", sa.String(length=256), nullable=True, comment="the latest claimant"),
        sa.Column(
            "errors",
            postgresql.JSONB(astext_type=sa.Text()),
            nullable=False,
            comment="sample errors and lost claims, oldest first",
        ),
        sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["eval_run.id"], name=op.f("fk_eval_shard_run_id_eval_run"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "shard_index", name=op.f("pk_eval_shard")),
    )


def downgrade() -> None:
    op.drop_table("eval_shard")
