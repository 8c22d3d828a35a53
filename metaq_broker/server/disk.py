"""A full disk, told plainly: a write that hits ENOSPC (or a quota) becomes a ``DiskFullError`` naming the
path and the free space (RESOURCE_EXHAUSTED on the wire) instead of an INTERNAL error with a traceback,
the broker logs one WARNING line now and then rather than one per refused write, and the state is seen in
the metrics and the health service (``metaq.write``) until a write succeeds again. Nothing is retried
here: the store cuts every failed append back, so writes resume by themselves once space is freed."""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from metaq_broker.errors import DiskFullError
from metaq_broker.protocol.status import DISK_FULL

log = logging.getLogger(__name__)

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
WARN_EVERY_S = 30.0  # at most one WARNING line per this many seconds while writes keep failing


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in FULL_ERRNOS


def free_space(path) -> tuple:
    """(bytes free to the broker, bytes in all) of the file system holding ``path`` (or its nearest
    existing parent); (-1, -1) if it cannot be asked."""
    at = Path(path)
    while True:
        try:
            st = os.statvfs(at)
            return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        except FileNotFoundError:
            if at.parent == at:
                return -1, -1
            at = at.parent
        except OSError:
            return -1, -1


def human(n: int) -> str:
    if n < 0:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


class DiskState:
    """Whether the last write of this broker found its disk full, and how often writes did.
    ``on_change(full)`` is called when that flips (the broker's health service)."""

    def __init__(self, data_path, on_change: Optional[Callable[[bool], None]] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.data_path = Path(data_path)
        self.full = False
        self.errors = 0  # writes refused for a full disk since the broker started
        self._on_change, self._clock = on_change, clock
        self._lock = threading.Lock()
        self._warned_at: Optional[float] = None
        self._unwarned = 0

    def error(self, e: OSError, where=None, note: str = "") -> DiskFullError:
        """The DiskFullError for ``e`` (the path it names, else ``where``, else the data directory),
        counted and logged (rate-limited)."""
        path = e.filename or where or self.data_path
        free, total = free_space(path)
        message = (f"{DISK_FULL} cannot write {path}: {e.strerror or os.strerror(e.errno)} ({human(free)} free of "
                   f"{human(total)}); {note or 'nothing of this call was stored: send it again once space is freed'}")
        with self._lock:
            self.errors += 1
            became_full, self.full = not self.full, True
            now = self._clock()
            warn = self._warned_at is None or now - self._warned_at >= WARN_EVERY_S
            unwarned, self._unwarned = (self._unwarned, 0) if warn else (0, self._unwarned + 1)
            if warn:
                self._warned_at = now
        if warn:
            log.warning("%s%s", message, f" ({unwarned} more refused since the last warning)" if unwarned else "")
        if became_full and self._on_change is not None:
            self._on_change(True)
        return DiskFullError(message, str(path), free)

    def ok(self) -> None:
        """A write succeeded: the disk is no longer full (costs one attribute read when it was not)."""
        if not self.full:
            return
        with self._lock:
            if not self.full:
                return
            self.full, unwarned, self._unwarned, self._warned_at = False, self._unwarned, 0, None
        free, _ = free_space(self.data_path)
        log.info("writes succeed again (%s free in %s)%s", human(free), self.data_path,
                    f"; {unwarned} more were refused for a full disk since the last warning" if unwarned else "")
        if self._on_change is not None:
            self._on_change(False)
