"""A member of a replicated broker group (docs/replication.md): its role, elections and the master's lease.

Every member registers an ephemeral member node; the master is whoever holds ``/brokers/ids/<b>``, which
is created only in the same ZooKeeper multi-op that raises the group's epoch, so clients (which route by
that node) and the epoch always agree. A member may stand when it is in the in-sync set with its own uuid
(a wiped data directory is a new uuid, so never electable), or when the group has no state yet.

The master serves only while its *lease* holds: ZooKeeper answered a ``sync`` sent less than 0.75 of the
session timeout ago. ZooKeeper expires a session only after a whole session timeout without hearing from
it, so no other member can have been elected while the lease holds; a master frozen (SIGSTOP) or cut off
from ZooKeeper refuses clients once its lease runs out, before anyone can replace it.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable, Optional

from kazoo.exceptions import KazooException, NoNodeError

from metaq_broker.errors import NotMasterError
from metaq_broker.zk import groups
from metaq_broker.zk.paths import ZkPaths

log = logging.getLogger(__name__)

ELECTING, MASTER, REPLICA = "electing", "master", "replica"
BOOTSTRAP_GRACE_S = 2.0  # a group without state waits this long for its other members before one stands
TICK_S = 0.25


class GroupMember:
    """Runs the member's role machine on a thread of its own. ``promote(state)`` and ``demote(why)`` are
    the broker's (storage epoch, journal, fetcher, manager); ``node_data()`` the JSON of the master node."""

    def __init__(self, registration, root: str, broker_id: int, replica_id: int, uuid: str,
                 session_timeout_s: float, node_data: Callable[[], dict], standing: Callable[[], tuple],
                 promote: Callable[[object], None], demote: Callable[[str], None],
                 follow: Callable[[int, dict], None], tick: Callable[[], None] = lambda: None,
                 unclean: bool = False, lag_max_s: float = 10.0):
        self.registration = registration
        self.paths = ZkPaths(root)
        self.broker_id, self.replica_id, self.uuid = broker_id, replica_id, uuid
        self.session_timeout_s = session_timeout_s
        self._node_data, self._standing = node_data, standing
        self._promote, self._demote, self._follow, self._tick = promote, demote, follow, tick
        self.unclean, self.lag_max_s = unclean, lag_max_s
        self.role = ELECTING
        self.epoch = 0
        self.state: Optional[groups.GroupState] = None
        self.master_info: Optional[dict] = None  # the master's node, when another member is master
        self._lease_until = 0.0  # monotonic
        self._next_lease = 0.0
        self._started_at = time.monotonic()
        self._no_master_since: Optional[float] = None
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
            try:
                data, stat = zk.get(self.paths.broker(self.broker_id))
            except NoNodeError:
                data = stat = None
            self.state = state
            mine = stat is not None and stat.ephemeralOwner == zk.client_id[0]
            if mine:
                if self.role != MASTER:  # won, but promotion did not finish (or a restart of the loop)
                    self._become_master(state)
                elif state is not None and state.epoch > self.epoch:
                    self._step_down(f"the group moved to epoch {state.epoch}")
                else:
                    self._renew_lease(now)
                return
            if self.role == MASTER:
                self._step_down("another member holds the master node" if stat is not None else
                                "its master node is gone")
            if stat is not None:
                self._no_master_since = None
                self.master_info = json.loads(data)
                epoch = state.epoch if state is not None else int(self.master_info.get("epoch", 0))
                self.epoch = epoch
                self.role = REPLICA
                self._follow(epoch, self.master_info)
                return
            self.master_info = None
            if self._no_master_since is None:
                self._no_master_since = now
            if self._may_stand(state, now):
                self._why_not_standing = ""
                self._stand(state)
            else:
                self._why_not_standing = self._not_standing_reason(state)

    def _may_stand(self, state, now: float) -> bool:
        if state is not None:
            if state.in_isr(self.replica_id, self.uuid):
                return True
            if set(state.replicas) <= {self.replica_id}:
                return True  # a group of one whose data was wiped: no other member can hold it
            if self.unclean and now - self._no_master_since > self.lag_max_s:
                return self._best_among_live()
            return False
        # No state yet (a new or upgraded group): a member holding data must win over an empty one.
        live = groups.members(self.zk, self.paths, self.broker_id)
        if len(live) > 1 and now - self._started_at < BOOTSTRAP_GRACE_S:
            return False
        return self._best_among_live(live)

    def _not_standing_reason(self, state) -> str:
        if state is None:
            return "its members are still choosing the first one"
        isr = list(state.isr_ids)
        head = (f"none of its in-sync set {isr} (epoch {state.epoch}) holds the master node, and member "
                f"{self.replica_id} is out of sync")
        if self.unclean:
            return (f"{head}; it stands (uncleanElection=true) once the group has been without master for "
                    f"replicaLagMaxMs ({self.lag_max_s:g}s) and no live member has more data")
        return (f"{head}: it waits for an in-sync member to come back (uncleanElection=false; true would let it "
                f"take over and lose what only the in-sync set had)")

    def _best_among_live(self, live: Optional[dict] = None) -> bool:
        live = groups.members(self.zk, self.paths, self.broker_id) if live is None else live
        me = self._standing()
        for r, info in live.items():
            if r == self.replica_id:
                continue
            theirs = (int(info.get("lastEpoch", 0)), int(info.get("logEnd", 0)))
            if theirs > me or (theirs == me and r < self.replica_id):
                return False
        return True

    def _stand(self, state) -> None:
        node = json.dumps({**self._node_data(), "replicaId": self.replica_id}, sort_keys=True).encode()
        try:
            new = groups.elect(self.zk, self.paths, self.broker_id, self.replica_id, self.uuid,
                               node, state, acl=self.registration.acl, min_epoch=self._standing()[0] + 1,
                               unclean=state is not None and not state.in_isr(self.replica_id, self.uuid))
        except groups.ElectionLostError:
            log.info("group %d: another member won the election", self.broker_id)
            return
        if new.unclean:
            log.warning("group %d: member %d became master WITHOUT being in sync (uncleanElection=true): "
                        "acknowledged messages it did not have are lost", self.broker_id, self.replica_id)
        self._become_master(new)

    def _become_master(self, state) -> None:
        if state is None:
            state = groups.read_state(self.zk, self.paths, self.broker_id)
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
        """Every quarter session timeout: ``sync``, then check the master node is still this session's."""
        if not force and now < self._next_lease:
            return
        sent = time.monotonic()
        path = self.paths.broker(self.broker_id)
        self.zk.sync(path)
        stat = self.zk.exists(path)
        if stat is None or stat.ephemeralOwner != self.zk.client_id[0]:
            return
        self._lease_until = sent + 0.75 * self.session_timeout_s
        self._next_lease = sent + self.session_timeout_s / 4

    # -- what the master writes -----------------------------------------------------------------------
    def alter_isr(self, isr: list) -> bool:
        """Write the in-sync set (the master only); False if the state moved on (then we step down)."""
        with self._lock:
            if self.role != MASTER or self.state is None:
                return False
            try:
                self.state = groups.alter_isr(self.zk, self.paths, self.broker_id, self.state,
                                              tuple((int(r), str(u)) for r, u in isr))
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
