"""The broker's presence in ZooKeeper (MetaQ's ``registerBrokerInZk`` / ``registerTopicsInZk``), in
metaq's own nodes and, with a MetaQ listener, MetaQ's (docs/protocol.md, "ZooKeeper layout").

* ``<root>/brokers/groups/<id>/members/<replicaId>``: ephemeral, this member's JSON addresses; the group's
  master node ``<root>/brokers/metaq/ids/<id>`` is created by its election (``server/member_role.py``).
  Ephemeral so that a broker that dies drops out of every client's view by itself when its session expires.
* ``<root>/brokers/metaq/topics/<topic>/<id>-m``: persistent, ``{"numPartitions": n, "brokerId": id}``,
  written by the master. Clients route to the entries of brokers that are alive; keys hash over all of
  them, so the entries stay when the broker stops (as when it crashes) and go only with ``metaq brokers
  forget`` or when the broker no longer has the topic.
* MetaQ's nodes, with ``metaqPort``: the master's ``brokers/ids/<id>/master`` and topic entries
  (``brokers/topics``, ``topics-pub``, ``topics-sub``), a replica's ``brokers/ids/<id>/slave<replicaId>``,
  all ephemeral (``zk/metaq_nodes.py``); the master's follow its election and go when it steps down.
* ``<root>/kafka/topics/<topic>``: with each topic entry, Kafka's numbers for the broker's partitions of it
  that have none yet (``zk/kafka_partitions.py``: append-only, so numbers never move).
* The node's JSON (made by the broker) holds its addresses: ``host`` (``advertisedHostName``),
  ``port``, ``dataPort``, ``metaqPort`` with a MetaQ listener, and ``kafkaPort`` while its Kafka listener is up.

Before its first registration the broker moves what a broker of the layout before issue 28 left where
MetaQ clients read (``zk/layout_upgrade.py``).

Registration must outlive ZooKeeper trouble: after a restart of ZooKeeper or an expired session the
ephemeral node is gone, so every reconnect re-checks and re-creates it (on a worker thread, because
kazoo state listeners must not block). A second broker with an id that a live session holds is
refused; when the holder has *our* address it is this broker's previous, crashed run, whose session
will expire shortly, so we wait for that instead (Kafka does the same), and say so in an ephemeral
``<root>/brokers/starting/<id>`` of our own session (``metaq brokers`` shows it) until we are registered.

With ``zk.auth`` these nodes (and the containers clients list) carry ``public_acl``: world-readable, so a
client without ZooKeeper credentials still finds brokers, but writable by the digest identity only.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Iterable, Optional

from kazoo.client import KazooState
from kazoo.exceptions import KazooException, NodeExistsError, NoNodeError

from metaq_broker.errors import MetaqError
from metaq_broker.security.settings import ZkSecurity
from metaq_broker.names import partition_name
from metaq_broker.zk import kafka_partitions, layout_upgrade, metaq_nodes, topic_entries
from metaq_broker.zk.metaq_layout import MetaqZkLayout
from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.session import ensure_public_path, new_client, public_acl, start_client

log = logging.getLogger(__name__)


class BrokerIdInUseError(MetaqError):
    """Another live ZooKeeper session holds this broker id. ``holder`` is the address stored there."""

    def __init__(self, message: str, broker_id: int = -1, holder=None, session: int = 0):
        super().__init__(message)
        self.broker_id, self.holder, self.session = broker_id, holder, session  # session: the holder's id


class BrokerRegistration:
    def __init__(self, zk_connect: str, root: str, broker_id: int, address: dict, topics: dict,
                 session_timeout: float = 10.0, zk_security: Optional[ZkSecurity] = None,
                 replica_id: Optional[int] = None, on_registered=lambda: None, before_register=lambda client: None,
                 metaq_uri: Optional[str] = None, static_topics: Iterable[str] = ()):
        self.paths = ZkPaths(root)
        self.layout = MetaqZkLayout(root)
        self.metaq_uri = metaq_uri  # meta://host:port of this broker's MetaQ listener (metaqPort), or None
        self.broker_id = broker_id
        # In a replicated group the node is the member's (``groups/<b>/members/<r>``); ``/brokers/ids/<b>`` is
        # the master's, created by the election (``server/member_role.py``), and only the master publishes topics.
        self.replica_id = replica_id
        self.publish_topics = replica_id is None
        self._on_registered = on_registered
        self._before_register = before_register  # given the connected client once, before the first registration
        self._registered_session = None
        self.address = dict(address)
        self.topics: dict = dict(topics)
        self.static_topics = frozenset(static_topics)  # the topics of server.ini: their entries say so
        self.session_timeout = session_timeout
        self.zk_security = zk_security
        self._acl = public_acl(zk_security)  # None: kazoo's default (open, or private with zk.auth)
        self.client = new_client(zk_connect, session_timeout, zk_security)
        self.zk_connect = zk_connect
        self.state_history: list = []  # every KazooState seen, in order (for tests and diagnosis)
        self.registrations = 0  # successful (re-)registrations
        self._lock = threading.RLock()  # serialises ZooKeeper writes of this registration
        self._kick_lock = threading.Lock()
        self._dirty = False
        self._worker: Optional[threading.Thread] = None
        self._started = self._stopped = False
        self._warned = False

    @property
    def node(self) -> str:
        if self.replica_id is not None:
            return self.paths.group_replica(self.broker_id, self.replica_id)
        return self.paths.broker(self.broker_id)

    @property
    def starting_node(self) -> str:
        if self.replica_id:
            return self.paths.group_starting(self.broker_id, self.replica_id)
        return self.paths.broker_starting(self.broker_id)

    @property
    def acl(self):
        return self._acl

    @property
    def registered(self) -> bool:
        """Our node exists in the current session."""
        return self.connected and self._registered_session == self.client.client_id

    def update_node(self, fields: dict) -> None:
        """Merge ``fields`` into this broker's node data: written now if our session holds the node, and in
        every later (re-)registration. A group member tells its standing in elections this way."""
        with self._lock:
            self.address = {**self.address, **fields}
            if not self._started or self._stopped or not self.registered:
                return
            data = json.dumps(self.address, sort_keys=True).encode()
            _, stat = self.client.get(self.node)
            if stat.ephemeralOwner == self.client.client_id[0]:
                self.client.set(self.node, data, version=stat.version)

    def set_publishing(self, publish: bool) -> None:
        """The group's master publishes the topic entries (and MetaQ's master nodes); a replica leaves them
        alone (and has MetaQ's ``slave<replicaId>``)."""
        with self._lock:
            was, self.publish_topics = self.publish_topics, publish
            if not self._started or self._stopped or not self.connected:
                return
            if publish:
                self._withdraw_slave()
                self._write_topics()
                return
            try:
                if was:
                    self._withdraw_master()
                if self.metaq_uri is not None and self.replica_id is not None:
                    metaq_nodes.publish_slave(self.client, self.layout, self.broker_id, self.replica_id,
                                              self.metaq_uri, self._acl)
            except KazooException as e:  # they are ephemeral: they go with this session at the latest
                log.warning("broker %d member %d: could not withdraw MetaQ's master nodes now (%s)", self.broker_id,
                            self.replica_id, type(e).__name__)

    @property
    def connected(self) -> bool:
        return self.client.state == KazooState.CONNECTED

    # -- start ----------------------------------------------------------------------------------------
    def start(self, timeout: float = 15.0) -> "BrokerRegistration":
        """Connect and register; BrokerIdInUseError if a live broker holds the id, ZooKeeperUnavailableError
        if ZooKeeper does not answer within ``timeout``."""
        self.client.add_listener(self._on_state)
        start_client(self.client, self.zk_connect, timeout)
        self._before_register(self.client)
        moved = layout_upgrade.upgrade(self.client, self.paths, self.broker_id, self._acl)
        if moved:
            log.info("moved from the ZooKeeper layout before issue 28: %s", moved)
        stale_deadline = time.monotonic() + 2 * self.session_timeout + 2
        try:
            while True:
                try:
                    self._register()
                    break
                except BrokerIdInUseError as e:
                    if not self._same_address(e.holder) or time.monotonic() > stale_deadline:
                        raise
                    if not self._warned:
                        self._warned = True
                        log.warning("broker id %d is still held by a session with our own address (a crashed "
                                    "previous run?); waiting for it to expire (within about %.0fs, "
                                    "zk.sessionTimeout)", self.broker_id, self.session_timeout)
                        self._announce_starting(e.session)
                    time.sleep(0.25)
        except BaseException:
            self._stopped = True
            self._withdraw_starting()
            self._close_client()
            raise
        self._withdraw_starting()
        self._started = True
        return self

    def _announce_starting(self, old_session: int) -> None:
        """``<root>/brokers/starting/<id>``, ephemeral: this broker waits for its previous run's session to
        expire, ZooKeeper expiring it at the latest a session timeout from now."""
        now = time.time()
        info = {**self.address, "address": f"{self.address.get('host')}:{self.address.get('port')}",
                "since": now, "expectedExpiry": now + self.session_timeout, "oldSession": f"0x{old_session:x}"}
        try:
            if self._acl is not None:
                ensure_public_path(self.client, self.paths.brokers_starting(), self.zk_security)
            self.client.create(self.starting_node, json.dumps(info, sort_keys=True).encode(),
                               acl=self._acl, ephemeral=True, makepath=True)
        except NodeExistsError:
            log.info("%s exists already: another broker with id %d is starting", self.starting_node,
                     self.broker_id)
        except KazooException as e:  # only a notice: waiting goes on without it
            log.warning("could not write %s: %s", self.starting_node, e)

    def _withdraw_starting(self) -> None:
        path = self.starting_node
        try:
            if self._warned and self.client.connected:
                _, stat = self.client.get(path)
                if stat.ephemeralOwner == self.client.client_id[0]:
                    self.client.delete(path, version=stat.version)
        except NoNodeError:
            pass
        except KazooException as e:  # ephemeral: it goes with our session anyway
            log.warning("could not remove %s: %s", path, e)

    def _same_address(self, holder) -> bool:
        return isinstance(holder, dict) and all(
            holder.get(k) == self.address.get(k) for k in ("host", "port", "brokerId"))

    def _register(self) -> None:
        """Create (or confirm) our ephemeral node, then write every topic node."""
        data = json.dumps(self.address, sort_keys=True).encode()
        with self._lock:
            if self._stopped:
                return  # stop() won the lock: writing now would leave topic nodes behind
            if self._acl is not None:
                containers = [self.paths.broker_ids(), self.paths.topics()]
                if self.replica_id is not None:
                    containers.append(self.paths.group_members(self.broker_id))
                if self.metaq_uri is not None:
                    containers += [self.layout.broker_ids(), self.layout.topics_legacy(), self.layout.topics_pub(),
                                   self.layout.topics_sub()]
                for container in containers:
                    ensure_public_path(self.client, container, self.zk_security)
            while True:
                try:
                    self.client.create(self.node, data, acl=self._acl, ephemeral=True, makepath=True)
                    break
                except NodeExistsError:
                    try:
                        held, stat = self.client.get(self.node)
                    except NoNodeError:
                        continue  # it just went away: create it
                    if stat.ephemeralOwner == self.client.client_id[0]:
                        if held != data:
                            self.client.set(self.node, data, version=stat.version)
                        break
                    try:
                        holder = json.loads(held)
                    except ValueError:
                        holder = held.decode(errors="replace")
                    raise BrokerIdInUseError(
                        f"broker id {self.broker_id} is already registered in ZooKeeper ({self.node}) by another "
                        f"live session, address {held.decode(errors='replace')}; stop that broker or give this "
                        f"one another brokerId", self.broker_id, holder, stat.ephemeralOwner) from None
            if self.publish_topics:
                for topic in topic_entries.topics_of(self.client, self.paths, self.broker_id):
                    if topic not in self.topics:  # a topic this broker had before its restart, and has no more
                        topic_entries.delete(self.client, self.paths, topic, self.broker_id)
                self._write_topics()
            elif self.metaq_uri is not None and self.replica_id is not None:
                metaq_nodes.publish_slave(self.client, self.layout, self.broker_id, self.replica_id, self.metaq_uri,
                                          self._acl)
            self.registrations += 1
            self._registered_session = self.client.client_id
        self._on_registered()
        log.info("broker %d registered in ZooKeeper at %s with %d topic(s)", self.broker_id, self.node,
                 len(self.topics))

    def _write_topics(self) -> None:
        for topic, n in list(self.topics.items()):
            self._write_topic(topic, n, metaq=False)
        self._publish_metaq(self.topics)

    def _publish_metaq(self, topics: dict) -> None:
        """MetaQ's master nodes and entries of ``topics``, while this member is master (a group's replicas
        write none; a master without a MetaQ listener only empties ``brokers/ids/<b>`` of an earlier
        master's URI: one that crashed, or this broker's run before ``metaqPort`` was turned off)."""
        if self.replica_id is None:
            return
        if not metaq_nodes.publish_master(self.client, self.paths, self.layout, self.broker_id, self.replica_id,
                                          self.metaq_uri, topics, self._acl):
            log.info("broker %d member %d is not master (any more): MetaQ's master nodes are not written",
                     self.broker_id, self.replica_id)

    def _withdraw_master(self) -> None:
        if self.metaq_uri is not None:
            metaq_nodes.withdraw_master(self.client, self.layout, self.broker_id, self.metaq_uri, list(self.topics))

    def _withdraw_slave(self) -> None:
        if self.metaq_uri is not None and self.replica_id is not None:
            metaq_nodes.withdraw_slave(self.client, self.layout, self.broker_id, self.replica_id)

    def _write_topic(self, topic: str, num_partitions: int, metaq: bool = True) -> None:
        data = topic_entries.entry(num_partitions, self.broker_id, topic in self.static_topics)
        path = self.paths.topic_entry(topic, self.broker_id)
        try:
            self.client.create(path, data, acl=self._acl, makepath=True)
        except NodeExistsError:
            if self.client.get(path)[0] != data:
                self.client.set(path, data)
        if metaq:
            self._publish_metaq({topic: num_partitions})
        names = [partition_name(self.broker_id, n) for n in range(int(num_partitions))]
        try:  # Kafka's numbers for partitions that have none yet (zk/kafka_partitions.py)
            kafka_partitions.number(self.client, self.paths, topic, names)
        except MetaqError as e:  # a damaged map is never overwritten: Kafka clients miss these until it is repaired
            log.error("%s; partitions %s of broker %d have no Kafka partition number", e, ", ".join(names),
                      self.broker_id)

    # -- topics at runtime ----------------------------------------------------------------------------
    def add_topic(self, topic: str, num_partitions: int) -> None:
        """Publish one (new or resized) topic."""
        self._update({**self.topics, topic: num_partitions}, only=[topic])

    def remove_topic(self, topic: str) -> None:
        """Unpublish one (deleted) topic."""
        self._update({t: n for t, n in self.topics.items() if t != topic}, only=[])

    def set_topics(self, topics: dict) -> None:
        """Publish exactly ``topics`` ({topic: numPartitions}); unpublish the ones no longer listed."""
        self._update(dict(topics), only=None)

    def _update(self, topics: dict, only) -> None:
        for t in topics:
            self.paths.topic(t)  # ValueError now for a name that cannot be a znode
        with self._lock:
            removed = [t for t in self.topics if t not in topics]
            self.topics = topics
            if not self._started or self._stopped or not self.publish_topics:
                return
            try:
                for t in only if only is not None else list(topics):
                    self._write_topic(t, topics[t])
                for t in removed:
                    topic_entries.delete(self.client, self.paths, t, self.broker_id)
                    metaq_nodes.withdraw_topic(self.client, self.layout, self.broker_id, t)
            except KazooException as e:
                # Not connected: the re-registration that follows the reconnect writes self.topics.
                log.warning("could not publish topics of broker %d now (%s); will on reconnect",
                            self.broker_id, type(e).__name__)
                self._kick()

    # -- reconnects -----------------------------------------------------------------------------------
    def _on_state(self, state) -> None:
        """Kazoo's connection thread calls this: record and hand off, never block."""
        self.state_history.append(state)
        if state == KazooState.LOST and not self._stopped:
            log.warning("ZooKeeper session of broker %d expired; registering again once reconnected",
                        self.broker_id)
        elif state == KazooState.SUSPENDED and not self._stopped:
            log.warning("broker %d lost its ZooKeeper connection; reconnecting", self.broker_id)
        elif state == KazooState.CONNECTED and self._started:
            self._kick()

    def _kick(self) -> None:
        with self._kick_lock:
            if self._stopped:
                return
            self._dirty = True
            if self._worker is None:
                self._worker = threading.Thread(target=self._reregister_loop, daemon=True,
                                                name=f"metaq-zk-register-{self.broker_id}")
                self._worker.start()

    def _reregister_loop(self) -> None:
        complained = False
        while True:
            with self._kick_lock:
                if not self._dirty or self._stopped:
                    self._worker = None
                    return
                self._dirty = False
            while not self._stopped and self.connected:
                try:
                    self._register()
                    break
                except BrokerIdInUseError as e:
                    # Usually our own expired session whose node ZooKeeper has not removed yet.
                    if not complained:
                        complained = True
                        (log.info if self._same_address(e.holder) else log.error)("%s; retrying", e)
                    time.sleep(0.5)
                except KazooException:
                    time.sleep(0.2)  # connection trouble; the loop ends if we are disconnected
                except Exception:  # noqa: BLE001 - keep the thread alive, try again
                    log.exception("re-registering broker %d failed", self.broker_id)
                    time.sleep(1.0)

    # -- stop -----------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Remove our broker node, then close the session. The topic entries stay (they are persistent), as
        after a crash: the partitions are down, not gone, so keys keep their partition across a restart
        and queries keep their offsets (``metaq brokers forget`` removes a broker for good). A node held by
        another session (a broker that took over the id) is left alone."""
        with self._kick_lock:
            self._stopped = True
        locked = self._lock.acquire(timeout=self.session_timeout)
        try:
            if self._started and self.connected:
                try:
                    if self.publish_topics:
                        self._withdraw_master()
                    self._withdraw_slave()
                    try:
                        _, stat = self.client.get(self.node)
                        if stat.ephemeralOwner == self.client.client_id[0]:
                            self.client.delete(self.node, version=stat.version)
                    except NoNodeError:
                        pass
                except Exception:  # noqa: BLE001 - the session ends below anyway
                    log.exception("deregistering broker %d failed", self.broker_id)
        finally:
            self._close_client()
            if locked:
                self._lock.release()
        log.info("broker %d left ZooKeeper", self.broker_id)

    def _close_client(self) -> None:
        try:
            self.client.stop()
            self.client.close()
        except Exception:  # noqa: BLE001
            log.debug("closing the ZooKeeper client failed", exc_info=True)
