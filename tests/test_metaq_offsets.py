"""MetaQ byte positions <-> metaq logical offsets (protocol/metaq/offsets.py), against a brute-force model
that walks every message: exact at every message start, 301 to the next visible position anywhere else
(control batches, aborted transactions, below the log start, past the last stable offset, gaps in the
byte stream), 404 at the visible end. And a consumer that only follows the answers, starting anywhere,
reads every visible message after its start once, in order, whatever window the broker looks through."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from metaq_broker.protocol.metaq.offsets import (INT64_MAX, Moved, NotFound, Serve, Window, answer_get,
                                                 nearest_position)

pytestmark = pytest.mark.unit


@st.composite
def partitions(draw):
    """A run of batches: (window, log_start, last_stable, visible_end, messages) where messages is the
    model: [(offset, start, size, visible)]."""
    nb = draw(st.integers(1, 8))
    base = draw(st.integers(0, 1000))
    pos = draw(st.integers(0, 10_000))
    bases, byte_bases, counts, sizes, hidden = [], [], [], [], []
    off = base
    for _ in range(nb):
        pos += draw(st.sampled_from([0, 0, 0, 7]))  # mostly contiguous, sometimes a gap
        n = draw(st.integers(1, 4))
        s = draw(st.lists(st.integers(20, 60), min_size=n, max_size=n))
        bases.append(off)
        byte_bases.append(pos)
        counts.append(n)
        sizes += s
        hidden.append(draw(st.booleans()) and draw(st.booleans()))
        off += n
        pos += sum(s)
    log_start = draw(st.integers(base, off))
    last_stable = draw(st.integers(log_start, off))
    w = Window(bases, byte_bases, counts, sizes, hidden)
    messages, i = [], 0
    for b in range(nb):
        start = byte_bases[b]
        for k in range(counts[b]):
            o = bases[b] + k
            messages.append((o, start, sizes[i], not hidden[b] and log_start <= o < last_stable))
            start += sizes[i]
            i += 1
    visible_end = next((m[1] for m in messages if m[0] == last_stable), w.end_position)
    return w, log_start, last_stable, visible_end, messages


def model_get(messages, window_end, position, max_bytes, visible_end, tell_max=False):
    if position >= visible_end:
        if position > visible_end and (tell_max or position == INT64_MAX):
            return Moved(visible_end)
        return NotFound()
    later = [i for i, (_, start, size, _) in enumerate(messages) if start + size > position]
    if later and messages[later[0]][1] == position and messages[later[0]][3]:
        i = later[0]
        run = [i]
        while (run[-1] + 1 < len(messages) and messages[run[-1] + 1][3]
               and messages[run[-1] + 1][1] == messages[run[-1]][1] + messages[run[-1]][2]):
            run.append(run[-1] + 1)
        taken, total = 0, 0
        for j in run:
            if total + messages[j][2] > max_bytes:
                break
            taken, total = taken + 1, total + messages[j][2]
        if taken == 0:
            return Serve(messages[i][0], 0, position, max_bytes)
        return Serve(messages[i][0], taken, position, total)
    for i in later:
        if messages[i][3]:
            return Moved(messages[i][1])
    return Moved(min(window_end, visible_end))


def positions_to_try(w, messages, draw_extra):
    starts = [m[1] for m in messages]
    return sorted(set(starts + [s + 1 for s in starts] + [w.start_position - 3, w.end_position, w.end_position + 5,
                                                          INT64_MAX, -1] + draw_extra))


@settings(max_examples=150, deadline=None)
@given(partitions(), st.integers(1, 200), st.lists(st.integers(-10, 12_000), max_size=10), st.booleans())
def test_answers_match_the_brute_force_model(part, max_bytes, extra, tell_max):
    w, log_start, last_stable, visible_end, messages = part
    for p in positions_to_try(w, messages, extra):
        if visible_end > p >= w.end_position:
            continue  # outside the contract: the window must hold the position's batch
        expected = model_get(messages, w.end_position, p, max_bytes, visible_end, tell_max)
        assert answer_get(w, p, max_bytes, log_start, last_stable, visible_end, tell_max) == expected, p
        near = nearest_position(w, p, log_start, last_stable, visible_end)
        if isinstance(expected, Serve):
            assert near == p
        elif p >= visible_end:
            assert near == visible_end
        else:
            assert near == expected.position


@settings(max_examples=150, deadline=None)
@given(partitions())
def test_exact_both_ways_at_every_message_start(part):
    w, _, _, _, messages = part
    for offset, start, _, _ in messages:
        assert w.position_of(offset) == start and w.offset_of(start) == offset
        assert w.offset_of(start + 1) is None
    assert w.position_of(w.end_offset) == w.end_position


def follow(w_for, position, max_bytes, log_start, last_stable, visible_end, limit=10_000):
    """A MetaQ consumer that only follows answers: next position = position + bytes of whole messages;
    a partial message doubles its maxSize. Returns the offsets read, in order."""
    read, size, moved_from = [], max_bytes, set()
    for _ in range(limit):
        a = answer_get(w_for(position), position, size, log_start, last_stable, visible_end)
        if isinstance(a, NotFound):
            return read
        if isinstance(a, Moved):
            assert position not in moved_from, f"moved from {position} twice: a loop"
            moved_from.add(position)
            position = a.position
            continue
        if a.count == 0:
            size *= 2
            continue
        read += list(range(a.offset, a.offset + a.count))
        position += a.nbytes
        size = max_bytes
    raise AssertionError("the consumer never reached the visible end")


@settings(max_examples=150, deadline=None)
@given(partitions(), st.integers(1, 150), st.integers(0, 3), st.data())
def test_a_consumer_following_answers_reads_every_visible_message_once(part, max_bytes, reach, data):
    w, log_start, last_stable, visible_end, messages = part
    start_msg = data.draw(st.integers(0, len(messages) - 1))
    start = data.draw(st.sampled_from([messages[start_msg][1], messages[start_msg][1] + 1, w.start_position - 100]))
    # what it must read: every visible message from the one holding ``start`` on (a position inside a
    # message is rounded down to that message's start)
    expected = [m[0] for m in messages if m[3] and m[1] + m[2] > start]

    def full(_):
        return w

    def narrow(position):
        """Only the batches from the one holding ``position`` (or the next, in a gap) to ``reach`` after it."""
        batch_end = np.add.reduceat(w.sizes, np.cumsum(w.counts) - w.counts) + w.byte_base
        b = min(int(np.searchsorted(batch_end, position, side="right")), len(w.counts) - 1)
        last = min(b + 1 + reach, len(w.base_offset))
        first_msg = int(w.counts[:b].sum())
        n = int(w.counts[b:last].sum())
        return Window(w.base_offset[b:last], w.byte_base[b:last], w.counts[b:last],
                      w.sizes[first_msg:first_msg + n], w.hidden[b:last])

    assert follow(full, start, max_bytes, log_start, last_stable, visible_end) == expected
    assert follow(narrow, start, max_bytes, log_start, last_stable, visible_end) == expected


def test_retention_moves_an_old_position_to_the_first_readable_message():
    # batches at offsets 0..5 (bytes 0..), the log start is 3 after retention
    w = Window([0, 3], [0, 90], [3, 3], [30] * 6)
    assert answer_get(w, 0, 1000, 3, 6, 180) == Moved(90)
    assert answer_get(w, 90, 1000, 3, 6, 180) == Serve(3, 3, 90, 90)
    assert nearest_position(w, 45, 3, 6, 180) == 90


def test_reply_stops_before_a_marker_and_the_marker_is_moved_past():
    # a transaction's batch, its commit marker (hidden, 21 bytes), then a plain batch
    w = Window([0, 2, 3], [0, 60, 81], [2, 1, 1], [30, 30, 21, 25], [False, True, False])
    assert answer_get(w, 0, 1000, 0, 4, 106) == Serve(0, 2, 0, 60)
    assert answer_get(w, 60, 1000, 0, 4, 106) == Moved(81)
    assert answer_get(w, 81, 1000, 0, 4, 106) == Serve(3, 1, 81, 25)
    assert answer_get(w, 106, 1000, 0, 4, 106) == NotFound()


def test_open_transaction_holds_readers_at_the_last_stable_offset():
    w = Window([0, 1], [0, 30], [1, 2], [30, 40, 40])
    assert answer_get(w, 30, 1000, 0, 1, 30) == NotFound()  # 1 = last stable offset: the open transaction's
    assert answer_get(w, 70, 1000, 0, 1, 30) == NotFound()  # inside the open transaction: nothing yet
    assert answer_get(w, INT64_MAX, 1000, 0, 1, 30) == Moved(30)  # alwaysConsumeFromMaxOffset
    assert answer_get(w, 70, 1000, 0, 1, 30, tell_max=True) == Moved(30)


def test_first_message_larger_than_max_size_is_sent_partially():
    w = Window([0], [0], [2], [500, 30])
    assert answer_get(w, 0, 100, 0, 2, 530) == Serve(0, 0, 0, 100)
    assert answer_get(w, 0, 500, 0, 2, 530) == Serve(0, 1, 0, 500)


def test_window_contract_is_checked():
    w = Window([5], [100], [1], [30])
    assert answer_get(w, 50, 100, 0, 6, 130) == Moved(100)  # no batch holds 50: the window starts after it
    with pytest.raises(ValueError, match="must hold its batch"):
        answer_get(w, 140, 100, 5, 9, 200)
    for bad in (dict(counts=[2]), dict(sizes=[10]), dict(byte_base=[100, 110], base_offset=[5, 6], counts=[1, 1],
                                                          sizes=[30, 30])):
        args = dict(base_offset=[5], byte_base=[100], counts=[1], sizes=[30]) | bad
        with pytest.raises(ValueError):
            Window(**args)
