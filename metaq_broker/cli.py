"""The ``metaq`` command line. For now: inspect and verify partition logs on disk (like Kafka's
kafka-dump-log); the broker issue adds topics, produce, consume, offsets, groups and quickstart."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from . import __version__
from .errors import MetaqError
from .store.config import TopicConfig
from .store.partition import PartitionLog


def _open_partition(directory: Path) -> PartitionLog:
    topic, _, num = directory.name.rpartition("-")
    if not topic or not num.isdigit():
        raise click.BadParameter(f"{directory} is not a <topic>-<partition> directory", param_hint="PARTITION_DIR")
    return PartitionLog(directory, topic, int(num), TopicConfig())


@click.group()
@click.version_option(__version__, prog_name="metaq")
def main():
    """metaq: a MetaQ-style message broker with an exactly-once Spark connector."""


@main.group("log")
def log_group():
    """Inspect partition logs in a broker's data directory (run only while the broker is stopped)."""


@log_group.command("describe")
@click.argument("partition_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
def describe(partition_dir: Path):
    """List a partition's segments: offsets, bytes and last store time."""
    try:
        p = _open_partition(partition_dir)
    except MetaqError as e:
        raise click.ClickException(str(e))
    try:
        click.echo(f"{p.name}: offsets {p.earliest_offset} to {p.latest_offset} (next), {p.size_bytes} bytes")
        for s in p.segments():
            click.echo(f"  {s.path.name}  base offset {s.base_offset:>12}  messages {s.count:>10}  bytes {s.size:>12}"
                       f"  last stored {s.last_timestamp if s.last_timestamp is not None else '-'}")
    finally:
        p.close()


@log_group.command("verify")
@click.argument("partition_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
def verify(partition_dir: Path):
    """Check every batch's checksums and offsets; exit 1 if anything is damaged."""
    try:
        p = _open_partition(partition_dir)
    except MetaqError as e:
        click.echo(f"damaged: {e}", err=True)
        sys.exit(1)
    try:
        problems = p.verify()
    finally:
        p.close()
    for problem in problems:
        click.echo(f"damaged: {problem}", err=True)
    if problems:
        sys.exit(1)
    click.echo(f"{partition_dir.name}: ok")
