"""Brokers restarted after a crash that wait for their previous run's ZooKeeper session to expire:
each says so in an ephemeral ``<root>/brokers/starting/<brokerId>`` of its new session (JSON: address,
since, expectedExpiry, oldSession) until it has registered. The broker writes it
(``server/registration.py``); admins and the console read it here."""
from __future__ import annotations

import json

from kazoo.exceptions import NoNodeError

from metaq_broker.zk.groups import master_data
from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.session import children


def waiting_brokers(zk, paths: ZkPaths) -> dict:
    """{brokerId: the starting node's JSON} of brokers still waiting: their id's node is missing or still
    held by another session (the crashed run's)."""
    root = paths.brokers_starting()
    out = {}
    for name in children(zk, root):
        try:
            data, stat = zk.get(f"{root}/{name}")
            info, bid = json.loads(data), int(name)
        except (NoNodeError, ValueError):
            continue  # registered meanwhile, or not a broker's
        master = master_data(zk, paths, bid)[1]  # a broker of the layout before issue 28 registers there too
        registered = master is not None and master.ephemeralOwner == stat.ephemeralOwner
        if not registered:
            out[bid] = info
    return out
