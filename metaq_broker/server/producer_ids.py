"""Producer ids for idempotent producers (``InitProducerId``), unique in the cluster.

With ZooKeeper, ids come in blocks of ``BLOCK`` taken from ``<root>/latest_producer_id_block`` with
versioned writes (``zk/producer_ids.py``), below 2^44, and always above the broker's *floor*: the end of the
last block it took (recorded in ``<dataPath>/producer-ids`` before any id of it is used) and the largest id
its partitions keep state for, so a ZooKeeper that lost its data never brings an id in use back; the floor
is written to ZooKeeper when the broker registers (``publish_floor``). A broker without ZooKeeper (a static broker list)
has no one to agree with, so its ids are its own: ``(brokerId + 1) << 44`` plus a counter whose blocks are
recorded in ``<dataPath>/producer-ids`` (written whole and fsynced before a block is used), so a restart
never gives an id out twice. Ids of a block not used up before a restart are skipped, as in Kafka.

An epoch is bumped by asking with the id and the epoch held (KIP-360): the same id, epoch + 1, which
fences the old epoch in every partition the new one writes to. The broker keeps no per-id record: the
partitions do the fencing. After epoch 32766 a new id is given instead."""
from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from kazoo.exceptions import KazooException

from metaq_broker.errors import MetaqError, StoreClosedError
from metaq_broker.protocol.records import crc
from metaq_broker.store.durable import replace_file
from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.producer_ids import ZK_ID_LIMIT, raise_floor, take_block

log = logging.getLogger(__name__)

BLOCK = 1000
FILE = "producer-ids"
MAX_EPOCH = 0x7FFE  # epochs are i16 and -1 means none: 0..32766
ZK_WAIT = 5.0  # seconds a request waits for ZooKeeper to be reachable before it is refused


class ProducerIds:
    """``zk()``: a connected ZooKeeper client or None while it is away; ``zk`` None: no ZooKeeper at all."""

    def __init__(self, broker_id: int, data_path, zk: Optional[Callable] = None, root: str = "/meta",
                 in_use: Callable[[], Iterable[int]] = tuple):
        self.broker_id = broker_id
        self._zk, self._paths = zk, ZkPaths(root)
        self._in_use = in_use  # the producer ids the broker's partitions keep state for
        self._file = Path(data_path) / FILE
        self._lock = threading.Lock()
        self._next, self._last = 0, -1  # the block in use: ids _next.._last

    @property
    def cluster_wide(self) -> bool:
        """Ids come from ZooKeeper's blocks, unique in the cluster: any member of a group may give them out,
        as any Kafka broker answers InitProducerId (clients ask the broker they like, a replica too)."""
        return self._zk is not None

    def init(self, producer_id: Optional[int] = None, epoch: Optional[int] = None) -> tuple:
        """(producer id, epoch): a new id with epoch 0, or ``producer_id`` with ``epoch`` + 1."""
        if producer_id is not None:
            if producer_id < 0 or epoch is None or not 0 <= epoch <= MAX_EPOCH:
                raise MetaqError(f"producer id {producer_id} with epoch {epoch}: give the id and the epoch held "
                                 f"(0 to {MAX_EPOCH}) to bump it")
            if epoch < MAX_EPOCH:
                return producer_id, epoch + 1
        with self._lock:
            if self._next > self._last:
                self._next, self._last = self._take()
            pid = self._next
            self._next += 1
        return pid, 0

    def _take(self) -> tuple:
        if self._zk is None:
            return self._take_local()
        deadline = time.monotonic() + ZK_WAIT
        while (client := self._zk()) is None:  # a reconnect: moments, usually
            if time.monotonic() > deadline:
                raise StoreClosedError("cannot give out a producer id now: ZooKeeper is not reachable (retry)")
            time.sleep(0.1)
        try:
            block = take_block(client, self._paths, self.broker_id, BLOCK, self.floor())
        except KazooException as e:
            raise StoreClosedError(f"cannot give out a producer id now: ZooKeeper: {e!r} (retry)") from None
        self._record(zk_end=block[1])  # durable before any id of the block is used
        return block

    def floor(self) -> int:
        """The largest ZooKeeper-given id this broker knows to be in use (-1: none)."""
        used = [pid for pid in self._in_use() if pid < ZK_ID_LIMIT]
        return max([self._read().get("zk_end", -1), *used])

    def publish_floor(self) -> None:
        """At registration: make ZooKeeper's last block end at this broker's floor at least, so that after
        ZooKeeper lost its data a broker that knows no floor takes its ids above it too."""
        client = self._zk() if self._zk is not None else None
        floor = self.floor() if client is not None else -1
        if floor >= 0 and raise_floor(client, self._paths, self.broker_id, floor):
            log.warning("producer ids: ZooKeeper's last block was below id %d, which this broker knows to be in "
                        "use (ZooKeeper lost its data?): raised it, so no id is given out twice", floor)

    def _take_local(self) -> tuple:
        base = (self.broker_id + 1) * ZK_ID_LIMIT
        start = self._read().get("next", base)
        if not base <= start < base + ZK_ID_LIMIT - BLOCK:
            raise MetaqError(f"{self._file}: next id {start} is outside broker {self.broker_id}'s ids")
        self._record(next=start + BLOCK)  # durable before any id of the block is used
        return start, start + BLOCK - 1

    def _read(self) -> dict:
        """``<dataPath>/producer-ids``: {"next": the next local id, "zk_end": the last ZooKeeper block's end}."""
        if not self._file.exists():
            return {}
        raw = self._file.read_bytes()
        try:
            checksum, body = int(raw[:8], 16), raw[9:]
            if crc(body) != checksum:
                raise ValueError("checksum mismatch")
            record = json.loads(body)
            if not isinstance(record, dict) or not all(isinstance(v, int) for v in record.values()):
                raise ValueError("not an object of ids")
            return record
        except (ValueError, TypeError) as e:
            raise MetaqError(f"{self._file}: unreadable ({e}); producer ids cannot be given out safely") from None

    def _record(self, **ids) -> None:
        body = json.dumps({**self._read(), **ids}, sort_keys=True).encode()
        replace_file(self._file, b"%08x\n" % crc(body) + body)
