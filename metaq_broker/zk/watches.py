"""kazoo's watch recipes, made to survive ZooKeeper losing its data.

A ZooKeeper that lost its data (or went back to an older snapshot) counts zxids from the start again.
kazoo's ``DataWatch`` calls back only when a node's ``mzxid`` changed, so a node written again there with
the ``mzxid`` the old one had, and other data, is never seen: a client kept sending to a member that was no
longer master until its timeout. kazoo's ``ChildrenWatch`` stops for good when its node is missing, so a
root that is gone when a new session starts (no broker has written it again yet) is never followed again:
no broker or topic registered later was seen. These two watches go on in both cases.
"""
from __future__ import annotations

from kazoo.exceptions import ConnectionClosedError
from kazoo.protocol.states import EventType
from kazoo.recipe.watchers import ChildrenWatch, DataWatch


class FollowingDataWatch(DataWatch):
    """A ``DataWatch`` that calls back on every read it makes (a watch event, a new connection or
    session), not only when the ``mzxid`` moved: callers apply what they are given, so the same data
    twice costs nothing."""

    @property
    def _version(self):
        return object()  # equal to nothing: kazoo's "unchanged" test never holds

    @_version.setter
    def _version(self, value) -> None:
        pass


class FollowingChildrenWatch(ChildrenWatch):
    """A ``ChildrenWatch`` of a node that may be missing for a while (a root, after ZooKeeper lost its
    data): once missing it calls back with no children, an ``exists`` watch waits for the node, and
    following resumes once it is created. A callback returning False still ends it."""

    def _get_children(self, event=None):
        super()._get_children(event)
        with self._run_lock:  # as kazoo calls back: one at a time
            if not self._stopped or self._func is None:
                return  # following, or ended by its callback
            self._stopped, self._watch_established = False, False  # missing (NoNodeError)
            had, self._prior_children = self._prior_children, []
            if had and (self._func([], event) if self._send_event else self._func([])) is False:
                self._stopped, self._func = True, None
                if self._allow_session_lost:
                    self._client.remove_listener(self._session_watcher)
                return
        try:
            if self._client.retry(self._client.exists, self._path, watch=self._created) is not None:
                self._client.handler.spawn(self._get_children)  # created meanwhile
        except ConnectionClosedError:
            pass  # the client was closed: nothing to follow

    def _created(self, event) -> None:
        if event.type == EventType.CREATED:
            self._get_children(event)
