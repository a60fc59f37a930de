"""API tokens, promotions and the append-only audit log (owned by ``app/api`` and ``app/promotion``).

Invariants kept at the database, not only in code: ``audit_log`` refuses UPDATE, DELETE and
TRUNCATE (a trigger); at most one live (unrevoked) token has a given name (a partial unique index),
so ``flywheel tokens revoke NAME`` is unambiguous; only the sha256 of a token is stored.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, DateTime, ForeignKey, Index, String, Text, text
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base, created_at_column

ROLES = ("viewer", "release_manager", "service", "inference")


class ApiToken(Base):
    """A bearer token; only its sha256 is stored."""

    __tablename__ = "api_token"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), nullable=False)
    role: Mapped[str] = mapped_column(String(32), nullable=False)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True, nullable=False)
    created_at: Mapped[datetime] = created_at_column()
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        Index("uq_api_token_live_name", "name", unique=True, postgresql_where=text("revoked_at IS NULL")),
    )


class Promotion(Base):
    """A change of production: a promotion or a rollback (a promotion of an earlier checkpoint)."""

    __tablename__ = "promotion"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), nullable=False, comment="promotion | rollback | initial")
    checkpoint_id: Mapped[str] = mapped_column(String(128), ForeignKey("checkpoint.id"), nullable=False)
    previous_production_id: Mapped[str | None] = mapped_column(String(128), ForeignKey("checkpoint.id"))
    actor: Mapped[str] = mapped_column(String(128), nullable=False)
    reason: Mapped[str] = mapped_column(Text, nullable=False, default="")
    gate_decision_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    created_at: Mapped[datetime] = created_at_column()

    __table_args__ = (
        Index("ix_promotion_created", "created_at"),
        Index("ix_promotion_checkpoint_id", "checkpoint_id"),
    )


class AuditLog(Base):
    """Every change by a person or service: who, what, on what, with which details."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    actor: Mapped[str] = mapped_column(String(128), nullable=False)
    action: Mapped[str] = mapped_column(String(64), nullable=False)
    target: Mapped[str | None] = mapped_column(String(256))
    details: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, default=dict)
    created_at: Mapped[datetime] = created_at_column()
