"""Dead letters: records that are not storable events (``consumers.classify`` says why), as the
``dead_letter`` table stores them and the DLQ topic receives them.

A dead letter's row keeps its source position, reason and detail, and the user and session its raw
bytes claim (:func:`claim_of`). One whose claimed user an erasure covers (:func:`covered_by_erasure`)
or whose session is in privacy mode is stored :func:`redacted` / :func:`redacted_private`: without
its key, bytes or headers, and ``redacted`` saying why (``consumers.batch`` decides which). Header
keys and values are stored as text that round-trips to their bytes (:func:`header_text`,
:func:`header_bytes`). Dead letters go to the ``dead_letter`` table in the batch's transaction and to
the DLQ topic (:class:`DeadLetterPublisher`, at least once) with the reason in headers.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any, NamedTuple

import orjson
from kafka import KafkaProducer

from app.repositories.events import DeadLetterRow
from consumers.classify import Decoded, why_unstorable
from consumers.settings import get_consumer_settings
from consumers.trajectory_state import trajectory_id_for
from producers.events.codec import DEFAULT_MAX_EVENT_BYTES
from producers.settings import kafka_security

BASE64_PREFIX = "base64:"
"""A stored header text that starts with this is the base64 of the header's bytes (see :func:`header_text`)."""


def header_text(v: bytes | None) -> str:
    """A Kafka header key or value as text a ``jsonb`` column can hold, and back with
    :func:`header_bytes`: its UTF-8 text, or :data:`BASE64_PREFIX` + base64 of its bytes
    when they are not UTF-8, hold a NUL (Postgres refuses it), or are text that itself starts with
    the prefix (so a stored text with the prefix is always an encoding). ``None`` -> ``""``."""
    if v is None:
        return ""
    try:
        text = v.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and "\x00" not in text and not text.startswith(BASE64_PREFIX):
        return text
    return BASE64_PREFIX + base64.b64encode(v).decode()


MAX_USER_ID_CHARS = 128
"""``dead_letter.user_id`` width (the contract's limit on ``user_id``)."""


class Claim(NamedTuple):
    """Whose event a dead letter's raw bytes say it is: the top-level ``user_id``, ``session_id`` and
    ``occurred_at`` of a JSON object, each None when absent or unusable, and whether it asks for
    ``privacy_mode``. Unvalidated: only used to find the row for an erasure or a privacy purge, and
    to decide whether its bytes may be kept."""

    user_id: str | None = None
    session_id: str | None = None
    occurred_at: datetime | None = None
    privacy_mode: bool = False


def _claimed_str(obj: dict[str, Any], key: str) -> str | None:
    v = obj.get(key)
    if not isinstance(v, str) or not 0 < len(v) <= MAX_USER_ID_CHARS or why_unstorable(v):
        return None
    return v


def claim_of(raw: bytes | None, max_bytes: int) -> Claim:
    """The :class:`Claim` of a record's raw bytes: fields of a JSON object of at most ``max_bytes``
    bytes; ids 1 to 128 characters and storable; ``occurred_at`` an ISO 8601 time with a UTC offset
    (a naive or unparseable time is None); ``privacy_mode`` any value but absent, ``null``,
    ``false`` or ``0`` (a malformed flag errs toward privacy). Never raises."""
    if not raw or len(raw) > max_bytes:
        return Claim()
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return Claim()
    if not isinstance(obj, dict):
        return Claim()
    at = obj.get("occurred_at")
    try:
        when = datetime.fromisoformat(at) if isinstance(at, str) else None
    except ValueError:
        when = None
    return Claim(
        _claimed_str(obj, "user_id"),
        _claimed_str(obj, "session_id"),
        when if when is not None and when.tzinfo is not None else None,
        obj.get("privacy_mode") not in (None, False, 0),
    )


def covered_by_erasure(claim: Claim, erased: Mapping[str, tuple[datetime, Collection[uuid.UUID]]]) -> datetime | None:
    """When the erasure that covers a dead letter was requested, or None if none does.

    ``erased``: ``{user_id: (latest requested_at, erased trajectory ids)}``
    (``app.repositories.events.erased_users``). The ingest rule for events, applied to what the bytes
    claim: the claimed user was erased and the record occurred at or before the request, or belongs
    to a session whose trajectory the erasure deleted; a record that does not say when it occurred,
    or of which session, is taken as covered. A record that names no user (not a JSON object, or not
    parsed: oversized) is not covered.
    """
    if claim.user_id is None or claim.user_id not in erased:
        return None
    requested_at, trajectory_ids = erased[claim.user_id]
    if (
        claim.occurred_at is None
        or claim.session_id is None
        or claim.occurred_at <= requested_at
        or trajectory_id_for(claim.session_id) in trajectory_ids
    ):
        return requested_at
    return None


def _without_bytes(row: DeadLetterRow, why: str, note: str) -> DeadLetterRow:
    """``row`` as stored when its bytes may not be kept: no key, bytes, hash or headers, ``redacted = why``
    and ``note`` before its detail (``consumers.erasure.purge_private_sessions`` does the same in SQL)."""
    return replace(row, key=None, raw=None, headers=None, raw_sha256=None, redacted=why, detail=note + row.detail)


def redacted(row: DeadLetterRow, requested_at: datetime) -> DeadLetterRow:
    """The dead letter of an erased user's record, as stored: its position, reason, detail and user id
    (a later erasure of the user deletes it), without its key, bytes or headers."""
    return _without_bytes(
        row, "erasure", f"raw bytes not kept: the user's erasure was requested at {requested_at.isoformat()}; "
    )


PRIVATE_DETAIL = "raw bytes not kept: the session is in privacy mode; "
"""What a privacy-redacted dead letter's ``detail`` starts with (the SQL of ``consumers.erasure`` too)."""


def redacted_private(row: DeadLetterRow) -> DeadLetterRow:
    """The dead letter of a privacy-mode session's record, as stored: its position, reason, detail,
    user and session ids, without its key, bytes or headers."""
    return _without_bytes(row, "privacy", PRIVATE_DETAIL)


def bounded_raw(raw: bytes | None, keep_bytes: int, head_bytes: int) -> tuple[bytes | None, int | None, bytes | None]:
    """``(bytes to store, size, SHA-256)`` of a record's value: the value whole up to ``keep_bytes``
    bytes, else its first ``head_bytes``; ``(None, None, None)`` for no value."""
    if raw is None:
        return None, None, None
    digest = hashlib.sha256(raw).digest()
    return (raw if len(raw) <= keep_bytes else raw[:head_bytes]), len(raw), digest


def dead_letter_row(d: Decoded, max_bytes: int = DEFAULT_MAX_EVENT_BYTES, claim: Claim | None = None) -> DeadLetterRow:
    """The ``dead_letter`` row of a classified record (headers as ``[[key, text]]``; ``user_id`` as
    :func:`claim_of` (the erasure finds a row without one by searching its bytes), not looked for in
    an oversized record or past ``max_bytes`` bytes;
    ``claim``: the record's :func:`claim_of`, if the caller has it). Its bytes are bounded
    (:func:`bounded_raw`, the consumer settings' ``dead_letter_max_bytes`` and
    ``dead_letter_head_bytes``); ``raw_size`` and ``raw_sha256`` describe the whole record."""
    m = d.msg
    cs = get_consumer_settings()
    raw, size, digest = bounded_raw(m.value, cs.dead_letter_max_bytes, cs.dead_letter_head_bytes)
    headers = [
        [header_text(k.encode("utf-8", "replace") if isinstance(k, str) else k), header_text(v)] for k, v in m.headers
    ]
    claim = claim if claim is not None else claim_of_dead_letter(d, max_bytes)
    return DeadLetterRow(
        topic=m.topic,
        partition=m.partition,
        offset=m.offset,
        key=m.key,
        raw=raw,
        headers=headers,
        reason=d.reason or "validation",
        detail=d.detail.replace("\x00", ""),
        user_id=claim.user_id,
        session_id=claim.session_id,
        raw_size=size,
        raw_sha256=digest,
        log_id=m.log_id,
    )


def claim_of_dead_letter(d: Decoded, max_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> Claim:
    """:func:`claim_of` a dead letter's bytes (none for an ``oversized`` one: it is not parsed)."""
    return Claim() if d.reason == "oversized" else claim_of(d.msg.value, max_bytes)


def header_bytes(text: str) -> bytes:
    """A stored header text back to the header's bytes: the inverse of :func:`header_text`
    (``base64:<b64>`` decodes, any other text is its UTF-8).

    Rows stored before the prefix was escaped may hold a literal text starting with ``base64:``:
    one that is not valid base64 comes back as its text; one that is cannot be told from an encoding.
    """
    if text.startswith(BASE64_PREFIX):
        try:
            return base64.b64decode(text[len(BASE64_PREFIX) :], validate=True)
        except binascii.Error:
            pass
    return text.encode("utf-8")


def stored_headers(stored: Sequence[Sequence[str]] | None) -> list[tuple[str, bytes]]:
    """A ``dead_letter`` row's ``headers`` (``[[key text, value text]]``, see :func:`header_text`) back
    to Kafka headers: (key as ``str``, value bytes). None (not kept) -> ``[]``."""
    return [(header_bytes(k).decode("utf-8", "replace"), header_bytes(v)) for k, v in stored or ()]


def dlq_record(row: DeadLetterRow, max_bytes: int) -> tuple[bytes | None, bytes, list[tuple[str, bytes]]]:
    """(key, value, headers) to publish on the DLQ topic for a stored dead letter: its raw bytes
    (truncated past ``max_bytes``, or as the table keeps them: a ``dlq-truncated-from`` header gives
    the record's size whenever they are not whole) and headers, with the reason, detail and source position added.
    A row stored without its bytes (an erasure covers it, or its session is in privacy mode) is
    published without them too: an empty value, no key, and a ``dlq-redacted`` header saying why."""
    raw = row.raw or b""
    headers = stored_headers(row.headers)
    headers += [
        ("dlq-reason", row.reason.encode()),
        ("dlq-detail", row.detail[:500].encode("utf-8", "replace")),
        ("dlq-source", f"{row.topic}:{row.partition}:{row.offset}".encode()),
    ]
    if row.redacted:  # every row stored without its bytes says why (migration 0010 marked the older ones)
        headers.append(("dlq-redacted", row.redacted.encode()))
    size = max(len(raw), row.raw_size or 0) if row.raw else len(raw)
    if len(raw) > max_bytes or size > len(raw):
        headers.append(("dlq-truncated-from", str(size).encode()))
        raw = raw[:max_bytes]
    return row.key, raw, headers


class DeadLetterPublisher:
    """Publishes dead letters to the DLQ topic (or, with :meth:`send`, any records, as the redrive
    does) and waits for the broker's acks (at least once: a retried batch may publish a record twice;
    the ``dead_letter`` table holds each exactly once). The Kafka client is rebuilt after a failure,
    so a retry starts from a clean connection.

    Args:
        topic: the DLQ topic (:meth:`publish`); None for a publisher used only through :meth:`send`.
        max_bytes: DLQ records' raw bytes are truncated past this; the client's request limit is
            this plus 128 KiB.
    """

    def __init__(self, bootstrap: str, topic: str | None, max_bytes: int, client_id: str = "flywheel-dlq") -> None:
        self.bootstrap, self.topic, self.max_bytes, self.client_id = bootstrap, topic, max_bytes, client_id
        self._producer: Any = None

    def publish(self, rows: Sequence[DeadLetterRow], timeout_s: float = 30.0) -> None:
        """Send stored dead letters to the DLQ topic (:func:`dlq_record`) and wait for every ack.

        Raises:
            kafka.errors.KafkaError: the broker did not take them (transient: callers retry).
            ValueError: this publisher was made without a topic (for :meth:`send` only).
        """
        topic = self.topic
        if topic is None:
            raise ValueError("this dead-letter publisher has no DLQ topic: use send()")
        self.send(((topic, *dlq_record(r, self.max_bytes)) for r in rows), timeout_s)

    def send(
        self, records: Iterable[tuple[str, bytes | None, bytes, list[tuple[str, bytes]]]], timeout_s: float = 30.0
    ) -> None:
        """Send ``(topic, key, value, headers)`` records and wait for every ack (``timeout_s`` seconds
        for the flush, and again for each ack).

        Raises:
            kafka.errors.KafkaError: the broker did not take them.
        """
        if self._producer is None:
            self._producer = KafkaProducer(
                bootstrap_servers=self.bootstrap,
                acks="all",
                linger_ms=5,
                max_request_size=self.max_bytes + 131_072,
                client_id=self.client_id,
                **kafka_security(),
            )
        try:
            futures = [self._producer.send(t, key=k, value=v, headers=h) for t, k, v, h in records]
            self._producer.flush(timeout=timeout_s)
            for f in futures:
                f.get(timeout=timeout_s)
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        """Close the client (idempotent)."""
        if self._producer is not None:
            try:
                self._producer.close(timeout=5)
            except Exception:  # noqa: BLE001 -- closing a broken client
                pass
            self._producer = None
