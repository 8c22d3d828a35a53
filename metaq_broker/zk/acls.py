"""ACLs in ZooKeeper, one node per resource pattern as Kafka keeps them:
``<root>/acls/<resource_type>/<pattern_type>/<quoted name>`` holds ``security.acl.encode`` of the ACLs
of that pattern. Writers read, change and write back with the node's version, so two admins adding ACLs
to one resource at once both keep theirs. The broker follows them through ``AclCache``."""
from __future__ import annotations

import logging
import threading
from typing import Callable, Iterable, Optional

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError, NotEmptyError
from kazoo.recipe.cache import TreeCache, TreeEvent

from metaq_broker.security import acl as acl_mod
from metaq_broker.security.acl import Acl
from metaq_broker.zk.paths import ZkPaths, unquote_component
from metaq_broker.zk.session import children

log = logging.getLogger(__name__)


def _by_pattern(acls: Iterable[Acl]) -> dict:
    out: dict = {}
    for a in acls:
        out.setdefault((a.resource_type, a.pattern_type, a.name), []).append(a)
    return out


def _read(zk, path: str):
    """(ACLs, version) of a pattern's node; ([], None) when it does not exist."""
    try:
        data, stat = zk.get(path)
    except NoNodeError:
        return [], None
    return acl_mod.decode(data), stat.version


def add_acls(zk, root: str, acls: Iterable[Acl]) -> list:
    """Store ``acls`` (ones already stored are left as they are); returns those that were new."""
    paths, added = ZkPaths(root), []
    for (rtype, ptype, name), wanted in _by_pattern(acls).items():
        path = paths.acl_resource(rtype, ptype, name)
        while True:
            held, version = _read(zk, path)
            new = [a for a in dict.fromkeys(wanted) if a not in held]
            if not new:
                break
            try:
                if version is None:
                    zk.create(path, acl_mod.encode(new), makepath=True)
                else:
                    zk.set(path, acl_mod.encode(held + new), version=version)
            except (BadVersionError, NodeExistsError, NoNodeError):
                continue  # another writer came first: read again
            added += new
            break
    return added


def remove_acls(zk, root: str, acls: Iterable[Acl]) -> list:
    """Remove ``acls`` (ones not stored are ignored); a pattern left with none loses its node. Returns
    those that were removed."""
    paths, removed = ZkPaths(root), []
    for (rtype, ptype, name), unwanted in _by_pattern(acls).items():
        path = paths.acl_resource(rtype, ptype, name)
        while True:
            held, version = _read(zk, path)
            gone = [a for a in held if a in unwanted]
            if not gone:
                break
            keep = [a for a in held if a not in unwanted]
            try:
                if keep:
                    zk.set(path, acl_mod.encode(keep), version=version)
                else:
                    zk.delete(path, version=version)
            except (BadVersionError, NoNodeError):
                continue
            removed += gone
            if not keep:
                _prune(zk, paths, rtype, ptype)
            break
    return removed


def _prune(zk, paths: ZkPaths, rtype: str, ptype: str) -> None:
    """Drop the type nodes left empty (quietly: another writer may be adding under them)."""
    for path in (paths.acl_pattern_type(rtype, ptype), paths.acl_resource_type(rtype)):
        try:
            zk.delete(path)
        except (NoNodeError, NotEmptyError):
            return


def list_acls(zk, root: str, resource_type: Optional[str] = None, name: Optional[str] = None,
              pattern_type: Optional[str] = None) -> list:
    """The stored ACLs, sorted; only those of ``resource_type`` / the resource pattern named exactly
    ``name`` / of ``pattern_type`` when given."""
    paths, out = ZkPaths(root), []
    types = [resource_type] if resource_type else sorted(children(zk, paths.acls()))
    for rtype in types:
        ptypes = [pattern_type] if pattern_type else sorted(children(zk, paths.acl_resource_type(rtype)))
        for ptype in ptypes:
            if name is not None:
                out += _read(zk, paths.acl_resource(rtype, ptype, name))[0]
                continue
            for component in sorted(children(zk, paths.acl_pattern_type(rtype, ptype))):
                out += _read(zk, f"{paths.acl_pattern_type(rtype, ptype)}/{component}")[0]
    return sorted(out, key=_order)


def _order(a: Acl):
    return (a.resource_type, a.name, a.pattern_type, a.principal, a.permission, a.operation)


class AclCache:
    """Every ACL, kept current by ZooKeeper watches (kazoo's TreeCache on ``<root>/acls``).
    ``on_change(acls)`` gets the full list once loaded (before the constructor returns, unless ZooKeeper
    is too slow) and again after every change, on the cache's thread."""

    def __init__(self, zk, root: str, on_change: Callable[[list], None], timeout: float = 15.0):
        self._paths = ZkPaths(root)
        self._root = self._paths.acls()
        self._on_change = on_change
        self._loaded = False
        self._ready = threading.Event()
        self._tree = TreeCache(zk, self._root)
        self._tree.listen(self._on_event)
        self._tree.listen_fault(lambda e: log.error("the cache of ACLs failed: %s", e))
        self._tree.start()
        if not self._ready.wait(timeout):
            log.warning("ACLs not loaded from ZooKeeper within %.0fs; requests are denied until they are", timeout)

    def acls(self) -> list:
        out = []
        tree = self._tree
        for rtype in tree.get_children(self._root) or ():
            for ptype in tree.get_children(f"{self._root}/{rtype}") or ():
                base = f"{self._root}/{rtype}/{ptype}"
                for component in tree.get_children(base) or ():
                    node = tree.get_data(f"{base}/{component}")
                    if node is None:
                        continue
                    try:
                        out += acl_mod.decode(node.data)
                    except (ValueError, KeyError, TypeError) as e:
                        log.warning("%s/%s holds no valid ACLs (%s); ignored", base, unquote_component(component), e)
        return sorted(out, key=_order)

    def close(self) -> None:
        self._tree.close()

    def _on_event(self, event) -> None:
        if event.event_type == TreeEvent.INITIALIZED:
            self._loaded = True
        elif not self._loaded or event.event_type not in (TreeEvent.NODE_ADDED, TreeEvent.NODE_UPDATED,
                                                           TreeEvent.NODE_REMOVED):
            return
        elif event.event_data is None or event.event_data.path.count("/") != self._root.count("/") + 3:
            return  # a type or pattern-type node: its ACLs come as events of their own
        try:
            self._on_change(self.acls())
        except Exception:  # noqa: BLE001 - a bug of the listener must not stop the cache
            log.exception("applying changed ACLs failed")
        self._ready.set()
