"""Making file-system changes survive a power cut: a new or renamed directory entry is durable only once
its parent directory is fsynced, not when the file itself is (POSIX; ext4 and xfs behave so)."""
from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(directory: Path) -> Path:
    """``mkdir -p`` whose new directories survive a power cut: each one created is fsynced into its parent.
    Returns ``directory``."""
    directory = Path(directory)
    missing = []
    at = directory
    while not at.exists():
        missing.append(at)
        at = at.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:  # made meanwhile by another thread or process: still fsync its parent
            pass
        fsync_dir(d.parent)
    return directory


def replace_file(path: Path, data: bytes) -> None:
    """Write ``path`` whole (temporary name, fsync, rename, fsync of the directory): after a crash it holds
    either the old or the new contents, and the new ones once this returns."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
