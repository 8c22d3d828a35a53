"""A member of a replicated broker group (docs/replication.md): its role, elections and the master's lease.

Every member registers an ephemeral member node; the master is whoever holds the master node
(``ZkPaths.broker``), which is created only in the same ZooKeeper multi-op that raises the group's epoch,
so clients (which route by that node) and the epoch always agree. A member may stand when it is in the in-sync set with its own uuid
(a wiped data directory is a new uuid, so never electable), or when the group has no state yet.

The master serves only while its *lease* holds: ZooKeeper answered a ``sync`` sent less than 0.75 of the
session timeout ZooKeeper negotiated ago. ZooKeeper expires a session only after a whole session timeout
without hearing from it, so no other member can have been elected while the lease holds; a master frozen
(SIGSTOP) or cut off from ZooKeeper refuses clients once its lease runs out, before anyone can replace it.

ZooKeeper losing its data (docs/replication.md): every member keeps the newest state it saw in its data
directory (``member.StateCopy``) and shows it in its member node. With no state in ZooKeeper, a member
stands only once every member of the newest in-sync set any live member knows is alive with the same
data (uuid) and has published a fresh standing, and only if it is the most advanced of them (last epoch,
then log end); the new epoch is above every epoch a live member has seen. The writer of each state keeps
it before acting on it, so if the newest copy known were not the last state, the member that wrote the
next one, which was in the newest copy's in-sync set and so is alive, would know a newer one.

Fresh standing: a member with no master pauses its copying first, then writes its last epoch and log end
into its member node with ``"electing": true``; it clears that before it follows a master again. Only
such values are compared (bootstrap and unclean elections), never ones from before the pause.

Lock order: ``_lock`` (role changes; ZooKeeper calls are made under it) before the replica manager's
condition (``promote``/``demote`` take it); the replica manager never takes ``_lock`` or calls ZooKeeper
while holding its condition (its in-sync writes come through ``alter_isr`` from ``tick``, this thread).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable, Optional

from kazoo.exceptions import KazooException

from metaq_broker.errors import NotMasterError
from metaq_broker.zk import groups
from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.session import negotiated_timeout

log = logging.getLogger(__name__)

ELECTING, MASTER, REPLICA = "electing", "master", "replica"
BOOTSTRAP_GRACE_S = 2.0  # a group without state waits this long for its other members before one stands
TICK_S = 0.25


class GroupMember:
    """Runs the member's role machine on a thread of its own. ``promote(state)`` and ``demote(why)`` are
    the broker's (storage epoch, journal, fetcher, manager); ``node_data()`` the JSON of the master node;
    ``standing()`` (last epoch, log end) of the local log; ``pause()`` stops copying (returns once no
    fetched reply can be applied any more); ``publish(fields)`` merges fields into this member's node;
    ``copy`` keeps the last state seen (``member.StateCopy``)."""

    def __init__(self, registration, root: str, broker_id: int, replica_id: int, uuid: str,
                 session_timeout_s: float, node_data: Callable[[], dict], standing: Callable[[], tuple],
                 promote: Callable[[object], None], demote: Callable[[str], None],
                 follow: Callable[[int, dict], None], tick: Callable[[], None] = lambda: None,
                 unclean: bool = False, lag_max_s: float = 10.0, pause: Callable[[], None] = lambda: None,
                 publish: Callable[[dict], None] = lambda fields: None, copy=None):
        self.registration = registration
        self.paths = ZkPaths(root)
        self.broker_id, self.replica_id, self.uuid = broker_id, replica_id, uuid
        self.session_timeout_s = session_timeout_s
        self._node_data, self._standing = node_data, standing
        self._promote, self._demote, self._follow, self._tick = promote, demote, follow, tick
        self._pause, self._publish, self.copy = pause, publish, copy
        self.unclean, self.lag_max_s = unclean, lag_max_s
        self.role = ELECTING
        self.epoch = 0
        self.state: Optional[groups.GroupState] = None
        self.master_info: Optional[dict] = None  # the master's node, when another member is master
        self._lease_until = 0.0  # monotonic
        self._next_lease = 0.0
        self._told_timeout = None  # the negotiated session timeout last warned about
        self._started_at = time.monotonic()
        self._no_master_since: Optional[float] = None
        self._published: Optional[dict] = None  # the election fields last written into the member node
        self._why_not_standing = ""  # when there is no master and this member may not stand: why (clients see it)
        self._handing_over = False  # a graceful stop: new calls are refused, the replicas catch up
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.RLock()  # role changes
        self._thread: Optional[threading.Thread] = None

    @property
    def zk(self):
        return self.registration.client

    # -- the gate every client call passes ------------------------------------------------------------
    def lease_valid(self) -> bool:
        return self.role == MASTER and (self.sole or time.monotonic() < self._lease_until)

    @property
    def sole(self) -> bool:
        """Only this member has ever been in the group (its roster and in-sync set are this member alone):
        no other member can be elected cleanly, so its mastership needs no lease, and it serves on while
        ZooKeeper is away, as a broker without replicas always did. (Only a newcomer with
        uncleanElection=true could take over meanwhile.)"""
        s = self.state
        return s is not None and set(s.replicas) <= {self.replica_id} and s.isr_ids == (self.replica_id,)

    def check_master(self) -> None:
        """The gate of every new client call: NotMasterError naming the master (if known) unless this member
        is master with a valid lease and not handing over (a graceful stop)."""
        if self._handing_over and self.role == MASTER:
            raise NotMasterError(f"not master: group {self.broker_id} member {self.replica_id} is stopping and "
                                 f"hands over to an in-sync member; the next master is being chosen")
        self.check_lease()

    def check_lease(self) -> None:
        """What an acknowledgement needs: master with a valid lease. A master handing over still answers the
        calls it took before (they must not be refused after they were stored: a producer resends ``not
        master``)."""
        if self.lease_valid():
            return
        if self.role == MASTER:
            raise NotMasterError(f"not master: group {self.broker_id} member {self.replica_id} lost contact with "
                                 f"ZooKeeper (its lease ran out); a new master is being chosen")
        m = self.master_info
        if m is None and self._why_not_standing:
            raise NotMasterError(f"not master: group {self.broker_id} has no master: {self._why_not_standing}")
        where = (f", master replica {m.get('replicaId')} at {m.get('host')}:{m.get('port')}, epoch {self.epoch}"
                 if m else ", no master right now")
        what = "a replica" if self.role == REPLICA else self.role
        raise NotMasterError(f"not master: group {self.broker_id} member {self.replica_id} is {what}{where}")

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> "GroupMember":
        self._thread = threading.Thread(target=self._run, name=f"metaq-group-{self.broker_id}", daemon=True)
        self._thread.start()
        return self

    def wake(self, *_args) -> None:
        self._wake.set()

    def stop(self, resign: bool = True) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            if self.role == MASTER:
                self._step_down("stopping", resign=resign)

    def hand_over(self, caught_up: Callable[[], bool], timeout: float) -> bool:
        """A graceful stop of the master: refuse new calls (``not master:``, which clients resend), wait up to
        ``timeout`` until ``caught_up()`` says every in-sync replica has the whole log, then resign, so an
        in-sync member is elected at once instead of after the session timeout. True if they caught up.
        ``caught_up`` must hold twice in a row: a call admitted just before the refusals may still append."""
        if self.role != MASTER:
            return False
        self._handing_over = True
        log.info("group %d: member %d stops: refusing new calls until the in-sync replicas have its whole log",
                 self.broker_id, self.replica_id)
        deadline = time.monotonic() + timeout
        streak = 0
        while self.lease_valid() and streak < 2 and time.monotonic() < deadline:
            streak = streak + 1 if caught_up() else 0
            time.sleep(0.05)
        if streak >= 2:
            log.info("group %d: member %d: its in-sync replicas have its whole log; resigning so one of them is "
                     "elected at once", self.broker_id, self.replica_id)
        else:
            log.warning("group %d: member %d stops although its in-sync replicas did not catch up within %.0fs; "
                        "what they lack was never acknowledged under acks=all (acks=1 puts may be lost)",
                        self.broker_id, self.replica_id, timeout)
        self.stop(resign=True)
        return streak >= 2

    def wait_role(self, timeout: float) -> str:
        """Wait until the member is master or replica (tests, startup logs)."""
        deadline = time.monotonic() + timeout
        while self.role == ELECTING and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.role

    # -- the loop -------------------------------------------------------------------------------------
    def _run(self) -> None:
        watched = False
        while not self._stop.is_set():
            try:
                if not watched and self.registration.connected:
                    self.zk.DataWatch(self.paths.broker(self.broker_id), self._watch)
                    self.zk.DataWatch(self.paths.group_state(self.broker_id), self._watch)
                    watched = True
                self._step()
            except KazooException as e:
                log.debug("group %d: ZooKeeper trouble (%s)", self.broker_id, e)
            except Exception:  # noqa: BLE001 - keep the role machine alive
                log.exception("group %d member %d: role check failed", self.broker_id, self.replica_id)
            if self.role == MASTER:
                try:
                    self._tick()
                except Exception:  # noqa: BLE001
                    log.exception("group %d: in-sync set maintenance failed", self.broker_id)
            self._wake.wait(TICK_S)
            self._wake.clear()

    def _watch(self, data, stat, event=None):
        self._wake.set()
        return not self._stop.is_set()

    def _step(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self.role == MASTER and now >= self._lease_until and not self.sole:
                self._step_down("its lease ran out (no answer from ZooKeeper within 0.75 of the session timeout)")
            if not self.registration.connected or not self.registration.registered:
                return
            zk = self.zk
            state = groups.read_state(zk, self.paths, self.broker_id)
            data, stat = groups.master_data(zk, self.paths, self.broker_id)  # also a master of the older layout
            self.state = state
            mine = stat is not None and stat.ephemeralOwner == zk.client_id[0]
            if mine:
                if self.role != MASTER:  # won, but promotion did not finish (or a restart of the loop)
                    self._become_master(state)
                elif state is not None and state.epoch > self.epoch:
                    self._step_down(f"the group moved to epoch {state.epoch}")
                else:
                    self._keep(state)
                    self._renew_lease(now)
                return
            if self.role == MASTER:
                self._step_down("another member holds the master node" if stat is not None else
                                "its master node is gone")
            if state is not None:
                self._keep(state)
            if stat is not None:
                self._no_master_since = None
                self.master_info = json.loads(data)
                epoch = state.epoch if state is not None else int(self.master_info.get("epoch", 0))
                self.epoch = epoch
                self.role = REPLICA
                self._tell(electing=False)  # before copying again: the standing published goes stale
                self._follow(epoch, self.master_info)
                return
            self.master_info = None
            if self._no_master_since is None:
                self._no_master_since = now
            self._pause()  # no more copying: the standing published next stays true until a master is followed
            self._tell(electing=True)
            if self._may_stand(state, now):
                self._why_not_standing = ""
                self._stand(state)

    def _keep(self, state) -> None:
        """Remember a state read or written, durably, before acting on it (``member.StateCopy``)."""
        if state is not None and self.copy is not None and self.copy.keep(state):
            self._tell()

    def _tell(self, electing: Optional[bool] = None) -> None:
        """Write into this member's node what elections compare: the last state it kept, the highest epoch
        it has seen, and with ``electing`` its fresh standing (last epoch, log end) or that it has none now."""
        fields = dict(self._published or {})
        if electing is not None:
            fields["electing"] = electing
        if electing or fields.get("electing"):
            fields["lastEpoch"], fields["logEnd"] = self._standing()
        kept = self.copy.state if self.copy is not None else None
        fields["lastState"] = kept.to_copy() if kept is not None else None
        fields["epochSeen"] = self._epoch_floor(fields.get("lastEpoch", 0))
        if fields != self._published:
            self._publish(fields)
            self._published = fields

    def _epoch_floor(self, log_epoch: int = 0) -> int:
        """The highest epoch this member has seen: in ZooKeeper, in its copy, in its log."""
        kept = self.copy.state if self.copy is not None else None
        return max(log_epoch, self._standing()[0], self.epoch, self.state.epoch if self.state is not None else 0,
                   kept.epoch if kept is not None else 0)

    def _may_stand(self, state, now: float) -> bool:
        live = groups.members(self.zk, self.paths, self.broker_id)
        if state is not None:
            self._why_not_standing = self._not_standing_reason(state)
            if state.in_isr(self.replica_id, self.uuid):
                return True
            if set(state.replicas) <= {self.replica_id}:
                return True  # a group of one whose data was wiped: no other member can hold it
            if self.unclean and now - self._no_master_since > self.lag_max_s:
                return self._best_among(live, None)
            return False
        newest = self._newest_copy(live)
        if newest is None:  # a new group (or one from before state copies): a member holding data must win
            self._why_not_standing = "its members are still choosing the first one"
            if len(live) > 1 and now - self._started_at < BOOTSTRAP_GRACE_S:
                return False
            return self._best_among(live, None)
        # ZooKeeper lost the group's state: every member of the last in-sync set must be heard from.
        missing = [r for r, u in newest.isr if not self._fresh(live, r, u)]
        if missing:
            self._why_not_standing = (
                f"ZooKeeper has no state for it (lost its data?); its last in-sync set was {list(newest.isr_ids)} "
                f"(epoch {newest.epoch}), and member(s) {missing} of it are not back with their data: waiting "
                f"for them, as only they can say nothing acknowledged is missing" + (
                    f"; it stands (uncleanElection=true) once the group has been without master for "
                    f"replicaLagMaxMs ({self.lag_max_s:g}s)" if self.unclean else
                    " (uncleanElection=true would let the most advanced live member take over and lose the rest)"))
            if self.unclean and now - self._no_master_since > self.lag_max_s:
                return self._best_among(live, None)
            return False
        self._why_not_standing = (f"ZooKeeper lost its state; the members of its last in-sync set "
                                  f"{list(newest.isr_ids)} are choosing the most advanced")
        return newest.in_isr(self.replica_id, self.uuid) and self._best_among(live, set(newest.isr_ids))

    def _newest_copy(self, live: dict) -> Optional[groups.GroupState]:
        """The newest group state any live member (this one included) kept."""
        newest = self.copy.state if self.copy is not None else None
        for r, info in live.items():
            if r == self.replica_id or not info.get("lastState"):
                continue
            try:
                theirs = groups.GroupState.from_copy(info["lastState"])
            except ValueError:
                continue
            if theirs.newer(newest):
                newest = theirs
        return newest

    def _fresh(self, live: dict, r: int, uuid: str) -> bool:
        """Member ``r`` with data ``uuid`` is alive and has published a fresh standing (this one: always)."""
        if r == self.replica_id:
            return uuid == self.uuid
        info = live.get(r)
        return info is not None and info.get("uuid") == uuid and info.get("electing") is True

    def _not_standing_reason(self, state) -> str:
        isr = list(state.isr_ids)
        head = (f"none of its in-sync set {isr} (epoch {state.epoch}) holds the master node, and member "
                f"{self.replica_id} is out of sync")
        if self.unclean:
            return (f"{head}; it stands (uncleanElection=true) once the group has been without master for "
                    f"replicaLagMaxMs ({self.lag_max_s:g}s) and no live member has more data")
        return (f"{head}: it waits for an in-sync member to come back (uncleanElection=false; true would let it "
                f"take over and lose what only the in-sync set had)")

    def _best_among(self, live: dict, among: Optional[set]) -> bool:
        """Whether this member is the most advanced (last epoch, then log end; ties to the lowest replicaId)
        of the live members (those in ``among``, if given), comparing fresh standings only: a live member
        that has not published one yet is waited for."""
        me = self._standing()
        for r, info in live.items():
            if r == self.replica_id or (among is not None and r not in among):
                continue
            if info.get("electing") is not True:
                return False  # still copying from a master, or not told yet: its figures would be stale
            theirs = (_number(info.get("lastEpoch")), _number(info.get("logEnd")))
            if theirs > me or (theirs == me and r < self.replica_id):
                return False
        return True

    def _stand(self, state) -> None:
        node = json.dumps({**self._node_data(), "replicaId": self.replica_id}, sort_keys=True).encode()
        live = groups.members(self.zk, self.paths, self.broker_id)
        floor = max([self._epoch_floor()] + [_number(i.get("epochSeen")) for i in live.values()])
        recovered = self._newest_copy(live) if state is None else None
        prior = state if state is not None else recovered
        unclean = prior is not None and not prior.in_isr(self.replica_id, self.uuid)
        try:
            new = groups.elect(self.zk, self.paths, self.broker_id, self.replica_id, self.uuid,
                               node, state, acl=self.registration.acl, min_epoch=floor + 1,
                               unclean=bool(unclean), recovered=recovered)
        except groups.ElectionLostError:
            log.info("group %d: another member won the election", self.broker_id)
            return
        if new.unclean:
            log.warning("group %d: member %d became master WITHOUT being in sync (uncleanElection=true): "
                        "acknowledged messages it did not have are lost", self.broker_id, self.replica_id)
        elif recovered is not None:
            log.warning("group %d: ZooKeeper had no state for the group; member %d is master of epoch %d, the most "
                        "advanced of its last in-sync set %s (epoch %d)", self.broker_id, self.replica_id,
                        new.epoch, list(recovered.isr_ids), recovered.epoch)
        self._become_master(new)

    def _become_master(self, state) -> None:
        if state is None:
            state = groups.read_state(self.zk, self.paths, self.broker_id)
        self._keep(state)  # kept before this member acts as master of it
        self._tell(electing=False)
        self.state, self.epoch = state, state.epoch
        self._renew_lease(time.monotonic(), force=True)
        log.info("group %d: member %d is master of epoch %d, in-sync set %s", self.broker_id, self.replica_id,
                 state.epoch, [r for r, _ in state.isr])
        self._promote(state)
        self.role = MASTER

    def _step_down(self, why: str, resign: bool = True) -> None:
        log.warning("group %d: member %d stops being master of epoch %d: %s", self.broker_id, self.replica_id,
                    self.epoch, why)
        self.role = ELECTING
        self._lease_until = 0.0
        try:
            self._demote(why)
        finally:
            if resign and self.registration.connected:
                try:
                    groups.resign(self.zk, self.paths, self.broker_id)
                except KazooException as e:
                    log.debug("could not delete the master node: %s", e)

    def _renew_lease(self, now: float, force: bool = False) -> None:
        """Every quarter session timeout: ``sync``, then check the master node is still this session's.
        The lease lasts 0.75 of the session timeout ZooKeeper negotiated (it may grant another than asked:
        its min and max session timeouts), since that is when it expires the session."""
        timeout = self.lease_timeout()
        if not force and now < self._next_lease:
            return
        sent = time.monotonic()
        path = self.paths.broker(self.broker_id)
        self.zk.sync(path)
        stat = self.zk.exists(path)
        if stat is None or stat.ephemeralOwner != self.zk.client_id[0]:
            return
        self._lease_until = sent + 0.75 * timeout
        self._next_lease = sent + timeout / 4

    def lease_timeout(self) -> float:
        """The session timeout the lease is measured against: the one ZooKeeper negotiated for the current
        session (``zk.session.negotiated_timeout``), else the one asked for. A difference is logged once."""
        got = negotiated_timeout(self.zk)
        if got is None:
            return self.session_timeout_s
        if abs(got - self.session_timeout_s) > 1e-3 and self._told_timeout != got:
            self._told_timeout = got
            log.warning("group %d member %d: ZooKeeper granted a session timeout of %gs, not the %gs of "
                        "zk.sessionTimeout (its minSessionTimeout/maxSessionTimeout); the master's lease follows "
                        "ZooKeeper's", self.broker_id, self.replica_id, got, self.session_timeout_s)
        return got

    # -- what the master writes -----------------------------------------------------------------------
    def alter_isr(self, isr: list) -> bool:
        """Write the in-sync set (the master only); False if the state moved on (then we step down)."""
        with self._lock:
            if self.role != MASTER or self.state is None:
                return False
            try:
                self.state = groups.alter_isr(self.zk, self.paths, self.broker_id, self.state,
                                              tuple((int(r), str(u)) for r, u in isr))
                self._keep(self.state)  # kept before the manager acts on it
                return True
            except groups.StaleStateError:
                self._wake.set()
                return False
            except KazooException as e:
                log.warning("group %d: could not write the in-sync set (%s)", self.broker_id, e)
                return False

    def higher_epoch_seen(self, epoch: int) -> None:
        if epoch > self.epoch:
            self._wake.set()


def _number(value) -> int:
    """A count from another member's node (0 if it is not one)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
