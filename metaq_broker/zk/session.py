"""ZooKeeper sessions for metaq's processes: how a kazoo client is made and started, with a clear error
when ZooKeeper does not answer."""
from __future__ import annotations

from kazoo.client import KazooClient
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.retry import KazooRetry

from metaq_broker.errors import MetaqError


class ZooKeeperUnavailableError(MetaqError):
    """ZooKeeper did not accept a session in time."""


def new_client(zk_connect: str, session_timeout: float = 10.0) -> KazooClient:
    """A kazoo client that reconnects forever (a broker must come back after any ZooKeeper outage) and
    retries single commands a few times."""
    return KazooClient(hosts=zk_connect, timeout=session_timeout,
                       connection_retry=KazooRetry(max_tries=-1, max_delay=2.0),
                       command_retry=KazooRetry(max_tries=5, max_delay=2.0))


def start_client(client: KazooClient, zk_connect: str, timeout: float) -> None:
    """``client.start`` with a clear error; on failure the client is stopped (it would retry forever)."""
    try:
        client.start(timeout)
    except KazooTimeoutError:
        client.stop()
        client.close()
        raise ZooKeeperUnavailableError(
            f"cannot connect to ZooKeeper at {zk_connect} within {timeout:.0f}s; is it running (zk.connect)?") from None
