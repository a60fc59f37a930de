"""The producer's disk spool: FIFO order across append/prepend, commit, crash recovery, lanes."""

from __future__ import annotations

import pytest

from producers.spool import Record, Spool, SpoolFullError, decode_frames, encode_record


def _rec(i: int, key: bytes | None = b"s1") -> Record:
    return Record("editor.interactions", key, [("event-type", b"edit.accepted"), ("traceparent", b"00-ab")],
                  f"value-{i}".encode())


def _drain(spool: Spool, batch: int = 3) -> list[Record]:
    out = []
    while True:
        records, token = spool.read(batch)
        if not records:
            return out
        out += records
        spool.commit(token)


def test_record_frame_round_trips_including_null_key_and_empty_headers():
    for rec in (_rec(1), _rec(2, key=None), Record("t", b"", [], b""), Record("t", b"k", [("h", b"")], b"\x00" * 5000)):
        records, used = decode_frames(encode_record(rec))
        assert records == [rec] and used == len(encode_record(rec))


def test_append_prepend_read_commit_keep_fifo_order(tmp_path):
    spool = Spool(tmp_path)
    spool.append([_rec(i) for i in range(3, 6)])
    spool.prepend([_rec(i) for i in range(0, 3)])      # older than what was appended
    spool.append([_rec(6)])
    assert spool.pending == 7
    first, token = spool.read(2)
    assert [r.value for r in first] == [b"value-0", b"value-1"]
    spool.prepend([_rec(-1)])                          # a refused batch goes back to the head
    spool.commit(token)
    got = _drain(spool)
    assert [r.value for r in got] == [f"value-{i}".encode() for i in (-1, 2, 3, 4, 5, 6)]
    assert spool.pending == 0
    assert not list(spool.dir.glob("*.log")), "delivered segments are deleted"
    spool.close()


def test_uncommitted_records_survive_reopen_and_a_torn_tail_is_truncated(tmp_path):
    spool = Spool(tmp_path)
    spool.append([_rec(i) for i in range(5)])
    records, token = spool.read(2)
    spool.commit(token)
    spool.sync()
    spool.close()
    segment = next(spool.dir.glob("*.log"))
    with open(segment, "ab") as f:                     # a crash in the middle of a write
        f.write(encode_record(_rec(99))[:-3])
    reopened = Spool(tmp_path)
    assert reopened.dir == spool.dir
    assert reopened.pending == 3
    assert [r.value for r in _drain(reopened)] == [b"value-2", b"value-3", b"value-4"]
    reopened.close()


def test_segments_roll_and_drain_in_order(tmp_path):
    spool = Spool(tmp_path, segment_bytes=200)
    for i in range(20):
        spool.append([_rec(i)])
    assert len(list(spool.dir.glob("*.log"))) > 3
    assert [r.value for r in _drain(spool, batch=7)] == [f"value-{i}".encode() for i in range(20)]
    spool.close()


def test_each_live_spool_takes_its_own_lane(tmp_path):
    a, b = Spool(tmp_path), Spool(tmp_path)
    assert a.dir != b.dir
    a.close()
    c = Spool(tmp_path)
    assert c.dir == a.dir, "a freed lane is reused (and its leftovers delivered)"
    b.close()
    c.close()


def test_no_free_lane_is_a_configuration_error(tmp_path):
    from app.core.errors import ConfigurationError

    a = Spool(tmp_path, max_lanes=1)
    with pytest.raises(ConfigurationError):
        Spool(tmp_path, max_lanes=1)
    a.close()


def test_append_stops_at_max_bytes_prepend_does_not_and_delivery_frees_room(tmp_path):
    frame = len(encode_record(_rec(0)))
    spool = Spool(tmp_path, max_bytes=3 * frame)
    spool.append([_rec(0), _rec(1)])
    with pytest.raises(SpoolFullError):
        spool.append([_rec(2), _rec(3)])             # all or none: neither is written
    spool.append([_rec(2)])
    assert (spool.pending, spool.pending_bytes) == (3, 3 * frame)
    with pytest.raises(SpoolFullError):
        spool.append([_rec(3)])
    spool.prepend([_rec(9)])                          # already accepted: never refused
    assert (spool.pending, spool.pending_bytes) == (4, 4 * frame)
    for expected in (b"value-9", b"value-0"):        # deliver the two oldest
        records, token = spool.read(1)
        assert [r.value for r in records] == [expected]
        spool.commit(token)
    assert spool.pending_bytes == 2 * frame
    spool.append([_rec(3)])
    assert [r.value for r in _drain(spool)] == [f"value-{i}".encode() for i in (1, 2, 3)]
    assert spool.pending_bytes == 0
    spool.close()


def test_pending_bytes_survive_reopen(tmp_path):
    frame = len(encode_record(_rec(0)))
    spool = Spool(tmp_path)
    spool.append([_rec(i) for i in range(5)])
    records, token = spool.read(2)
    spool.commit(token)
    spool.close()
    reopened = Spool(tmp_path, max_bytes=4 * frame)
    assert (reopened.pending, reopened.pending_bytes) == (3, 3 * frame)
    with pytest.raises(SpoolFullError):
        reopened.append([_rec(5), _rec(6)])
    reopened.close()


def test_a_segment_damaged_while_open_is_skipped_and_its_records_leave_the_counts(tmp_path, caplog):
    spool = Spool(tmp_path, segment_bytes=200)
    for i in range(12):
        spool.append([_rec(i)])
    spool.sync()
    first, second = sorted(spool.dir.glob("*.log"))[:2]
    in_first = len(decode_frames(first.read_bytes())[0])
    records, token = spool.read(1)
    spool.commit(token)
    data = bytearray(first.read_bytes())
    data[-2] ^= 0xFF                                   # the disk flips a byte under a running producer
    first.write_bytes(bytes(data))
    with caplog.at_level("ERROR", logger="producers.spool"):
        drained = _drain(spool)
    # what preceded the damage is delivered, the rest of that segment is gone, later segments are whole
    assert drained[0].value == b"value-1"
    assert [r.value for r in drained][-(12 - in_first):] == [f"value-{i}".encode() for i in range(in_first, 12)]
    assert spool.pending == 0 and spool.pending_bytes == 0
    assert "undelivered records it held" in caplog.text
    assert second.exists() is False
    spool.close()
