"""The nemesis harness's clients and what they record (``benchmarks/nemesis.py``; the checker is
``nemesis_check.py``).

Every message carries its identity in its value: ``<writer>|<seq>|<attempt>|``, padded. ``writer`` names
the client (its kind is ``History.kinds[writer]``), ``seq`` the message within it, and ``attempt`` which
send of it this copy came from, so a duplicate can be attributed: two copies from different attempts were
sent twice by the application after an error that said "may or may not be stored"; two copies from one
attempt were stored twice by one put (the client's own resend, or the broker).

* ``Writer`` (``acks=all``, ``acks=1``): an at-least-once application: a put that failed is sent again
  with the next attempt number until it is acknowledged (or the run ends). Every attempt is recorded with
  its outcome: ``acked`` (offsets known), ``refused`` (an error the client says stored nothing: ``not
  master``, ``not enough in-sync replicas``) or ``uncertain`` (anything else: it may or may not be stored).
* ``Writer`` (``idempotent``): ``Producer(idempotent=True)``; the application never sends a failed put
  again (the producer's own resends are what idempotence makes safe), so any duplicate is a violation.
* ``TxnWriter``: ``Producer.transaction``: a few batches on every partition, prepare, commit. Like an XA
  transaction manager it finishes what it decided: commit once the prepare was answered (outcome
  ``committed``), rollback once anything before failed, the prepare included (``aborted``). A
  transaction without a decision record waits on the broker for that call (docs/transactions.md), so
  the writer sends it until it is answered, and a writer that stops first leaves it due in
  ``History.txns`` for the next one (``recover``) or the harness's final recovery: a transaction left
  prepared would hold its partitions' readers forever.
* ``Reader``: a consumer reading every partition continuously from the earliest offset; every message it
  was shown is recorded with its offset.
* ``Observer``: the group's state in ZooKeeper (epoch, master, in-sync set) sampled every 100 ms.
"""
from __future__ import annotations

import bisect
import inspect
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer
from metaq_broker.client.settle import COMMIT, ROLLBACK, settle
from metaq_broker.names import parse_partition_name
from metaq_broker.protocol.status import STORED_NOTHING, RemoteOffsetOutOfRangeError, RemoteTransactionError

PAD = b"." * 24
ACKS_ALL, ACKS_ONE, IDEMPOTENT, TXN = "acks=all", "acks=1", "idempotent", "transactional"


def value_of(writer: str, seq: int, attempt: int, pad: bytes = PAD) -> bytes:
    return f"{writer}|{seq}|{attempt}|".encode() + pad


def identity(value: bytes) -> Optional[tuple]:
    """``(writer, seq, attempt)`` of a harness message, None for anything else."""
    parts = value.split(b"|", 3)
    if len(parts) < 4:
        return None
    try:
        return parts[0].decode(), int(parts[1]), int(parts[2])
    except ValueError:
        return None


def idempotence_available() -> bool:
    """Whether this tree's ``Producer`` takes ``idempotent=`` (the harness says so in its output)."""
    return "idempotent" in inspect.signature(Producer.__init__).parameters


@dataclass
class Attempt:
    """One send of messages ``seq .. seq + count - 1`` of ``writer``."""

    writer: str
    topic: str
    seq: int
    count: int
    attempt: int
    sent: float  # time.monotonic()
    done: float = 0.0
    outcome: str = ""  # acked | refused | uncertain
    partition: str = ""
    base_offset: int = -1
    error: str = ""


@dataclass
class Txn:
    writer: str
    xid_prefix: str
    started: float
    messages: list = field(default_factory=list)  # (topic, partition, offset, value)
    outcome: str = "open"  # committed | aborted | uncertain
    error: str = ""
    xids: list = field(default_factory=list)  # [[brokerId, xid]] begun
    decision: str = ""  # COMMIT or ROLLBACK once decided, until the broker answered it ("": none due)


class History:
    """Everything the clients did and saw, appended under one lock (the checker reads it)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.kinds: dict = {}  # writer -> kind
        self.attempts: list = []  # Attempt, in the order they ended
        self.txns: list = []
        self.seen: list = []  # (topic, partition, offset, value, reader) shown to a reader
        self.reader_errors: list = []  # (time, reader, error) other than a failover's
        self._acks_all: list = []  # (acknowledged, sent) of acks=all puts, in the order they were recorded

    def add_attempt(self, a: Attempt) -> None:
        with self.lock:
            self.attempts.append(a)
            if a.outcome == "acked" and self.kinds.get(a.writer) in (ACKS_ALL, IDEMPOTENT):
                self._acks_all.append((a.done, a.sent))

    def acks_all_times(self, since: float = 0.0) -> list:
        """[(sent, acknowledged)] of the acknowledged acks=all puts (plain and idempotent) acknowledged at
        or after ``since`` (recorded in about that order: a margin covers threads that raced)."""
        with self.lock:
            start = max(0, bisect.bisect_left(self._acks_all, (since,)) - 64)
            return [(sent, done) for done, sent in self._acks_all[start:] if done >= since]


class _Client(threading.Thread):
    def __init__(self, name: str, history: History):
        super().__init__(name=f"nemesis-{name}", daemon=True)
        self.stop_event = threading.Event()
        self.history = history
        self.crash: Optional[str] = None

    def stop(self) -> None:
        self.stop_event.set()

    def run(self) -> None:
        try:
            self.loop()
        except BaseException as e:  # noqa: BLE001 - a harness bug must show in the report, not vanish
            import traceback
            self.crash = "".join(traceback.format_exception(e))


class Writer(_Client):
    """Puts of 1..``batch_max`` messages, one after another with ``pace`` seconds between them."""

    def __init__(self, name: str, kind: str, history: History, topic: str, client: dict, seed: int,
                 timeout: float, pace: float = 0.02, batch_max: int = 5, pad: bytes = PAD):
        super().__init__(name, history)
        self.kind, self.topic, self.pace, self.batch_max, self.pad = kind, topic, pace, batch_max, pad
        self.rng = random.Random(f"{seed}-{name}")
        options = dict(client, timeout=timeout, acks="1" if kind == ACKS_ONE else "all")
        if kind == IDEMPOTENT:
            options["idempotent"] = True
        elif idempotence_available():
            options["idempotent"] = False  # today's behaviour, said explicitly once idempotence is the default
        self.producer = Producer(**options)
        history.kinds[name] = kind

    def loop(self) -> None:
        seq = 0
        with self.producer:
            while not self.stop_event.is_set():
                count = self.rng.randint(1, self.batch_max)
                attempt = 0
                while not self.stop_event.is_set():
                    if self._put(seq, count, attempt) or self.kind == IDEMPOTENT:
                        break
                    attempt += 1
                    self.stop_event.wait(0.1)
                seq += count
                self.stop_event.wait(self.pace)

    def _put(self, seq: int, count: int, attempt: int) -> bool:
        a = Attempt(self.name.removeprefix("nemesis-"), self.topic, seq, count, attempt, time.monotonic())
        values = [value_of(a.writer, seq + i, attempt, self.pad) for i in range(count)]
        try:
            result = self.producer.send_batch(self.topic, values)[0]
            a.outcome, a.partition, a.base_offset = "acked", result.partition, result.base_offset
        except Exception as e:  # noqa: BLE001 - every outcome is recorded and judged by the checker
            a.outcome = "refused" if isinstance(e, STORED_NOTHING) else "uncertain"
            a.error = f"{type(e).__name__}: {e}"
        a.done = time.monotonic()
        self.history.add_attempt(a)
        return a.outcome == "acked"


class TxnWriter(_Client):
    """Transactions of one batch per partition of ``topic``: begin, put, prepare, commit; first it settles
    the transactions an earlier writer decided and could not settle (``recover``)."""

    def __init__(self, name: str, history: History, topic: str, client: dict, seed: int, timeout: float,
                 pace: float = 0.05, txn_timeout_ms: int = 10_000):
        super().__init__(name, history)
        self.topic, self.pace, self.seed, self.txn_timeout_ms = topic, pace, seed, txn_timeout_ms
        self.rng = random.Random(f"{seed}-{name}")
        options = dict(client, timeout=timeout)
        if idempotence_available():
            options["idempotent"] = False
        self.producer = Producer(**options)
        history.kinds[name] = TXN

    def loop(self) -> None:
        writer, seq, n = self.name.removeprefix("nemesis-"), 0, 0
        with self.producer:
            recover(self.producer, self.history, self.stop_event)
            partitions = []
            while not partitions and not self.stop_event.is_set():
                partitions = sorted(self.producer.partitions(self.topic))
                self.stop_event.wait(0.1)
            while not self.stop_event.is_set():
                t = Txn(writer, f"nem-{self.seed}-{writer}-{n}", time.monotonic())
                n += 1
                txn = self.producer.transaction(t.xid_prefix, timeout_ms=self.txn_timeout_ms)
                try:
                    for name in partitions:
                        count = self.rng.randint(1, 3)
                        values = [value_of(writer, seq + i, 0) for i in range(count)]
                        seq += count
                        for pname, body in self.producer.encode_batches(self.topic, values, partition=name):
                            xid = txn.xid_on(parse_partition_name(pname)[0])
                            t.xids = sorted(txn.xids.items())
                            r = self.producer.start_put(self.topic, pname, body, xid).result()
                            t.messages += [(self.topic, pname, r.base_offset + i, v) for i, v in enumerate(values)]
                    t.decision = ROLLBACK  # until the prepare is answered: it may be stored either way
                    txn.prepare()
                    t.decision = COMMIT
                except Exception as e:  # noqa: BLE001 - recorded; the checker says whether it was kept all or nothing
                    t.error = f"{type(e).__name__}: {e}"
                    t.decision = ROLLBACK
                finish(self.producer, t, self.stop_event)
                with self.history.lock:  # the checker judges it once its partitions' readers pass it
                    self.history.txns.append(t)
                self.stop_event.wait(self.pace)


def finish(producer: Producer, t: Txn, stop_event: Optional[threading.Event] = None, wait_s: float = 120.0) -> None:
    """Send ``t``'s decision until a broker answers it (or ``stop_event``, or ``wait_s``: it stays due).
    The outcome the checker holds it to is the decision's: nobody else decides a transaction without a
    decision record, so a commit decided once the prepare was answered must end up ``committed``, and a
    rollback ``aborted``, whatever the answers on the way (an answer refusing it for good is noted)."""
    if not t.decision:
        return
    t.outcome = "committed" if t.decision == COMMIT else "aborted"
    if not t.xids:  # nothing was begun
        t.decision = ""
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            settle(producer, t.xids, t.decision, wait_s=producer.pool.timeout)
        except RemoteTransactionError as e:  # e.g. unknown to a new master (an open one it aborted)
            t.error += f"; {t.decision}: {type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - no master, ZooKeeper away: sent again
            t.error = t.error[:2000] + f"; {t.decision} not answered yet: {type(e).__name__}: {str(e)[:200]}"
            if stop_event is not None and stop_event.wait(0.5):
                return
            continue
        t.decision = ""
        return


def recover(producer: Producer, history: History, stop_event: Optional[threading.Event] = None) -> int:
    """Settle every transaction whose decision is still due (a writer stopped before a broker answered it);
    returns how many are still due."""
    with history.lock:
        due = [t for t in history.txns if t.decision]
    for t in due:
        finish(producer, t, stop_event)
    return sum(1 for t in due if t.decision)


class Reader(_Client):
    """Reads every partition of ``topic`` from its earliest offset on, recording each message shown."""

    def __init__(self, name: str, history: History, topic: str, client: dict, timeout: float):
        super().__init__(name, history)
        self.topic = topic
        self.consumer = Consumer(**client, timeout=timeout)
        self.positions: dict = {}
        self.jumps: list = []  # (partition, from, to): the earliest offset moved past the reader (retention)

    def loop(self) -> None:
        reader = self.name.removeprefix("nemesis-")
        with self.consumer:
            while not self.stop_event.is_set():
                try:
                    for p in self.consumer.partitions(self.topic):
                        self.positions.setdefault(p, 0)
                    for p, pos in sorted(self.positions.items()):
                        self._read(reader, p, pos)
                except Exception as e:  # noqa: BLE001 - a failover: read again shortly
                    with self.history.lock:
                        self.history.reader_errors.append((time.monotonic(), reader, f"{type(e).__name__}: {e}"))
                    self.stop_event.wait(0.2)
                self.stop_event.wait(0.05)

    def _read(self, reader: str, p: str, pos: int) -> None:
        try:
            f = self.consumer.fetch(self.topic, p, pos, max_bytes=256 << 10, max_wait_ms=0)
        except RemoteOffsetOutOfRangeError:
            earliest = self.consumer.offsets(self.topic, [p])[p][0]
            if earliest > pos:
                self.jumps.append((p, pos, earliest))
                self.positions[p] = earliest
                return
            raise
        if f.batch.num_rows:
            offsets = f.batch.column("offset").to_pylist()
            values = f.batch.column("value").to_pylist()
            with self.history.lock:
                self.history.seen += [(self.topic, p, o, v, reader) for o, v in zip(offsets, values)]
        self.positions[p] = f.next_offset


class Observer(threading.Thread):
    """Samples the group's state every ``interval`` seconds: ``sample()`` returns (epoch, master, in-sync
    replicaIds) or None."""

    def __init__(self, sample, interval: float = 0.1):
        super().__init__(name="nemesis-observer", daemon=True)
        self.sample, self.interval = sample, interval
        self.samples: list = []  # (time.monotonic(), epoch, master replicaId or None, in-sync replicaIds)
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(self.interval):
            try:
                sample = self.sample()
            except Exception:  # noqa: BLE001 - ZooKeeper down (a fault): no sample
                continue
            if sample:
                self.samples.append((time.monotonic(), *sample))

    def first_after(self, t: float, predicate) -> Optional[tuple]:
        return next((s for s in self.samples if s[0] >= t and predicate(s)), None)

    def stop(self) -> None:
        self.stop_event.set()
