"""Blocks of producer ids from ZooKeeper (Kafka's ZooKeeper-era ProducerIdManager): one node,
``<root>/latest_producer_id_block``, holds the last block a broker took as JSON
``{"version": 1, "broker": <brokerId>, "block_start": a, "block_end": b}`` (ids a..b inclusive). A broker
takes the next block with a write conditioned on the version it read, so two brokers never take the same
one; a lost race reads again. Ids stay below ``ZK_ID_LIMIT``: brokers without ZooKeeper give out ids above it
(``server/producer_ids.py``)."""
from __future__ import annotations

import json

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from metaq_broker.errors import MetaqError
from metaq_broker.zk.paths import ZkPaths

ZK_ID_LIMIT = 1 << 44
ATTEMPTS = 20


def take_block(zk, paths: ZkPaths, broker_id: int, size: int, floor: int = -1) -> tuple:
    """(first, last) ids of a block of ``size`` that no other broker took, all above ``floor``; kazoo's
    errors when ZooKeeper cannot be reached."""
    path = paths.producer_id_block()
    for _ in range(ATTEMPTS):
        try:
            data, stat = zk.get(path)
        except NoNodeError:
            block = (floor + 1, floor + size)
            try:
                zk.create(path, _encode(broker_id, *block), makepath=True)
                return block
            except NodeExistsError:
                continue
        last = max(_block_end(path, data), floor)
        block = (last + 1, last + size)
        if block[1] >= ZK_ID_LIMIT:
            raise MetaqError(f"producer ids are exhausted ({path} reached {last})")
        try:
            zk.set(path, _encode(broker_id, *block), version=stat.version)
            return block
        except (BadVersionError, NoNodeError):
            continue
    raise MetaqError(f"could not take a block of producer ids from {path}: {ATTEMPTS} writes lost to other brokers")


def raise_floor(zk, paths: ZkPaths, broker_id: int, floor: int) -> bool:
    """Make the last block taken end at ``floor`` at least (a broker's start after ZooKeeper lost its data:
    brokers that know no floor then take blocks above it too); True when written."""
    path = paths.producer_id_block()
    for _ in range(ATTEMPTS):
        try:
            data, stat = zk.get(path)
        except NoNodeError:
            try:
                zk.create(path, _encode(broker_id, floor, floor), makepath=True)
                return True
            except NodeExistsError:
                continue
        if _block_end(path, data) >= floor:
            return False
        try:
            zk.set(path, _encode(broker_id, floor, floor), version=stat.version)
            return True
        except (BadVersionError, NoNodeError):
            continue
    return False


def _block_end(path: str, data: bytes) -> int:
    try:
        return int(json.loads(data)["block_end"])
    except (ValueError, KeyError, TypeError) as e:
        raise MetaqError(f"ZooKeeper node {path} is not a producer id block ({e}): {data[:200]!r}") from None


def _encode(broker_id: int, first: int, last: int) -> bytes:
    return json.dumps({"version": 1, "broker": broker_id, "block_start": first, "block_end": last}).encode()
