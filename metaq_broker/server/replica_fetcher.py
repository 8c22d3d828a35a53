"""A replica's copy loop: fetch from the master's data port (``REPLICA_FETCH``), write what comes verbatim,
fsync, ask again. Each request says where every local partition ends and the epoch of its last batch, so
the master can tell where the logs parted (KIP-101/KIP-279) and answer DIVERGING; the replica then cuts its
log there, durably, before it asks again. The transaction journal rides along as an ordered record stream.

The next request is sent only after the fsync of what the last reply brought, so the durable offsets it
reports (which move the master's high watermark) are true.

Fencing: a reply is applied only if its master is still the one followed (checked under the control lock
just before the log is touched), and ``pause`` (this member is being promoted) returns only once no reply
can be applied any more: a deposed master's late answer never enters a new master's log. ``follow`` to
another master and ``pause`` shut the connection down, so a fetch blocked on a frozen or cut-off master
ends at once; no socket operation waits longer than ``fetch_timeout_s`` (the broker's replicaLagMaxMs)
in any case.

Security is the broker's own, as Kafka's inter-broker listener (docs/replication.md, Security): with SSL or
SASL_SSL the member speaks TLS to the master's data port and gRPC, trusting ``ssl.ca.location``, checking
the master's host name and presenting its own certificate; under SASL_SSL it logs in over the master's
gRPC as ``replication.sasl.username`` and sends the session in an AUTH frame. A refusal (no CA or user
configured, a handshake or login refused, a missing ACL) is logged as an error, once while it lasts, and
retried every ``REFUSED_RETRY_S``, not in a tight loop."""
from __future__ import annotations

import errno
import logging
import os
import select
import socket
import ssl
import threading
import time
from typing import Callable, Optional

import grpc
import numpy as np

from metaq_broker.errors import AuthenticationError, AuthorizationError, ConfigError, MetaqError
from metaq_broker.net.blocking import authenticate, read_replica_reply, recv_exact
from metaq_broker.protocol import dataport
from metaq_broker.protocol import replication as rp
from metaq_broker.protocol import sasl
from metaq_broker.protocol.services import AUTH_PATH, SESSION_METADATA
from metaq_broker.protocol.status import error_of
from metaq_broker.security import scram, tls
from metaq_broker.security.settings import ClientSecurity

log = logging.getLogger(__name__)

MAX_WAIT_MS = 500
MAX_BYTES = 8 << 20
FETCH_TIMEOUT_S = 10.0  # the default replicaLagMaxMs: no socket operation of the fetch waits longer
RETRY_S = 0.2
REFUSED_RETRY_S = 5.0  # after a refusal (security, ACLs): a misconfiguration is not fixed in 0.2 s
REFUSED_RELOG_S = 300.0  # the same refusal is logged again after this long
FAILURES_TOLD = 50  # connection failures in a row (about 10 s of retries) before one is logged as a warning
CONNECT_TIMEOUT = 5.0
CONNECT_POLL_S = 0.05  # how soon a connect in progress notices that the member follows another master
CALL_TIMEOUT = 10.0  # gRPC calls to the master: login, topics
_CLOSED = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)  # a connection going away


class StaleReply(Exception):
    """A reply from a master this member no longer follows (``follow`` moved on, or ``pause``): dropped."""


class ReplicationRefused(MetaqError):
    """The master refused this member (or it cannot reach the master securely) for a reason that lasts:
    logged as an error and retried slowly."""


def _refusal(e: BaseException) -> bool:
    return isinstance(e, (ConfigError, AuthenticationError, AuthorizationError, ReplicationRefused)) or \
        (isinstance(e, ssl.SSLError) and not isinstance(e, _CLOSED))


class MasterLink:
    """One master's gRPC channel, secured as ``security`` says, and under SASL_SSL the session this member
    logged in with (renewed at half its lifetime, or when the master no longer knows it)."""

    def __init__(self, security: ClientSecurity, master: dict):
        self.security = security
        self.address = f"{master['host']}:{master['port']}"
        if security.uses_tls:  # ssl.ca.location is set: replication_problem would have stopped us before
            self.channel = grpc.secure_channel(self.address, grpc.ssl_channel_credentials(*security.pem_files()))
        else:
            self.channel = grpc.insecure_channel(self.address)
        self._token: Optional[str] = None
        self._renew_at = 0.0

    def token(self, renew: bool = False) -> Optional[str]:
        """The session token (None without SASL)."""
        sec = self.security
        if not sec.uses_sasl:
            return None
        if renew or self._token is None or time.monotonic() >= self._renew_at:
            try:
                self._token, lifetime = sasl.authenticate(
                    self.channel.unary_unary(AUTH_PATH), sec.sasl_mechanism, sec.sasl_username, sec.sasl_password,
                    CALL_TIMEOUT, self.address, scram.ScramClient)
            except AuthenticationError as e:
                raise AuthenticationError(f"replication login as {sec.sasl_username} (replication.sasl.username) "
                                          f"failed: {e}") from None
            self._renew_at = time.monotonic() + lifetime / 2
        return self._token

    def metadata(self) -> tuple:
        """What gRPC calls to the master carry: the session under SASL_SSL."""
        token = self.token()
        return ((SESSION_METADATA, token),) if token else ()

    def close(self) -> None:
        self.channel.close()


class ReplicaFetcher:
    """``sync_topics(master, link)`` makes the local store hold the master's topics, asking over ``link``
    (``master``: the master's ZooKeeper node, a dict with host, port, dataPort), and returns how many it
    created or grew; ``on_fenced(epoch)`` is told when the master's epoch differs from the one followed (the
    group member re-reads the state). ``security`` is how to reach the master, ``problem`` why it cannot
    be (``BrokerSecurity.replication_client``, ``replication_problem``); ``gone_on_master(topics)`` is told
    the topics this member has and the master has none of (deleted there while this member was away: the
    broker decides, ``Broker._gone_on_master``). ``fetch_timeout_s`` bounds every
    socket operation (connect, send, each receive): replicaLagMaxMs.

    Locks: ``_lock`` (control: the target, the socket) is never held while waiting on the network;
    ``_apply`` is held while a reply is received and applied, and ``pause`` takes it after changing the
    target (so it waits only for an apply under way, the receive being cut short by the shutdown)."""

    def __init__(self, store, transactions, replica_id: int, uuid: str,
                 sync_topics: Callable[[dict, MasterLink], int], on_fenced: Callable[[int], None],
                 security: Optional[ClientSecurity] = None, problem: Optional[str] = None,
                 fetch_timeout_s: float = FETCH_TIMEOUT_S, gone_on_master: Callable[[list], None] = lambda t: None):
        self.store, self.transactions = store, transactions
        self.replica_id, self.uuid = replica_id, bytes.fromhex(uuid)
        self._sync_topics, self._on_fenced = sync_topics, on_fenced
        self._gone_on_master = gone_on_master  # told the topics the master has none of (deleted there?)
        # How to reach the master (BrokerSecurity.replication_client), and why it cannot be, if so
        self.security, self._problem = security or ClientSecurity(), problem
        self._context: Optional[ssl.SSLContext] = None
        self.last_error: Optional[str] = None  # the refusal that stops copying now, None while it copies
        self._logged = ("", 0.0)  # the last refusal logged, and when
        self._failures = 0  # fetches failed in a row for other reasons (a master going away, a network fault)
        self.fetch_timeout_s = fetch_timeout_s
        self._lock = threading.Condition()
        self._apply = threading.Lock()  # held while a reply is received and applied to the log
        self._sock: Optional[socket.socket] = None  # the connection in use (shut down by follow/pause)
        self._target: Optional[tuple] = None  # (epoch, master node dict)
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self.learned_hw: dict = {}  # (topic, partition) -> the master's HW in its last reply
        self.unknown_on_master: list = []  # topics of which the master's last reply knew no partition
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
                self._interrupt()  # a fetch blocked on the old master (frozen, cut off) ends now
            self._target = (epoch, master)
            self._lock.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="metaq-replica-fetcher", daemon=True)
                self._thread.start()

    def pause(self) -> None:
        """Stop copying (this member becomes master, or is stopping); ``follow`` resumes. Returns once no
        reply can be applied any more: one received before is either applied already or dropped."""
        with self._lock:
            self._target = None
            self._interrupt()
            self._lock.notify_all()
        with self._apply:
            pass

    def applying(self):
        """The lock a reply is applied under: a topic deleted while holding it is in no request under way."""
        return self._apply

    def stop(self) -> None:
        with self._lock:
            self._stop, self._target = True, None
            self._interrupt()
            self._lock.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=10)

    def _interrupt(self) -> None:
        """Shut the connection in use down (holding ``_lock``): a receive blocked on it returns at once. The
        plain socket's shutdown, also under TLS (``SSLSocket.shutdown`` would drop the TLS state under the
        reading thread)."""
        if self._sock is not None:
            try:
                socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def _following(self, target: tuple) -> bool:
        with self._lock:
            return self._target == target and not self._stop

    # -- the loop -------------------------------------------------------------------------------------
    def _run(self) -> None:
        sock, connected_to, link = None, None, None
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
                    self._close(sock)
                    sock, connected_to = None, None
                    if link is None or link.address != f"{master['host']}:{master['port']}":
                        link = _replace_link(link, self._link(master))
                    sock = self._connect(master, link, target)
                    connected_to = target
                    with self._lock:
                        if self._target != target:
                            raise StaleReply("the master changed while connecting")
                        self._sock = sock
                with self._apply:
                    topics_changed = self._exchange(sock, target, link)
                if self.unknown_on_master:
                    self._gone_on_master(self.unknown_on_master)
                if topics_changed and not self._sync_topics(master, link):
                    # The master has partitions this member lacks, yet listed no topic to create: ACLs hide them.
                    raise ReplicationRefused(
                        "the master has topics its ListTopics does not show this member: its principal needs "
                        "Describe on every topic (an ACL on topic '*'), or to be in super.users")
                self._failures = 0
                if self.last_error is not None:
                    log.info("replica %d copies from %s:%s again", self.replica_id, master.get("host"),
                             master.get("dataPort"))
                    self.last_error, self._logged = None, ("", 0.0)
            except Exception as e:  # noqa: BLE001 - the master died or moved: try again, the group re-routes
                moved = not self._following(target)
                log.debug("replica fetch from %s failed%s: %s", master, " (no longer followed)" if moved else "", e,
                          exc_info=not moved)
                refused = _refusal(e) and not moved
                if refused:
                    self._tell(master, e)
                elif moved or isinstance(e, StaleReply):
                    pass  # follow() or pause() cut it short on purpose
                elif not isinstance(e, (OSError, dataport.ProtocolError)):
                    log.warning("replica fetch from %s:%s failed: %s: %s", master.get("host"),
                                master.get("dataPort"), type(e).__name__, e)
                else:  # usually the master going away; said once if it lasts (a TLS refusal whose alert was lost)
                    self._failures += 1
                    if self._failures == FAILURES_TOLD:
                        log.warning("replica fetch from %s:%s failed %d times in a row, last: %s: %s",
                                    master.get("host"), master.get("dataPort"), FAILURES_TOLD, type(e).__name__, e)
                self._close(sock)
                sock, connected_to = None, None
                if refused:  # a new channel and login next time: the settings or the master may have changed
                    link = _replace_link(link, None)
                with self._lock:
                    if not self._stop and not moved:
                        self._lock.wait(REFUSED_RETRY_S if refused else RETRY_S)
        self._close(sock)
        _replace_link(link, None)

    def _close(self, sock) -> None:
        with self._lock:
            if self._sock is sock:
                self._sock = None
        _close(sock)

    def _tell(self, master: dict, e: BaseException) -> None:
        """A refusal, logged as an error when it is new (or every REFUSED_RELOG_S while it lasts)."""
        where = f"{master.get('host')}:{master.get('dataPort')}"
        text = tls.explain(e, where) if isinstance(e, ssl.SSLError) else str(e)
        if isinstance(e, AuthorizationError):
            text += (" (a group member's principal needs ClusterAction on the cluster and Describe on the topics, "
                     "or to be in super.users)")
        self.last_error = f"replica {self.replica_id} cannot copy from its master {where}: {text}"
        now = time.monotonic()
        if self._logged[0] != text or now - self._logged[1] >= REFUSED_RELOG_S:
            self._logged = (text, now)
            log.error("%s (retrying every %.0f s; docs/replication.md, Security)", self.last_error, REFUSED_RETRY_S)

    def _link(self, master: dict) -> MasterLink:
        if self._problem:
            raise ConfigError(self._problem)
        return MasterLink(self.security, master)

    def _connect(self, master: dict, link: MasterLink, target: tuple) -> socket.socket:
        """A connection to the master's data port: TLS (the master's host name checked) and the AUTH frame
        as the broker's protocol wants."""
        host, port = master["host"], int(master["dataPort"])
        sock = self._open(host, port, target)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.security.uses_tls:
                if self._context is None:
                    self._context = tls.client_context(self.security)
                try:
                    sock = self._context.wrap_socket(sock, server_hostname=host)
                except _CLOSED:
                    raise
                except ssl.SSLError as e:
                    raise AuthenticationError(tls.explain(e, f"{host}:{port}")) from None
            sock.settimeout(self.fetch_timeout_s)  # never a wait past replicaLagMaxMs on a frozen master
            if self.security.uses_sasl:
                self._login(sock, link, f"{host}:{port}")
        except BaseException:
            sock.close()
            raise
        return sock

    def _open(self, host: str, port: int, target: tuple) -> socket.socket:
        """A TCP connection within CONNECT_TIMEOUT (and replicaLagMaxMs), given up as soon as ``target`` is
        no longer followed: ``follow`` cannot interrupt a connect, and a cut-off master drops the SYN, so
        a replica that had started connecting to it just before a new master was elected would otherwise
        wait out the timeout before following, holding the new master's acks=all puts meanwhile."""
        deadline = time.monotonic() + min(CONNECT_TIMEOUT, self.fetch_timeout_s)
        error: BaseException = OSError(f"cannot resolve {host}:{port}")
        for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                code = sock.connect_ex(address)
                while code in (errno.EINPROGRESS, errno.EALREADY, errno.EAGAIN):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise socket.timeout(f"connecting to {host}:{port} timed out")
                    if not self._following(target):
                        raise StaleReply(f"the master changed while connecting to {host}:{port}")
                    if select.select([], [sock], [], min(left, CONNECT_POLL_S))[1]:
                        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code:
                    raise OSError(code, f"connecting to {host}:{port}: {os.strerror(code)}")
                sock.settimeout(min(CONNECT_TIMEOUT, self.fetch_timeout_s))  # the TLS handshake's, as before
                return sock
            except StaleReply:
                sock.close()
                raise
            except OSError as e:
                sock.close()
                error = e
        raise error

    def _login(self, sock: socket.socket, link: MasterLink, where: str) -> None:
        """The AUTH frame with the session's token; a token the master no longer knows is renewed once."""
        def recv(view: memoryview) -> None:
            if not recv_exact(sock, view):
                raise dataport.ProtocolError(f"data port {where} closed the connection during the AUTH exchange")
        authenticate(sock, link.token, recv, where)

    def _request(self, epoch: int):
        parts = []
        for p in self.store.all_partitions():
            end = p.log_end_offset
            parts.append(rp.PartitionFetch(p.topic, p.partition, end, p.recovery_point, p.epoch_before(end)))
        seq = self.transactions.applied_seq if self.transactions is not None else 0
        return rp.FetchRequest(epoch, self.replica_id, self.uuid, seq, MAX_WAIT_MS, MAX_BYTES, parts)

    def _exchange(self, sock: socket.socket, target: tuple, link: MasterLink) -> bool:
        """One request and its reply, applied (holding ``_apply``) only while ``target`` is still followed;
        True when the master says its topics changed."""
        epoch, master = target
        req = self._request(epoch)
        sock.sendall(rp.pack_request(req))
        head, journal, sections = read_replica_reply(sock, self._buffer)
        if not self._following(target):
            raise StaleReply(f"a reply from {master.get('host')}:{master.get('dataPort')} (epoch {epoch}), no "
                             f"longer followed: dropped")
        if head.status != 0:
            if head.master_epoch != epoch or head.message.startswith(rp.FENCED):
                self._on_fenced(head.master_epoch)
            code = dataport.STATUS_BY_NUMBER.get(head.status)
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                raise error_of(code, head.message, f"{master.get('host')}:{master.get('dataPort')}")
            raise dataport.ProtocolError(f"master refused the replica fetch: {head.message}")
        if self.transactions is not None and (journal or head.flags & rp.FLAG_JOURNAL_SNAPSHOT):
            self.transactions.apply(journal, head.journal_first_seq, head.journal_last_seq,
                                    bool(head.flags & rp.FLAG_JOURNAL_SNAPSHOT))
        known = {pf.topic for pf, sec in zip(req.partitions, sections) if sec.status != rp.SECTION_UNKNOWN}
        self.unknown_on_master = sorted({pf.topic for pf in req.partitions} - known)
        written, learned = [], []
        for pf, sec in zip(req.partitions, sections):
            key = (pf.topic, pf.partition)
            part = self.store.partition(pf.topic, pf.partition)
            if sec.identity and sec.identity != part.identity:  # the master's log is another log than ours
                if part.identity_adopted:  # ours was given to an older data directory: the logs may agree
                    part.adopt_identity(sec.identity)
                else:
                    # Start over where the master's log starts, with the epoch it has there: a RESET names it;
                    # else from offset 0, so that the master's next answer is a RESET naming it, or the log
                    # from its start with every epoch marker. (Started at the earliest offset with epoch 0,
                    # a log whose first epoch's marker retention removed parted from the master's forever.)
                    offset, epoch = (sec.offset, sec.epoch) if sec.status == rp.RESET else (0, 0)
                    log.warning("%s: the master's log is another one (identity %s, ours %s): starting the "
                                "partition over at offset %d", part.name, sec.identity, part.identity, offset)
                    part.reset_to(offset, identity=sec.identity, epoch=epoch)
                    continue
            if sec.status == rp.DIVERGING:
                self._truncate(part, sec.epoch, sec.offset)
            elif sec.status == rp.RESET:
                log.warning("%s: the master's log starts at %d (epoch %d), beyond this replica's end %d: starting "
                            "the partition over there", part.name, sec.offset, sec.epoch, part.log_end_offset)
                part.reset_to(sec.offset, epoch=sec.epoch)
            elif sec.status == rp.SECTION_DATA and len(sec.records):
                part.append_replicated(sec.records)
                written.append(part)
            if sec.status != rp.SECTION_UNKNOWN:
                self.learned_hw[key] = sec.hw
                learned.append((part, sec.hw))
        for part in written:
            part.make_durable(part.log_end_offset)
        for part, hw in learned:
            if part.high_watermark is not None:
                # A member that was master keeps its readers' cap (its late fetches must not see past what
                # the group acknowledged); as Kafka's follower it moves it with the master's HW, else its
                # DescribeTopic would report its old HW as latest for as long as it runs.
                part.set_high_watermark(min(hw, part.log_end_offset))
        if self.transactions is not None:
            self.transactions.apply_pending()
        return bool(head.flags & rp.FLAG_TOPICS_CHANGED)

    def _truncate(self, part, epoch: int, end: int) -> None:
        """KIP-279: the master's largest epoch <= ours is ``epoch``, ending at ``end``. If we hold that epoch,
        cut to where it ends on both sides; if not, cut to the end of our largest epoch below it and ask again."""
        mine, my_end = part.epochs.end_offset_for(epoch, part.log_end_offset)
        # Epoch 0 (offsets before a log's first stamp) is held by every log, so epoch - 1 >= 0 below.
        cut = min(end, my_end, part.log_end_offset) if mine == epoch else \
            part.epochs.end_offset_for(epoch - 1, part.log_end_offset)[1]
        before = part.log_end_offset
        new_end = part.truncate_to(max(cut, part.earliest_offset))
        if new_end < before:
            self.truncations += 1
            self.truncated_offsets += before - new_end
        log.warning("%s: truncated from %d to %d where this log parted from the master's (epoch %d ends at %d "
                    "there)", part.name, before, new_end, epoch, end)


def _replace_link(old: Optional[MasterLink], new: Optional[MasterLink]) -> Optional[MasterLink]:
    if old is not None:
        old.close()
    return new


def _close(sock) -> None:
    if sock is not None:
        try:
            sock.close()
        except OSError:
            pass
