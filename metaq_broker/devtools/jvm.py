"""Class-data archives for the development JVMs: ZooKeeper's (tests, quickstart, ``metaq zookeeper``) and
the tests' Spark drivers (tests/spark_helpers.py; the quickstart's own Spark driver does not use one).

Why: such a JVM spends most of its short life loading and verifying classes. The JDK's class-data sharing
(CDS; a dynamic archive, JDK 13+) maps the classes a JVM loaded once from an archive instead: measured on
this project's 2-core machine, a Spark session's start, first job and stop 10.5 -> 5 CPU-s (and 10 -> 5 s),
a ZooKeeper's start and stop 1.3 -> 0.7 CPU-s. Nothing else changes: the same classes, flags and code.

An archive is valid only for the JDK, the classpath and the flags it was made with, so its file name
carries a digest of the java executable, the JDK's module image, the jar directory's listing and the flags:
an upgraded pyspark or JDK gets a new archive and never maps an old one. A JVM given an archive it cannot
use runs without it (``-Xshare:auto``, the default) and says nothing (``-Xlog:cds=off``): an archive only
ever saves time. ``make`` writes one under a temporary name and renames it when the JVM that dumped it
has exited, so no JVM maps a half-written archive; two makers at once each write their own and the last
rename wins. Archives live in ``$METAQ_JVM_CACHE``, else ``$XDG_CACHE_HOME/metaq/jvm`` or ``~/.cache/metaq/jvm``.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable, Sequence

QUIET = ("-Xlog:cds=off", "-Xlog:cds+dynamic=off")  # an unusable archive is skipped, not reported


def cache_dir() -> Path:
    if os.environ.get("METAQ_JVM_CACHE"):
        return Path(os.environ["METAQ_JVM_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "metaq" / "jvm"


def archive_path(kind: str, java: str, jars: Path, flags: Sequence[str]) -> Path:
    """Where the archive of ``kind`` (a JVM's role: "zookeeper", "spark-driver") for this JDK, jar directory
    and flags is kept."""
    digest = hashlib.sha256()
    java_home = Path(os.path.realpath(java)).parent.parent
    for path in (Path(os.path.realpath(java)), java_home / "lib" / "modules"):
        digest.update(_identity(path))
    for jar in sorted(Path(jars).glob("*.jar")):
        digest.update(_identity(jar))
    digest.update("\0".join(flags).encode())
    return cache_dir() / f"{kind}-{digest.hexdigest()[:16]}.jsa"


def _identity(path: Path) -> bytes:
    try:
        st = path.stat()
    except OSError:
        return f"{path}:missing".encode()
    return f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()


def sharing_options(archive: Path) -> list:
    """The flags that map ``archive``: none while it does not exist yet."""
    return [f"-XX:SharedArchiveFile={archive}", *QUIET] if archive.is_file() else []


def make(archive: Path, run: Callable[[list], None]) -> bool:
    """Make ``archive`` unless it exists: ``run(flags)`` must start a JVM with ``flags`` added, have it load
    what it usually loads, and return once it has exited normally (a JVM writes its archive as it exits; a
    killed one writes none). True when the archive exists afterwards."""
    if archive.is_file():
        return True
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(f"{archive.name}.{os.getpid()}.partial")
    try:
        run([f"-XX:ArchiveClassesAtExit={partial}", *QUIET])
        if partial.is_file() and partial.stat().st_size > 0:
            os.replace(partial, archive)
    finally:
        partial.unlink(missing_ok=True)
    return archive.is_file()
