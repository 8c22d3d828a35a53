"""SCRAM users in ZooKeeper, as Kafka keeps them: ``<root>/config/users/<quoted name>`` holds JSON
``{"SCRAM-SHA-256": "salt=..,stored_key=..,server_key=..,iterations=N"}``: a salted credential, never
the password. ``metaq users`` writes them; the broker reads them through ``UserCache``, which watches
the nodes so that a login costs no ZooKeeper request and a changed or removed user is noticed at once
(the broker then drops that user's sessions)."""
from __future__ import annotations

import json
import logging
import threading
from typing import Optional

from kazoo.exceptions import NodeExistsError, NoNodeError
from kazoo.recipe.cache import TreeCache, TreeEvent

from metaq_broker.errors import MetaqError
from metaq_broker.security.scram import MECHANISM, Credential
from metaq_broker.zk.paths import ZkPaths, unquote_component

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


def list_users(zk, root: str) -> list:
    """Every stored user name, sorted."""
    try:
        return sorted(unquote_component(c) for c in zk.get_children(ZkPaths(root).users()))
    except NoNodeError:
        return []


class UserCache:
    """Every user's credential, kept current by ZooKeeper watches (kazoo's TreeCache on
    ``<root>/config/users``). ``credential(name)`` is a dictionary lookup. A changed or removed user's
    sessions end by themselves: a session token names the credential's salt (server/auth.py)."""

    def __init__(self, zk, root: str, timeout: float = 15.0):
        self._path = ZkPaths(root).users()
        self._users: dict = {}
        self._ready = threading.Event()
        self._tree = TreeCache(zk, self._path)
        self._tree.listen(self._on_event)
        self._tree.listen_fault(lambda e: log.error("the cache of SCRAM users failed: %s", e))
        self._tree.start()
        if not self._ready.wait(timeout):
            log.warning("SCRAM users not loaded from ZooKeeper within %.0fs; logins fail until they are", timeout)

    def credential(self, name: str) -> Optional[Credential]:
        return self._users.get(name)

    def close(self) -> None:
        self._tree.close()

    def _on_event(self, event) -> None:
        if event.event_type == TreeEvent.INITIALIZED:
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
