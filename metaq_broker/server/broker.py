"""The broker process: storage, the request handler and the transports on it (gRPC with the standard health
service, the data port), ZooKeeper registration and the replicated group, topics created at runtime, and a
start and stop that build and undo the same parts in the same order."""
from __future__ import annotations

import configparser
import contextlib
import fcntl
import io
import logging
import os
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from metaq_broker import __version__
from metaq_broker.errors import ConfigError, InvalidTopicError, NotMasterError, UnknownTopicError
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.proto import metaq_pb2_grpc as pb_grpc
from metaq_broker.protocol import rawput
from metaq_broker.protocol.status import to_error
from metaq_broker.security.settings import private_key_warning, read_pem
from metaq_broker.server import kafka_metadata
from metaq_broker.server.auth import BrokerAuth
from metaq_broker.server.config import BrokerConfig, topic_config_from, topic_ini_values, topic_names
from metaq_broker.server.data_server import DataServer, data_listener
from metaq_broker.server.disk import DiskState
from metaq_broker.server.group_listing import GroupListingService
from metaq_broker.server.group_offsets_service import GroupOffsetsService
from metaq_broker.server.handler import Limits, RequestHandler
from metaq_broker.server.kafka_groups import KafkaGroups
from metaq_broker.server.kafka_listener import KafkaServer, kafka_listener
from metaq_broker.server.listener import Listener
from metaq_broker.server.member import DIRECTORY as MEMBER_DIRECTORY
from metaq_broker.server.member import StateCopy, load_or_create
from metaq_broker.server.member_role import MASTER, GroupMember
from metaq_broker.server.metaq_server import MetaqServer, check_security, metaq_listener
from metaq_broker.server.metrics import BrokerMetrics
from metaq_broker.server.offset_bridge import OffsetBridge
from metaq_broker.server.producer_ids import ProducerIds
from metaq_broker.server.registration import BrokerRegistration
from metaq_broker.server.replica_fetcher import ReplicaFetcher
from metaq_broker.server.replica_manager import ReplicaManager
from metaq_broker.server.service import BrokerService
from metaq_broker.server.sinks import SinkDecisionsService
from metaq_broker.server.stats import BrokerStats
from metaq_broker.server.topic_deletion import TopicDeletions, deletion_service
from metaq_broker.server.txn_resolver import TransactionResolver
from metaq_broker.store import MessageStore, validate_topic_name
from metaq_broker.store.durable import make_dirs, open_to_others, replace_file, restrict_tree
from metaq_broker.store.message_store import TRANSACTIONS_DIRECTORY
from metaq_broker.store.transactions import TransactionManager
from metaq_broker.zk import groups as zk_groups
from metaq_broker.zk import topic_entries
from metaq_broker.zk.acls import AclCache
from metaq_broker.zk.kafka_cluster import KafkaClusterCache
from metaq_broker.zk.metaq_layout import broker_uri
from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.session import client_subtrees, new_client, share_client_nodes, start_client
from metaq_broker.zk.users import UserCache, scram_secret

log = logging.getLogger(__name__)

RUNTIME_TOPICS_FILE = "runtime-topics.ini"
SERVICE_NAME = "metaq.v1.Broker"
WRITE_SERVICE = "metaq.write"  # health: NOT_SERVING while the last write found the disk full
MAX_GRPC_MESSAGE = 256 << 20  # a reply: a fetch (maxTransferSize, or one larger batch), a replica's topic list
HANDSHAKE_TIMEOUT_MS = 10_000  # a gRPC connection's TLS and HTTP/2 handshake must be done by then
CONNECTION_IDLE_MS = 600_000  # a gRPC connection with no call for this long is closed (clients reconnect; Kafka's
# connections.max.idle.ms)
LOCK_FILE = "lock"  # <dataPath>/replication/lock: held by the running member (flock), names this run
HAND_OVER_S = 5.0  # a stopping master waits at most this long for its in-sync replicas to have its whole log


class _UndecodableRequests(logging.Filter):
    """gRPC logs every request it cannot deserialize at ERROR with a traceback (``grpc._common``): anyone who
    reaches the port could fill the log. The call is refused all the same (INTERNAL, "Exception deserializing
    request"); here it becomes one warning a minute, with the count, and no traceback."""

    def __init__(self, every_s: float = 60.0):
        super().__init__()
        self.every_s, self.count, self.last = every_s, 0, -every_s

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("Exception deserializing"):
            return True
        self.count += 1
        now = time.monotonic()
        if now - self.last < self.every_s:
            return False
        log.warning("gRPC: %d request(s) that could not be deserialized were refused (logged at most once a "
                    "minute)", self.count)
        self.count, self.last = 0, now
        return False


logging.getLogger("grpc._common").addFilter(_UndecodableRequests())


class _GroupCalls:
    """The way into the group member for the parts it drives, which are built before it and call back: the
    replica manager writes the in-sync set through it and reports a higher epoch, the fetcher and the
    registration wake it. ``member`` is set as soon as the member is built, before any of them starts, so
    none calls into nothing."""

    def __init__(self):
        self.member: Optional[GroupMember] = None

    def wake(self, *_) -> None:
        if self.member is not None:
            self.member.wake()

    def alter_isr(self, isr) -> bool:
        return self.member is not None and self.member.alter_isr(isr)

    def higher_epoch_seen(self, epoch: int) -> None:
        if self.member is not None:
            self.member.higher_epoch_seen(epoch)

    def lease_valid(self) -> bool:
        return self.member is not None and self.member.lease_valid()


class Broker:
    """``start()`` opens the store, serves gRPC (and the data port) and registers in ZooKeeper (unless
    ``zk.connect`` is ``none``); ``stop()`` hands a master's group over, stops serving once in-flight calls
    finish, fsyncs and closes the store. ``repair``: recovery cuts a damaged log tail even where
    acknowledged messages follow the damage (``metaq-broker --repair``), instead of refusing to start.

    ``start`` builds the broker in dependency order, one stage after the other (``STAGES``), and pushes the
    stop of each part it starts onto one ``ExitStack``: a start that fails at any stage, and ``stop()``,
    undo the same parts in the reverse order (servers before the store they read, the data directory's
    lock last, so a successor takes over only nodes of a run that holds it no more)."""

    STAGES = ("data", "store", "auth", "listeners", "group", "handler", "serving", "cluster", "kafka", "bridge",
              "resolver")

    def __init__(self, config: BrokerConfig, repair: bool = False):
        self.config = config
        self.repair = repair
        self.port: Optional[int] = None
        self.metrics_port: Optional[int] = None  # the Prometheus port once started (metricsPort >= 0)
        self.data_port: Optional[int] = None  # the data port once started (dataPort >= 0)
        # The Kafka listener's port once it listens (kafkaPort >= 0), registered for Kafka clients
        self.kafka_port: Optional[int] = None
        self.kafka_server: Optional[KafkaServer] = None
        self._kafka_listener: Optional[Listener] = None
        # metaqPort >= 0: the MetaQ listener's port, bound (not listening yet: a connection is refused, not left
        # hanging) and registered in MetaQ's layout; the listener itself (issue 28, phase 2) listens on it
        self.metaq_port: Optional[int] = None
        self._metaq_listener: Optional[Listener] = None  # MetaQ's text protocol, listening from the listeners stage
        self.metaq_server: Optional[MetaqServer] = None
        self.offset_bridge: Optional[OffsetBridge] = None  # group offsets in metaq's and MetaQ's forms (metaqPort)
        self.data_server: Optional[DataServer] = None
        self.put_limit: Optional[int] = None  # the largest put request taken, once started (max_put_bytes)
        self.stats, self.metrics = BrokerStats(), None
        self.disk: Optional[DiskState] = None  # whether the last write found the disk full (handler, metrics)
        self.store = self.server = self.registration = self.transactions = self.resolver = None
        self.handler: Optional[RequestHandler] = None
        self.auth: Optional[BrokerAuth] = None  # TLS, SASL and ACLs (security.*, authorizer)
        # Replication (with ZooKeeper): who this member is, its role, the master's and the replica's parts
        self.identity = self.group = self.replicas = self.fetcher = None
        self.producer_ids: Optional[ProducerIds] = None  # InitProducerId's ids (server/producer_ids.py)
        self.deletions: Optional[TopicDeletions] = None  # topic deletions recorded in ZooKeeper, carried out here
        self._postponed: dict = {}  # topic -> why its deletion here waits, as last logged
        self._checked_gone: dict = {}  # topic -> when the master last had none of it (``_gone_on_master``)
        self.instance: Optional[str] = None  # the locked data directory (boot id, device, inode): see _lock_data
        self._lock_fd = -1
        self._security_zk = self._users = self._acls = None  # the ZooKeeper session and caches auth reads
        self._health = health.HealthServicer()  # says SERVING for "" until told otherwise: not before start ends
        for name in ("", SERVICE_NAME):
            self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._topic_lock = threading.Lock()
        self._stop_lock = threading.Lock()
        self._stopping = False
        self._stopped = threading.Event()
        self._running = contextlib.ExitStack()  # the started parts' stops, undone by stop()
        self._grace = 0.0  # how long stopping servers wait for calls in flight (stop's grace; 0 after a failed start)
        self._grpc_started = False
        self._data_listener: Optional[Listener] = None  # the data port, listening from the listeners stage

    @property
    def address(self) -> str:
        return f"{self.config.host_name}:{self.port}"

    @property
    def uses_zookeeper(self) -> bool:
        return self.config.zk_connect.lower() != "none"

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> "Broker":
        with contextlib.ExitStack() as stack:  # a failed stage undoes every part started before it
            for stage in self.STAGES:
                getattr(self, f"_start_{stage}")(stack)
            self._running = stack.pop_all()
        for name in ("", SERVICE_NAME):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._write_health(self.disk.full)
        log.info("metaq broker %d listening on %s%s%s%s%s (data in %s)", self.config.broker_id, self.address,
                 f", data port {self.data_port}" if self.data_port is not None else "",
                 f", Kafka port {self.kafka_port}" if self.kafka_port is not None else "",
                 f", MetaQ port {self.metaq_port}" if self.metaq_port is not None else "",
                 f", metrics port {self.metrics_port}" if self.metrics_port is not None else "",
                 Path(self.config.data_path).resolve())
        return self

    def stop(self, grace: float = 10.0) -> None:
        with self._stop_lock:
            if self._stopping:
                return
            self._stopping = True
        self._health.enter_graceful_shutdown()
        if self.group is not None and grace > 0:
            self.group.hand_over(self._replicas_caught_up, min(grace, HAND_OVER_S))
        self._grace = grace
        self._running.close()
        log.info("metaq broker %d stopped", self.config.broker_id)
        self._stopped.set()

    # -- the stages of start, in dependency order -----------------------------------------------------
    def _start_data(self, stack: contextlib.ExitStack) -> None:
        """The data directory: made, what others could read narrowed, locked by this process (with ZooKeeper)."""
        data = Path(self.config.data_path)
        make_dirs(data)
        self._warn_about_exposure(data)
        if self.uses_zookeeper:
            self._lock_data(data)
            stack.callback(self._unlock_data)

    def _start_store(self, stack: contextlib.ExitStack) -> None:
        """The partitions (recovered) and the transaction journal. In a group, a member starts as a follower:
        only the elected master settles transactions, after its epoch marker, so the markers it writes are
        ordered in the log like every other append."""
        cfg = self.config
        data = Path(cfg.data_path)
        self.store = MessageStore(data, {**self._runtime_topics(), **cfg.topics}, default_config=cfg.topic_defaults,
                                  retention_interval=cfg.retention_check_interval_s, repair=self.repair)
        stack.callback(self.store.close)  # fsyncs every partition
        self.transactions = TransactionManager(self.store, data / TRANSACTIONS_DIRECTORY,
                                               cfg.transaction_timeout_ms / 1000,
                                               max_timeout_s=cfg.transaction_max_timeout_ms / 1000,
                                               follower=self.uses_zookeeper)
        stack.callback(self.transactions.close)
        self.disk = DiskState(data, on_change=self._write_health)
        self.put_limit = self.max_put_bytes()

    def _start_auth(self, stack: contextlib.ExitStack) -> None:
        """Authentication and ACLs; users and ACLs come from ZooKeeper through watch-driven caches on a
        session of their own, loaded before the first call is served."""
        cfg = self.config
        sec = cfg.security
        needs_zk = sec.uses_sasl or sec.authorizer == "acl"
        if needs_zk and not self.uses_zookeeper:
            raise ConfigError("security.protocol SASL_SSL and authorizer=acl keep users and ACLs in ZooKeeper; "
                              "set zk.connect")
        if needs_zk:
            self._security_zk = new_client(cfg.zk_connect, cfg.zk_session_timeout_ms / 1000, cfg.zk_security)
            self._security_zk.share_below(*client_subtrees(cfg.zk_root))  # it writes groups and decisions
            stack.callback(_close_zookeeper, self._security_zk)
            start_client(self._security_zk, cfg.zk_connect, cfg.zk_session_timeout_ms / 1000)
            self._users = UserCache(self._security_zk, cfg.zk_root)
            stack.callback(self._users.close)
        if sec.uses_sasl:
            self.auth = BrokerAuth(sec, cfg.data_path, self._users.credential,
                                   fake_key=scram_secret(self._security_zk, cfg.zk_root),
                                   iterations=self._users.typical_iterations)
            self._users.listen(self.auth.user_changed)  # sessions of a changed or removed user end on every port
        else:
            self.auth = BrokerAuth(sec, cfg.data_path)
        if sec.authorizer == "acl":
            self._acls = AclCache(self._security_zk, cfg.zk_root, self.auth.set_acls)
            stack.callback(self._acls.close)

    def _start_listeners(self, stack: contextlib.ExitStack) -> None:
        """The gRPC port and the data port, listening (so their ports are known to the parts that register
        them), not serving yet; with metaqPort, the MetaQ listener too (registered in MetaQ's layout by the
        group stage)."""
        cfg = self.config
        executor = futures.ThreadPoolExecutor(max_workers=cfg.grpc_workers, thread_name_prefix="metaq-grpc")
        stack.callback(executor.shutdown, wait=False)
        self.server = grpc.server(
            executor, interceptors=[self.auth.gate()],
            options=[("grpc.max_receive_message_length", self.put_limit),  # a Put's fields fit the allowance
                     ("grpc.max_send_message_length", MAX_GRPC_MESSAGE),
                     ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
                     ("grpc.max_connection_idle_ms", CONNECTION_IDLE_MS),
                     ("grpc.so_reuseport", 0)])
        stack.callback(self._stop_grpc, self.server)
        try:
            self.port = self._listen(f"{cfg.host_name}:{cfg.server_port}")
        except RuntimeError as e:
            raise ConfigError(f"serverPort: cannot listen on {cfg.host_name}:{cfg.server_port}: {e}") from None
        if cfg.data_port >= 0:
            try:
                listener = data_listener(cfg.host_name, cfg.data_port, self.auth, cfg.request_timeout_ms / 1000)
            except OSError as e:
                raise ConfigError(f"dataPort: cannot listen on {cfg.host_name}:{cfg.data_port}: {e}") from None
            stack.callback(self._stop_listener, listener)  # no reply is sent from a segment file once the store closes
            self.data_port = listener.port
            self._data_listener = listener
        if cfg.kafka_port >= 0:
            try:
                listener = kafka_listener(cfg.host_name, cfg.kafka_port, self.auth, cfg.request_timeout_ms / 1000)
            except OSError as e:
                raise ConfigError(f"kafkaPort: cannot listen on {cfg.host_name}:{cfg.kafka_port}: {e} (kafkaPort=0 "
                                  f"takes any free port, -1 turns the Kafka listener off)") from None
            stack.callback(self._stop_listener, listener)
            self.kafka_port = listener.port
            self._kafka_listener = listener
        if cfg.metaq_port >= 0:
            check_security(cfg.security, topic_names(cfg.metaq_anonymous_topics))
            try:
                listener = metaq_listener(cfg.host_name, cfg.metaq_port, self.auth, cfg.request_timeout_ms / 1000)
            except OSError as e:
                raise ConfigError(f"metaqPort: cannot bind {cfg.host_name}:{cfg.metaq_port}: {e}") from None
            stack.callback(self._stop_listener, listener)
            self.metaq_port = listener.port
            self._metaq_listener = listener

    def _start_group(self, stack: contextlib.ExitStack) -> None:
        """With ZooKeeper, the replicated group's parts, built, not started: this member's identity, the
        master's replica manager, the replica's fetcher, the registration and the group member that drives
        them (``_GroupCalls`` is their way back into it)."""
        if not self.uses_zookeeper:
            return
        cfg = self.config
        calls = _GroupCalls()
        self.identity = load_or_create(cfg.data_path, cfg.broker_id, cfg.replica_id)
        self.replicas = ReplicaManager(self.store, self.transactions, cfg.broker_id, cfg.replica_id,
                                       self.identity.uuid, cfg.replica_lag_max_ms / 1000, alter_isr=calls.alter_isr,
                                       on_higher_epoch=calls.higher_epoch_seen, wake=calls.wake,
                                       lease_valid=calls.lease_valid)
        self.fetcher = ReplicaFetcher(self.store, self.transactions, cfg.replica_id, self.identity.uuid,
                                      sync_topics=self._sync_topics, on_fenced=calls.wake,
                                      security=cfg.security.replication_client(),
                                      problem=cfg.security.replication_problem(),
                                      fetch_timeout_s=cfg.replica_lag_max_ms / 1000,
                                      gone_on_master=self._gone_on_master)
        self.registration = BrokerRegistration(
            cfg.zk_connect, cfg.zk_root, cfg.broker_id, self._member_info(),
            {t: self.store.topic_config(t).num_partitions for t in self.store.topics()},
            session_timeout=cfg.zk_session_timeout_ms / 1000, zk_security=cfg.zk_security,
            replica_id=cfg.replica_id, on_registered=self._registered, before_register=self._before_register,
            metaq_uri=None if self.metaq_port is None else broker_uri(cfg.advertised_host, self.metaq_port),
            static_topics=cfg.topics)
        self.group = calls.member = GroupMember(
            self.registration, cfg.zk_root, cfg.broker_id, cfg.replica_id, self.identity.uuid,
            cfg.zk_session_timeout_ms / 1000, node_data=self._member_info, standing=self._standing,
            promote=self._promote, demote=self._demote, follow=self.fetcher.follow, tick=self.replicas.tick,
            unclean=cfg.unclean_election, lag_max_s=cfg.replica_lag_max_ms / 1000, pause=self.fetcher.pause,
            publish=self.registration.update_node, copy=StateCopy(cfg.data_path))

    def _start_handler(self, stack: contextlib.ExitStack) -> None:
        """The request handler every transport calls, and the transports' services on it. Only the master
        settles prepared transactions from their decision records (the resolver, started last)."""
        cfg = self.config
        self.resolver = TransactionResolver(self.transactions, cfg.broker_id, self._resolver_zk)
        if cfg.metrics_port >= 0:
            self.metrics = BrokerMetrics(self)
        host = cfg.advertised_host
        self.handler = RequestHandler(
            self.store, cfg.broker_id, Limits(cfg.max_transfer_size, cfg.max_fetch_wait_ms, self.put_limit),
            self.auth, self.stats, self.disk, create_topic=self.create_topic, transactions=self.transactions,
            add_partitions=self.add_partitions, delete_topic=self.delete_topic, deleting=self._deleting,
            group=self.group, replicas=self.replicas,
            producer_ids=self._new_producer_ids(),
            settle_ahead=self._settle_ahead, observe=self.metrics.observe_rpc if self.metrics else None,
            auto_create_topics=cfg.auto_create_topics, paths=ZkPaths(cfg.zk_root),
            own_addresses=(f"{host}:{self.port}", "" if self.data_port is None else f"{host}:{self.data_port}"))
        service = BrokerService(self.handler)
        pb_grpc.add_BrokerServicer_to_server(service, self.server)
        self.server.add_generic_rpc_handlers((service.raw_handler(), service.lookup_handler(), service.auth_handler(),
                                              deletion_service(self.auth, self.handler, lambda: self.deletions)))
        if self.uses_zookeeper:  # what clients keep in ZooKeeper, through the broker and its ACL checks
            self.server.add_generic_rpc_handlers((
                GroupOffsetsService(self.auth, self._groups_zk, cfg.zk_root).handler(),
                GroupListingService(self.auth, self._groups_zk, cfg.zk_root).handler(),
                SinkDecisionsService(self.auth, self._groups_zk, cfg.zk_root).handler()))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self.server)
        if self.data_port is not None:
            self.data_server = DataServer(self.handler, self._data_listener, replicated=self.replicas is not None)
        if self._metaq_listener is not None:
            largest = max([cfg.topic_defaults.max_message_size] +  # a put body over it is refused unread
                          [self.store.topic_config(t).max_message_size for t in self.store.topics()])
            self.metaq_server = MetaqServer(self.handler, self._metaq_listener, largest,
                                            topic_names(cfg.metaq_anonymous_topics))

    def _start_serving(self, stack: contextlib.ExitStack) -> None:
        """gRPC, the data port and the metrics port serve (their stops are on the stack since they listen)."""
        cfg = self.config
        self.server.start()
        self._grpc_started = True
        if self.data_server is not None:
            self.data_server.start()
        if self.metaq_server is not None:
            self.metaq_server.start()
        if self.metrics is not None:
            stack.callback(self.metrics.stop)  # before the store closes: scrapes read it
            self.metrics_port = self.metrics.start(cfg.host_name, cfg.metrics_port, self.auth)

    def _start_cluster(self, stack: contextlib.ExitStack) -> None:
        """Registered in ZooKeeper, the group member started (a master settles, a replica copies), and its
        first role awaited. Undone in reverse: the member (a master resigns, another takes over at once, not
        after the session timeout), the fetcher, then the registration (its nodes, its session)."""
        if not self.uses_zookeeper:
            return
        cfg = self.config
        stack.callback(self.registration.stop)
        self.registration.start()
        stack.callback(self.fetcher.stop)
        self.deletions = TopicDeletions(self._zk_if_connected, ZkPaths(cfg.zk_root), cfg.broker_id,
                                        topics=self.store.topics, delete_here=self._delete_topic_here,
                                        publishes=lambda: self.registration.publish_topics)
        stack.callback(self.deletions.stop)
        self.deletions.start()
        stack.callback(self.group.stop)
        self.group.start()
        role = self.group.wait_role(max(5.0, 2 * cfg.zk_session_timeout_ms / 1000))
        if role not in ("master", "replica"):
            log.warning("group %d member %d has no role yet: no master is alive and this member may not "
                        "stand (see metaq brokers)", cfg.broker_id, cfg.replica_id)

    def _start_kafka(self, stack: contextlib.ExitStack) -> None:
        """The Kafka listener serves (it listens since the listeners stage, so its port is registered): with
        ZooKeeper, from the cluster cache and with the consumer groups' coordinator; without, from this
        broker's own topics (no groups). Stopped before the groups and the cache it calls."""
        if self._kafka_listener is None:
            return
        cfg = self.config
        groups = None
        if self.uses_zookeeper:
            cache = KafkaClusterCache(self.registration.client, cfg.zk_root)
            stack.callback(cache.close)
            cluster = cache.snapshot
            groups = KafkaGroups(self._groups_zk, cfg.zk_root, cfg.broker_id, cluster,
                                 coordinating=self._serves_clients).start()
            stack.callback(groups.close)
            cache.on_change(groups.cluster_changed)
        else:
            cluster = self._static_cluster
        self.kafka_server = KafkaServer(self.handler, self._kafka_listener, cluster, groups,
                                        auto_create=cfg.auto_create_topics, config=cfg, deletions=self.deletions)
        stack.callback(self._stop_listener, self._kafka_listener)
        self.kafka_server.start()

    def _serves_clients(self) -> bool:
        """This member is its group's master (or the broker has no group): it coordinates Kafka groups."""
        try:
            self.handler.gate()
        except NotMasterError:
            return False
        return True

    def _static_cluster(self):
        """The cluster of a broker without ZooKeeper, as Kafka clients see it (``kafka_metadata.static_snapshot``)."""
        topics = {t: self.store.topic_config(t).num_partitions for t in self.store.topics()}
        ids = {t: kafka_metadata.topic_id_of(self.store.partition(t, 0).identity) for t in topics}
        return kafka_metadata.static_snapshot(self.config.broker_id, self.config.advertised_host, self.kafka_port,
                                              topics, ids, f"metaq-{self.config.broker_id}")

    def _start_bridge(self, stack: contextlib.ExitStack) -> None:
        """With ZooKeeper and metaqPort: group offsets kept in metaq's and MetaQ's forms (``OffsetBridge``),
        stopped before the store closes (it reads the logs)."""
        if not (self.uses_zookeeper and self.metaq_port is not None):
            return
        cfg = self.config
        self.offset_bridge = OffsetBridge(self.store, cfg.broker_id, cfg.zk_root, self._groups_zk,
                                          lambda: self.is_master)
        stack.callback(self.offset_bridge.stop)
        self.offset_bridge.start()

    def _start_resolver(self, stack: contextlib.ExitStack) -> None:
        stack.callback(self.resolver.stop)
        self.resolver.start()

    def _stop_grpc(self, server) -> None:
        """Refuse new calls, let running ones finish (``_grace``). A server never started is started first:
        gRPC frees the port of a server only once it ran."""
        if not self._grpc_started:
            server.start()
        server.stop(self._grace).wait()

    def _stop_listener(self, listener: Listener) -> None:
        listener.stop(self._grace)

    def _lock_data(self, data: Path) -> None:
        """Lock ``<dataPath>/replication/lock`` for this process's life: a second broker on the same data is
        refused, and ``instance`` (boot id, device, inode of the locked file) goes into this member's nodes,
        so that a restart can take over the nodes its crashed run's session still holds
        (``_take_over_stale_nodes``): whoever holds this lock knows that run is dead."""
        directory = data / MEMBER_DIRECTORY
        make_dirs(directory)
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(f"dataPath {data} is in use by another running broker (pid {holder}, holding "
                              f"{directory / LOCK_FILE}): give this one its own dataPath") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        try:
            with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
                boot = f.read().strip()
        except OSError:
            return  # no boot id: no proof that a stale run is dead, so never take its nodes over
        st = os.fstat(fd)
        self.instance = f"{boot}:{st.st_dev}:{st.st_ino}"

    def _unlock_data(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def _before_register(self, client) -> None:
        """Consumer groups and decision records get the ACL that lets the clients' identity in (zk.client.auth,
        zk/session.py), nodes an earlier start made included; then stale nodes of a crashed run go."""
        changed = share_client_nodes(client, self.config.zk_root, self.config.zk_security)
        if changed:
            log.info("gave %d consumer-group and decision-record nodes the ACL of zk.auth and zk.client.auth", changed)
        self._take_over_stale_nodes(client)

    def _take_over_stale_nodes(self, client) -> None:
        """A restart right after a crash (``kill -9``): the crashed run's ZooKeeper session still holds this
        member's node and, if it was master, ``/brokers/ids/<b>``, and ZooKeeper drops them only after
        ``zk.sessionTimeout``. They carry that run's ``instance``; when it is ours, that run held the lock we
        hold now, so it is dead: delete them and go on at once (for a group of one: master again at once).
        A process sharing our uuid through a copied data directory has another instance: its nodes stay,
        and this member waits for them (or is refused) as before."""
        if self.instance is None:
            return
        cfg = self.config
        try:
            taken = zk_groups.take_over_stale(client, ZkPaths(cfg.zk_root), cfg.broker_id, cfg.replica_id,
                                              self.identity.uuid, self.instance)
        except Exception as e:  # noqa: BLE001 - only a shortcut: registration waits for the old session instead
            log.warning("could not check for nodes of this member's previous run: %s", e)
            return
        for path, session in taken:
            log.warning("took over %s from ZooKeeper session 0x%x, this member's previous run (dead: this "
                        "process holds its data directory's lock), instead of waiting for the session to expire",
                        path, session)

    def _member_info(self) -> dict:
        """The member node's JSON (and, plus ``replicaId``, the master node's): addresses (``host`` is
        ``advertisedHostName``, for every listener) and what an election of a group without state compares."""
        cfg = self.config
        last_epoch, log_end = self._standing()
        return {"host": cfg.advertised_host, "port": self.port, "brokerId": cfg.broker_id, "version": __version__,
                "securityProtocol": cfg.security.protocol, "replicaId": cfg.replica_id, "uuid": self.identity.uuid,
                # clients without a ZooKeeper identity then commit offsets and decisions through brokers
                **({"zkAcl": True} if cfg.zk_security.digest else {}),
                "lastEpoch": last_epoch, "logEnd": log_end,
                **({"instance": self.instance} if self.instance is not None else {}),
                **({"dataPort": self.data_port} if self.data_port is not None else {}),
                **({"metaqPort": self.metaq_port} if self.metaq_port is not None else {}),
                **({"kafkaPort": self.kafka_port} if self.kafka_port is not None else {})}

    def _standing(self) -> tuple:
        parts = self.store.all_partitions()
        return (max([p.last_epoch for p in parts], default=0), sum(p.log_end_offset for p in parts))

    def _new_producer_ids(self) -> ProducerIds:
        cfg = self.config
        self.producer_ids = ProducerIds(
            cfg.broker_id, cfg.data_path, self._groups_zk if self.uses_zookeeper else None, cfg.zk_root,
            in_use=lambda: [pid for p in self.store.all_partitions() for pid in p.producer_ids()])
        return self.producer_ids

    def _registered(self) -> None:
        """Registered in ZooKeeper (again): the group looks at its roles, and the producer id floor is made
        known (after ZooKeeper lost its data, no broker may give out ids this one's partitions use)."""
        if self.group is not None:
            self.group.wake()
        try:
            self.producer_ids.publish_floor()
        except Exception as e:  # noqa: BLE001 - a later block is still taken above this broker's floor
            log.warning("could not write the producer id floor to ZooKeeper: %s", e)

    def _promote(self, state) -> None:
        """Become master of ``state.epoch``: stop copying, stamp the epoch in the log (the first append of
        each partition writes its marker), settle what the journal says, then serve. A group of one stamps
        nothing (its offsets stay dense) until a replica first fetches (``ReplicaManager``): offsets before
        the first stamp are epoch 0 on every member, since a replica copies them from this log."""
        self.fetcher.pause()
        if len(set(state.replicas)) > 1:  # a group that never had a second member needs no epoch in its log
            self.store.begin_epoch(state.epoch, self.config.replica_id)
        self.transactions.promote()
        self.replicas.activate(state.epoch, dict(state.isr), self.fetcher.learned_hw)
        self.registration.set_publishing(True)
        if self.resolver is not None:
            self.resolver.wake()  # what this member holds in doubt may be decided: settle it now

    def _settle_ahead(self, partitions) -> None:
        """Before a commit or rollback is answered: settle the older in-doubt transactions of its partitions
        whose decision is recorded (``TransactionResolver.settle_ahead``); ZooKeeper trouble only delays
        that to the resolver's next round."""
        try:
            self.resolver.settle_ahead(partitions)
        except Exception as e:  # noqa: BLE001 - the resolver's rounds settle them anyway
            log.warning("could not settle in-doubt transactions ahead of a commit now: %s", e)

    def _demote(self, why: str) -> None:
        self.replicas.deactivate()
        self.transactions.follow()
        self.registration.set_publishing(False)  # MetaQ's master nodes go (metaq's own went with the election)

    def _replicas_caught_up(self) -> bool:
        """Every other in-sync member has fetched the whole log, durably, and the whole journal (the
        graceful hand-over waits for this before resigning)."""
        rm = self.replicas
        ends = [((p.topic, p.partition), p.log_end_offset) for p in self.store.all_partitions()]
        for r in set(rm.isr) | set(rm.ack_set):
            if r == self.config.replica_id:
                continue
            prog = rm.progress.get(r)
            if prog is None or prog.journal_applied < self.transactions.journal_seq:
                return False
            if any(prog.durable.get(key, -1) < end for key, end in ends):
                return False
        return True

    def _sync_topics(self, master: dict, link) -> int:
        """Create here the topics the master has and this replica lacks, asked over the master's gRPC through
        ``link`` (the fetcher's ``MasterLink``: TLS and the SASL session as the replica fetch); returns how
        many were created or grown. With ACLs the member's principal needs Describe on the topics."""
        stub = pb_grpc.BrokerStub(link.channel)
        changed = 0
        try:
            listed = stub.ListTopics(pb.ListTopicsRequest(), timeout=10, metadata=link.metadata())
            for summary in listed.topics:
                if self._deleting(summary.topic):
                    continue  # deleted here, or soon: never copied back
                have = summary.topic in self.store.topics()
                if have and self.store.topic_config(summary.topic).num_partitions >= summary.num_partitions:
                    continue
                if have:
                    log.info("replica: growing topic %s to %d partitions as the master has it", summary.topic,
                             summary.num_partitions)
                    self.add_partitions(summary.topic, summary.num_partitions)
                else:
                    desc = stub.DescribeTopic(pb.TopicRequest(topic=summary.topic), timeout=10,
                                              metadata=link.metadata())
                    log.info("replica: creating topic %s (%d partitions) as the master has it", summary.topic,
                             summary.num_partitions)
                    self.create_topic(summary.topic, summary.num_partitions, dict(desc.config))
                changed += 1
        except grpc.RpcError as e:
            raise to_error(e, link.address) from None  # PERMISSION_DENIED etc. as metaq errors, told in words
        return changed

    @property
    def is_master(self) -> bool:
        return self.group is None or self.group.role == MASTER

    def _resolver_zk(self):
        return self._zk_if_connected() if self.is_master else None

    def _warn_about_exposure(self, data: Path) -> None:
        """Before anything is served: what below ``dataPath`` others could read is narrowed to 0700/0600
        (store/durable.py); a ``dataPath`` open to others, a private key others may read, and users or ACLs
        in a ZooKeeper without ``zk.auth`` are warned about, once, naming the fix."""
        cfg = self.config
        narrowed = restrict_tree(data)
        if narrowed:
            log.warning("narrowed %d files and directories below %s to 0600/0700: group or others could read "
                        "them (written by an older version or under a wider umask)", narrowed, data)
        mode = open_to_others(data)
        if mode:
            log.warning("dataPath %s is open to group or others (mode %s); what the broker keeps below it is "
                        "0700/0600, but its listing names every topic: chmod 700 %s", data, mode, data)
        for key, path in (("ssl.key.location", cfg.security.key_location),
                          ("zk.ssl.key.location", cfg.zk_security.key_location)):
            problem = private_key_warning(key, path)
            if problem:
                log.warning("%s", problem)
        sec = cfg.security
        if (sec.uses_sasl or sec.authorizer == "acl") and self.uses_zookeeper and not cfg.zk_security.digest:
            log.warning("%s keeps users and ACLs in ZooKeeper, but zk.auth is not set: anyone who reaches "
                        "ZooKeeper at %s can add a user or grant itself any ACL. Set zk.auth (docs/security.md, "
                        "section 6)", "security.protocol SASL_SSL" if sec.uses_sasl else "authorizer=acl",
                        cfg.zk_connect)

    def max_put_bytes(self) -> int:
        """The largest put request this broker takes, on the data port and over gRPC (``rawput.SPLIT_BYTES``
        says why): max(maxTransferSize, the largest maxMessageSize, SPLIT_BYTES) + the header's allowance.
        A topic created later may not ask for a larger maxMessageSize (``create_topic``)."""
        cfg = self.config
        sizes = [cfg.max_transfer_size, cfg.topic_defaults.max_message_size, rawput.SPLIT_BYTES]
        sizes += [self.store.topic_config(t).max_message_size for t in self.store.topics()]
        return max(sizes) + rawput.HEADER_ALLOWANCE

    def _groups_zk(self):
        """The ZooKeeper session group offsets are written with (None while ZooKeeper is away)."""
        if self._security_zk is not None:
            return self._security_zk if self._security_zk.connected else None
        return self._zk_if_connected()

    def _listen(self, address: str) -> int:
        """The gRPC port, with TLS (the same PEM files as the data port) unless PLAINTEXT."""
        sec = self.config.security
        if not sec.uses_tls:
            return self.server.add_insecure_port(address)
        key, chain = (read_pem(k, path) for k, path in (("ssl.key.location", sec.key_location),
                                                         ("ssl.certificate.location", sec.certificate_location)))
        self.auth.data_port_context()  # a key that does not fit its certificate fails here, naming the files
        required = sec.client_auth == "required"
        root = read_pem("ssl.ca.location", sec.ca_location) if required else None
        return self.server.add_secure_port(address, grpc.ssl_server_credentials([(key, chain)], root, required))

    def _write_health(self, full: bool) -> None:
        self._health.set(WRITE_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING if full
                         else health_pb2.HealthCheckResponse.SERVING)

    def open_transactions(self) -> dict:
        """Transactions by state (open, prepared, committing), for the metrics."""
        return self.transactions.counts() if self.transactions is not None else {}

    def _zk_if_connected(self):
        r = self.registration
        return r.client if r is not None and r.connected else None

    def wait(self) -> None:
        # Wake now and then: a signal that the kernel hands to another thread (it may, e.g. under strace)
        # runs its Python handler only when the main thread next runs bytecode.
        while not self._stopped.wait(0.5):
            pass

    # -- topics ---------------------------------------------------------------------------------------
    def _runtime_topics_path(self) -> Path:
        return Path(self.config.data_path) / RUNTIME_TOPICS_FILE

    def _runtime_topics(self) -> dict:
        path = self._runtime_topics_path()
        if not path.exists():
            return {}
        parser = configparser.ConfigParser(interpolation=None)
        parser.optionxform = str
        parser.read(path, encoding="utf-8")
        return {s[len("topic="):]: topic_config_from(self.config.topic_defaults, dict(parser[s]), f"{path} [{s}]")
                for s in parser.sections() if s.startswith("topic=")}

    def create_topic(self, topic: str, num_partitions: Optional[int], overrides: dict):
        """Create a topic at runtime: stored, remembered in the data directory, registered in ZooKeeper."""
        validate_topic_name(topic)
        settings = dict(overrides)
        if num_partitions:
            settings["numPartitions"] = str(num_partitions)
        config = topic_config_from(self.config.topic_defaults, settings, f"topic {topic!r}")
        limit = self.put_limit
        if limit and config.max_message_size + rawput.HEADER_ALLOWANCE > limit:
            raise ConfigError(f"topic {topic!r}: maxMessageSize {config.max_message_size} is over what this broker "
                              f"takes in one put ({limit - rawput.HEADER_ALLOWANCE} bytes: the largest of "
                              f"maxTransferSize, {rawput.SPLIT_BYTES} and the maxMessageSize of its topics at "
                              f"start); raise maxTransferSize")
        with self._topic_lock:
            created = topic not in self.store.topics()
            if created and self._deleting(topic):
                raise InvalidTopicError(f"topic {topic!r} is being deleted; create it again once its deletion is "
                                        f"done (it is gone from Metadata and `metaq topics`)")
            config = self.store.create_topic(topic, config)
            if created:
                if self.replicas is not None:
                    self.replicas.topic_created(topic)
                self._remember_topic(topic, config)
        if created and self.registration is not None:
            self.registration.add_topic(topic, config.num_partitions)
        return config

    def add_partitions(self, topic: str, num_partitions: int):
        """Grow a topic of this broker to ``num_partitions`` at runtime (Kafka's CreatePartitions): the new
        partitions stored, the count remembered in the data directory, published in ZooKeeper (where Kafka
        numbers them after the ones the topic has); a group's members grow as they copy (``_sync_topics``)."""
        with self._topic_lock:
            have = self.store.topic_config(topic).num_partitions
            config = self.store.add_partitions(topic, num_partitions)
            if config.num_partitions == have:
                return config
            if self.replicas is not None:
                self.replicas.topic_created(topic, range(have, config.num_partitions))
            self._remember_topic(topic, config)
        log.info("topic %s grown from %d to %d partitions", topic, have, config.num_partitions)
        if self.registration is not None:
            self.registration.add_topic(topic, config.num_partitions)
        return config

    # -- deleting topics (server/topic_deletion.py) ----------------------------------------------------
    def delete_topic(self, topic: str, requested_by: str) -> None:
        """Record ``topic``'s deletion (the request: any member may take it): every broker then deletes its
        copy, and the record is gone once no broker has the topic (``deletions.wait_done``). A topic some
        broker's server.ini configures is refused (it would come back at that broker's restart)."""
        cfg = self.config
        validate_topic_name(topic)
        if topic in cfg.topics:
            raise ConfigError(f"topic {topic!r} is configured in broker {cfg.broker_id}'s configuration file "
                              f"{cfg.source or '(server.ini)'} ([topic={topic}]): it would come back at that broker's "
                              f"restart; remove the section there (and restart it) to delete the topic")
        if self.deletions is None:
            if topic not in self.store.topics():
                raise UnknownTopicError(f"unknown topic {topic!r}")
            if not self._delete_topic_here(topic):
                raise ConfigError(f"topic {topic!r} cannot be deleted now: {self._postponed.get(topic)}")
            return
        zk = self._zk_if_connected()
        if zk is None:
            raise NotMasterError(f"not master: broker {cfg.broker_id} has no ZooKeeper session now to record the "
                                 f"deletion of {topic!r}; retry")
        paths = ZkPaths(cfg.zk_root)
        if topic not in self.store.topics() and not topic_entries.partition_counts(zk, paths, topic) \
                and not self._deleting(topic):
            raise UnknownTopicError(f"unknown topic {topic!r}")
        static = topic_entries.static_brokers(zk, paths, topic)
        if static:
            raise ConfigError(f"topic {topic!r} is configured in the configuration file (server.ini, "
                              f"[topic={topic}]) of broker(s) {', '.join(map(str, static))}: it would come back at "
                              f"their restart; remove the section there (and restart them) to delete the topic")
        self.deletions.record(zk, topic, requested_by, self.registration.acl)
        log.info("deletion of topic %s recorded (asked by %s)", topic, requested_by)

    def _deleting(self, topic: str) -> bool:
        return self.deletions is not None and self.deletions.is_pending(topic)

    def _delete_topic_here(self, topic: str) -> bool:
        """Delete this member's copy of ``topic``: forgotten by runtime-topics.ini, its partitions removed
        from the store (crash-safe, ``MessageStore.delete_topic``), its entry unpublished. False while it
        must wait: a transaction that has batches in it is still live (it ends by its commit, rollback or
        timeout; puts to the topic are refused meanwhile), or this broker's server.ini configures it."""
        why = None
        xids = self.transactions.on_topic(topic) if self.transactions is not None else []
        if topic in self.config.topics:
            why = (f"it is configured in {self.config.source or 'server.ini'} ([topic={topic}]): remove the section "
                   f"and restart this broker")
        elif xids:
            why = f"{len(xids)} transaction(s) with batches in it are not settled yet ({', '.join(xids[:3])})"
        if why is not None:
            if self._postponed.get(topic) != why:
                log.warning("topic %s: its deletion on broker %d waits: %s", topic, self.config.broker_id, why)
            self._postponed[topic] = why
            return False
        self._postponed.pop(topic, None)
        with self._topic_lock:
            if topic not in self.store.topics():
                return True
            self._forget_topic(topic)  # first: after a crash from here on, the record finishes the deletion
            with self.fetcher.applying() if self.fetcher is not None else contextlib.nullcontext():
                self.store.delete_topic(topic)
            if self.replicas is not None:
                self.replicas.topic_deleted(topic)
        self.stats.forget_topic(topic)
        if self.handler is not None:
            self.handler.topic_deleted(topic)
        if self.registration is not None:
            self.registration.remove_topic(topic)
        return True

    def _gone_on_master(self, topics: list) -> None:
        """A replica's fetcher found that the master has none of ``topics``: each whose deletion is recorded,
        or that has no entry of this group any more (deleted while this member was away, the record finished
        since), is deleted here too. Asked of ZooKeeper at most every few seconds per topic."""
        zk = self._zk_if_connected()
        if zk is None:
            return
        now = time.monotonic()
        paths = ZkPaths(self.config.zk_root)
        for topic in topics:
            if now - self._checked_gone.get(topic, -10.0) < 5.0:
                continue
            self._checked_gone[topic] = now
            try:
                gone = self._deleting(topic) or not zk.exists(paths.topic_entry(topic, self.config.broker_id))
            except Exception as e:  # noqa: BLE001 - asked again next time
                log.debug("could not check topic %s in ZooKeeper: %s", topic, e)
                continue
            if gone and topic not in self.config.topics:
                log.warning("topic %s: the master has none of it and no deletion keeps it: deleted here too", topic)
                self._delete_topic_here(topic)

    def _forget_topic(self, topic: str) -> None:
        self._write_runtime_topics(lambda parser: parser.remove_section(f"topic={topic}"))

    def _remember_topic(self, topic: str, config) -> None:
        self._write_runtime_topics(lambda parser: parser.__setitem__(f"topic={topic}", topic_ini_values(config)))

    def _write_runtime_topics(self, change) -> None:
        path = self._runtime_topics_path()
        parser = configparser.ConfigParser(interpolation=None)
        parser.optionxform = str
        if path.exists():
            parser.read(path, encoding="utf-8")
        change(parser)
        text = io.StringIO()
        parser.write(text)
        replace_file(path, text.getvalue().encode("utf-8"))


def _close_zookeeper(client) -> None:
    client.stop()
    client.close()
