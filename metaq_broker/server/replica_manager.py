"""The master's side of replication (docs/replication.md): what each replica has, the in-sync set, the high
watermark, and acknowledgements that wait for it.

A replica's fetch request says, per partition, where its log ends (written and fsynced) and the epoch of
its last batch. The master checks that prefix against its own epochs (Kafka's KIP-101/KIP-279): a
consistent entry is *validated* and its durable offset counts towards the partition's high watermark
(HW): the least durable end over the master and every member of the ack set. Readers stop at the HW, and
an ``acks=all`` put is answered once the HW passes it *and* the ack set still has minInSyncReplicas
members, so an acknowledged or seen message is on every member that can be elected.

The ack set is the committed in-sync set plus an expansion being written (KIP-497): a replica leaves it
only after ZooKeeper has the shrink, and joins it before ZooKeeper has the expansion, so it is always a
superset of what an election may pick from. The join is decided under the lock, so no acknowledgement
slips between the check "it has everything acknowledged" and the join.

Lock order (a deadlock between the data port's fetch thread and the group thread taught it): the group's
role lock (``GroupMember._lock``) before this manager's condition ``_cond``, before a partition's locks.
Nothing here calls ZooKeeper or takes the group's lock while holding ``_cond``: in-sync changes are
decided under it, written by ``tick`` (the group thread) with it released, then applied under it again.
The data port's threads (``serve_fetch``) only record progress and wake the group thread.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from metaq_broker.errors import NotAcknowledgedError, NotEnoughReplicasError, NotMasterError, OffsetOutOfRangeError
from metaq_broker.protocol import replication as rp

log = logging.getLogger(__name__)

LONG_POLL_S = 0.5  # a fetch with nothing to send waits this long at most for new data
ACK_GRACE_S = 5.0  # an acks=all put gives up after replicaLagMaxMs plus this without progress


@dataclass
class ReplicaProgress:
    """What the master knows of one replica in the current epoch."""

    replica_id: int
    uuid: str
    durable: dict = field(default_factory=dict)  # (topic, partition) -> fsynced end, validated entries only
    fetched: dict = field(default_factory=dict)  # (topic, partition) -> its log end offset in the last request (lag)
    sent_end: dict = field(default_factory=dict)  # (topic, partition) -> master log end in the last reply
    sent_journal: int = 0  # journal_last_seq of the last reply
    sent_at: float = 0.0  # monotonic time of the last reply
    journal_applied: int = -1
    last_caught_up: float = 0.0  # monotonic


@dataclass
class IsrChange:
    """An in-sync change decided under the lock, written to ZooKeeper without it (``tick``)."""

    epoch: int
    replica_id: int
    uuid: str
    isr: dict  # the committed in-sync set to write: replicaId -> uuid
    expand: bool
    why: str = ""


@dataclass
class Section:
    """One partition's answer to a replica fetch: ``where`` (a FileRange) on SECTION_DATA."""

    status: int
    where: object = None
    earliest: int = 0
    latest: int = 0
    log_end: int = 0
    hw: int = 0
    epoch: int = 0
    offset: int = 0


@dataclass
class Answer:
    epoch: int
    journal: tuple  # (first_seq, last_seq, frames, is_snapshot)
    sections: list
    topics_changed: bool


class FencedError(Exception):
    """A replica fetched with an older epoch than the master's: it must re-read the group's state."""


class ReplicaManager:
    """``alter_isr(isr) -> bool`` writes the in-sync set (``[(replicaId, uuid), ...]``) to ZooKeeper with
    the state's version; False when the write lost (a newer epoch: the caller demotes) or ZooKeeper did not
    answer. It is called by ``tick`` only, never with ``_cond`` held. ``wake()`` asks the group thread for
    an early ``tick`` (a replica may join or must leave the in-sync set). ``lease_valid()`` says whether
    this master's lease still holds (read without a lock, so it may be called with ``_cond`` held)."""

    def __init__(self, store, transactions, broker_id: int, replica_id: int, uuid: str, lag_max_s: float,
                 alter_isr: Callable[[list], bool], on_higher_epoch: Callable[[int], None] = lambda e: None,
                 clock=time.monotonic, wake: Callable[[], None] = lambda: None,
                 lease_valid: Callable[[], bool] = lambda: True):
        self.store, self.transactions = store, transactions
        self.broker_id, self.replica_id, self.uuid = broker_id, replica_id, uuid
        self._on_higher_epoch = on_higher_epoch
        self.lag_max_s = lag_max_s
        self._alter_isr = alter_isr
        self._wake = wake
        self._lease_valid = lease_valid
        self._clock = clock
        self._cond = threading.Condition()
        self.epoch = 0
        self.active = False  # master of ``epoch``
        self.isr: dict = {}  # committed in-sync set: replicaId -> uuid (master included)
        self.ack_set: set = set()  # replica ids, master included
        self._joining: Optional[tuple] = None  # (replicaId, uuid) in the ack set, its expansion being written
        self.progress: dict = {}  # replicaId -> ReplicaProgress
        self._hw: dict = {}  # (topic, partition) -> high watermark
        self._activated_at = 0.0
        self.elections = self.isr_shrinks = self.isr_expands = 0  # since start, for the metrics

    # -- roles ----------------------------------------------------------------------------------------
    def activate(self, epoch: int, isr: dict, hw_hint: Optional[dict] = None) -> None:
        """Become master of ``epoch`` with the committed in-sync set ``isr``; the HW starts at the best
        known value (checkpoint or what fetch replies taught us) capped at the own log end."""
        with self._cond:
            self.epoch, self.active = epoch, True
            self.elections += 1
            self._activated_at = self._clock()
            self.isr = dict(isr)
            self.ack_set = set(isr) | {self.replica_id}
            self._joining = None
            self.progress = {}
            self._hw = {}
            for p in self.store.all_partitions():
                key = (p.topic, p.partition)
                self._hw[key] = min(max((hw_hint or {}).get(key, 0), p.earliest_offset), p.log_end_offset)
                p.set_high_watermark(self._hw[key] if self._capped else None)
            self._cond.notify_all()
        self.refresh_all()

    def deactivate(self) -> None:
        """Stop being master: waiting acknowledgements fail at once."""
        with self._cond:
            self.active = False
            self._cond.notify_all()

    # -- acknowledgements -----------------------------------------------------------------------------
    def check_enough(self, topic: str) -> None:
        """Refuse an ``acks=all`` put before it is written when the in-sync set is below the topic's
        minInSyncReplicas: nothing is half written."""
        need = self._min_insync(topic)
        if len(self.isr) < need:
            raise NotEnoughReplicasError(
                f"not enough in-sync replicas: group {self.broker_id} has in-sync set "
                f"{sorted(self.isr)} ({len(self.isr)} of {len(self.roster())} members), topic {topic!r} needs "
                f"minInSyncReplicas={need}; nothing was written")

    def await_hw(self, topic: str, partition: int, end: int) -> None:
        """Return once the HW of the partition is at ``end`` or beyond (every ack-set member has the
        batch, durable by its flush policy) with the ack set still at least the topic's minInSyncReplicas.
        The size is checked before the HW is trusted: a HW recomputed over a set that shrank below the
        minimum says nothing about the other members. NotAcknowledgedError ("may or may not be stored")
        when it cannot be promised: the set below minInSyncReplicas, a demotion, or no progress for
        replicaLagMaxMs plus ACK_GRACE_S."""
        key = (topic, partition)
        deadline = self._clock() + self.lag_max_s + ACK_GRACE_S
        where = f"the batch up to offset {end} of {topic}-{partition}"
        with self._cond:
            while True:
                self._check_acknowledging(topic, where)
                if self._refresh(key) >= end:
                    return
                left = deadline - self._clock()
                if left <= 0:
                    raise NotAcknowledgedError(
                        f"not acknowledged: {where} is on the master, not on in-sync set {sorted(self.ack_set)} "
                        f"within {self.lag_max_s + ACK_GRACE_S:.0f}s; it may or may not be stored")
                self._cond.wait(min(left, 0.05))

    def await_journal(self, seq: int, topics=()) -> None:
        """Return once every ack-set replica has applied journal record ``seq`` (a transaction call), the
        ack set at least minInSyncReplicas of each of ``topics`` (the transaction's)."""
        deadline = self._clock() + self.lag_max_s + ACK_GRACE_S
        where = f"the transaction's journal record {seq}"
        with self._cond:
            while True:
                for topic in sorted(set(topics)) or [None]:
                    self._check_acknowledging(topic, where)
                behind = [r for r in self.ack_set if r != self.replica_id
                          and (r not in self.progress or self.progress[r].journal_applied < seq)]
                if not behind:
                    return
                left = deadline - self._clock()
                if left <= 0:
                    raise NotAcknowledgedError(f"not acknowledged: in-sync replicas {behind} did not take {where} "
                                               f"within {self.lag_max_s + ACK_GRACE_S:.0f}s; the transaction's "
                                               f"state may or may not be stored")
                self._cond.wait(min(left, 0.05))

    def _check_acknowledging(self, topic: Optional[str], where: str) -> None:
        """NotAcknowledgedError unless this member is master with a valid lease and its ack set has the
        topic's minInSyncReplicas (holding the lock). A lease that ran out ends the wait at once: its
        replicas are refused their fetches from then on, so the HW cannot move, and waiting on would only
        make the client time out instead of hearing why."""
        if not self.active:
            raise NotAcknowledgedError(
                f"not acknowledged: this member stopped being master of group {self.broker_id} while waiting for "
                f"its in-sync set; {where} may or may not be stored")
        if not self._lease_valid():
            raise NotAcknowledgedError(
                f"not acknowledged: the lease of group {self.broker_id}'s master ran out (no word from ZooKeeper) "
                f"while waiting for its in-sync set; {where} may or may not be stored")
        need = self._min_insync(topic) if topic is not None else 1
        if len(self.ack_set) < need:
            raise NotAcknowledgedError(
                f"not acknowledged: {where} is on the master, but group {self.broker_id}'s in-sync set "
                f"{sorted(self.ack_set)} is below minInSyncReplicas={need}; it may or may not be stored")

    def _refresh(self, key) -> int:
        """Recompute one partition's HW (holding the lock); it never moves down."""
        topic, partition = key
        try:
            part = self.store.partition(topic, partition)
        except Exception:  # noqa: BLE001 - a topic dropped under us: nothing to wait for
            return 1 << 62
        hw = part.visible_end  # what the topic's flush policy acknowledges: fsynced, or written (unflushThreshold)
        for r in self.ack_set:
            if r == self.replica_id:
                continue
            prog = self.progress.get(r)
            if prog is None or key not in prog.durable or prog.uuid != self._ack_uuid(r):
                return self._hw.get(key, 0)  # an ack-set member not heard from in this epoch holds the HW
            hw = min(hw, prog.durable[key])
        old = self._hw.get(key, 0)
        if hw > old:
            self._hw[key] = hw
            if self._capped:
                part.set_high_watermark(hw)
            self._cond.notify_all()
            return hw
        return old

    def _ack_uuid(self, r: int) -> Optional[str]:
        """The uuid (data directory) ack-set member ``r`` counts with: a member that came back wiped is
        another, and holds the HW until its old entry is shrunk out."""
        if r in self.isr:
            return self.isr[r]
        return self._joining[1] if self._joining is not None and self._joining[0] == r else None

    @property
    def _capped(self) -> bool:
        """Readers are capped at the HW only while another member is in the ack set; a master alone has
        HW = its durable end, which is what readers see without a cap (no wait, no change for a group
        of one)."""
        return len(self.ack_set) > 1

    def _uncap(self) -> None:
        """Readers see up to the log end again: the master is alone in the ack set."""
        for p in self.store.all_partitions():
            p.set_high_watermark(None)

    def topic_created(self, topic: str, partitions: Optional[Iterable[int]] = None) -> None:
        """Cap a new topic's partitions (or a grown topic's new ``partitions``) before anything is written to
        them, if readers are capped."""
        with self._cond:
            if self.active and self._capped:
                for p in self.store.partitions(topic) if partitions is None else \
                        [self.store.partition(topic, n) for n in partitions]:
                    p.set_high_watermark(p.earliest_offset)

    def topic_deleted(self, topic: str) -> None:
        """Forget ``topic``'s high watermarks and what replicas fetched of it: a topic created again under
        the name starts from offset 0, and must not be acknowledged by the old one's numbers."""
        with self._cond:
            self._hw = {k: v for k, v in self._hw.items() if k[0] != topic}
            for prog in self.progress.values():
                for d in (prog.durable, prog.fetched, prog.sent_end):
                    for key in [k for k in d if k[0] == topic]:
                        del d[key]

    def refresh_all(self) -> None:
        """Move every partition's HW (a tick: the master's own fsyncs, markers, idle partitions)."""
        with self._cond:
            if not self.active:
                return
            for p in self.store.all_partitions():
                self._refresh((p.topic, p.partition))

    # -- the replica fetch ----------------------------------------------------------------------------
    def serve_fetch(self, req, is_active: Callable[[], bool]) -> Answer:
        """Validate and record the request, then plan the reply (long-polling while nothing is new)."""
        if req.epoch > self.epoch:
            self._on_higher_epoch(req.epoch)
            raise NotMasterError(f"not master: a replica follows epoch {req.epoch}, this member is at {self.epoch}")
        if not self.active:
            raise NotMasterError(f"not master: group {self.broker_id} member {self.replica_id} is not master")
        if req.epoch < self.epoch:
            raise FencedError(f"fenced: the replica fetches for epoch {req.epoch}, the master is at {self.epoch}")
        uuid = req.uuid.hex()
        parts = [(pf, self._partition(pf)) for pf in req.partitions]
        with self._cond:
            prog = self.progress.get(req.replica_id)
            if prog is None or prog.uuid != uuid:
                self.store.begin_epoch(self.epoch, self.replica_id)  # from now on the log says who wrote what
                prog = self.progress[req.replica_id] = ReplicaProgress(req.replica_id, uuid)
            # Kafka's lastCaughtUpTime: at the log end now, or at least where the previous reply said it was.
            now = self._clock()
            tm = self.transactions
            now_ok = tm is None or req.journal_applied_seq >= tm.journal_seq
            prev_ok = prog.sent_at > 0 and req.journal_applied_seq >= prog.sent_journal
            for pf, part in parts:
                key = (pf.topic, pf.partition)
                prog.fetched[key] = pf.fetch_offset
                if part is None or self._divergence(part, pf) or pf.fetch_offset < part.earliest_offset:
                    prog.durable.pop(key, None)
                    now_ok = prev_ok = False
                    continue
                prog.durable[key] = min(pf.durable_offset, pf.fetch_offset)
                now_ok = now_ok and pf.fetch_offset >= part.log_end_offset
                prev_ok = prev_ok and pf.fetch_offset >= prog.sent_end.get(key, 0)
            missing = self._missing_partitions(req)
            if not missing and (now_ok or prev_ok):
                prog.last_caught_up = max(prog.last_caught_up, now if now_ok else prog.sent_at)
            prog.journal_applied = req.journal_applied_seq
            for pf, part in parts:
                if part is not None:
                    self._refresh((pf.topic, pf.partition))
            if self.isr.get(req.replica_id) not in (None, uuid) or (
                    req.replica_id not in self.ack_set and now - prog.last_caught_up <= self.lag_max_s):
                self._wake()  # a wiped member's old entry leaves, or a caught-up one may join: tick decides
            self._cond.notify_all()
        deadline = time.monotonic() + min(req.max_wait_ms / 1000, LONG_POLL_S)
        seen = -1
        while True:
            seen = self.store.wait_written(seen, 0) if seen < 0 else seen
            answer = self._plan(req, parts, prog, bool(missing))
            if answer.topics_changed or answer.journal[2] or answer.journal[3] or \
                    any(s.status != rp.SECTION_DATA or s.where.length for s in answer.sections):
                return answer
            left = deadline - time.monotonic()
            if left <= 0 or not is_active() or not self.active:
                return answer
            seen = self.store.wait_written(seen, left)

    def _partition(self, pf):
        try:
            return self.store.partition(pf.topic, pf.partition)
        except Exception:  # noqa: BLE001 - unknown to this master: answered UNKNOWN
            return None

    @staticmethod
    def _divergence(part, pf) -> Optional[tuple]:
        """(e', end) when the replica's log parted from this one (KIP-279's answer), else None."""
        e, end = part.epochs.end_offset_for(pf.last_epoch, part.log_end_offset)
        return (e, end) if e != pf.last_epoch or pf.fetch_offset > end else None

    def _missing_partitions(self, req) -> bool:
        have = {(pf.topic, pf.partition) for pf in req.partitions}
        return any((p.topic, p.partition) not in have for p in self.store.all_partitions())

    def _plan(self, req, parts, prog, topics_changed: bool) -> Answer:
        journal = self._journal_for(req.journal_applied_seq)
        budget = max(req.max_bytes, 1 << 16)
        sections = []
        for pf, part in parts:
            if part is None:
                sections.append(Section(rp.SECTION_UNKNOWN))
                continue
            key = (pf.topic, pf.partition)
            log_end, hw = part.log_end_offset, self._hw.get(key, 0)
            base = dict(earliest=part.earliest_offset, latest=part.last_stable_offset, log_end=log_end, hw=hw)
            parted = self._divergence(part, pf)
            if parted is not None:
                sections.append(Section(rp.DIVERGING, epoch=parted[0], offset=parted[1], **base))
                continue
            if pf.fetch_offset < part.earliest_offset:
                sections.append(self._reset(part, base))
                continue
            try:  # past the budget: an empty section (the next request asks again)
                where = part.locate(pf.fetch_offset, max(budget, 1), end=log_end if budget > 0 else pf.fetch_offset)
            except OffsetOutOfRangeError:
                sections.append(self._reset(part, base))
                continue
            budget -= where.length
            with self._cond:
                prog.sent_end[key] = log_end
            sections.append(Section(rp.SECTION_DATA, where, **base))
        with self._cond:
            prog.sent_journal, prog.sent_at = journal[1], self._clock()
        return Answer(self.epoch, journal, sections, topics_changed)

    @staticmethod
    def _reset(part, base: dict) -> Section:
        """RESET: start over at the earliest offset, with the epoch that covers it here (its marker may be
        gone with retention), so the replica's next request names the epoch this log has there."""
        earliest = part.earliest_offset
        return Section(rp.RESET, offset=earliest, epoch=part.epochs.epoch_at(earliest), **base)

    def _journal_for(self, applied: int) -> tuple:
        tm = self.transactions
        if tm is None:
            return (0, 0, b"", False)
        if applied >= 0:
            got = tm.records_since(applied)
            if got is not None:
                return (*got, False)
        return (*tm.snapshot_records(), True)

    # -- the in-sync set ------------------------------------------------------------------------------
    def tick(self) -> None:
        """The group thread's, every quarter second and when woken: shrink the in-sync set of replicas that
        fell behind (or came back wiped), expand it with caught-up ones, move the HWs. Each change is
        decided under ``_cond``, written to ZooKeeper without it, then applied under it."""
        for _ in range(8):  # a few changes per tick at most; the next tick does the rest
            with self._cond:
                if not self.active:
                    return
                change = self._next_change_locked()
            if change is None:
                break
            written = self._alter_isr(sorted(change.isr.items()))
            with self._cond:
                self._apply_change_locked(change, written)
            if not written:
                break
        self.refresh_all()

    def _next_change_locked(self) -> Optional[IsrChange]:
        """The next in-sync change due, if any. A shrink waits for its write before the replica leaves the
        ack set; an expansion joins the ack set now, before its write (KIP-497)."""
        now = self._clock()
        for r in sorted(self.isr):
            if r == self.replica_id:
                continue
            prog = self.progress.get(r)
            if prog is not None and prog.uuid != self.isr[r]:
                why = "it came back with a new uuid (its data was wiped)"
            else:
                since = max(prog.last_caught_up if prog is not None else 0.0, self._activated_at)
                if now - since <= self.lag_max_s:
                    continue
                why = f"not caught up for {now - since:.1f}s, over replicaLagMaxMs"
            isr = {k: v for k, v in self.isr.items() if k != r}
            return IsrChange(self.epoch, r, self.isr[r], isr, expand=False, why=why)
        for prog in sorted(self.progress.values(), key=lambda p: p.replica_id):
            if self._may_join_locked(prog):
                self.ack_set.add(prog.replica_id)
                self._joining = (prog.replica_id, prog.uuid)
                return IsrChange(self.epoch, prog.replica_id, prog.uuid, {**self.isr, prog.replica_id: prog.uuid},
                                 expand=True)
        return None

    def _may_join_locked(self, prog: ReplicaProgress) -> bool:
        """A replica joins once caught up in this epoch, durable at every HW and up to date with the journal.
        The first to join a master alone caps readers where they are (``cap_at_visible``) and must have
        all of that."""
        r = prog.replica_id
        if r in self.ack_set or r in self.isr or self._clock() - prog.last_caught_up > self.lag_max_s:
            return False
        tm = self.transactions
        if tm is not None and prog.journal_applied < tm.journal_seq:
            return False
        parts = {(p.topic, p.partition): p for p in self.store.all_partitions()}
        if any(prog.durable.get(key, -1) < self._hw.get(key, 0) for key in parts):
            return False
        if not self._capped:  # the first replica to join: from now on readers stop at the HW
            if any(prog.durable.get(key, -1) < p.visible_end for key, p in parts.items()):
                return False  # not caught up with what readers may have seen
            frozen = {key: p.cap_at_visible() for key, p in parts.items()}
            if any(prog.durable.get(key, -1) < hw for key, hw in frozen.items()):
                self._uncap()
                return False
            for key, hw in frozen.items():
                self._hw[key] = max(self._hw.get(key, 0), hw)
        return True

    def _apply_change_locked(self, change: IsrChange, written: bool) -> None:
        """The outcome of a change's ZooKeeper write. A change of an older epoch (demoted, or master again
        since) is void: ``activate`` started from the state the election wrote."""
        if change.epoch != self.epoch or not self.active:
            return
        r = change.replica_id
        if change.expand:
            self._joining = None
            if written:
                self.isr = change.isr
                self.isr_expands += 1
                log.info("replica %d joined the in-sync set of epoch %d: %s", r, self.epoch, sorted(self.isr))
            else:
                self.ack_set.discard(r)
                if not self._capped:
                    self._uncap()
        elif written:
            self.isr = change.isr
            self.ack_set.discard(r)
            self.isr_shrinks += 1
            if not self._capped:
                self._uncap()
            log.warning("replica %d left the in-sync set of epoch %d (%s): %s", r, self.epoch, change.why,
                        sorted(self.isr))
        self._cond.notify_all()

    # -- seeing it ------------------------------------------------------------------------------------
    def roster(self) -> set:
        return set(self.isr) | set(self.progress) | {self.replica_id}

    def describe(self) -> dict:
        """What ``DescribeGroup`` and the metrics show, read under the lock: ``{"epoch", "active", "isr",
        "partitions", "replicas": {replicaId: {"uuid", "lag", "caught_up_ago", "journal_lag"}}}``. A replica's
        lag is the master's log end offset less the replica's, summed over partitions (offsets, so epoch and
        transaction markers count); a partition it has not asked for yet counts whole."""
        parts = self.store.all_partitions()
        ends = [((p.topic, p.partition), p.log_end_offset, p.earliest_offset) for p in parts]
        with self._cond:
            now = self._clock()
            seq = self.transactions.journal_seq if self.transactions is not None else 0
            replicas = {}
            for r, prog in self.progress.items():
                lag = sum(max(end - max(prog.fetched.get(key, earliest), earliest), 0)
                          for key, end, earliest in ends)
                replicas[r] = {"uuid": prog.uuid, "lag": lag, "journal_lag": max(seq - prog.journal_applied, 0),
                               "caught_up_ago": now - prog.last_caught_up if prog.last_caught_up else None}
            return {"epoch": self.epoch, "active": self.active, "isr": dict(self.isr), "partitions": len(ends),
                    "replicas": replicas}

    def _min_insync(self, topic: str) -> int:
        try:
            return self.store.topic_config(topic).min_insync_replicas
        except Exception:  # noqa: BLE001
            return 1
