"""Settling prepared broker transactions: the one place commit and rollback requests are sent from (the
producer's ``Transaction`` and the Spark sink's driver), with one retry policy. Both calls are idempotent
on the broker, so resending is always safe: ``settle`` keeps resending to a broker that is down or
restarting, brokers in parallel, until ``wait_s``; ``rollback_quietly`` is the best-effort rollback of
work being abandoned (its broker rolls back whatever is left, by timeout or by decision record)."""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from metaq_broker.errors import InvalidPartitionError
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.protocol.status import BrokerUnavailableError

log = logging.getLogger(__name__)

COMMIT, ROLLBACK = "CommitTransaction", "RollbackTransaction"


class SettleTimeoutError(RuntimeError):
    """A broker stayed unreachable for the whole wait; the outcome is still due (and recorded, for the
    sink: the broker settles the transaction from its decision record when it is back)."""


def settle(client, xids: list, method: str, wait_s: float) -> None:
    """Send ``method`` (COMMIT or ROLLBACK) for every ``[brokerId, xid]``, brokers in parallel, waiting up
    to ``wait_s`` for a broker that is down or restarting."""
    by_broker: dict = {}
    for bid, xid in xids:
        by_broker.setdefault(int(bid), []).append(xid)
    deadline = time.monotonic() + wait_s

    def one_broker(bid: int) -> None:
        for xid in by_broker[bid]:
            while True:
                try:
                    client.call(bid, method, pb.TransactionRequest(xid=xid), retries=3)
                    break
                except (InvalidPartitionError, BrokerUnavailableError) as e:
                    if time.monotonic() > deadline:
                        raise SettleTimeoutError(f"{method} of {xid} on broker {bid}: {e} (the outcome is still "
                                                 f"due: the broker settles the transaction when it is back)") from e
                    time.sleep(0.2)

    if len(by_broker) <= 1:
        for bid in by_broker:
            one_broker(bid)
        return
    with ThreadPoolExecutor(len(by_broker)) as pool:
        for f in [pool.submit(one_broker, bid) for bid in sorted(by_broker)]:
            f.result()


def rollback_quietly(client, bid: int, xid: str) -> bool:
    """One rollback attempt; False (and a warning) if it could not be sent."""
    try:
        client.call(int(bid), ROLLBACK, pb.TransactionRequest(xid=xid), timeout=10, retries=1)
        return True
    except Exception as e:  # noqa: BLE001 - best effort: the broker rolls back what is left
        log.warning("could not roll back transaction %s on broker %s (its broker will): %s", xid, bid, e)
        return False
