"""A replica's copy loop: fetch from the master's data port (``REPLICA_FETCH``), write what comes verbatim,
fsync, ask again. Each request says where every local partition ends and the epoch of its last batch, so
the master can tell where the logs parted (KIP-101/KIP-279) and answer DIVERGING; the replica then cuts its
log there, durably, before it asks again. The transaction journal rides along as an ordered record stream.

The next request is sent only after the fsync of what the last reply brought, so the durable offsets it
reports (which move the master's high watermark) are true."""
from __future__ import annotations

import logging
import socket
import threading
from typing import Callable, Optional

import numpy as np

from metaq_broker.protocol import dataport
from metaq_broker.protocol import replication as rp

log = logging.getLogger(__name__)

MAX_WAIT_MS = 500
MAX_BYTES = 8 << 20
RETRY_S = 0.2
CONNECT_TIMEOUT = 5.0


class ReplicaFetcher:
    """``sync_topics(master)`` makes the local store hold the master's topics (``master``: the master's
    ZooKeeper node, a dict with host, port, dataPort); ``on_fenced(epoch)`` is told when the master's epoch
    differs from the one followed (the group member re-reads the state)."""

    def __init__(self, store, transactions, replica_id: int, uuid: str,
                 sync_topics: Callable[[dict], None], on_fenced: Callable[[int], None]):
        self.store, self.transactions = store, transactions
        self.replica_id, self.uuid = replica_id, bytes.fromhex(uuid)
        self._sync_topics, self._on_fenced = sync_topics, on_fenced
        self._lock = threading.Condition()
        self._target: Optional[tuple] = None  # (epoch, master node dict)
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self.learned_hw: dict = {}  # (topic, partition) -> the master's HW in its last reply
        self.truncations = self.truncated_offsets = 0  # cuts where the log parted from the master's (metrics)
        self._body = np.empty(0, np.uint8)  # reply bodies, reused

    def _buffer(self, n: int):
        if len(self._body) < n:
            self._body = np.empty(max(n, MAX_BYTES + (1 << 20)), np.uint8)
        return self._body
    # -- control --------------------------------------------------------------------------------------
    def follow(self, epoch: int, master: dict) -> None:
        with self._lock:
            if self._target != (epoch, master):
                log.info("replica %d follows the master of epoch %d at %s:%s", self.replica_id, epoch,
                         master.get("host"), master.get("dataPort"))
            self._target = (epoch, master)
            self._lock.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="metaq-replica-fetcher", daemon=True)
                self._thread.start()

    def pause(self) -> None:
        """Stop copying (this member became master, or is stopping); ``follow`` resumes."""
        with self._lock:
            self._target = None
            self._lock.notify_all()

    def stop(self) -> None:
        with self._lock:
            self._stop, self._target = True, None
            self._lock.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=10)

    # -- the loop -------------------------------------------------------------------------------------
    def _run(self) -> None:
        sock, connected_to = None, None
        while True:
            with self._lock:
                while self._target is None and not self._stop:
                    self._lock.wait()
                if self._stop:
                    break
                target = self._target
            epoch, master = target
            try:
                if connected_to != target:
                    _close(sock)
                    sock, connected_to = None, None
                    sock = socket.create_connection((master["host"], int(master["dataPort"])), CONNECT_TIMEOUT)
                    sock.settimeout(MAX_WAIT_MS / 1000 + 30)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    connected_to = target
                self._exchange(sock, epoch, master)
            except Exception as e:  # noqa: BLE001 - the master died or moved: try again, the group re-routes
                log.debug("replica fetch from %s failed: %s", master, e, exc_info=True)
                if not isinstance(e, (OSError, dataport.ProtocolError)):
                    log.warning("replica fetch from %s:%s failed: %s: %s", master.get("host"),
                                master.get("dataPort"), type(e).__name__, e)
                _close(sock)
                sock, connected_to = None, None
                with self._lock:
                    if not self._stop:
                        self._lock.wait(RETRY_S)
        _close(sock)

    def _request(self, epoch: int):
        parts = []
        for p in self.store.all_partitions():
            end = p.written_end
            parts.append(rp.PartitionFetch(p.topic, p.partition, end, p.durable_offset, p.epoch_before(end)))
        seq = self.transactions.applied_seq if self.transactions is not None else 0
        return rp.FetchRequest(epoch, self.replica_id, self.uuid, seq, MAX_WAIT_MS, MAX_BYTES, parts)

    def _exchange(self, sock: socket.socket, epoch: int, master: dict) -> None:
        req = self._request(epoch)
        sock.sendall(rp.pack_request(req))
        head, journal, sections = rp.read_reply(sock, self._buffer)
        if head.status != 0:
            if head.master_epoch != epoch or head.message.startswith(rp.FENCED):
                self._on_fenced(head.master_epoch)
            raise dataport.ProtocolError(f"master refused the replica fetch: {head.message}")
        if self.transactions is not None and (journal or head.flags & rp.FLAG_JOURNAL_SNAPSHOT):
            self.transactions.apply(journal, head.journal_first_seq, head.journal_last_seq,
                                    bool(head.flags & rp.FLAG_JOURNAL_SNAPSHOT))
        written = []
        for pf, sec in zip(req.partitions, sections):
            key = (pf.topic, pf.partition)
            part = self.store.partition(pf.topic, pf.partition)
            if sec.status == rp.DIVERGING:
                self._truncate(part, sec.epoch, sec.offset)
            elif sec.status == rp.RESET:
                log.warning("%s: the master's log starts at %d, beyond this replica's end %d: starting the "
                            "partition over there", part.name, sec.offset, part.written_end)
                part.reset_to(sec.offset)
            elif sec.status == rp.SECTION_DATA and len(sec.records):
                part.append_replicated(sec.records)
                written.append(part)
            if sec.status != rp.SECTION_UNKNOWN:
                self.learned_hw[key] = sec.hw
        for part in written:
            part.make_durable(part.written_end)
        if self.transactions is not None:
            self.transactions.apply_pending()
        if head.flags & rp.FLAG_TOPICS_CHANGED:
            self._sync_topics(master)

    def _truncate(self, part, epoch: int, end: int) -> None:
        """KIP-279: the master's largest epoch <= ours is ``epoch``, ending at ``end``. If we hold that epoch,
        cut to where it ends on both sides; if not, cut to the end of our largest epoch below it and ask again."""
        mine, my_end = part.epochs.end_offset_for(epoch, part.written_end)
        # Epoch 0 (offsets before a log's first stamp) is held by every log, so epoch - 1 >= 0 below.
        cut = min(end, my_end, part.written_end) if mine == epoch else \
            part.epochs.end_offset_for(epoch - 1, part.written_end)[1]
        before = part.written_end
        new_end = part.truncate_to(max(cut, part.earliest_offset))
        if new_end < before:
            self.truncations += 1
            self.truncated_offsets += before - new_end
        log.warning("%s: truncated from %d to %d where this log parted from the master's (epoch %d ends at %d "
                    "there)", part.name, before, new_end, epoch, end)


def _close(sock) -> None:
    if sock is not None:
        try:
            sock.close()
        except OSError:
            pass
