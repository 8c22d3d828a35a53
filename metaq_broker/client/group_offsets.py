"""Consumer-group state in ZooKeeper, MetaQ's layout: committed offsets (ASCII decimal), members
(ephemeral ``ids/<consumerId>``) and partition owners (ephemeral ``owners/<topic>/<partition>``)."""
from __future__ import annotations

from kazoo.exceptions import NodeExistsError, NoNodeError

from ..zkpaths import ZkPaths, parse_partition_name


class GroupStore:
    def __init__(self, zk, root: str = "/meta"):
        self.zk = zk
        self.paths = ZkPaths(root)

    # -- offsets --------------------------------------------------------------------------------------
    def commit(self, group: str, topic: str, offsets: dict) -> None:
        """Write ``{partition: next offset}`` in one ZooKeeper transaction."""
        if not offsets:
            return
        parent = self.paths.group_offsets(group, topic)
        self.zk.ensure_path(parent)
        tx = self.zk.transaction()
        for partition, offset in offsets.items():
            path = self.paths.group_offset(group, topic, partition)
            data = str(int(offset)).encode()
            if self.zk.exists(path):
                tx.set_data(path, data)
            else:
                tx.create(path, data)
        results = tx.commit()
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            raise errors[0]

    def fetch(self, group: str, topic: str) -> dict:
        try:
            children = self.zk.get_children(self.paths.group_offsets(group, topic))
        except NoNodeError:
            return {}
        out = {}
        for p in children:
            try:
                out[p] = int(self.zk.get(self.paths.group_offset(group, topic, p))[0])
            except (NoNodeError, ValueError):
                continue
        return out

    def groups(self) -> list:
        try:
            return sorted(self.zk.get_children(self.paths.consumers()))
        except NoNodeError:
            return []

    def group_topics(self, group: str) -> list:
        try:
            return sorted(self.zk.get_children(f"{self.paths.group(group)}/offsets"))
        except NoNodeError:
            return []

    # -- membership and balancing ---------------------------------------------------------------------
    def join(self, group: str, consumer_id: str, topics) -> None:
        path = self.paths.group_member(group, consumer_id)
        self.zk.ensure_path(self.paths.group_ids(group))
        data = ",".join(topics).encode()
        try:
            self.zk.create(path, data, ephemeral=True)
        except NodeExistsError:
            self.zk.set(path, data)

    def leave(self, group: str, consumer_id: str) -> None:
        try:
            self.zk.delete(self.paths.group_member(group, consumer_id))
        except NoNodeError:
            pass

    def members(self, group: str) -> list:
        try:
            return sorted(self.zk.get_children(self.paths.group_ids(group)))
        except NoNodeError:
            return []

    def assign(self, group: str, consumer_id: str, topic: str, partitions) -> list:
        """This member's share by the range rule: sorted members take contiguous runs of the sorted
        partitions, the first ``len(partitions) % len(members)`` members one extra."""
        members = self.members(group)
        if consumer_id not in members:
            return []
        parts = sorted(partitions, key=parse_partition_name)
        i, k = members.index(consumer_id), len(members)
        per, extra = divmod(len(parts), k)
        start = i * per + min(i, extra)
        return parts[start: start + per + (1 if i < extra else 0)]

    def claim(self, group: str, topic: str, partition: str, consumer_id: str) -> bool:
        """Own ``partition`` (ephemeral node); False while another member still owns it."""
        path = self.paths.group_owner(group, topic, partition)
        self.zk.ensure_path(self.paths.group_owners(group, topic))
        try:
            self.zk.create(path, consumer_id.encode(), ephemeral=True)
            return True
        except NodeExistsError:
            try:
                return self.zk.get(path)[0].decode() == consumer_id
            except NoNodeError:
                return self.claim(group, topic, partition, consumer_id)

    def release(self, group: str, topic: str, partition: str, consumer_id: str) -> None:
        path = self.paths.group_owner(group, topic, partition)
        try:
            if self.zk.get(path)[0].decode() == consumer_id:
                self.zk.delete(path)
        except NoNodeError:
            pass
