"""Retention: when a sealed segment is due for removal (MetaQ's delete policy ``delete|archive,<hours>``
and a size bound per partition), and archiving it (gzip into ``archive/``) before it goes. The partition
removes due segments oldest first, under its write lock (``PartitionLog.apply_retention``)."""
from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path
from typing import Optional

from metaq_broker.store.config import TopicConfig
from metaq_broker.store.durable import fsync_dir, make_dirs
from metaq_broker.store.segment import Segment


def removal_reason(seg: Segment, partition_bytes: int, config: TopicConfig, now_ms: int) -> Optional[str]:
    """Why the partition's oldest segment ``seg`` is due (None: it is not), given the partition's size."""
    cutoff = now_ms - config.delete_policy.hours * 3600 * 1000
    if seg.count and seg.last_timestamp < cutoff:
        return "older than the delete policy"
    if config.retention_bytes > 0 and partition_bytes - seg.size >= config.retention_bytes:
        return "over the size bound"
    return None


def archive_segment(seg: Segment, archive: Path) -> None:
    """Copy the segment gzipped into ``archive`` (tmp, fsync, rename, fsync of the directory)."""
    make_dirs(archive)
    target = archive / (seg.path.name + ".gz")
    tmp = target.with_suffix(".gz.tmp")
    with open(seg.path, "rb") as src, gzip.open(tmp, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, target)
    fsync_dir(archive)
