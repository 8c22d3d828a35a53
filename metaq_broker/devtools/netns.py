"""Several hosts on one machine for partition tests: network namespaces on a bridge, links cut and healed.

Topology. A Linux bridge in the calling (root) namespace carries two of its addresses: the *client*
address (primary, so the source of every connection the test process opens to a member) and the
*zookeeper* address (secondary: where members reach ZooKeeper, which runs in the root namespace and
listens on every address). Each member is a namespace of its own with a veth pair: one end (``eth0``)
holds the member's address, the other hangs on the bridge. Member to member traffic crosses the bridge,
member to ZooKeeper uses the zookeeper address, member to client the client address: three kinds of
link, each of which can be cut alone (a client cut from the master only, a master cut from ZooKeeper only).

Cutting. Each member namespace has an nftables table (``inet mqnem``): a set of cut-off peers and input
and output chains that drop every packet from or to them. ``cut`` adds the peer's address to the set in
the namespace of each member it concerns, ``heal`` removes it. Packets are dropped, not rejected, and the
link stays up, because that is a partition: nobody is told, sends go unanswered, TCP retransmits until a
timeout or the heal, and only timeouts and leases notice. A link set down or a ``blackhole``/``prohibit``
route would fail sends at once with an error (ENETUNREACH, EACCES), a kinder fault. tc could drop as
well, but its drop action (``act_gact``) and ``netem`` are modules many kernels lack (this CI machine's
has neither), while nf_tables is built into Debian's kernels; the rules live in the member's namespace,
so deleting the namespace deletes them.

Cleanup. Names carry the ``mqnem`` prefix (or ``METAQ_NETNS_PREFIX``, up to 5 letters and digits, on
a machine several people share) and the creating process's pid; ``close()`` deletes the namespaces (with
their veth ends and tables) and the bridge, and runs at interpreter exit for a network left open;
``sweep()`` removes what a run that was killed (its pid gone) left behind. Needs root, ``ip`` (iproute2)
and ``nft`` (nftables): ``unavailable()`` says what is missing.
"""
from __future__ import annotations

import atexit
import ipaddress
import itertools
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Optional

from metaq_broker.devtools.broker_process import BrokerProcess
from metaq_broker.devtools.group import BrokerGroup

log = logging.getLogger(__name__)

PREFIX = os.environ.get("METAQ_NETNS_PREFIX", "mqnem")  # link names have 15 characters at most
if not re.fullmatch(r"[a-z][a-z0-9]{0,4}", PREFIX):
    raise ValueError(f"METAQ_NETNS_PREFIX must be 1 to 5 lower-case letters and digits, starting with a letter, "
                     f"got {PREFIX!r}")
CLIENT, ZOOKEEPER = "client", "zookeeper"  # the two hosts in the root namespace
SERVER_PORT, DATA_PORT = 8123, 8124  # every member has an address of its own, so all use the same ports
_RULES = """table inet mqnem {
  set cut { type ipv4_addr; }
  chain input { type filter hook input priority 0; policy accept; ip saddr @cut drop; }
  chain output { type filter hook output priority 0; policy accept; ip daddr @cut drop; }
}
"""
_serial = itertools.count()
_open: "set[Network]" = set()


def _run(*argv: str, check: bool = True, stdin: Optional[str] = None) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def unavailable() -> Optional[str]:
    """Why namespaces cannot be used here (None: they can): not root, ``ip`` or ``nft`` missing, or the
    kernel refuses a namespace or an nftables table in it."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian package {package})"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        r = _run("ip", "netns", "add", probe, check=False)
        if r.returncode:
            return f"cannot create a network namespace: {r.stderr.strip()}"
        r = _run("ip", "netns", "exec", probe, "nft", "-f", "-", stdin=_RULES, check=False)
        if r.returncode:
            return f"nftables does not work in a namespace: {r.stderr.strip()}"
        return None
    finally:
        _run("ip", "netns", "del", probe, check=False)


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def sweep() -> list:
    """Delete the namespaces and links of runs whose process is gone; returns their names."""
    removed = []
    for name in _run("ip", "netns", "list").stdout.split():
        m = re.fullmatch(rf"{PREFIX}-(\d+)-\d+-.+", name)
        if m and not _alive(int(m.group(1))):
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    for line in _run("ip", "-o", "link", "show").stdout.splitlines():
        m = re.match(rf"\d+: ({PREFIX}([0-9a-f]+)x[0-9a-f][0-9a-z])[@:]", line)
        if m and not _alive(int(m.group(2), 16)):
            _run("ip", "link", "del", m.group(1), check=False)
            removed.append(m.group(1))
    return removed


@dataclass(frozen=True)
class Host:
    """A place on the network: ``namespace`` None for the two root-namespace hosts."""

    name: str
    address: str
    namespace: Optional[str]

    def wrap(self, argv=()) -> list:
        """``argv`` run on this host (``ip netns exec <ns> ...``)."""
        return ([] if self.namespace is None else ["ip", "netns", "exec", self.namespace]) + list(argv)


class Network:
    """A bridge with the client and zookeeper addresses, and a namespace per ``add_host``."""

    def __init__(self):
        made = next(_serial)
        serial = made % 16
        self.tag = f"{os.getpid():x}x{serial:x}"  # in every link name (15 characters at most)
        self.bridge = f"{PREFIX}{self.tag}b"
        self._ns_prefix = f"{PREFIX}-{os.getpid()}-{serial}-"
        self.hosts: dict = {}
        self._veths: list = []
        self._cuts: set = set()
        self._closed = False
        subnet = self._free_subnet(made)
        self._addresses = iter(subnet.hosts())
        _open.add(self)
        try:
            # A bridge's own address, fixed: left to the kernel it becomes its lowest port's, and changes when
            # a host added later brings a lower one; members that cached the old one for the client and
            # ZooKeeper then send to another port's address, which the root namespace drops as not its
            # own, until their neighbour entries expire (~30 s: a run's client got no answer from a
            # master while the members reached each other).
            _run("ip", "link", "add", self.bridge, "address", self._bridge_address(made), "type", "bridge")
            for name in (CLIENT, ZOOKEEPER):  # the first address added is the primary: the client's
                address = str(next(self._addresses))
                _run("ip", "addr", "add", f"{address}/{subnet.prefixlen}", "dev", self.bridge)
                self.hosts[name] = Host(name, address, None)
            _run("ip", "link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise
        self._prefixlen = subnet.prefixlen

    @staticmethod
    def _bridge_address(made: int) -> str:
        """A locally administered unicast MAC address, one per network of this process."""
        pid = os.getpid()
        return f"02:6d:{pid >> 16 & 0xff:02x}:{pid >> 8 & 0xff:02x}:{pid & 0xff:02x}:{made & 0xff:02x}"

    @staticmethod
    def _free_subnet(made: int) -> ipaddress.IPv4Network:
        """A /24 in 10.213.0.0/16 that no address or route of this machine uses, and not the one this
        process's previous network had (``made``: how many it made before): a test's hosts never reuse the
        addresses of the test before, so nothing that outlived it (neighbour entries, conntrack, a
        connection gRPC still shares between channels) can meet them. (Made for a run whose client got no
        answer from a member while the members reached each other; that one's cause was the bridge's
        address moving, see ``__init__``.)"""
        used = set(re.findall(r"\b10\.213\.(\d+)\.", _run("ip", "-4", "-o", "addr").stdout
                              + _run("ip", "-4", "route").stdout))
        start = (os.getpid() + 17 * made) % 256
        for i in range(256):
            n = (start + i) % 256
            if str(n) not in used:
                return ipaddress.IPv4Network(f"10.213.{n}.0/24")
        raise RuntimeError("no free /24 in 10.213.0.0/16 for a test network")

    @property
    def client(self) -> Host:
        return self.hosts[CLIENT]

    @property
    def zookeeper(self) -> Host:
        return self.hosts[ZOOKEEPER]

    def add_host(self, name: str) -> Host:
        """A namespace with its own address on the bridge, loopback up and an empty cut set."""
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        index = len(self.hosts) - 2
        ns, veth = f"{self._ns_prefix}{name}", f"{PREFIX}{self.tag}{index:x}"
        host = Host(name, str(next(self._addresses)), ns)
        self.hosts[name] = host
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._veths.append(veth)
        _run("ip", "link", "set", veth, "master", self.bridge, "up")
        _run("ip", "-n", ns, "addr", "add", f"{host.address}/{self._prefixlen}", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run(*host.wrap(["nft", "-f", "-"]), stdin=_RULES)
        return host

    def _pair(self, a: str, b: str) -> tuple:
        ha, hb = self.hosts[a], self.hosts[b]
        if ha.namespace is None and hb.namespace is None:
            raise ValueError(f"{a} and {b} are both in the root namespace: a link between them cannot be cut")
        return ha, hb

    def _set(self, verb: str, ha: Host, hb: Host) -> None:
        for here, peer in ((ha, hb), (hb, ha)):
            if here.namespace is not None:
                _run(*here.wrap(["nft", verb, "element", "inet", "mqnem", "cut", f"{{ {peer.address} }}"]))

    def cut(self, a: str, b: str) -> None:
        """Drop every packet between hosts ``a`` and ``b`` (both ways); a no-op if already cut."""
        ha, hb = self._pair(a, b)
        if frozenset((a, b)) not in self._cuts:
            self._set("add", ha, hb)
            self._cuts.add(frozenset((a, b)))
            log.info("network %s: cut %s (%s) from %s (%s)", self.tag, a, ha.address, b, hb.address)

    def heal(self, a: str, b: str) -> None:
        ha, hb = self._pair(a, b)
        if frozenset((a, b)) in self._cuts:
            self._set("delete", ha, hb)
            self._cuts.discard(frozenset((a, b)))
            log.info("network %s: healed %s - %s", self.tag, a, b)

    def heal_all(self) -> None:
        for a, b in [tuple(sorted(c)) for c in self._cuts]:
            self.heal(a, b)

    @property
    def cuts(self) -> list:
        return sorted(tuple(sorted(c)) for c in self._cuts)

    def close(self) -> None:
        """Delete every namespace (its veth pair and rules go with it) and the bridge. Processes still
        running in a namespace keep it alive, unnamed, until they exit: stop them first."""
        if self._closed:
            return
        self._closed = True
        _open.discard(self)
        for veth in self._veths:  # both ends at once; a deleted namespace frees its own only later
            _run("ip", "link", "del", veth, check=False)
        for host in self.hosts.values():
            if host.namespace is not None:
                _run("ip", "netns", "del", host.namespace, check=False)
        _run("ip", "link", "del", self.bridge, check=False)

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@atexit.register
def _close_all() -> None:
    for network in list(_open):
        network.close()


class NetnsBroker(BrokerProcess):
    """A ``metaq-broker`` started inside ``host``'s namespace (``ip netns exec``), listening on the host's
    address: gRPC on ``SERVER_PORT``, the data port on ``DATA_PORT``."""

    def __init__(self, workdir, host: Host, broker_id: int, zk_connect: str, settings: Optional[dict] = None,
                 topics: Optional[dict] = None):
        super().__init__(workdir, broker_id, zk_connect, port=SERVER_PORT, topics=topics,
                         settings={**(settings or {}), "hostName": host.address, "serverPort": SERVER_PORT,
                                   "dataPort": DATA_PORT})
        self.host = host
        self.netns = host.namespace

    @property
    def address(self) -> str:
        return f"{self.host.address}:{self.port}"


def group_in_namespaces(network: Network, workdir, broker_id: int, zk_connect: str, zk_root: str = "/meta",
                        members: int = 3, settings: Optional[dict] = None,
                        topics: Optional[dict] = None) -> BrokerGroup:
    """A ``BrokerGroup`` whose member ``r`` runs on host ``m<r>`` of ``network`` (``members[r].host``);
    ``zk_connect`` must name ZooKeeper by ``network.zookeeper.address``."""
    group = BrokerGroup(workdir, broker_id, zk_connect, zk_root, members, settings, topics)
    group.members = [NetnsBroker(m.workdir, network.add_host(f"m{r}"), broker_id, zk_connect,
                                 settings=m.settings, topics=topics) for r, m in enumerate(group.members)]
    return group
