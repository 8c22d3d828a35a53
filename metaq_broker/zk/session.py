"""ZooKeeper sessions for metaq's processes: how a kazoo client is made and started, with a clear error
when ZooKeeper does not answer, and the ACLs of the nodes it creates.

Two identities (docs/security.md, section 6). The cluster's, ``zk.auth`` of brokers and of the admin:
every znode a session with it creates is readable and writable by that identity only (``private_acl``),
so a stranger with ZooKeeper access cannot read or rewrite users, ACLs, offsets or decision records.
Broker registrations and topic entries are made with ``public_acl`` instead (world READ as well) so that
clients without credentials still find brokers. And the clients', the brokers' ``zk.client.auth``: for
clients that must write ZooKeeper themselves (balanced group membership, PLAINTEXT committers), it may
write the consumer groups and the exactly-once sinks' decision records, nothing else. Brokers give the
tops of those two subtrees ``shared_acl`` (``share_client_nodes``) and every session makes the nodes below
them with their top's ACL (``MetaqZooKeeper.share_below``), as ZooKeeper would if ACLs were inherited.
Without ``zk.auth`` znodes stay open, as before."""
from __future__ import annotations

import logging
import socket
import ssl
import time
from typing import Optional

from kazoo.client import KazooClient, TransactionRequest
from kazoo.exceptions import NoAuthError, NoNodeError, SessionExpiredError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.retry import KazooRetry
from kazoo.security import READ_ACL_UNSAFE, make_digest_acl

from metaq_broker.errors import MetaqError
from metaq_broker.security.settings import ZkSecurity
from metaq_broker.security.tls import explain
from metaq_broker.zk.paths import ZkPaths

log = logging.getLogger(__name__)

SHARED_ACL_TTL_S = 60.0  # how long a session reuses the ACL it read from a shared subtree's top


class ZooKeeperUnavailableError(MetaqError):
    """ZooKeeper did not accept a session in time."""


def private_acl(security: Optional[ZkSecurity]) -> Optional[list]:
    """All permissions for the ``zk.auth`` digest identity only; None (kazoo's open ACL) without zk.auth."""
    if security is None or not security.digest:
        return None
    return [make_digest_acl(security.auth_user, security.auth_password, all=True)]


def shared_acl(security: Optional[ZkSecurity]) -> Optional[list]:
    """``private_acl`` plus all permissions for the clients' identity (``zk.client.auth``): the ACL of the
    consumer groups' and decision records' nodes. None without zk.auth."""
    private = private_acl(security)
    if private is None or not security.client_user:
        return private
    return private + [make_digest_acl(security.client_user, security.client_password, all=True)]


def public_acl(security: Optional[ZkSecurity]) -> Optional[list]:
    """``private_acl`` plus world READ: for broker registrations, topic entries and starting brokers, which
    clients without credentials read to find brokers. None without zk.auth."""
    private = private_acl(security)
    return None if private is None else private + list(READ_ACL_UNSAFE)


class MetaqZooKeeper(KazooClient):
    """A kazoo client whose nodes below a shared subtree's top (``share_below``) take the top's ACL when the
    caller names none; elsewhere kazoo's ``default_acl`` applies. The top's ACL is read (once a minute at
    most) only by the calling thread's own create and ensure_path, never on kazoo's event thread: an
    asynchronous create from there (ensure_path's recursion) gets the ACL its caller resolved."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.shared_tops: tuple = ()
        self._tops: dict = {}  # top -> (its ACL, monotonic time read)

    def share_below(self, *tops: str) -> None:
        self.shared_tops = tuple(tops)

    def inherited_acl(self, path: str, read: bool = True) -> Optional[list]:
        """The ACL a new node at ``path`` takes: its shared top's, None elsewhere (or while the top does not
        exist or cannot be read: the create then fails or succeeds on its own terms)."""
        top = next((t for t in self.shared_tops if path.startswith(t + "/")), None)
        if top is None or self.default_acl is None:  # no zk.auth: nodes are open, as their tops
            return None
        held = self._tops.get(top)
        if read and (held is None or time.monotonic() - held[1] > SHARED_ACL_TTL_S):
            try:
                held = self._tops[top] = (self.get_acls(top)[0], time.monotonic())
            except (NoNodeError, NoAuthError):
                return None
        return held[0] if held else None

    def create(self, path, value=b"", acl=None, *args, **kw):
        return super().create(path, value, acl or self.inherited_acl(path), *args, **kw)

    def create_async(self, path, value=b"", acl=None, *args, **kw):
        return super().create_async(path, value, acl or self.inherited_acl(path, read=False), *args, **kw)

    def ensure_path(self, path, acl=None):
        return super().ensure_path(path, acl or self.inherited_acl(path))

    def ensure_path_async(self, path, acl=None):
        return super().ensure_path_async(path, acl or self.inherited_acl(path, read=False))

    def transaction(self) -> "TransactionRequest":
        return _SharedTransaction(self)


class _SharedTransaction(TransactionRequest):
    def create(self, path, value=b"", acl=None, ephemeral=False, sequence=False):
        return super().create(path, value, acl or self.client.inherited_acl(path), ephemeral, sequence)


def client_subtrees(root: str) -> tuple:
    """The tops of what clients may keep in ZooKeeper: consumer groups, the sinks' decision records."""
    paths = ZkPaths(root)
    return paths.consumers(), paths.sinks()


def share_client_nodes(client: MetaqZooKeeper, root: str, security: Optional[ZkSecurity]) -> int:
    """A broker's part (before it registers): ``<root>/consumers`` and ``<root>/sinks`` exist with
    ``shared_acl``, and so does every node below them that an earlier start made with another (zk.client.auth
    set or changed since); ``client`` makes its own nodes there alike. Returns how many nodes changed."""
    tops = client_subtrees(root)
    client.share_below(*tops)
    acl = shared_acl(security)
    if acl is None:
        return 0
    changed = 0
    for top in tops:
        client.ensure_path(top.rsplit("/", 1)[0] or "/")  # the root stays private: kazoo would give it ``acl``
        client.ensure_path(top, acl)
        if set(client.get_acls(top)[0]) != set(acl):
            changed += _set_acls_below(client, top, acl)
    return changed


def _set_acls_below(client: KazooClient, path: str, acl: list) -> int:
    try:
        client.set_acls(path, acl)
        below = client.get_children(path)
    except NoNodeError:
        return 0  # gone meanwhile (an ephemeral member, a deleted group)
    except NoAuthError:  # made by another identity with an ACL that leaves the brokers out
        log.warning("cannot give %s the ACL of zk.auth and zk.client.auth: its ACL leaves this broker out "
                    "(setAcl it, or delete it, with an identity it lets in)", path)
        return 0
    return 1 + sum(_set_acls_below(client, f"{path}/{c}", acl) for c in below)


def new_client(zk_connect: str, session_timeout: float = 10.0, security: Optional[ZkSecurity] = None,
               reconnect_tries: int = -1) -> MetaqZooKeeper:
    """A kazoo client that reconnects forever (a broker must come back after any ZooKeeper outage; with
    ``reconnect_tries`` >= 0 that many times, for a caller that drops and remakes the client) and retries
    single commands a few times. ``security`` adds the zk.auth digest (sent again on every
    reconnect) with ``private_acl`` as the default for znodes it creates, and TLS to ZooKeeper's secure
    client port (the server's certificate and host name checked) when zk.ssl.ca.location is set."""
    kw = {}
    if security is not None and security.digest:
        kw.update(auth_data=[("digest", security.digest)], default_acl=private_acl(security))
    if security is not None and security.uses_tls:
        kw.update(use_ssl=True, ca=security.ca_location, certfile=security.certificate_location,
                  keyfile=security.key_location, verify_certs=True, check_hostname=True)
    client = MetaqZooKeeper(hosts=zk_connect, timeout=session_timeout,
                          connection_retry=KazooRetry(max_tries=reconnect_tries, max_delay=2.0),
                          command_retry=KazooRetry(max_tries=5 if reconnect_tries < 0 else reconnect_tries,
                                                   max_delay=2.0), **kw)
    _watch_connects(client)
    return client


def negotiated_timeout(client: KazooClient) -> Optional[float]:
    """The session timeout (seconds) ZooKeeper granted the client's current session, None before the first
    connection. ZooKeeper may grant another than asked (its minSessionTimeout and maxSessionTimeout), and
    a group master's lease must follow the granted one. kazoo computes it at each connection but keeps it
    to itself: ``new_client`` records it from the connect timeout kazoo derives from it (the negotiated
    timeout divided by the number of hosts)."""
    return getattr(client, "metaq_negotiated_timeout", None)


def _watch_connects(client: KazooClient) -> None:
    """Wrap kazoo's connection handshake: record the negotiated session timeout, and give up a session
    that reachable servers have refused for a whole session timeout. A ZooKeeper that lost its data (or
    was restored from an older snapshot) refuses every client that has seen a later transaction than it
    has, forever: kazoo would retry the handshake without end. Such a session is as good as expired, so
    it is treated as expired: a new session starts from zxid 0, and listeners see LOST as for a real
    expiry (a broker registers again)."""
    connection = client._connection
    connect = connection._connect
    refused_since = [None]

    def connect_and_record(*args, **kwargs):
        try:
            read_timeout, connect_timeout = connect(*args, **kwargs)
        except SessionExpiredError:
            refused_since[0] = None
            raise
        except Exception:
            if connection._socket is None or client._session_id is None:
                raise  # not reached (a server down), or no session to give up
            now = time.monotonic()
            refused_since[0] = refused_since[0] or now
            if now - refused_since[0] < client._session_timeout / 1000.0:
                raise
            refused_since[0] = None
            log.warning("ZooKeeper at %s has refused this client's session 0x%x for more than its session timeout "
                        "(it lost its data, or went back to an older snapshot?): starting a new session",
                        client.hosts, client._session_id)
            raise SessionExpiredError("refused by every reachable server for a whole session timeout") from None
        refused_since[0] = None
        client.metaq_negotiated_timeout = connect_timeout * len(client.hosts) / 1000.0
        return read_timeout, connect_timeout

    connection._connect = connect_and_record


def ensure_public_path(client: KazooClient, path: str, security: Optional[ZkSecurity]) -> None:
    """Make sure ``path`` exists with ``public_acl`` (a container clients list to find brokers). Missing
    parents are created private first; a node made private before (say by a client's ``ensure_path``)
    is opened for READ. Nothing to do without zk.auth."""
    acl = public_acl(security)
    if acl is None:
        client.ensure_path(path)
        return
    parent = path.rsplit("/", 1)[0]
    if parent:
        client.ensure_path(parent)
    client.ensure_path(path, acl)
    try:
        held, _ = client.get_acls(path)
    except NoNodeError:
        return
    if set(held) != set(acl):
        client.set_acls(path, acl)


def start_client(client: KazooClient, zk_connect: str, timeout: float) -> None:
    """``client.start`` with a clear error; on failure the client is stopped (it would retry forever)."""
    try:
        client.start(timeout)
    except KazooTimeoutError:
        client.stop()
        client.close()
        why = _tls_diagnosis(client, zk_connect) if client.use_ssl else "is it running (zk.connect)?"
        raise ZooKeeperUnavailableError(
            f"cannot connect to ZooKeeper at {zk_connect} within {timeout:.0f}s; {why}") from None


def _tls_diagnosis(client: KazooClient, zk_connect: str) -> str:
    """Why TLS to ZooKeeper fails, from one handshake of our own with the first server (kazoo only logs
    it and retries)."""
    host, _, port = zk_connect.split(",")[0].rpartition(":")
    host = host.strip("[]")
    ctx = ssl.create_default_context(cafile=client.ca)
    if client.certfile:
        ctx.load_cert_chain(client.certfile, client.keyfile)
    try:
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            with ctx.wrap_socket(raw, server_hostname=host) as tls:
                tls.recv(1)  # TLS 1.3 reports a refused client certificate only after the handshake
    except ssl.SSLError as e:
        text = str(e).lower()
        if any(w in text for w in ("bad certificate", "certificate required", "unknown ca", "certificate unknown")):
            return (f"ZooKeeper refused this client's certificate (zk.ssl.certificate.location, "
                    f"zk.ssl.key.location): {e.reason}" if client.certfile else
                    "ZooKeeper requires a client certificate (zk.ssl.certificate.location, zk.ssl.key.location)")
        if "eof" in text:
            return "ZooKeeper closed the connection during the TLS handshake: is that its secureClientPort?"
        return "ZooKeeper's " + explain(e, f"{host}:{port}").replace("ssl.ca.location", "zk.ssl.ca.location")
    except (OSError, ValueError) as e:
        return f"over TLS: {e}"
    return "the TLS handshake succeeds, but no session was opened (zk.ssl.* and the server's ssl.clientAuth?)"


def children(zk, path: str) -> list:
    """The children of ``path``; none where it is not there (not made yet, or removed meanwhile). One read:
    an ``exists`` before ``get_children`` races with the node's removal in between."""
    try:
        return zk.get_children(path)
    except NoNodeError:
        return []
