"""Making file-system changes survive a power cut: a new or renamed directory entry is durable only once
its parent directory is fsynced, not when the file itself is (POSIX; ext4 and xfs behave so). And keeping
them private: directories the broker makes are 0700 and the files it writes 0600 (``PRIVATE_UMASK`` in the
broker process; explicit modes here), whatever the operator's umask, since segments hold messages that
only ACLs may hand out and ``session.key`` signs every SASL session."""
from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path

log = logging.getLogger(__name__)

DIR_MODE, FILE_MODE = 0o700, 0o600
PRIVATE_UMASK = 0o077  # the broker process's umask on top of the operator's: new files 0600, directories 0700


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
            d.mkdir(DIR_MODE)  # mkdir's mode is narrowed by the umask, never widened
        except FileExistsError:  # made meanwhile by another thread or process: still fsync its parent
            pass
        fsync_dir(d.parent)
    return directory


DELETED_SUFFIX = ".deleted"  # a directory being removed (``remove_dir``): never opened, finished off on start


def remove_dir(directory: Path) -> None:
    """Remove ``directory`` and what is below it so that a crash at any point leaves either the directory
    whole or a ``<name>.deleted`` one, which ``finish_removals`` removes on the next start: renamed first
    (atomic, the rename fsynced into the parent), then removed, then the parent fsynced again."""
    directory = Path(directory)
    doomed = directory.with_name(directory.name + DELETED_SUFFIX)
    if doomed.exists():  # a removal cut short: finished now, the new one renamed over nothing
        shutil.rmtree(doomed)
    os.rename(directory, doomed)
    fsync_dir(directory.parent)
    shutil.rmtree(doomed)
    fsync_dir(directory.parent)


def finish_removals(parent: Path) -> list:
    """Remove every ``*.deleted`` directory below ``parent`` (removals a crash cut short); their names."""
    done = []
    for entry in sorted(Path(parent).iterdir()):
        if entry.name.endswith(DELETED_SUFFIX) and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
            done.append(entry.name)
    if done:
        fsync_dir(Path(parent))
    return done


def replace_file(path: Path, data: bytes) -> None:
    """Write ``path`` whole (temporary name, fsync, rename, fsync of the directory): after a crash it holds
    either the old or the new contents, and the new ones once this returns."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise naming(e, tmp) from None
    os.replace(tmp, path)
    fsync_dir(path.parent)


def restrict_tree(directory: Path) -> int:
    """Narrow what lies below ``directory`` to 0700 (directories) and 0600 (files) where group or others
    had any access (data directories written by an older version, or under a wide umask); returns how many
    entries changed. ``directory`` itself is left as it is: it may be a directory others share, so the
    broker only warns about it (``open_to_others``). Entries owned by another user are left alone too."""
    changed = 0
    uid = os.geteuid()
    for top, dirs, files in os.walk(directory):
        for name, mode in [(d, DIR_MODE) for d in dirs] + [(f, FILE_MODE) for f in files]:
            path = os.path.join(top, name)
            try:
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode) or st.st_uid != uid or not st.st_mode & 0o077:
                    continue
                os.chmod(path, stat.S_IMODE(st.st_mode) & mode)
                changed += 1
            except FileNotFoundError:
                continue  # removed meanwhile (the broker is not serving yet; an operator's tool may be)
    return changed


def open_to_others(path: Path) -> str | None:
    """``"0755"`` when group or others may access ``path``, else None."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    return f"{mode:04o}" if mode & 0o077 else None


def write_all(fd: int, parts: list, position: int | None = None) -> None:
    """Write every byte of ``parts`` (at ``position`` if given); loops over short writes."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        n = os.pwritev(fd, views, position) if position is not None else os.writev(fd, views)
        if position is not None:
            position += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def append_or_cut_back(fd: int, path: Path, parts: list, end: int, fsync: bool = False) -> None:
    """Write ``parts`` at ``end`` (the file's end), and fsync with ``fsync``. If either fails (a full disk,
    an I/O error) the file is cut back to ``end`` and the error raised: no partial record stays behind."""
    try:
        write_all(fd, parts, end)
        if fsync:
            os.fsync(fd)
    except OSError as e:
        try:
            os.ftruncate(fd, end)
        except OSError:
            log.exception("could not cut %s back to %d bytes after a failed write", path, end)
        raise naming(e, path) from None


def naming(e: OSError, path) -> OSError:
    """``e`` with ``path`` as its file name if it has none (``os.pwritev`` and ``os.fsync`` name no file),
    so a full disk's error can say where."""
    if e.filename is not None:
        return e
    named = type(e)(e.errno, e.strerror, str(path))
    named.__traceback__ = e.__traceback__
    return named
