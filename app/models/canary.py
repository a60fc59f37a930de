"""Canaries: a gate-passed candidate served to a sticky fraction of users beside production
(owned by ``app/promotion``; read by serving, the simulator and the API).

Invariant kept at the database, not only in code: at most one canary is ``active`` (the partial
unique index ``uq_canary_one_active``, backed by an advisory lock and ``FOR UPDATE`` in
``app.lifecycle.canary``). A row is never deleted: a stopped canary keeps its window
(``started_at`` .. ``stopped_at``), which is what the online comparison reads.
"""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import DateTime, Float, ForeignKey, Index, String, Text, text
from sqlalchemy.dialects.postgresql import UUID
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base, created_at_column

CANARY_STATUSES = ("active", "stopped")


class Canary(Base):
    """One canary: ``checkpoint_id`` serves users whose arm hash is below ``fraction``; the rest
    are served by ``production_id`` (production when the canary started)."""

    __tablename__ = "canary"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    checkpoint_id: Mapped[str] = mapped_column(String(128), ForeignKey("checkpoint.id"), nullable=False)
    production_id: Mapped[str] = mapped_column(String(128), ForeignKey("checkpoint.id"), nullable=False)
    fraction: Mapped[float] = mapped_column(
        Float, nullable=False, comment="share of users served by the canary, (0, 1)"
    )
    status: Mapped[str] = mapped_column(String(16), nullable=False, default="active", comment="active | stopped")
    actor: Mapped[str] = mapped_column(String(128), nullable=False)
    reason: Mapped[str] = mapped_column(Text, nullable=False, default="")
    gate_decision_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    started_at: Mapped[datetime] = created_at_column()
    stopped_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    stopped_by: Mapped[str | None] = mapped_column(String(128))
    stop_reason: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        Index("uq_canary_one_active", "status", unique=True, postgresql_where=text("status = 'active'")),
        Index("ix_canary_checkpoint_id", "checkpoint_id"),
    )
