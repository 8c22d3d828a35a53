"""A SPARK_HOME for the Spark this project starts (the tests, ``jvm_archives.py``, ``metaq quickstart``) whose
Python workers import the installed pyspark, compiled once, instead of compiling it again in every worker.

Why: the pyspark wheel is its own SPARK_HOME, and Spark puts its ``python/lib/pyspark.zip`` (sources, no
bytecode) first on every Python worker's path. Python never caches bytecode for a module in a zip, so each
daemon and each worker compiles every pyspark module it imports. Measured on this project's 2-core
machine: importing ``pyspark.daemon`` costs 0.78 CPU-s from the zip and 0.22 from the installed package,
a data source planner's module 1.08 and 0.50; a session's first query started its nine Python processes
on 7.5 CPU-s, and on 3.2 from here. The test suite starts ~460 of them.

This directory holds a link to each entry of the wheel's SPARK_HOME except ``python/``. Spark runs the
same launch scripts and jars through the links, the zip Spark names on the workers' path does not exist
(Python skips such an entry), and the workers import the pyspark the driver imports, of the same
version, from its bytecode cache. Nothing else the tests run changes (``bin/pyspark``'s shell, which reads
``python/``, is not run from here). It is made once per machine and pyspark installation, under a
temporary name and renamed (two makers at once: the first rename wins), beside the JVM archives
(``jvm.cache_dir()``).
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from metaq_broker.devtools import jvm

log = logging.getLogger(__name__)

# Not linked: the wheel's python/lib (pyspark.zip and py4j's source zip); what is written into a SPARK_HOME
# as Spark and Python run (work/: local-cluster applications; __pycache__), so the home's name stays put
LEFT_OUT = frozenset({"python", "work", "__pycache__"})


def wheel_home() -> Optional[Path]:
    """The installed pyspark's directory when it is a Spark home (the wheel's: ``bin/spark-submit`` and
    ``jars/`` beside the package), found without importing pyspark (0.3 s); else None (no pyspark, or one
    from a Spark source tree, whose own SPARK_HOME pyspark finds as before)."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.submodule_search_locations:
        return None
    wheel = Path(os.path.realpath(list(spec.submodule_search_locations)[0]))
    return wheel if (wheel / "bin" / "spark-submit").is_file() and (wheel / "jars").is_dir() else None


def spark_home() -> Optional[Path]:
    """This machine's SPARK_HOME for the installed pyspark (made if missing); None without a wheel's."""
    wheel = wheel_home()
    if wheel is None:
        return None
    entries = sorted(e for e in os.listdir(wheel) if e not in LEFT_OUT)
    digest = hashlib.sha256("\0".join([str(wheel), *entries]).encode()).hexdigest()[:16]
    home = jvm.cache_dir() / f"spark-home-{digest}"
    if home.is_dir():
        return home
    home.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=home.parent, prefix=f".{home.name}."))
    try:
        for entry in entries:
            os.symlink(wheel / entry, partial / entry)
        os.rename(partial, home)
    except OSError:
        if not home.is_dir():  # not another maker's rename: a real failure
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return home


def spark_jars() -> Optional[Path]:
    """The jars directory a Spark driver started now names on its classpath (``$SPARK_HOME/jars``): what
    its class-data archive must be made with."""
    home = os.environ.get("SPARK_HOME") or wheel_home()
    return Path(home) / "jars" if home else None


def use() -> None:
    """Point SPARK_HOME (this process's, which its children inherit) at ``spark_home()``, unless it is set
    already: to another Spark, or to this one by the process that started us. A home that cannot be made
    (a read-only cache, no home directory, a full disk) leaves SPARK_HOME unset: Spark then runs from the
    wheel, its workers compiling the zip, as without this module."""
    if os.environ.get("SPARK_HOME"):
        return
    try:
        home = spark_home()
    except (OSError, RuntimeError) as e:
        log.warning("no SPARK_HOME of compiled pyspark for the Python workers (%s); they import the wheel's zip", e)
        return
    if home is not None:
        os.environ["SPARK_HOME"] = str(home)


@contextmanager
def launching():
    """``use()`` for as long as a Spark JVM is being started (it and its Python workers keep the environment
    they start with), then SPARK_HOME as it was: what a tool starting Spark in someone else's process (the
    quickstart, maybe in a notebook) does, leaving that process's environment as it found it."""
    before = os.environ.get("SPARK_HOME")
    use()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("SPARK_HOME", None)
        else:
            os.environ["SPARK_HOME"] = before
