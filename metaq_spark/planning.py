"""Planning a metaq read on the driver: which partitions a query reads (every registered one, for its
first offsets), their starting offsets from the options, data-loss checks against what the partitions
hold, and the ranges of a batch, split to reach ``minPartitions``. Offsets are
``{"topic": {"<brokerId>-<n>": next offset}}`` with sorted keys, so Spark's checkpoint is the truth and a
replayed batch reads exactly the same rows."""
from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np
from pyspark.sql.datasource import InputPartition

from metaq_broker.client.consumer import Consumer
from metaq_broker.names import parse_partition_name, partition_name
from metaq_broker.security.settings import ClientSecurity
from metaq_spark.options import EARLIEST, LATEST, OptionError, SourceOptions

log = logging.getLogger(__name__)


class DataLossError(RuntimeError):
    """Offsets the query needs are gone (retention removed them, a partition vanished, or its broker lost
    messages the query had already passed)."""


class PartitionUnavailableError(RuntimeError):
    """A partition's broker is registered but down, so its starting offset cannot be chosen."""


class UnsettledTransactionError(RuntimeError):
    """A range reaches past the partition's last stable offset and the transaction holding it back stayed
    open for fetchTimeoutMs. Nothing is lost, so this is not a DataLossError and never skipped."""


def _names(partitions) -> str:
    """``[(topic, partition)]`` as "topic 1-0 (broker 1), ..." for messages."""
    return ", ".join(f"{t} {p} (broker {parse_partition_name(p)[0]})" for t, p in partitions)


class Planner:
    """What the driver asks the cluster: the subscribed partitions, their offset ranges, addresses."""

    def __init__(self, opts: SourceOptions):
        self.opts = opts
        self.consumer = Consumer(zk_connect=opts.zk_connect, zk_root=opts.zk_root, group=opts.group,
                                 security=opts.security)

    def partitions(self, registered: bool = False) -> dict:
        """{topic: [partition names]} subscribed: on live brokers, or (``registered``) every partition the
        topics have, also those whose broker is down now (assign: as given)."""
        if self.opts.assign is not None:
            return {t: list(ps) for t, ps in self.opts.assign.items()}
        match = self.opts.topic_matcher()
        listing = self.consumer.cluster.registered_partitions if registered else self.consumer.cluster.topic_partitions
        out = {}
        for topic in self.consumer.cluster.topics():
            if match(topic):
                parts = [partition_name(b, n) for b, n in listing(topic)]
                if parts:
                    out[topic] = parts
        return out

    def ranges(self, timestamp_ms: Optional[int] = None) -> dict:
        """{topic: {partition: (earliest, latest, log end[, for_timestamp])}} of partitions on live brokers;
        one call per broker and topic. ``latest`` is the last stable offset: ranges end there (readers
        see committed data only), never inside a transaction still open (between it and the log end)."""
        return {t: self.consumer.offset_bounds(t, ps, timestamp_ms=timestamp_ms) for t, ps in self.partitions().items()}

    def initial_ranges(self) -> dict:
        """``ranges()`` of every registered partition of the subscription, for a query's first offsets: a
        partition whose broker is registered but down is waited for (up to ``fetchTimeoutMs``), as its
        offsets cannot be chosen without it; then the query fails naming it (``failOnDataLoss=false``: it
        is left out with a warning and read from its earliest offset once its broker is back)."""
        deadline = time.monotonic() + self.opts.fetch_timeout_ms / 1000
        warned = False
        while True:
            wanted = self.partitions(registered=True)
            self._check_assigned(wanted)
            down = sorted({(t, p) for t, ps in wanted.items() for p in ps if not self.broker_alive(p)})
            if not down or time.monotonic() > deadline:
                break
            if not warned:
                log.warning("waiting up to fetchTimeoutMs=%d for the brokers of %s to choose the starting offsets",
                            self.opts.fetch_timeout_ms, _names(down))
                warned = True
            time.sleep(0.2)
        if down:
            message = (f"cannot choose the starting offsets of {_names(down)}: their brokers are registered but "
                       f"have been down for fetchTimeoutMs={self.opts.fetch_timeout_ms}")
            if self.opts.fail_on_data_loss:
                raise PartitionUnavailableError(message + "; start them, or set failOnDataLoss=false to start "
                                                "without these partitions (read from their earliest once back)")
            log.warning("%s; starting without them", message)
            wanted = {t: [p for p in ps if (t, p) not in down] for t, ps in wanted.items()}
        return {t: self.consumer.offset_bounds(t, ps) for t, ps in wanted.items() if ps}

    def _check_assigned(self, wanted: dict) -> None:
        """An assigned partition that the topic does not have is a bad option, not a broker to wait for."""
        if self.opts.assign is None:
            return
        for topic, parts in wanted.items():
            have = {partition_name(b, n) for b, n in self.consumer.cluster.registered_partitions(topic)}
            missing = [p for p in parts if p not in have]
            if missing:
                raise OptionError(f"option assign: topic {topic} has no partition {', '.join(missing)}"
                                  + (f" (it has {', '.join(sorted(have, key=parse_partition_name))})" if have
                                     else " (no broker registered the topic)"))

    def broker_alive(self, partition: str) -> bool:
        return parse_partition_name(partition)[0] in self.consumer.cluster.brokers()

    def address(self, partition: str, wait: float = 30.0) -> str:
        """The partition's broker address; waits a while for a broker that is restarting."""
        bid, _ = parse_partition_name(partition)
        deadline = time.monotonic() + wait
        while (addr := self.consumer.cluster.brokers().get(bid)) is None:
            if time.monotonic() > deadline:
                raise DataLossError(f"broker {bid} of partition {partition} has not been alive for {wait:.0f}s")
            time.sleep(0.2)
        return addr

    def data_address(self, partition: str) -> Optional[str]:
        """The partition's broker's data port, if it registered one (else tasks fetch with FetchRaw)."""
        return self.consumer.cluster.data_address(parse_partition_name(partition)[0])

    def other_members(self, partition: str, address: str) -> tuple:
        """The other live members of the partition's broker group, as (address, data address): where its
        tasks look for the master when the one planned with stops being it (a failover)."""
        members = self.consumer.cluster.group_members(parse_partition_name(partition)[0])
        return tuple(m for m in members if m[0] != address)

    def identities(self, offsets: dict) -> dict:
        """{topic: {partition: identity}} of the partitions in ``offsets``, as the last ``ranges`` saw them
        ("" for a broker that predates identities)."""
        seen = self.consumer.identities
        return {t: {p: seen.get((t, p), "") for p in ps} for t, ps in offsets.items()}

    def keeps_key_index(self, topics) -> bool:
        """Do all of ``topics`` keep a key index (``keyIndex``) on every broker that has them? (A broker from
        before key indexes says nothing: no.)"""
        for topic in topics:
            for bid in sorted({b for b, _ in self.consumer.cluster.topic_partitions(topic)}):
                if self.consumer.topic_config(topic, bid).get("keyIndex") != "true":
                    return False
        return True

    def offsets_at(self, topic: str, partitions, timestamp_ms: int) -> dict:
        """{partition: first offset at or after ``timestamp_ms``} (the latest where there is none)."""
        return {p: r[2] for p, r in self.consumer.offsets(topic, partitions, timestamp_ms=timestamp_ms).items()}

    def create_time_ranges(self, topic: str, partitions, since_ms: Optional[int], until_ms: Optional[int]) -> dict:
        """{partition: (start, end) holding every message whose create time is in [since_ms, until_ms], or
        None where its broker cannot say} (``Consumer.offsets_for_create_times``)."""
        return self.consumer.offsets_for_create_times(topic, partitions, since_ms, until_ms)

    def close(self) -> None:
        self.consumer.close()


def _sorted(offsets: dict) -> dict:
    return {t: {p: int(offsets[t][p]) for p in sorted(offsets[t], key=parse_partition_name)}
            for t in sorted(offsets) if offsets[t]}


def resolve_start(opts: SourceOptions, planner: Planner, ranges: dict) -> dict:
    """Starting offsets of every partition in ``ranges`` (``Planner.initial_ranges``) from startingOffsets /
    startingTimestamp / startingOffsetsByTimestamp; a partition these do not name starts at its earliest."""
    out = {t: {p: r[0] for p, r in parts.items()} for t, parts in ranges.items()}
    if opts.starting_timestamp is not None or opts.starting_by_timestamp is not None:
        for topic, parts in ranges.items():
            if opts.starting_timestamp is not None:
                wanted = {p: opts.starting_timestamp for p in parts}
            else:
                wanted = {p: ts for p, ts in opts.starting_by_timestamp.get(topic, {}).items() if p in parts}
            for ts in sorted(set(wanted.values())):  # one call per broker for each distinct time
                same = [p for p, t in wanted.items() if t == ts]
                for p, offset in planner.offsets_at(topic, same, ts).items():
                    if offset >= ranges[topic][p][1] and opts.timestamp_strategy == "error":
                        raise OptionError(f"no message at or after timestamp {ts} in {topic} {p} "
                                          f"(startingOffsetsByTimestampStrategy=error)")
                    out[topic][p] = offset
        return _sorted(out)
    committed = {}
    if opts.starting == "group":
        committed = {t: planner.consumer.committed(t) for t in ranges}
    for topic, parts in ranges.items():
        for p, (earliest, latest, *_) in parts.items():
            if isinstance(opts.starting, dict):
                if topic not in opts.starting or p not in opts.starting[topic]:
                    if opts.assign is None:
                        continue  # documented: from its earliest
                    raise OptionError(f"option startingOffsets: no offset for assigned {topic} {p}")
                want = opts.starting[topic][p]
                value = earliest if want == EARLIEST else latest if want == LATEST else want
            elif opts.starting == "latest":
                value = latest
            elif opts.starting == "group":
                value = committed[topic].get(p, earliest)
            else:
                value = earliest
            out[topic][p] = value
    return _sorted(out)


def check_identities(opts: SourceOptions, recorded: dict, now: dict, ranges: dict) -> dict:
    """Partitions whose log is another one than the offsets were taken of (``recorded`` vs ``now``, both
    {topic: {partition: identity}}): a wiped data directory or a topic deleted and made again, even when
    the new log has grown past the old offsets. failOnDataLoss=true: DataLossError naming topic,
    partition and both identities. false: a warning, and {topic: {partition: the new log's earliest}},
    where those partitions are read from. An identity missing on either side (a checkpoint or a broker
    from before identities) matches any."""
    restarts: dict = {}
    for topic, parts in recorded.items():
        for p, old in parts.items():
            new = now.get(topic, {}).get(p, "")
            if not old or not new or old == new or p not in ranges.get(topic, {}):
                continue
            message = (f"{topic} {p} is another log now: identity {old} in the query's offsets, {new} on its broker "
                       f"(its data directory was wiped, or the topic was deleted and created again); the query's "
                       f"offsets of the old log mean nothing in the new one")
            if opts.fail_on_data_loss:
                raise DataLossError(message + "; set failOnDataLoss=false to read the new log from its earliest offset")
            earliest = ranges[topic][p][0]
            log.warning("%s; reading the new log from its earliest offset %d, some data may have been missed",
                        message, earliest)
            restarts.setdefault(topic, {})[p] = earliest
    return restarts


def check_data_loss(opts: SourceOptions, start: dict, ranges: dict) -> dict:
    """Offsets the query needs that the partition no longer has fail the query, or with
    failOnDataLoss=false move, with a warning, to where the partition's messages are: below its earliest
    (retention removed them) up to the earliest; above its latest (its broker lost messages the query had
    passed: a wiped data directory, a tail lost under ``unflushThreshold>0``) down to the latest, as
    Kafka's source does, so that messages written from then on are read. Offsets are compared, never row
    counts (transaction markers and aborted transactions leave gaps), and an offset past the last stable
    offset but within the log end (``ranges``' third field) is not loss: an open transaction holds it
    back, and the query reads on from it once the transaction settles."""
    fixed = {t: dict(ps) for t, ps in start.items()}
    for topic, parts in start.items():
        for p, offset in parts.items():
            have = ranges.get(topic, {}).get(p)
            if have is None:
                message = f"partition {p} of topic {topic} is gone (needed from offset {offset})"
                if opts.fail_on_data_loss:
                    raise DataLossError(message + "; set failOnDataLoss=false to continue without it")
                log.warning("%s; continuing without it", message)
                del fixed[topic][p]
            elif offset < have[0]:
                message = (f"offsets {offset} to {have[0] - 1} of {topic} {p} are gone (retention removed them); "
                           f"the earliest available is {have[0]}")
                if opts.fail_on_data_loss:
                    raise DataLossError(message + "; set failOnDataLoss=false to continue from there")
                log.warning("%s; continuing from %d", message, have[0])
                fixed[topic][p] = have[0]
            elif offset > have[1] and not (len(have) > 2 and offset <= have[2]):
                message = (f"{topic} {p} went backwards: the query is at offset {offset} but the partition's latest "
                           f"offset is {have[1]} (its broker lost messages: a wiped data directory, or an unflushed "
                           f"tail lost in a crash)")
                if opts.fail_on_data_loss:
                    raise DataLossError(message + f"; set failOnDataLoss=false to continue from offset {have[1]}")
                log.warning("%s; the offset was changed from %d to %d, some data may have been missed",
                            message, offset, have[1])
                fixed[topic][p] = have[1]
    return _sorted(fixed)


class MetaqPartition(InputPartition):
    def __init__(self, topic: str, partition: str, address: str, start: int, end: int, fetch_max_bytes: int,
                 fail_on_data_loss: bool, fetch_timeout_ms: int, data_address: Optional[str] = None,
                 security: Optional[ClientSecurity] = None, other_members: tuple = (), columns: Optional[tuple] = None,
                 identity: str = "", keys: Optional[tuple] = None, msg_ids: Optional[tuple] = None):
        super().__init__((topic, partition, start, end))
        self.keys, self.msg_ids = keys, msg_ids  # pushed filters: only messages with these keys or ids (lookups)
        self.identity = identity  # of the log the range was planned in ("": not known, not checked)
        self.columns = columns  # the query's columns when it gave a schema (None: all of the source's)
        self.other_members = other_members  # ((address, data address), ...) of its group's other members
        self.security = security or ClientSecurity()  # how the task connects (TLS, SASL), as the driver does
        self.topic, self.partition, self.address = topic, partition, address
        self.data_address = data_address  # the broker's data port ("host:port"), None: FetchRaw only
        self.start, self.end = start, end
        self.fetch_max_bytes = fetch_max_bytes
        self.fail_on_data_loss = fail_on_data_loss
        self.fetch_timeout_ms = fetch_timeout_ms


def plan_partitions(opts: SourceOptions, planner: Planner, start: dict, end: dict, identities: Optional[dict] = None,
                    restarts: Optional[dict] = None, keys: Optional[tuple] = None, msg_ids: Optional[tuple] = None) -> list:
    """One Spark partition per MetaQ partition range, split further to reach minPartitions. Only the
    offsets given count (a replay reads the same rows): a partition missing from ``start`` has no range
    yet (``latestOffset`` records its start first), and one whose end is below its start (its broker lost
    messages, failOnDataLoss=false) reads nothing. ``restarts`` ({topic: {partition: offset}}, from the
    end offsets) replaces the start of a partition whose log was replaced (``check_identities``);
    ``identities`` are the logs' the ranges are of, checked by the tasks. ``keys``, ``msg_ids``: pushed
    filters, answered by each task with lookups in its range instead of reading it."""
    start = {t: {**ps, **(restarts or {}).get(t, {})} for t, ps in start.items()}
    ranges = [(t, p, start[t][p], e) for t, parts in end.items() for p, e in parts.items()
              if p in start.get(t, {}) and e > start[t][p]]
    total = sum(e - s for _, _, s, e in ranges)
    pieces = []
    for t, p, s, e in ranges:
        n = 1
        if opts.min_partitions and total and opts.min_partitions > len(ranges):
            n = max(1, round(opts.min_partitions * (e - s) / total))
        bounds = np.linspace(s, e, n + 1).astype(np.int64)
        addr, data_addr = planner.address(p), planner.data_address(p)
        others = planner.other_members(p, addr)
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b > a:
                pieces.append(MetaqPartition(t, p, addr, int(a), int(b), opts.fetch_max_bytes, opts.fail_on_data_loss,
                                             opts.fetch_timeout_ms, data_addr, opts.security, others, opts.columns,
                                             (identities or {}).get(t, {}).get(p, ""), keys, msg_ids))
    return pieces


def _proportional(start: dict, waiting: dict, budget: int) -> dict:
    """Split ``budget`` rows across partitions in proportion to what each has waiting."""
    total = sum(waiting.values())
    keys = sorted(waiting)
    exact = np.array([budget * waiting[k] / total for k in keys])
    share = np.floor(exact).astype(np.int64)
    left = budget - int(share.sum())
    for i in np.argsort(-(exact - share), kind="stable")[:left]:
        share[i] += 1
    out = {t: dict(ps) for t, ps in start.items()}
    for (t, p), s in zip(keys, share):
        out[t][p] = start[t][p] + int(min(s, waiting[(t, p)]))
    return out
