"""Crash simulations: torn and damaged tails, damaged older segments, lost or wrong indexes, missing
segments, torn segment creation, and a real process killed while appending."""
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from metaq_broker.errors import CorruptLogError
from metaq_broker.store import PartitionLog, TopicConfig
from metaq_broker.store.segment import SEGMENT_HEADER_SIZE

pytestmark = pytest.mark.unit

SMALL = TopicConfig(max_segment_size=4096)


def open_log(path, config=SMALL, **kw):
    return PartitionLog.open(path, "t", 0, config, **kw)


def fill(path, batches, per_batch=3, config=SMALL):
    """Write ``batches`` batches; return the log's values by offset and each batch's (offset, position)."""
    log = open_log(path, config)
    values, starts = [], []
    for b in range(batches):
        vals = [b"batch%03d-msg%d-" % (b, i) + b"x" * (b % 7) for i in range(per_batch)]
        r = log.append(vals, keys=[b"k%d" % b] * per_batch)
        starts.append((r.base_offset, log.position(r.base_offset)))
        values.extend(vals)
    log.close()
    return values, starts


def all_values(log):
    out, offset = [], log.earliest_offset
    while offset < log.last_stable_offset:
        batch = log.read_arrow(offset)
        out.extend(batch.column("value").to_pylist())
        offset += batch.num_rows
    return out


def segment_files(path):
    return sorted(p for p in path.iterdir() if p.suffix == ".meta")


def file_offset(seg_path, logical_position):
    return logical_position - int(seg_path.stem)


def test_clean_reopen_keeps_everything(tmp_path):
    values, _ = fill(tmp_path, 40)
    log = open_log(tmp_path)
    assert len(segment_files(tmp_path)) > 1
    assert all_values(log) == values
    r = log.append([b"after"])
    assert r.base_offset == len(values)
    log.close()


def test_truncating_the_tail_at_every_byte_of_the_last_batch(tmp_path, caplog):
    values, starts = fill(tmp_path, 5, config=TopicConfig())
    seg = segment_files(tmp_path)[-1]
    data = seg.read_bytes()
    last_offset, last_pos = starts[-1]
    last_start = file_offset(seg, last_pos)
    for cut in range(last_start, len(data)):
        seg.write_bytes(data[:cut])
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            log = open_log(tmp_path, TopicConfig())
        assert log.last_stable_offset == last_offset
        assert all_values(log) == values[:last_offset]
        if cut > last_start:
            assert f"truncated {cut - last_start} bytes" in caplog.text
        log.close()
        assert seg.stat().st_size == last_start
    # After recovery the log takes appends at the cut point.
    log = open_log(tmp_path, TopicConfig())
    assert log.append([b"new"]).base_offset == last_offset
    assert all_values(log) == values[:last_offset] + [b"new"]
    log.close()


def test_flipping_bits_in_the_last_batch_drops_only_that_batch(tmp_path):
    values, starts = fill(tmp_path, 5, config=TopicConfig())
    seg = segment_files(tmp_path)[-1]
    data = seg.read_bytes()
    last_offset, last_pos = starts[-1]
    last_start = file_offset(seg, last_pos)
    for i in range(last_start, len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 0x10
        seg.write_bytes(bytes(damaged))
        log = open_log(tmp_path, TopicConfig())
        assert log.last_stable_offset == last_offset, f"flip at byte {i}"
        assert all_values(log) == values[:last_offset]
        log.close()


def _damage_second_batch(tmp_path, config):
    values, starts = fill(tmp_path, 5, config=config)
    seg = segment_files(tmp_path)[-1]
    data = bytearray(seg.read_bytes())
    second_offset, second_pos = starts[1]
    data[file_offset(seg, second_pos) + 60] ^= 0xFF  # inside the second batch's body
    seg.write_bytes(bytes(data))
    return values, second_offset, file_offset(seg, second_pos), seg, bytes(data)


def test_damage_followed_by_valid_batches_under_group_commit_is_cut(tmp_path, caplog):
    """Under group commit an acknowledged batch was fsynced, and an fsync covers everything written
    before it: a damaged batch and all after it were never acknowledged, so recovery may cut there."""
    values, second_offset, _, seg, _ = _damage_second_batch(tmp_path, TopicConfig())
    with caplog.at_level(logging.WARNING):
        log = open_log(tmp_path, TopicConfig())
    assert log.last_stable_offset == second_offset
    assert all_values(log) == values[:second_offset]
    assert f"offset {second_offset}" in caplog.text and "no fsync covered them" in caplog.text
    assert log.append([b"next"]).base_offset == second_offset
    log.close()


def test_damage_followed_by_valid_batches_is_refused_where_acks_preceded_fsync(tmp_path):
    """unflushThreshold > 0 acknowledges before fsync: cutting could drop acknowledged messages, also on
    the first open after switching the topic back to group commit."""
    unflushed = TopicConfig(unflush_threshold=100)
    values, second_offset, second_pos, seg, data = _damage_second_batch(tmp_path, unflushed)
    for config in (unflushed, TopicConfig()):
        with pytest.raises(CorruptLogError, match=r"followed by valid batches.*unflushThreshold.*--repair") as e:
            open_log(tmp_path, config)
        assert e.value.path == seg and e.value.position == second_pos
        assert seg.read_bytes() == data  # nothing was cut
    # The operator can choose to cut at the damage.
    log = open_log(tmp_path, TopicConfig(), repair=True)
    assert log.last_stable_offset == second_offset
    assert all_values(log) == values[:second_offset]
    log.close()


def test_damage_in_an_older_segment_is_reported_when_read_and_by_verify(tmp_path):
    values, starts = fill(tmp_path, 40)
    first = segment_files(tmp_path)[0]
    data = bytearray(first.read_bytes())
    data[SEGMENT_HEADER_SIZE + 70] ^= 0x01  # the first batch's body
    first.write_bytes(bytes(data))
    log = open_log(tmp_path)  # opening checks structure, not every checksum of sealed segments
    with pytest.raises(CorruptLogError, match=first.name) as e:
        log.read_arrow(0)
    assert e.value.path == first and e.value.position == SEGMENT_HEADER_SIZE  # the first batch, in the file
    # Data after the damaged batch is still served.
    assert log.read_arrow(3).column("value").to_pylist()[0] == values[3]
    problems = log.verify()
    assert len(problems) == 1 and first.name in problems[0] and "checksum" in problems[0]
    log.close()


def test_damage_in_an_older_segment_whose_index_is_lost_fails_the_open(tmp_path):
    fill(tmp_path, 40)
    first = segment_files(tmp_path)[0]
    data = bytearray(first.read_bytes())
    data[SEGMENT_HEADER_SIZE + 70] ^= 0x01
    first.write_bytes(bytes(data))
    first.with_suffix(".index").unlink()
    with pytest.raises(CorruptLogError, match="checksum"):
        open_log(tmp_path)
    assert first.read_bytes() == bytes(data)


@pytest.mark.parametrize("damage", ["delete", "truncate", "zero", "extend"])
def test_lost_or_wrong_index_is_rebuilt(tmp_path, caplog, damage):
    values, _ = fill(tmp_path, 120)
    idx = segment_files(tmp_path)[1].with_suffix(".index")
    assert len(segment_files(tmp_path)) >= 3
    good = idx.read_bytes()
    if damage == "delete":
        idx.unlink()
    elif damage == "truncate":
        idx.write_bytes(good[: len(good) // 2])
    elif damage == "zero":
        idx.write_bytes(b"\0" * len(good))
    else:
        idx.write_bytes(good + good[-32:])
    with caplog.at_level(logging.WARNING):
        log = open_log(tmp_path)
    assert "rebuilding it from the log" in caplog.text
    assert all_values(log) == values
    assert log.range_bytes(0, len(values)) > 0
    log.close()
    assert idx.read_bytes() == good


def test_missing_middle_segment_fails_with_a_clear_error(tmp_path):
    fill(tmp_path, 120)
    segs = segment_files(tmp_path)
    assert len(segs) >= 3
    segs[1].unlink()
    with pytest.raises(CorruptLogError, match="not contiguous"):
        open_log(tmp_path)


def test_badly_named_segment_fails(tmp_path):
    fill(tmp_path, 2)
    (tmp_path / "12.meta").write_bytes(b"")
    with pytest.raises(CorruptLogError, match="20-digit"):
        open_log(tmp_path)


def test_torn_segment_creation_is_repaired(tmp_path, caplog):
    values, _ = fill(tmp_path, 40)
    log = open_log(tmp_path)
    end = log.segments()[-1].start + log.segments()[-1].size
    log.close()
    torn = tmp_path / f"{end:020d}.meta"
    torn.write_bytes(b"MQSEG")  # a crash while creating the next segment
    with caplog.at_level(logging.WARNING):
        log = open_log(tmp_path)
    assert "torn header" in caplog.text
    assert all_values(log) == values
    assert log.append([b"next"]).base_offset == len(values)
    assert all_values(log) == values + [b"next"]
    log.close()


def test_recovered_tail_is_fsynced_before_it_is_served(tmp_path, monkeypatch):
    log = open_log(tmp_path, TopicConfig(unflush_threshold=10 ** 6, unflush_interval_ms=10 ** 6))
    log.append([b"written, never fsynced"])
    del log  # a process crash: the batch is in the page cache only
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    log = open_log(tmp_path, TopicConfig())
    assert log.last_stable_offset == 1
    assert any(path.endswith("00000000000000000000.meta") for path in synced)
    log.close()


def test_unclosed_log_recovers_the_tail_index(tmp_path):
    log = open_log(tmp_path, TopicConfig())
    for i in range(10):
        log.append([b"m%d" % i])
    # No close(): the tail index was only in memory, as after a crash.
    del log
    log = open_log(tmp_path, TopicConfig())
    assert all_values(log) == [b"m%d" % i for i in range(10)]
    log.close()


WRITER = textwrap.dedent("""
    import sys
    from metaq_broker.store import PartitionLog, TopicConfig
    log = PartitionLog.open(sys.argv[1], "t", 0, TopicConfig(max_segment_size=64 * 1024))
    i = 0
    while True:
        r = log.append([b"value-%d" % (i + j) for j in range(5)])
        print(r.base_offset + r.count, flush=True)   # acknowledged up to here
        i += 5
""")


@pytest.mark.process
def test_process_killed_while_appending_loses_no_acknowledged_message(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    acked = 0
    try:
        for line in proc.stdout:
            acked = int(line)
            if acked >= 3000:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    log = open_log(tmp_path, TopicConfig(max_segment_size=64 * 1024))
    assert log.last_stable_offset >= acked
    got = all_values(log)
    assert got == [b"value-%d" % i for i in range(len(got))]
    assert len(segment_files(tmp_path)) > 1
    assert log.verify() == []
    log.close()
