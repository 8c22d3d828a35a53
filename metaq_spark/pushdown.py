"""Filter pushdown for batch reads (Spark's ``DataSourceReader.pushFilters``): which of a query's filters
the source answers itself, so that Spark reads only what they select.

Answered exactly, and so taken from Spark: ``topic`` and ``partition`` equal to or in a list (fewer
partitions), ``offset`` compared with a number or equal to one (narrower ranges; an IN list's range is
read and the list stays with Spark too), ``key`` equal to or in a list (the brokers' key indexes through
``Lookup``, when every subscribed topic keeps one), ``msgId`` equal to or in a list (the offset index; lists
of at most MAX_LOOKUPS: a lookup per value in every task costs more than reading a range), and
the ``IsNotNull`` Spark adds beside them on columns that are never null or that such a filter requires.

Narrowed but left with Spark as well: ``timestamp`` compared with a time or equal to one. The column is a
message's create time where its producer gave one, which the brokers' time index (ordered by store time)
answers only through each segment's skew bounds (``PartitionLog.offsets_for_create_times``): whole batches,
bounds that may be wide, so each partition's range shrinks to one holding every match and Spark's filter
picks the rows. Anything else stays with Spark. Spark calls ``pushFilters`` only when
``spark.sql.python.filterPushdown.enabled`` is true (``MetaqDataSource.reader``).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field, replace
from typing import Optional

from pyspark.sql.datasource import (EqualNullSafe, EqualTo, GreaterThan, GreaterThanOrEqual, In, IsNotNull, LessThan,
                                    LessThanOrEqual)

NEVER_NULL = {"topic", "partition", "offset", "timestamp", "timestampType", "msgId", "flag"}
_EQUAL = (EqualTo, EqualNullSafe)
_COMPARE = (GreaterThan, GreaterThanOrEqual, LessThan, LessThanOrEqual)
MAX_OFFSET = 2 ** 63 - 1
MAX_LOOKUPS = 256  # keys or ids a query may push: each costs every task a Lookup; a longer list is Spark's


@dataclass(frozen=True)
class Pushed:
    """What the pushed filters select, ANDed: None where a filter does not restrict; ``offsets``: [low,
    high)."""

    topics: Optional[frozenset] = None
    partitions: Optional[frozenset] = None
    offsets: tuple = (0, MAX_OFFSET)
    keys: Optional[frozenset] = None  # bytes
    msg_ids: Optional[frozenset] = None
    create_times: tuple = (None, None)  # [since, until] ms, inclusive, None: unbounded (``timestamp`` filters)
    shown: tuple = field(default=(), compare=False)  # the filters taken, for logs
    narrowing: tuple = field(default=(), compare=False)  # the filters that narrow ranges but stay Spark's

    @property
    def empty(self) -> bool:
        """Nothing can match (e.g. ``key = 'a' AND key = 'b'``, ``offset > 5 AND offset < 3``)."""
        lo, hi = self.offsets
        since, until = self.create_times
        return lo >= hi or (since is not None and until is not None and since > until) or \
            any(s is not None and not s for s in (self.topics, self.partitions, self.keys, self.msg_ids))


def _column(f) -> Optional[str]:
    path = getattr(f, "attribute", None)
    return path[0] if isinstance(path, tuple) and len(path) == 1 else None


def _values(f) -> Optional[tuple]:
    """The values an equality or IN filter allows; None for other filters."""
    if isinstance(f, _EQUAL):
        return None if f.value is None else (f.value,)
    if isinstance(f, In):
        return tuple(v for v in f.value if v is not None)
    return None


def _bytes(v) -> Optional[bytes]:
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    if isinstance(v, str):
        return v.encode()
    return None


def _int(v) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


def _micros(v) -> Optional[int]:
    """A ``timestamp`` literal (Spark hands an aware datetime) as µs since the epoch; None for anything
    else (a naive datetime's zone is not known here)."""
    if isinstance(v, datetime.datetime) and v.tzinfo is not None:
        return (v - _EPOCH) // datetime.timedelta(microseconds=1)
    return None


def _create_times(f, us: int, current: tuple) -> tuple:
    """``current`` [since, until] (ms, inclusive) narrowed by ``timestamp <op> us``: the column holds whole
    ms, so e.g. ``>= 1500 µs`` is ``>= 2 ms`` and ``< 1500 µs`` is ``<= 1 ms``."""
    up, down = -(-us // 1000), us // 1000  # the ms at or above, at or below
    since, until = {GreaterThan: (down + 1, None), GreaterThanOrEqual: (up, None), LessThan: (None, up - 1),
                    LessThanOrEqual: (None, down), EqualTo: (up, down), EqualNullSafe: (up, down)}[type(f)]
    return (current[0] if since is None else since if current[0] is None else max(since, current[0]),
            current[1] if until is None else until if current[1] is None else min(until, current[1]))


def _restrict(current: Optional[frozenset], values) -> frozenset:
    values = frozenset(values)
    return values if current is None else current & values


def push(filters, key_index: bool) -> tuple:
    """(Pushed, the filters Spark must still apply: the same objects it gave). ``key_index``: every
    subscribed topic keeps a key index (else key filters stay with Spark)."""
    pushed, kept, taken, narrowing = Pushed(), [], [], []
    for f in filters:
        col, values = _column(f), _values(f)
        p = None
        if col == "timestamp" and isinstance(f, _COMPARE + _EQUAL) and _micros(f.value) is not None:
            pushed = replace(pushed, create_times=_create_times(f, _micros(f.value), pushed.create_times))
            narrowing.append(repr(f))  # and it stays with Spark, below
        elif col in ("topic", "partition") and values is not None and all(isinstance(v, str) for v in values):
            p = replace(pushed, **{col + "s": _restrict(getattr(pushed, col + "s"), values)})
        elif col == "key" and key_index and values is not None and len(values) <= MAX_LOOKUPS and \
                all(_bytes(v) is not None for v in values):
            p = replace(pushed, keys=_restrict(pushed.keys, map(_bytes, values)))
        elif col == "msgId" and values is not None and len(values) <= MAX_LOOKUPS and \
                all(_int(v) is not None for v in values):
            p = replace(pushed, msg_ids=_restrict(pushed.msg_ids, values))
        elif col == "offset" and values is not None and all(_int(v) is not None for v in values):
            lo, hi = pushed.offsets
            allowed = sorted(v for v in values if lo <= v < hi)
            p = replace(pushed, offsets=(allowed[0], allowed[-1] + 1) if allowed else (0, 0))
            if len(allowed) > 1:  # an IN list with gaps: the range covers it, Spark picks the offsets
                kept.append(f)
        elif col == "offset" and isinstance(f, _COMPARE) and _int(f.value) is not None:
            lo, hi = pushed.offsets
            v = f.value
            bound = {GreaterThan: (v + 1, None), GreaterThanOrEqual: (v, None), LessThan: (None, v),
                     LessThanOrEqual: (None, v + 1)}[type(f)]
            p = replace(pushed, offsets=(max(lo, bound[0]) if bound[0] is not None else lo,
                                         min(hi, bound[1]) if bound[1] is not None else hi))
        elif isinstance(f, IsNotNull) and (col in NEVER_NULL or col == "key" and key_index):
            taken.append(f)  # never null; for key: decided below, when a key filter was taken
            continue
        if p is None:
            kept.append(f)
        else:
            pushed = p
            taken.append(f)
    if pushed.keys is None:  # IsNotNull(key) alone selects something: Spark applies it
        for f in taken:
            if isinstance(f, IsNotNull) and _column(f) == "key":
                kept.append(f)
    shown = tuple(repr(f) for f in taken if f not in kept)
    return replace(pushed, shown=shown, narrowing=tuple(narrowing)), kept

