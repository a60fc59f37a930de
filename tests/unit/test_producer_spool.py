"""The producer's disk spool: FIFO order across append/prepend, commit, crash recovery, lanes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from producers.spool import Record, Spool, SpoolFullError, decode_frames, encode_record, salvage_frames


def _rec(i: int, key: bytes | None = b"s1") -> Record:
    return Record(
        "editor.interactions", key, [("event-type", b"edit.accepted"), ("traceparent", b"00-ab")], f"value-{i}".encode()
    )


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
    spool.prepend([_rec(i) for i in range(0, 3)])  # older than what was appended
    spool.append([_rec(6)])
    assert spool.pending == 7
    first, token = spool.read(2)
    assert [r.value for r in first] == [b"value-0", b"value-1"]
    spool.prepend([_rec(-1)])  # a refused batch goes back to the head
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
    with open(segment, "ab") as f:  # a crash in the middle of a write
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
        spool.append([_rec(2), _rec(3)])  # all or none: neither is written
    spool.append([_rec(2)])
    assert (spool.pending, spool.pending_bytes) == (3, 3 * frame)
    with pytest.raises(SpoolFullError):
        spool.append([_rec(3)])
    spool.prepend([_rec(9)])  # already accepted: never refused
    assert (spool.pending, spool.pending_bytes) == (4, 4 * frame)
    for expected in (b"value-9", b"value-0"):  # deliver the two oldest
        records, token = spool.read(1)
        assert [r.value for r in records] == [expected]
        spool.commit(token)
    assert spool.pending_bytes == 2 * frame
    spool.append([_rec(3)])
    assert [r.value for r in _drain(spool)] == [f"value-{i}".encode() for i in (1, 2, 3)]
    assert spool.pending_bytes == 0
    spool.close()


def test_a_zero_filled_tail_is_truncated_on_open(tmp_path):
    spool = Spool(tmp_path)
    spool.append([_rec(i) for i in range(3)])
    spool.close()
    segment = next(spool.dir.glob("*.log"))
    size = segment.stat().st_size
    with open(segment, "ab") as f:  # a crash after the file grew, before its data landed
        f.write(bytes(4096))
    reopened = Spool(tmp_path)
    assert reopened.pending == 3 and segment.stat().st_size == size
    assert [r.value for r in _drain(reopened)] == [b"value-0", b"value-1", b"value-2"]
    reopened.close()


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


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_segment_damaged_while_open_loses_only_the_damaged_record_and_counts_stay_right(tmp_path, caplog):
    frame = len(encode_record(_rec(0)))
    spool = Spool(tmp_path, segment_bytes=6 * frame)
    for i in range(12):
        spool.append([_rec(i)])
    spool.sync()
    first, second = sorted(spool.dir.glob("*.log"))[:2]
    assert len(decode_frames(first.read_bytes())[0]) == 6
    records, token = spool.read(1)
    spool.commit(token)
    _flip(first, 3 * frame + 10)  # the disk flips a byte of value-3 under a running producer
    with caplog.at_level("ERROR", logger="producers.spool"):
        drained = _drain(spool)
    assert [r.value for r in drained] == [f"value-{i}".encode() for i in range(1, 12) if i != 3]
    assert spool.pending == 0 and spool.pending_bytes == 0
    assert "1 of its 3 undelivered records lost to damage" in caplog.text  # read 2 by 2 from value-1
    assert not first.exists() and not second.exists()
    spool.close()


def test_a_segment_damaged_at_rest_is_salvaged_on_open(tmp_path, caplog):
    frame = len(encode_record(_rec(0)))
    spool = Spool(tmp_path)
    spool.append([_rec(i) for i in range(8)])
    records, token = spool.read(2)
    spool.commit(token)
    spool.close()
    segment = next(spool.dir.glob("*.log"))
    _flip(segment, 4 * frame + 1)  # value-4's length field: the resync must find value-5
    with caplog.at_level("ERROR", logger="producers.spool"):
        reopened = Spool(tmp_path)
    assert (reopened.pending, reopened.pending_bytes) == (5, 5 * frame)
    assert f"skipped {frame} bytes, kept its 5 valid undelivered records" in caplog.text
    reopened.close()
    again = Spool(tmp_path)  # the rewrite is durable: nothing is skipped twice
    assert [r.value for r in _drain(again)] == [b"value-2", b"value-3", b"value-5", b"value-6", b"value-7"]
    again.close()


def test_damage_to_the_segment_being_written_moves_appends_to_a_new_segment(tmp_path):
    spool = Spool(tmp_path)
    spool.append([_rec(i) for i in range(4)])
    spool.sync()
    segment = next(spool.dir.glob("*.log"))
    _flip(segment, 10)  # value-0
    records, token = spool.read(10)  # salvages the tail segment, closing its writer
    spool.append([_rec(4)])
    assert [r.value for r in records] == [b"value-1", b"value-2", b"value-3"]
    assert len(list(spool.dir.glob("*.log"))) == 2 and spool.pending == 4
    spool.commit(token)
    assert [r.value for r in _drain(spool)] == [b"value-4"]
    assert spool.pending == 0 and spool.pending_bytes == 0
    spool.close()


def test_a_token_from_before_a_salvage_commits_nothing(tmp_path):
    spool = Spool(tmp_path)
    spool.append([_rec(i) for i in range(6)])
    spool.sync()
    stale_records, stale = spool.read(2)
    assert [r.value for r in stale_records] == [b"value-0", b"value-1"]
    _flip(next(spool.dir.glob("*.log")), 10)  # value-0, before ``stale`` is committed
    records, token = spool.read(10)  # salvages the segment: value-1 now starts the file
    assert [r.value for r in records] == [f"value-{i}".encode() for i in range(1, 6)]
    spool.commit(stale)  # offsets of the old file: void, nothing is removed
    assert spool.pending == 5
    spool.commit(token)
    assert spool.pending == 0 and spool.pending_bytes == 0
    spool.close()


@settings(max_examples=200, deadline=None)
@given(n=st.integers(2, 12), where=st.data())
def test_one_flipped_byte_anywhere_costs_exactly_the_frame_it_hit(n, where):
    frames = [encode_record(_rec(i, key=None if i % 3 == 0 else b"session-%d" % i)) for i in range(n)]
    buf = bytearray(b"".join(frames))
    at = where.draw(st.integers(0, len(buf) - 1))
    buf[at] ^= where.draw(st.integers(1, 255))
    hit = next(i for i in range(n) if sum(map(len, frames[: i + 1])) > at)
    kept, count, skipped = salvage_frames(bytes(buf))
    assert count == n - 1 and skipped == len(frames[hit])
    assert [r.value for r in decode_frames(kept)[0]] == [f"value-{i}".encode() for i in range(n) if i != hit]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(2, 12), where=st.data())
def test_a_zero_filled_run_costs_exactly_the_frames_it_overlaps(n, where):
    # What a crash can leave on a file system that zero-fills blocks it had not written yet.
    frames = [encode_record(_rec(i)) for i in range(n)]
    buf = bytearray(b"".join(frames))
    a = where.draw(st.integers(0, len(buf) - 1))
    b = where.draw(st.integers(a + 1, len(buf)))
    buf[a:b] = bytes(b - a)
    starts = [sum(map(len, frames[:i])) for i in range(n)]
    survivors = [i for i in range(n) if buf[starts[i] : starts[i] + len(frames[i])] == frames[i]]  # zeros over zeros
    kept, count, _ = salvage_frames(bytes(buf))
    assert [r.value for r in decode_frames(kept)[0]] == [f"value-{i}".encode() for i in survivors]
    assert count == len(survivors)
