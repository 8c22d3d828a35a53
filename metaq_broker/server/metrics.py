"""Prometheus metrics of one broker, served over HTTP on ``metricsPort`` (docs/metrics.md lists them).

Each broker has its own registry, so several brokers in one process (tests, benchmarks) never mix their
numbers. Apart from the RPC latency histogram, which the service feeds, nothing is counted on the hot
paths: a collector reads what the broker already keeps (``BrokerStats``, the partitions, the ZooKeeper
client) when Prometheus scrapes.

With security on (docs/security.md, "The metrics port") the port is no back door: under ``SSL`` and
``SASL_SSL`` it serves HTTPS with the broker's certificate, and a scraper logs in with HTTP basic
authentication against the SCRAM users (``SASL_SSL`` with PLAIN enabled: the broker's own PLAIN check) or
presents a client certificate (``ssl.client.auth=required``); under ``PLAINTEXT`` with ``authorizer=acl``
it listens on loopback only. Either way a scrape shows only the topics and groups its principal may
``Describe``, as ``ListTopics`` does."""
from __future__ import annotations

import base64
import binascii
import logging
import ssl
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from kazoo.exceptions import KazooException
from prometheus_client import CollectorRegistry, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from metaq_broker import __version__
from metaq_broker.errors import AuthenticationError, ConfigError, MetaqError
from metaq_broker.names import parse_partition_name, partition_name
from metaq_broker.security import tls
from metaq_broker.server.disk import free_space
from metaq_broker.server.member_role import ELECTING, MASTER, REPLICA
from metaq_broker.zk.group_offsets import GroupOffsetWatcher

log = logging.getLogger(__name__)

# Fetch latencies include long-poll waits (up to maxFetchWait), hence the long tail of buckets.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ZK_STATES = ("connected", "suspended", "lost", "connecting", "disabled")
ROLES = (MASTER, REPLICA, ELECTING)
PARTITION = ["topic", "partition"]
GROUP_PARTITION = ["group", "topic", "partition"]

# metric (without _total) -> (PartitionCounters field of stats.py, help)
STATS_COUNTERS = {
    "metaq_messages_in": ("put_messages", "Messages appended"),
    "metaq_bytes_in": ("put_bytes", "Batch body bytes appended (as sent by producers)"),
    "metaq_put_requests": ("puts", "Put calls that stored a batch"),
    "metaq_put_failures": ("put_failures", "Put calls refused or failed"),
    "metaq_messages_out": ("get_messages", "Messages fetched"),
    "metaq_bytes_out": ("get_bytes", "Stored batch bytes sent by fetches"),
    "metaq_fetch_requests": ("gets", "Fetch calls answered, empty ones included"),
    "metaq_fetch_misses": ("get_misses", "Fetch calls that found no new message"),
    "metaq_fetch_failures": ("get_failures", "Fetch calls refused or failed"),
}


class BrokerMetrics:
    """The registry, RPC latency histogram and HTTP endpoint of one ``Broker``."""

    def __init__(self, broker):
        self.registry = CollectorRegistry()
        self.rpc_latency = Histogram("metaq_rpc_latency_seconds", "Time to serve a gRPC call, by method",
                                     ["method"], registry=self.registry, buckets=LATENCY_BUCKETS)
        self._latency = {}  # method -> histogram child: .labels() takes a lock, a dict lookup does not
        self.registry.register(BrokerCollector(broker))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.server = self.thread = None
        self.port = None

    def observe_rpc(self, method: str, seconds: float) -> None:
        child = self._latency.get(method)
        if child is None:
            child = self._latency.setdefault(method, self.rpc_latency.labels(method))
        child.observe(seconds)

    def start(self, host: str, port: int, auth=None) -> int:
        """Serve ``/metrics`` on host:port (0: any free port); returns the port. ``auth`` (the broker's
        ``BrokerAuth``) decides TLS, the login, the address and what each scraper sees (module docstring)."""
        security = auth.security if auth is not None and auth.enabled else None
        if security is not None and not security.uses_tls:
            host = LOOPBACK  # PLAINTEXT with ACLs: no way to log in over plaintext, so only this machine
        try:
            self.server = MetricsServer((host, port), self.registry, auth if security is not None else None)
        except OSError as e:
            raise ConfigError(f"metricsPort: cannot listen on {host}:{port}: {e}") from None
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                       name="metaq-metrics-http", daemon=True)
        self.thread.start()
        self.port = self.server.server_port
        log.info("Prometheus metrics at %s://%s:%d/metrics%s", "https" if self.server.tls else "http", host,
                 self.port, f" ({self.server.login_note})" if security is not None else "")
        return self.port

    def stop(self) -> None:
        """Stop serving and close the listening socket, so the port is free when this returns."""
        server, self.server = self.server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            self.thread.join()


LOOPBACK = "127.0.0.1"
HTTP_TIMEOUT_S = 10.0  # a scrape's TLS handshake and request must arrive within this (slow senders)
REALM = 'Basic realm="metaq metrics", charset="UTF-8"'


class MetricsServer(ThreadingHTTPServer):
    """The ``/metrics`` endpoint: ``auth`` None serves everything to everyone (security off); else TLS
    when the broker speaks it, a login where one is possible, and a view filtered by the scraper's
    ``Describe`` rights. The TLS handshake runs in the request's own thread, never in the accept loop."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, registry, auth=None):
        self.registry, self.auth = registry, auth
        sec = auth.security if auth is not None else None
        self.tls = sec is not None and sec.uses_tls
        self.basic = sec is not None and sec.uses_sasl and "PLAIN" in sec.mechanisms
        self.certificates = sec is not None and sec.client_auth == "required"
        super().__init__(address, MetricsHandler)
        if self.tls:
            self.socket = auth.data_port_context().wrap_socket(self.socket, server_side=True,
                                                               do_handshake_on_connect=False)

    @property
    def login_note(self) -> str:
        ways = [w for w, on in (("HTTP basic authentication as a SASL user", self.basic),
                                ("a client certificate", self.certificates)) if on]
        return ("log in with " + " or ".join(ways)) if ways else \
            "no login possible: scrapers are User:ANONYMOUS" + ("" if self.tls else ", loopback only")

    def principal(self, handler: "MetricsHandler") -> Optional[str]:
        """Who scrapes: the basic-auth user, else the client certificate's principal, else ANONYMOUS where
        no login is possible; None when a login is required and was not given or failed."""
        if self.auth is None:
            return tls.ANONYMOUS
        header = handler.headers.get("Authorization", "")
        if self.basic and header[:6].lower() == "basic ":
            try:
                user, sep, password = base64.b64decode(header[6:].strip(), validate=True).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return None
            if not sep:
                return None
            try:  # the broker's PLAIN login: its credential check, its concurrency limit, its failure count
                return self.auth.authenticate({"mechanism": "PLAIN", "message": f"\0{user}\0{password}"})["principal"]
            except AuthenticationError as e:
                log.debug("metrics login of %r refused: %s", user, e)
                return None
        if self.certificates:
            try:  # the one rule every port maps a certificate by (ssl.principal.mapping.rules)
                return self.auth.principal_of_certificate(handler.request.getpeercert(binary_form=True))
            except AuthenticationError as e:
                log.debug("metrics: client certificate refused: %s", e)
                return None
        return None if self.basic else tls.ANONYMOUS

    def handle_error(self, request, client_address) -> None:
        log.debug("metrics request from %s failed", client_address, exc_info=True)  # a failed handshake, a reset


class MetricsHandler(BaseHTTPRequestHandler):
    server: MetricsServer
    server_version = "metaq-metrics"

    def setup(self) -> None:
        self.request.settimeout(HTTP_TIMEOUT_S)
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()
        super().setup()

    def log_message(self, fmt, *args) -> None:
        log.debug("metrics %s " + fmt, self.address_string(), *args)

    def _reply(self, status: int, body: bytes, ctype: str = "text/plain; charset=utf-8", extra=()) -> None:
        self.send_response(status)
        for key, value in (("Content-Type", ctype), ("Content-Length", str(len(body))), *extra):
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.split("?", 1)[0] not in ("/", "/metrics"):
            return self._reply(HTTPStatus.NOT_FOUND, b"not found: scrape /metrics\n")
        principal = self.server.principal(self)
        if principal is None:
            return self._reply(HTTPStatus.UNAUTHORIZED, b"log in: HTTP basic authentication as a SASL user\n",
                               extra=(("WWW-Authenticate", REALM),))
        registry = self.server.registry if self.server.auth is None else Visible(self.server.registry,
                                                                                 self.server.auth, principal)
        encoder, ctype = choose_encoder(self.headers.get("Accept", ""))
        self._reply(HTTPStatus.OK, encoder(registry), ctype)


class Visible:
    """The samples of ``registry`` that ``principal`` may see: one labelled with a topic or a group only
    if the principal may ``Describe`` it (a group's lag needs both). One check per name and scrape."""

    def __init__(self, registry, auth, principal: str):
        self.registry, self.auth, self.principal = registry, auth, principal
        self._seen: dict = {}

    def _may(self, resource_type: str, name: Optional[str]) -> bool:
        if name is None:
            return True
        key = (resource_type, name)
        if key not in self._seen:
            self._seen[key] = self.auth.allows(self.principal, "Describe", resource_type, name)
        return self._seen[key]

    def collect(self):
        for family in self.registry.collect():
            samples = [s for s in family.samples
                       if self._may("topic", s.labels.get("topic")) and self._may("group", s.labels.get("group"))]
            if len(samples) == len(family.samples):
                yield family
                continue
            kept = Metric(family.name, family.documentation, family.type, family.unit)
            kept.samples = samples
            yield kept


class BrokerCollector:
    """Reads a broker's state at scrape time (nothing is added to the hot paths)."""

    def __init__(self, broker):
        self.broker = broker
        self._lag_lock = threading.Lock()
        self._offsets = None  # GroupOffsetWatcher, made with the broker's first ZooKeeper session

    def collect(self):
        b = self.broker
        bid = b.config.broker_id
        info = GaugeMetricFamily("metaq_broker_info", "Broker id and version (value 1)",
                                 labels=["broker_id", "version"])
        info.add_metric([str(bid), __version__], 1)
        yield info
        yield GaugeMetricFamily("metaq_uptime_seconds", "Seconds since the broker started", value=b.stats.uptime())
        yield from self._partitions(b, bid)
        yield from self._disk(b)
        yield from self._zookeeper(b)
        yield from self._group_lag(b, bid)
        yield from self._replication(b)
        yield from self._security(b)
        txn = GaugeMetricFamily("metaq_open_transactions", "Open transactions, by state", labels=["state"])
        for state, n in b.open_transactions().items():
            txn.add_metric([state], n)
        yield txn

    @staticmethod
    def _partitions(b, bid):
        store = b.store
        counters = {name: CounterMetricFamily(name, help_, labels=PARTITION)
                    for name, (_, help_) in STATS_COUNTERS.items()}
        gauges = {
            "segments": GaugeMetricFamily("metaq_segments", "Segment files", labels=PARTITION),
            "disk": GaugeMetricFamily("metaq_disk_bytes", "Bytes in segment files (indexes not counted)",
                                      labels=PARTITION),
            "earliest": GaugeMetricFamily("metaq_earliest_offset", "First offset still stored", labels=PARTITION),
            "latest": GaugeMetricFamily("metaq_latest_offset", "The end of the acknowledged log (visible end)",
                                        labels=PARTITION),
            "stable": GaugeMetricFamily("metaq_last_stable_offset", "Where readers stop: the first offset of "
                                        "the oldest open transaction, else the log end", labels=PARTITION),
        }
        fsyncs = CounterMetricFamily("metaq_fsyncs", "fsyncs that made appends durable", labels=PARTITION)
        fsync_s = CounterMetricFamily("metaq_fsync_seconds", "Time spent in those fsyncs", labels=PARTITION)
        stats = {(s.topic, s.partition): s for s in b.stats.snapshot()}
        for topic in store.topics():
            try:
                parts = store.partitions(topic)
            except MetaqError:  # created this very moment: its partitions are still opening
                continue
            for p in parts:
                labels = [topic, partition_name(bid, p.partition)]
                s = stats.get(tuple(labels))
                for name, (field, _) in STATS_COUNTERS.items():
                    counters[name].add_metric(labels, getattr(s, field) if s is not None else 0)
                gauges["segments"].add_metric(labels, len(p.segments()))
                gauges["disk"].add_metric(labels, p.size_bytes)
                gauges["earliest"].add_metric(labels, p.earliest_offset)
                stable = p.last_stable_offset  # read first: it never passes the visible end read after it
                gauges["latest"].add_metric(labels, p.visible_end)
                gauges["stable"].add_metric(labels, stable)
                fsyncs.add_metric(labels, p.fsync_count)
                fsync_s.add_metric(labels, p.fsync_seconds)
        yield from counters.values()
        yield from gauges.values()
        yield fsyncs
        yield fsync_s

    @staticmethod
    def _disk(b):
        """A full disk: whether the last write hit it, how many writes it refused, the space left."""
        disk = b.disk
        yield GaugeMetricFamily("metaq_disk_full", "1 while the last write found the disk full (ENOSPC)",
                                value=int(disk is not None and disk.full))
        yield CounterMetricFamily("metaq_disk_full_errors", "Writes refused because the disk was full",
                                  value=disk.errors if disk is not None else 0)
        free = GaugeMetricFamily("metaq_data_free_bytes", "Bytes free on the file system of the data directory",
                                 labels=["path"])
        if disk is not None:
            free.add_metric([str(disk.data_path)], free_space(disk.data_path)[0])
        yield free

    @staticmethod
    def _security(b):
        """Refusals: calls the ACLs denied, by operation and resource type; failed SASL logins, by mechanism."""
        denied = CounterMetricFamily("metaq_authorization_denials", "Requests the ACLs refused",
                                     labels=["operation", "resource_type"])
        failed = CounterMetricFamily("metaq_authentication_failures", "SASL logins refused (wrong password, "
                                     "unknown user, malformed exchange)", labels=["mechanism"])
        if b.auth is not None:
            for (operation, resource_type), n in list(b.auth.denied.items()):
                denied.add_metric([operation, resource_type], n)
            for mechanism, n in list(b.auth.failures.items()):
                failed.add_metric([mechanism], n)
        yield denied
        yield failed

    @staticmethod
    def _zookeeper(b):
        reg = b.registration
        if not b.uses_zookeeper:
            state = "disabled"
        elif reg is None:
            state = "connecting"  # before the first session
        else:
            state = str(reg.client.state).lower()  # KazooState: CONNECTED, SUSPENDED, LOST
        yield GaugeMetricFamily("metaq_zookeeper_connected", "1 while the ZooKeeper session is connected",
                                value=int(state == "connected"))
        states = GaugeMetricFamily("metaq_zookeeper_state", "ZooKeeper session state (1 for the current one)",
                                   labels=["state"])
        for s in ZK_STATES:
            states.add_metric([s], int(s == state))
        yield states
        yield CounterMetricFamily("metaq_zookeeper_registrations", "Times the broker (re-)registered in ZooKeeper",
                                  value=reg.registrations if reg is not None else 0)

    @staticmethod
    def _replication(b):
        """A broker group member's role and epoch; on the master, the in-sync set, each replica's lag and
        the under-replicated partitions (Kafka's UnderReplicatedPartitions: all of them while the in-sync
        set is smaller than the group, since it is one set per group). Nothing without ZooKeeper."""
        group, manager, fetcher = b.group, b.replicas, b.fetcher
        role = GaugeMetricFamily("metaq_replication_role", "This member's role in its broker group (1 for the "
                                 "current one)", labels=["role"])
        epoch = GaugeMetricFamily("metaq_replication_epoch", "The broker group's epoch as this member knows it")
        isr = GaugeMetricFamily("metaq_replication_in_sync_replicas", "Members in the group's in-sync set, "
                                "master included")
        lag = GaugeMetricFamily("metaq_replication_replica_lag_messages", "On the master: offsets a replica is "
                                "behind the master's log end, summed over partitions (markers count)",
                                labels=["replica"])
        under = GaugeMetricFamily("metaq_replication_under_replicated_partitions", "On the master: partitions "
                                  "while the in-sync set is smaller than the group")
        elections = CounterMetricFamily("metaq_replication_elections", "Times this member became master")
        shrinks = CounterMetricFamily("metaq_replication_isr_shrinks", "Replicas the master removed from the "
                                      "in-sync set")
        expands = CounterMetricFamily("metaq_replication_isr_expands", "Replicas the master added to the "
                                      "in-sync set")
        truncations = CounterMetricFamily("metaq_replication_truncations", "Partition logs this member cut "
                                          "where they parted from the master's")
        truncated = CounterMetricFamily("metaq_replication_truncated_offsets", "Offsets those cuts removed")
        if group is not None and manager is not None:
            for r in ROLES:
                role.add_metric([r], int(group.role == r))
            state = group.state
            seen = manager.describe()
            epoch.add_metric([], seen["epoch"] if seen["active"] else group.epoch)
            if seen["active"]:
                isr.add_metric([], len(seen["isr"]))
                for r, prog in sorted(seen["replicas"].items()):
                    lag.add_metric([str(r)], prog["lag"])
                group_size = len(set(state.replicas) | set(seen["isr"])) if state is not None else len(seen["isr"])
                under.add_metric([], seen["partitions"] if len(seen["isr"]) < group_size else 0)
            elif state is not None:
                isr.add_metric([], len(state.isr))
            elections.add_metric([], manager.elections)
            shrinks.add_metric([], manager.isr_shrinks)
            expands.add_metric([], manager.isr_expands)
        if fetcher is not None:
            truncations.add_metric([], fetcher.truncations)
            truncated.add_metric([], fetcher.truncated_offsets)
        yield from (role, epoch, isr, lag, under, elections, shrinks, expands, truncations, truncated)

    # -- consumer-group lag ---------------------------------------------------------------------------
    def _committed(self, b, bid) -> dict:
        """``{(group, topic, partition): offset}`` of this broker's partitions; {} without ZooKeeper."""
        reg = b.registration
        if reg is None or not reg.connected:
            return {}  # stale offsets against fresh log ends would show a lag that is not there
        if self._offsets is None or self._offsets.zk is not reg.client:
            self._offsets = GroupOffsetWatcher(reg.client, b.config.zk_root, bid)
        try:
            return self._offsets.offsets()
        except KazooException as e:
            log.debug("group offsets not readable from ZooKeeper now: %s", e)
            return {}

    def _group_lag(self, b, bid):
        """Per group and partition, the Kafka lag exporters' lag in offsets and in seconds. The seconds come
        from the store time of the message at the committed offset, in the offset index."""
        lag = GaugeMetricFamily("metaq_consumergroup_lag", "Last stable offset minus the group's committed "
                                "offset", labels=GROUP_PARTITION)
        lag_s = GaugeMetricFamily("metaq_consumergroup_lag_seconds", "Seconds since the first message not yet "
                                  "consumed by the group was stored (0 when caught up)", labels=GROUP_PARTITION)
        with self._lag_lock:  # scrapes may overlap; the offsets' watcher is this collector's
            # a group's replicas hold the same partitions: only its master reports, so sums stay right
            committed = self._committed(b, bid) if b.is_master else {}
            now_ms = time.time() * 1000
            for (group, topic, name), offset in sorted(committed.items()):
                try:
                    p = b.store.partition(topic, parse_partition_name(name)[1])
                except (MetaqError, ValueError):
                    continue  # a topic or partition this broker does not hold (any more)
                if offset < 0:
                    continue  # not a number: nothing committed that a lag could be measured from
                stable = p.last_stable_offset
                labels = [group, topic, name]
                lag.add_metric(labels, max(stable - offset, 0))
                if offset >= stable:
                    lag_s.add_metric(labels, 0.0)
                    continue
                first = max(offset, p.earliest_offset)  # below it: removed by retention
                try:
                    stored = p.timestamp_at(first)
                except MetaqError as e:  # retention or a roll moved the range meanwhile
                    log.debug("no store time for %s %s offset %d: %s", topic, name, first, e)
                    continue
                lag_s.add_metric(labels, max(now_ms - stored, 0) / 1000)
        yield lag
        yield lag_s
