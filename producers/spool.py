"""The producer's disk spool: a FIFO of Kafka records on local disk, in numbered segment files.

Invariant: records leave the spool in the order they are meant to be delivered. ``append`` adds to
the tail (the newest segment), ``prepend`` writes a new segment *below* the lowest one (records that
were older than everything spooled, e.g. a batch the broker refused), ``read`` returns records from
the head without removing them, and ``commit`` removes them once the broker acknowledged them.
A record is therefore removed only after delivery: a crash between send and commit re-delivers it
(consumers deduplicate on ``event_id``), never loses it.

Layout of one spool lane (``<root>/lane-<i>/``): ``<n:020d>.log`` segment files of frames
``u32 body_len | u32 crc32(body) | body`` and ``<n:020d>.ack`` holding the byte offset up to which a
segment has been delivered. A torn frame at the end of a segment (crash mid-write) fails its CRC or
length check and is truncated on open. Damage inside a segment (a flipped bit, a lost block) costs
only the frames it hit: reading resyncs at the next valid frame and the segment is rewritten as its
valid undelivered frames (:meth:`Spool._salvage`), on open or when a read meets it.

Bound: ``append`` refuses records (:class:`SpoolFullError`) once the undelivered bytes would pass
``max_bytes``; ``prepend`` never does (its records were already accepted and were only in memory),
so the spool can pass the bound by what the producer holds in memory.

Each producer process locks one lane with ``flock``; a new producer takes the first free lane, so it
picks up what a dead producer on that lane left behind.

Size: over 400 lines because the segment format, its crash recovery and salvage, and lane locking
are one invariant (a record leaves only after delivery) and are read and tested together.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import struct
import threading
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import BinaryIO, NamedTuple

from producers.errors import ConfigurationError
from producers.files import fsync_dir

log = logging.getLogger(__name__)

_FRAME = struct.Struct("<II")  # body length (bytes), crc32 of body
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_MIN_BODY = 2 + 4 + 2  # topic length, key length, header count
_NON_ZERO = re.compile(rb"[^\x00]")
_FIRST_SEGMENT = 10**12  # room below for prepended segments
_SUFFIX = ".log"


class SpoolFullError(OSError):
    """The spool already holds ``max_bytes`` of undelivered records: the new ones are not written."""


class Record(NamedTuple):
    """One Kafka record as the producer sends it (value already encoded)."""

    topic: str
    key: bytes | None
    headers: list[tuple[str, bytes]]
    value: bytes


class ReadToken(NamedTuple):
    """Where a ``read`` ended: commit it to remove the records read."""

    segment: int
    end_offset: int
    records: int
    rewrite: int = 0
    """How many times the segment had been salvaged (rewritten) when it was read: a token from
    before a rewrite no longer names offsets of the file and commits nothing (its records are
    delivered again)."""


def encode_record(rec: Record) -> bytes:
    """A record as one length-prefixed, CRC-checked frame."""
    topic = rec.topic.encode()
    key = rec.key if rec.key is not None else b""
    parts = [
        _U16.pack(len(topic)),
        topic,
        _U32.pack(len(key) if rec.key is not None else 0xFFFFFFFF),
        key,
        _U16.pack(len(rec.headers)),
    ]
    for hk, hv in rec.headers:
        hkb = hk.encode()
        parts += [_U16.pack(len(hkb)), hkb, _U32.pack(len(hv)), hv]
    parts.append(rec.value)
    body = b"".join(parts)
    return _FRAME.pack(len(body), zlib.crc32(body)) + body


def _decode_body(body: bytes) -> Record:
    pos = 0

    def take(n: int) -> bytes:
        nonlocal pos
        out = body[pos : pos + n]
        pos += n
        return out

    (tlen,) = _U16.unpack(take(2))
    topic = take(tlen).decode()
    (klen,) = _U32.unpack(take(4))
    key = None if klen == 0xFFFFFFFF else take(klen)
    (nh,) = _U16.unpack(take(2))
    headers = []
    for _ in range(nh):
        (hl,) = _U16.unpack(take(2))
        hk = take(hl).decode()
        (vl,) = _U32.unpack(take(4))
        headers.append((hk, take(vl)))
    return Record(topic, key, headers, body[pos:])


def decode_frames(buf: bytes, max_records: int | None = None) -> tuple[list[Record], int]:
    """Decode whole, valid frames from ``buf``. Returns the records and the bytes consumed; stops
    at the first torn or corrupt frame (the caller decides whether that is the end of the file)."""
    out: list[Record] = []
    pos, n = 0, len(buf)
    while pos + _FRAME.size <= n and (max_records is None or len(out) < max_records):
        length, crc = _FRAME.unpack_from(buf, pos)
        end = pos + _FRAME.size + length
        if end > n:
            break
        body = buf[pos + _FRAME.size : end]
        if length < _MIN_BODY or zlib.crc32(body) != crc:  # a zeroed header passes the CRC check
            break
        try:
            out.append(_decode_body(body))
        except (struct.error, UnicodeDecodeError):
            break
        pos = end
    return out, pos


def next_frame(buf: bytes, pos: int) -> int | None:
    """Offset of the first valid frame (length fits, CRC-32 matches, body decodes) at or after
    ``pos`` in ``buf``, or None: a resync past damaged bytes, one candidate offset at a time (a false
    match needs a 32-bit CRC collision); runs of zero bytes (a crash on a file system that zero-fills)
    are skipped whole."""
    view, n = memoryview(buf), len(buf)
    while pos + _FRAME.size <= n:
        length, crc = _FRAME.unpack_from(buf, pos)
        if length < _MIN_BODY:
            if length == 0:  # no frame starts here, nor before 3 bytes short of the next non-zero byte
                nz = _NON_ZERO.search(buf, pos + 4)
                pos = max(pos + 1, nz.start() - 3) if nz else n
            else:
                pos += 1
            continue
        end = pos + _FRAME.size + length
        if end <= n and zlib.crc32(view[pos + _FRAME.size : end]) == crc:
            try:
                _decode_body(bytes(view[pos + _FRAME.size : end]))
                return pos
            except (struct.error, UnicodeDecodeError):
                pass
        pos += 1
    return None


def salvage_frames(buf: bytes) -> tuple[bytes, int, int]:
    """The valid frames of ``buf``, resynced past damage: (their bytes concatenated, how many, bytes
    skipped). Bytes after the last valid frame (a torn tail) count as skipped."""
    kept: list[bytes] = []
    count = pos = skipped = 0
    while pos < len(buf):
        records, used = decode_frames(buf[pos:])
        kept.append(buf[pos : pos + used])
        count += len(records)
        pos += used
        if pos >= len(buf):
            break
        nxt = next_frame(buf, pos + 1)
        skipped += (nxt if nxt is not None else len(buf)) - pos
        if nxt is None:
            break
        pos = nxt
    return b"".join(kept), count, skipped


class Spool:
    """A disk FIFO of :class:`Record` for one producer process (thread-safe).

    Args:
        root: the spool directory (``$FLYWHEEL_HOME/spool`` by default in the producer).
        segment_bytes: roll the tail to a new segment file past this size (bytes).
        max_lanes: how many producer processes may share ``root`` at once.
        max_bytes: undelivered bytes past which :meth:`append` refuses records (None: no bound).

    Raises:
        ConfigurationError: every lane under ``root`` is locked by another producer.
    """

    def __init__(
        self, root: Path, *, segment_bytes: int = 64 << 20, max_lanes: int = 64, max_bytes: int | None = None
    ) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.segment_bytes, self.max_bytes = segment_bytes, max_bytes
        self._lock = threading.Lock()
        self._lock_fd: int | None = None
        for i in range(max_lanes):
            lane = root / f"lane-{i}"
            lane.mkdir(exist_ok=True)
            fd = os.open(lane / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._lock_fd, self.dir = fd, lane
            break
        else:
            raise ConfigurationError(f"all {max_lanes} spool lanes under {root} are in use")
        self._segments: list[int] = sorted(int(p.stem) for p in self.dir.glob(f"*{_SUFFIX}"))
        self._acked: dict[int, int] = {n: self._read_ack(n) for n in self._segments}
        self._rewrites: dict[int, int] = {}
        self._writer: BinaryIO | None = None  # the tail segment's; None exactly when _writer_seg is
        self._writer_seg: int | None = None
        self._dirty = False
        recovered = [self._recover(n) for n in self._segments]
        self._seg_pending: dict[int, int] = {n: count for n, (count, _) in zip(self._segments, recovered)}
        """Undelivered records per segment (``pending`` is their sum)."""
        self._pending_bytes = sum(nbytes for _, nbytes in recovered)
        if self.pending:
            log.info("spool %s holds %d undelivered records (%d bytes)", self.dir, self.pending, self._pending_bytes)

    # ---- state ------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Records spooled and not yet committed as delivered."""
        with self._lock:  # another thread may be adding or dropping a segment
            return sum(self._seg_pending.values())

    @property
    def pending_bytes(self) -> int:
        """Bytes of the records spooled and not yet committed as delivered (frames included)."""
        return self._pending_bytes

    @property
    def dirty(self) -> bool:
        """Whether appended records may not be on disk yet (``sync`` clears it)."""
        return self._dirty

    def _path(self, n: int, suffix: str = _SUFFIX) -> Path:
        return self.dir / f"{n:020d}{suffix}"

    def _read_ack(self, n: int) -> int:
        try:
            return int(self._path(n, ".ack").read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def _recover(self, n: int) -> tuple[int, int]:
        """(records, bytes) undelivered in segment ``n``; a torn tail is truncated, damage inside the
        segment salvaged (:meth:`_salvage`)."""
        path = self._path(n)
        data = path.read_bytes()
        start = min(self._acked[n], len(data))
        records, used = decode_frames(data[start:])
        if start + used == len(data):
            return len(records), used
        if next_frame(data, start + used + 1) is not None:
            return self._salvage(n, data[start:])
        log.warning("spool segment %s: dropping %d torn bytes at its end", path.name, len(data) - start - used)
        with open(path, "r+b") as f:
            f.truncate(start + used)
            os.fsync(f.fileno())
        return len(records), used

    def _salvage(self, n: int, undelivered: bytes) -> tuple[int, int]:
        """Rewrite segment ``n`` as the valid frames of its ``undelivered`` bytes, delivered from
        offset 0; returns their (records, bytes). The acknowledged offset is reset before the file
        is written: a crash in between re-delivers the segment's delivered records (consumers
        deduplicate on ``event_id``), it never skips an undelivered one.

        Raises:
            OSError: the rewrite failed.
        """
        frames, count, skipped = salvage_frames(undelivered)
        log.error(
            "spool segment %s is damaged: skipped %d bytes, kept its %d valid undelivered records (%d bytes)",
            self._path(n).name,
            skipped,
            count,
            len(frames),
        )
        self._write_ack(n, 0)
        self._write_segment(n, frames)
        self._acked[n] = 0
        self._rewrites[n] = self._rewrites.get(n, 0) + 1
        return count, len(frames)

    def _write_segment(self, n: int, data: bytes) -> None:
        """Make ``data`` segment ``n``'s file, durably: a temporary file, fsynced, renamed over it."""
        tmp = self._path(n, ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._path(n))
        fsync_dir(self.dir)

    def _write_ack(self, n: int, offset: int) -> None:
        tmp = self._path(n, ".ack.tmp")
        tmp.write_text(str(offset))
        os.replace(tmp, self._path(n, ".ack"))

    # ---- writing ----------------------------------------------------------------------------

    def append(self, records: Sequence[Record]) -> None:
        """Add records at the tail (buffered; call :meth:`sync` to make them durable).

        Raises:
            SpoolFullError: they would take the undelivered bytes past ``max_bytes``; none is written.
            OSError: the write failed (e.g. disk full).
        """
        if not records:
            return
        data = b"".join(encode_record(r) for r in records)
        with self._lock:
            if self.max_bytes is not None and self._pending_bytes + len(data) > self.max_bytes:
                raise SpoolFullError(
                    errno.ENOSPC,
                    f"spool {self.dir} holds {self._pending_bytes} undelivered bytes (limit {self.max_bytes})",
                )
            writer, seg = self._writer, self._writer_seg
            if writer is None or seg is None or writer.tell() >= self.segment_bytes:
                writer, seg = self._open_tail()
            writer.write(data)
            self._seg_pending[seg] += len(records)
            self._pending_bytes += len(data)
            self._dirty = True

    def _open_tail(self) -> tuple[BinaryIO, int]:
        if self._writer is not None:
            self._close_writer()
        n = self._segments[-1] + 1 if self._segments else _FIRST_SEGMENT
        writer = self._writer = open(self._path(n), "ab")
        self._writer_seg = n
        self._segments.append(n)
        self._acked[n] = 0
        self._seg_pending[n] = 0
        fsync_dir(self.dir)
        return writer, n

    def prepend(self, records: Iterable[Record]) -> None:
        """Put records at the head, ahead of everything spooled; durable when this returns."""
        data = b"".join(encode_record(r) for r in records)
        if not data:
            return
        count = len(decode_frames(data)[0])
        with self._lock:
            n = self._segments[0] - 1 if self._segments else _FIRST_SEGMENT
            self._write_segment(n, data)
            self._segments.insert(0, n)
            self._acked[n] = 0
            self._seg_pending[n] = count
            self._pending_bytes += len(data)

    def sync(self) -> None:
        """Flush and fsync the tail segment: every appended record is durable after this."""
        with self._lock:
            if self._writer is not None and self._dirty:
                self._writer.flush()
                os.fsync(self._writer.fileno())
            self._dirty = False

    # ---- reading ----------------------------------------------------------------------------

    def read(self, max_records: int) -> tuple[list[Record], ReadToken | None]:
        """Up to ``max_records`` from the head (not removed until :meth:`commit`).

        Raises:
            OSError: reading, or rewriting a damaged segment, failed.
        """
        salvaged: set[int] = set()
        with self._lock:
            while self._segments:
                n = self._segments[0]
                if self._writer is not None and n == self._writer_seg:
                    self._writer.flush()
                    size = self._writer.tell()
                else:
                    size = self._path(n).stat().st_size
                start = self._acked[n]
                if start >= size:
                    self._drop_segment(n)
                    continue
                with open(self._path(n), "rb") as f:
                    f.seek(start)
                    # A bounded window; a frame larger than it is read whole below.
                    records, used = decode_frames(f.read(max(1 << 20, max_records * 4096)), max_records)
                    if not records:
                        f.seek(start)
                        records, used = decode_frames(f.read(), max_records)
                if records:
                    return records, ReadToken(n, start + used, len(records), self._rewrites.get(n, 0))
                # The file was damaged after it was opened: keep what of it is still valid. (A second
                # failure on the rewritten file means the disk is failing: skip the segment.)
                held = self._seg_pending.get(n, 0)
                if n == self._writer_seg:  # appends go on in a new segment
                    self._close_writer()
                if n in salvaged:
                    count, nbytes = 0, 0
                else:
                    salvaged.add(n)
                    with open(self._path(n), "rb") as f:
                        f.seek(start)
                        count, nbytes = self._salvage(n, f.read())
                log.error(
                    "spool segment %s: %d of its %d undelivered records lost to damage",
                    self._path(n).name,
                    max(0, held - count),
                    held,
                )
                self._pending_bytes = max(0, self._pending_bytes - (size - start) + nbytes)
                self._seg_pending[n] = count
                if not count:
                    self._drop_segment(n)
            return [], None

    def commit(self, token: ReadToken) -> None:
        """Remove the records a :meth:`read` returned (they were delivered)."""
        with self._lock:
            n = token.segment
            if n not in self._acked or token.rewrite != self._rewrites.get(n, 0):
                return
            self._pending_bytes -= token.end_offset - self._acked[n]
            self._acked[n] = token.end_offset
            self._seg_pending[n] -= token.records
            size = (
                self._writer.tell()
                if self._writer is not None and n == self._writer_seg
                else self._path(n).stat().st_size
            )
            if token.end_offset >= size:
                self._drop_segment(n)
            else:
                self._write_ack(n, token.end_offset)

    def _close_writer(self) -> None:
        """Flush, fsync and close the tail segment's writer; the next append opens a new segment."""
        if self._writer is None:
            return
        self._writer.flush()
        os.fsync(self._writer.fileno())
        self._writer.close()
        self._writer, self._writer_seg, self._dirty = None, None, False

    def _drop_segment(self, n: int) -> None:
        if self._writer is not None and n == self._writer_seg:
            self._writer.close()
            self._writer, self._writer_seg, self._dirty = None, None, False
        self._path(n).unlink(missing_ok=True)
        self._path(n, ".ack").unlink(missing_ok=True)
        self._segments.remove(n)
        self._acked.pop(n, None)
        self._seg_pending.pop(n, None)
        self._rewrites.pop(n, None)

    def close(self) -> None:
        """Sync, close files and release the lane lock."""
        self.sync()
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer, self._writer_seg = None, None
            if self._lock_fd is not None:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                os.close(self._lock_fd)
                self._lock_fd = None
