"""SCRAM users in ZooKeeper, as Kafka keeps them: ``<root>/config/users/<quoted name>`` holds JSON
``{"SCRAM-SHA-256": "salt=..,stored_key=..,server_key=..,iterations=N"}``: a salted credential, never
the password. ``metaq users`` writes them; the broker reads them through ``UserCache``, which watches
the nodes so that a login costs no ZooKeeper request and a changed or removed user is noticed at once
(the broker then drops that user's sessions).

An unknown user must look like a known one with a wrong password, so a broker answers its SCRAM login
with a made-up salt that every broker derives alike, restart after restart: an HMAC of the name under
``scram_secret``, 32 random bytes the first broker stores at ``<root>/config/scram-secret`` (with
``zk.auth``, readable by the brokers' identity only)."""
from __future__ import annotations

import json
import logging
import secrets
import threading
from collections import Counter
from typing import Callable, Optional

from kazoo.exceptions import NodeExistsError, NoNodeError
from kazoo.recipe.cache import TreeCache, TreeEvent

from metaq_broker.errors import MetaqError
from metaq_broker.security.scram import DEFAULT_ITERATIONS, MECHANISM, Credential
from metaq_broker.zk.paths import ZkPaths, unquote_component
from metaq_broker.zk.session import children

log = logging.getLogger(__name__)


class UnknownUserError(MetaqError, LookupError):
    """No SCRAM user of that name is stored."""


def encode_user(credential: Credential) -> bytes:
    return json.dumps({MECHANISM: credential.encode()}, sort_keys=True).encode()


def decode_user(data: bytes) -> Optional[Credential]:
    """The node's SCRAM-SHA-256 credential; None if it has none (or is not metaq's)."""
    try:
        text = json.loads(data or b"{}").get(MECHANISM)
        return Credential.decode(text) if text else None
    except (ValueError, KeyError, AttributeError, TypeError):
        return None


def put_user(zk, root: str, name: str, credential: Credential) -> bool:
    """Create the user, or replace its credential (a new password). True if it was created."""
    path = ZkPaths(root).user(name)
    data = encode_user(credential)
    while True:
        try:
            zk.create(path, data, makepath=True)
            return True
        except NodeExistsError:
            try:
                zk.set(path, data)
                return False
            except NoNodeError:
                continue  # removed meanwhile: create it


def delete_user(zk, root: str, name: str) -> None:
    try:
        zk.delete(ZkPaths(root).user(name))
    except NoNodeError:
        raise UnknownUserError(f"user {name!r} does not exist (metaq users list shows the users)") from None


def scram_secret(zk, root: str) -> bytes:
    """The cluster's key for made-up SCRAM salts: read, or made by the first broker to ask (its session's
    ACL: the brokers' ``zk.auth`` identity only)."""
    path = ZkPaths(root).scram_secret()
    while True:
        try:
            data, _ = zk.get(path)
            if len(data) == 32:
                return data
            log.warning("%s holds %d bytes, not 32: replaced by a new key", path, len(data))
            zk.set(path, secrets.token_bytes(32))
            continue
        except NoNodeError:
            pass
        try:
            zk.create(path, secrets.token_bytes(32), makepath=True)
        except NodeExistsError:
            pass  # another broker made it first: read theirs


def list_users(zk, root: str) -> list:
    """Every stored user name, sorted."""
    return sorted(unquote_component(c) for c in children(zk, ZkPaths(root).users()))


class UserCache:
    """Every user's credential, kept current by ZooKeeper watches (kazoo's TreeCache on
    ``<root>/config/users``). ``credential(name)`` is a dictionary lookup. A changed or removed user's
    sessions end by themselves: a session token names the credential's salt (server/auth.py)."""

    def __init__(self, zk, root: str, timeout: float = 15.0):
        self._path = ZkPaths(root).users()
        self._users: dict = {}
        self._listeners: list = []  # called with a user's name once it was changed or removed
        self._typical: Optional[int] = None  # typical_iterations, until the users change
        self._version = 0  # changes seen
        self._ready = threading.Event()
        self._tree = TreeCache(zk, self._path)
        self._tree.listen(self._on_event)
        self._tree.listen_fault(lambda e: log.error("the cache of SCRAM users failed: %s", e))
        self._tree.start()
        if not self._ready.wait(timeout):
            log.warning("SCRAM users not loaded from ZooKeeper within %.0fs; logins fail until they are", timeout)

    def credential(self, name: str) -> Optional[Credential]:
        return self._users.get(name)

    def typical_iterations(self) -> int:
        """The SCRAM iteration count most users have (DEFAULT_ITERATIONS without users): what an unknown
        user is told, so that the count does not give it away."""
        typical = self._typical
        if typical is None:  # counted again after a change, not at every login
            version = self._version
            counts = Counter(c.iterations for c in list(self._users.values()))
            typical = counts.most_common(1)[0][0] if counts else DEFAULT_ITERATIONS
            if version == self._version:  # no change meanwhile: keep it
                self._typical = typical
        return typical

    def listen(self, callback: Callable[[str], None]) -> None:
        """``callback(name)`` on ZooKeeper's event thread each time a user is changed or removed."""
        self._listeners.append(callback)

    def close(self) -> None:
        self._tree.close()

    def _on_event(self, event) -> None:
        if event.event_type == TreeEvent.INITIALIZED:
            self._reload()
            self._ready.set()
            return
        data = event.event_data
        if data is None or not data.path.startswith(self._path + "/"):
            return
        component = data.path[len(self._path) + 1:]
        if "/" in component:
            return
        name = unquote_component(component)
        if event.event_type in (TreeEvent.NODE_ADDED, TreeEvent.NODE_UPDATED):
            credential = decode_user(data.data)
            if credential is None:
                log.warning("%s holds no %s credential; ignored", data.path, MECHANISM)
                self._users.pop(name, None)
            else:
                self._users[name] = credential
        elif event.event_type == TreeEvent.NODE_REMOVED:
            self._users.pop(name, None)
        else:
            return
        self._version += 1
        self._typical = None
        if event.event_type != TreeEvent.NODE_ADDED:
            self._tell([name])

    def _reload(self) -> None:
        """Every user again from the tree, at the first load and after each new session: a node that a
        ZooKeeper which lost its data wrote again can have the old node's mzxid, and TreeCache then tells no
        change (it still holds the new data). Listeners hear of the users changed or gone meanwhile."""
        users = {}
        for component in self._tree.get_children(self._path) or ():
            node = self._tree.get_data(f"{self._path}/{component}")
            credential = decode_user(node.data) if node is not None else None
            if credential is not None:
                users[unquote_component(component)] = credential
        old, self._users = self._users, users
        if users != old:
            self._version += 1
            self._typical = None
            self._tell([name for name, credential in old.items() if users.get(name) != credential])

    def _tell(self, names) -> None:
        for name in names:
            for callback in self._listeners:
                try:
                    callback(name)
                except Exception:  # noqa: BLE001 - a listener's failure must not stop the cache
                    log.exception("a listener of user changes failed")
