"""The ``metaq`` command line: a local ZooKeeper, topics, produce, consume, lookups by key and message id,
offsets, groups, stats, SCRAM users and ACLs, the quickstart, and offline inspection of partition logs. Exit codes: 0 success, 1 the
operation failed (the message says why), 2 bad usage. ``--command-config FILE`` (Kafka's name) gives the
security settings of every command that connects: zk.* keys for ZooKeeper, the rest for brokers."""
from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import signal
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

import click
from kazoo.exceptions import KazooException, NoAuthError

from metaq_broker import __version__
from metaq_broker.client.admin import Admin
from metaq_broker.client.consumer import Consumer, GroupMember
from metaq_broker.client.producer import Producer
from metaq_broker.console.server import run as run_console
from metaq_broker.devtools.zookeeper import run_foreground
from metaq_broker.errors import ConfigError, MetaqError
from metaq_broker.protocol import records
from metaq_broker.protocol.lookup import DEFAULT_MAX_ANSWERS, MAX_ANSWERS
from metaq_broker.security import acl as acl_mod
from metaq_broker.security.scram import DEFAULT_ITERATIONS, MAX_ITERATIONS, MECHANISM, MIN_ITERATIONS, Credential
from metaq_broker.security.settings import ClientSecurity, ZkSecurity, load_properties, parse_principal
from metaq_broker.store import offset_index
from metaq_broker.store.config import TopicConfig
from metaq_broker.store.partition import PartitionLog
from metaq_broker.tools.progress import progressbar
from metaq_broker.tools.quickstart import run as run_quickstart
from metaq_broker.zk import acls as zk_acls
from metaq_broker.zk import users as zk_users
from metaq_broker.zk.session import new_client, start_client

ZK_HELP = "ZooKeeper connect string (env METAQ_ZK)"


@contextlib.contextmanager
def _client(cls, ctx_obj, **kw):
    """A client for the command, closed within ``CLOSE_S`` when it ends (``_closed``)."""
    try:
        if ctx_obj.get("props") is not None:
            kw["security"] = _client_security(ctx_obj)
        if ctx_obj["brokers"]:
            client = cls(brokers=ctx_obj["brokers"], **kw)
        else:
            client = cls(zk_connect=ctx_obj["zk"], zk_root=ctx_obj["zk_root"], **kw)
    except (MetaqError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    try:
        yield client
    finally:
        _closed(client)


# A command's client closes within this, or the command ends without waiting for it: a gRPC channel's close
# waits for every call begun on it to be drained, and a call whose start a Ctrl-C interrupted (between gRPC
# making the call and starting the thread that drains it) never is (stop 39's run: consume hung in close)
CLOSE_S = 5.0


def _closed(client) -> None:
    done, outcome = _awaited(client.close, CLOSE_S)
    if not done:
        click.echo(f"warning: the connections to the brokers did not close within {CLOSE_S:g}s; "
                   f"exiting without them", err=True)
    elif isinstance(outcome, BaseException):
        raise outcome


class Fail(click.ClickException):
    exit_code = 1


def _run(fn, *args, **kwargs):
    """Call ``fn``; turn metaq errors into a one-line message and exit code 1."""
    try:
        return fn(*args, **kwargs)
    except (MetaqError, ValueError, RuntimeError) as e:
        raise Fail(str(e)) from None


@click.group()
@click.version_option(__version__, prog_name="metaq")
@click.option("--zk", envvar="METAQ_ZK", default="127.0.0.1:2181", show_default=True, help=ZK_HELP)
@click.option("--zk-root", envvar="METAQ_ZK_ROOT", default="/meta", show_default=True)
@click.option("--brokers", envvar="METAQ_BROKERS", default=None,
              help="static broker list instead of ZooKeeper: '1=host:port,2=host:port'")
@click.option("--command-config", "command_config", type=click.Path(dir_okay=False), default=None,
              envvar="METAQ_COMMAND_CONFIG",
              help="properties file with security settings (security.protocol, ssl.*, sasl.*, zk.auth, zk.ssl.*)")
@click.pass_context
def main(ctx, zk, zk_root, brokers, command_config):
    """metaq: a MetaQ-style message broker with an exactly-once Spark connector."""
    with contextlib.suppress(ValueError, RuntimeError):  # not where stderr is no file (click's CliRunner)
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: where a command that hangs waits
    props = None
    if command_config is not None:
        try:
            props = load_properties(command_config)
        except ConfigError as e:
            raise click.BadParameter(str(e), param_hint="--command-config") from None
    ctx.obj = {"zk": zk, "zk_root": zk_root, "brokers": brokers, "command_config": command_config, "props": props}


def _client_security(obj) -> ClientSecurity:
    """The --command-config file's settings (checked; a bad key or value exits 2 naming it)."""
    try:
        where = obj.get("command_config")
        return ClientSecurity.from_properties(obj.get("props") or {}, where=f"{where}: " if where else "")
    except ConfigError as e:
        raise click.BadParameter(str(e), param_hint="--command-config") from None


def _zk_security(obj) -> ZkSecurity:
    return _client_security(obj).zk


@contextlib.contextmanager
def _zk_session(obj):
    """A ZooKeeper session with the --command-config file's zk.* settings; ZooKeeper's refusals become
    one-line errors (exit 1)."""
    client = new_client(obj["zk"], security=_zk_security(obj))
    _run(start_client, client, obj["zk"], 15.0)
    try:
        yield client
    except NoAuthError:
        raise Fail(f"ZooKeeper refused access under {obj['zk_root']} (NoAuth): give the cluster's zk.auth "
                   f"(zk.auth=digest:USER:PASSWORD) in the --command-config file") from None
    except KazooException as e:
        raise Fail(f"ZooKeeper request failed: {type(e).__name__} {e}".rstrip()) from None
    finally:
        client.stop()
        client.close()


# -- ZooKeeper ----------------------------------------------------------------------------------------
@main.command()
@click.option("--port", default=2181, show_default=True)
@click.option("--data", "data_dir", type=click.Path(file_okay=False), default=None,
              help="data directory (default: a temporary one, removed on exit)")
def zookeeper(port, data_dir):
    """Run a local ZooKeeper from the jars inside the pyspark wheel, for development (Ctrl-C stops it)."""
    sys.exit(_run(run_foreground, port, data_dir))


# -- brokers ------------------------------------------------------------------------------------------
@main.command()
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--forget", type=int, default=None, metavar="ID",
              help="remove a stopped broker for good: its partitions leave the topics (keys then hash over "
                   "the others)")
@click.pass_obj
def brokers(obj, fmt, forget):
    """Brokers, live and starting: one restarted after a crash waits until ZooKeeper expires the session
    of its previous run (about zk.sessionTimeout) before it registers. A stopped broker's partitions stay
    in its topics (down, not gone) until --forget. "kafka" is its Kafka listener's address (bootstrap.servers),
    "-" without one. Then the members of replicated broker groups: replicaId,
    address, role, epoch, in the in-sync set or not, lag in offsets behind the master (--format json: every
    broker's "members", groups of one included)."""
    with _client(Admin, obj) as admin:
        if forget is not None:
            gone = _run(admin.forget_broker, forget)
            click.echo(f"broker {forget} forgotten: its partitions left {', '.join(gone) or 'no topic'}")
            return
        rows, now = _run(admin.brokers_status), time.time()
        members = _run(admin.brokers)
        kafka = _run(admin.kafka_addresses)
    by_broker: dict = {}
    for m in members:
        by_broker.setdefault(m["brokerId"], []).append(m)
    if fmt == "json":
        click.echo(json.dumps([{"brokerId": r.broker_id, "address": r.address, "kafka": kafka.get(r.broker_id),
                                "state": r.state,
                                "since": r.since, "expectedExpiry": r.expected_expiry,
                                "secondsLeft": None if r.seconds_left(now) is None else round(r.seconds_left(now), 1),
                                "status": r.describe(now),
                                "members": [{k: v for k, v in m.items() if k != "brokerId"}
                                            for m in by_broker.get(r.broker_id, [])]} for r in rows]))
        return
    click.echo(f"{'broker':>6}  {'address':<22} {'kafka':<22} state")
    for r in rows:
        click.echo(f"{r.broker_id:>6}  {r.address:<22} {kafka.get(r.broker_id, '-'):<22} {r.describe(now)}")
    if not rows:
        click.echo("(no broker is registered)")
    replicated = [m for r in rows for m in by_broker.get(r.broker_id, []) if len(by_broker[r.broker_id]) > 1]
    if replicated:  # a group of one is its broker row above
        click.echo(f"\n{'group':>6} {'replica':>7}  {'address':<22} {'role':<9} {'epoch':>6} {'in-sync':<8} "
                   f"{'lag':>10}")
        for m in replicated:
            lag = "?" if m["lagMessages"] is None else m["lagMessages"]
            click.echo(f"{m['brokerId']:>6} {m['replicaId']:>7}  {m['address'] or '-':<22} {m['role']:<9} "
                       f"{m['epoch']:>6} {'yes' if m['inSync'] else 'no':<8} {lag:>10}")
        for bid in sorted({m["brokerId"] for m in replicated if m["error"]}):
            click.echo(f"group {bid}: no lag figures: {by_broker[bid][0]['error']}")


# -- topics -------------------------------------------------------------------------------------------
@main.group()
def topics():
    """List, describe, create and delete topics."""


@topics.command("list")
@click.pass_obj
def topics_list(obj):
    with _client(Admin, obj) as admin:
        for topic, parts in _run(admin.topics).items():
            click.echo(f"{topic}\t{len(parts)} partitions\t{','.join(parts)}")


@topics.command("describe")
@click.argument("topic")
@click.pass_obj
def topics_describe(obj, topic):
    with _client(Admin, obj) as admin:
        rows = _run(admin.describe, topic)
        click.echo(f"{'partition':<10} {'earliest':>12} {'latest':>12} {'bytes':>14} {'segments':>8}  state")
        for p in rows:
            click.echo(f"{p.partition:<10} {p.earliest:>12} {p.latest:>12} {p.bytes:>14} {p.segments:>8}  "
                       f"{'closed' if p.closed else 'open'}")


@topics.command("create")
@click.argument("topic")
@click.option("--partitions", type=click.IntRange(0, 10_000), default=0, help="per broker (0: broker default)")
@click.option("--broker", "broker_ids", type=int, multiple=True, help="broker id (default: every live broker)")
@click.option("--config", "settings", multiple=True, metavar="KEY=VALUE", help="per-topic setting, e.g. unflushThreshold=0")
@click.pass_obj
def topics_create(obj, topic, partitions, broker_ids, settings):
    config = {}
    for item in settings:
        if "=" not in item:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--config")
        k, v = item.split("=", 1)
        config[k.strip()] = v.strip()
    with _client(Admin, obj) as admin:
        names = _run(admin.create_topic, topic, partitions, list(broker_ids) or None, config)
        click.echo(f"topic {topic}: partitions {','.join(names)}")


@topics.command("delete")
@click.argument("topic")
@click.option("--timeout", type=click.FloatRange(0, 60), default=30.0, show_default=True,
              help="seconds to wait for the deletion to be done on every broker")
@click.pass_obj
def topics_delete(obj, topic, timeout):
    """Delete TOPIC on every broker and member of its groups, with its groups' offsets (Delete on the topic).
    A topic of a broker's server.ini is refused: it would come back at that broker's restart."""
    with _client(Admin, obj) as admin:
        if _run(admin.delete_topic, topic, timeout):
            click.echo(f"topic {topic}: deleted")
        else:
            click.echo(f"topic {topic}: deletion recorded, not done within {timeout:g}s (a broker that has it is "
                       f"down or busy); it goes on")


# -- produce / consume --------------------------------------------------------------------------------
@main.command()
@click.argument("topic")
@click.option("--file", "path", type=click.File("rb"), default=None, help="one message a line (default stdin)")
@click.option("--count", type=click.IntRange(1), default=None, help="send generated test messages instead")
@click.option("--size", type=click.IntRange(1), default=100, show_default=True, help="bytes per generated message")
@click.option("--key", default=None, help="the key of every message (same key, same partition)")
@click.option("--partition", default=None, help="send everything to this partition (<brokerId>-<n>)")
@click.option("--batch", type=click.IntRange(1, 1_000_000), default=1000, show_default=True)
@click.option("--progress/--no-progress", default=None,
              help="progress bar on stderr for --count (default: when stderr is a terminal)")
@click.pass_obj
def produce(obj, topic, path, count, size, key, partition, batch, progress):
    """Send messages: lines of a file or stdin, or --count generated ones (with a progress bar)."""

    with _client(Producer, obj) as producer:
        def send(values) -> int:
            keys = None if key is None else [key] * len(values)
            _run(producer.send_batch, topic, values, keys=keys, partition=partition)
            return len(values)

        sent = 0
        if count is not None:
            show = sys.stderr.isatty() if progress is None else progress
            with progressbar(show, length=count, label=f"producing to {topic}") as bar:
                while sent < count:
                    n = send([(b"%012d " % (sent + i)).ljust(size, b".")[:size]
                              for i in range(min(batch, count - sent))])
                    sent += n
                    bar.update(n)
        else:
            lines = []
            for line in path or click.get_binary_stream("stdin"):
                lines.append(line.rstrip(b"\r\n"))
                if len(lines) == batch:
                    sent += send(lines)
                    lines = []
            if lines:
                sent += send(lines)
        click.echo(f"sent {sent} messages to {topic}", err=True)


@main.command()
@click.argument("topic")
@click.option("--partition", "partitions", multiple=True, help="partition(s) to read (default: all)")
@click.option("--from", "start", default=None,
              help="earliest, latest or an offset  [default: earliest; with --group the group's committed "
                   "offsets, earliest where it has none]")
@click.option("--max", "max_messages", type=click.IntRange(1), default=None, help="stop after this many")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--follow/--no-follow", default=False, help="keep waiting for new messages")
@click.option("--group", default=None, help="join this consumer group: read this member's share of the "
              "partitions and commit the offset after each message printed")
@click.pass_obj
def consume(obj, topic, partitions, start, max_messages, fmt, follow, group):
    """Print messages: value per line (text; a null value prints as null, as Kafka's console consumer
    prints it), or one JSON object per line (value null for a null value; timestampType CreateTime or
    LogAppendTime: what the timestamp is)."""
    if start is not None and start not in ("earliest", "latest") and not start.lstrip("-").isdigit():
        raise click.BadParameter("use earliest, latest or an offset", param_hint="--from")
    if group is not None and partitions:
        raise click.UsageError("--group and --partition cannot be combined: a group member reads the share of "
                               "the partitions the group assigns it")
    with _client(Consumer, obj, group=group) as consumer:
        member = None
        if group is None:
            parts = list(partitions) or _run(consumer.partitions, topic)
            ranges = _run(consumer.offsets, topic, parts)
            start = start or "earliest"
            pos = {p: ranges[p][0] if start == "earliest" else ranges[p][1] if start == "latest" else int(start)
                   for p in parts}
        else:
            member = _run(GroupMember, consumer, topic, start if start in (None, "earliest", "latest") else int(start))
            parts, pos = _share(member)
        printed = 0
        out = click.get_binary_stream("stdout")
        try:
            while max_messages is None or printed < max_messages:
                moved = False  # by offsets: a fetch of transaction markers or aborted messages prints nothing
                for p in parts:
                    if max_messages is not None and printed >= max_messages:
                        break
                    f = _run(consumer.fetch, topic, p, pos[p], max_wait_ms=200 if follow else 0)
                    moved |= f.next_offset > pos[p]
                    messages = f.messages()
                    if max_messages is not None and printed + len(messages) > max_messages:
                        messages = messages[:max_messages - printed]
                        pos[p] = messages[-1].offset + 1  # the group resumes after the last one printed
                    else:
                        pos[p] = f.next_offset
                    for m in messages:
                        _print_message(out, m, fmt)
                    printed += len(messages)
                out.flush()
                if member is not None and moved:
                    _in_group(member.commit)
                if not moved and not follow:
                    break
                if member is not None and follow and _in_group(member.rebalance_if_due):  # members come and go
                    parts, pos = _share(member)
        finally:
            if member is not None:
                out.flush()
                _in_group(member.commit, COMMIT_BEFORE_EXIT_S,
                          "the messages printed since the last commit will be read again")


def _in_group(call, bound: Optional[float] = None, otherwise: str = "the next commit takes them"):
    """A group member's commit or rebalance, run by ``_awaited`` for at most ``bound`` seconds. ZooKeeper
    lost or silent is a warning ending in ``otherwise``, not the end of the command (False then): kazoo
    raises ConnectionLoss for the call it had sent and holds later ones until it reconnects."""
    done, outcome = _awaited(lambda: _run(call), bound)
    if done and not isinstance(outcome, BaseException):
        return outcome
    if done and not isinstance(outcome, KazooException):
        raise outcome
    why = f"{type(outcome).__name__} from ZooKeeper" if done else f"ZooKeeper did not answer within {bound:g}s"
    click.echo(f"warning: the group's offsets were not committed ({why}); {otherwise}", err=True)
    return False


# The last commit of a member that ends (Ctrl-C, --max, the end of the topic) waits this long at most: a
# command must end while ZooKeeper is away (the call is dropped when the client closes).
COMMIT_BEFORE_EXIT_S = 10.0


def _awaited(call, bound: Optional[float] = None) -> tuple:
    """(done, what ``call()`` returned or raised), run in a thread of its own while the command's thread
    waits in slices of 0.1 s, for at most ``bound`` seconds: a command waiting on a lock without a timeout
    (kazoo's calls) misses a Ctrl-C the kernel hands to another of its threads, since Python runs signal
    handlers in the main thread only, between its bytecodes (stop 38's run: a commit held while
    ZooKeeper was away never ended)."""
    outcome = []

    def run():
        try:
            outcome.append(call())
        except BaseException as e:  # noqa: BLE001 - returned to the command's thread
            outcome.append(e)
    worker = threading.Thread(target=run, daemon=True, name="awaited")
    worker.start()
    deadline = None if bound is None else time.monotonic() + bound
    while worker.is_alive() and (deadline is None or time.monotonic() < deadline):
        worker.join(0.1)
    return (True, outcome[0]) if outcome else (False, None)


def _print_message(out, m, fmt: str) -> None:
    """A message as ``consume`` and ``lookup`` print it: its value (text; null for a null value), or one
    JSON object."""
    if fmt == "text":
        out.write((b"null" if m.value is None else m.value) + b"\n")
        return
    out.write(json.dumps({
        "topic": m.topic, "partition": m.partition, "offset": m.offset,
        "key": None if m.key is None else m.key.decode("utf-8", "backslashreplace"),
        "value": None if m.value is None else m.value.decode("utf-8", "backslashreplace"),
        "timestamp": m.timestamp.isoformat(), "timestampType": records.TIMESTAMP_TYPE_NAMES[m.timestamp_type],
        "msgId": m.msg_id, "flag": m.flag, "attribute": m.attribute}).encode() + b"\n")


@main.command()
@click.argument("topic")
@click.option("--key", default=None, help="the messages with this key (UTF-8), newest first")
@click.option("--msg-id", "msg_id", type=int, default=None, help="the message with this id")
@click.option("--since", default=None, metavar="TIME",
              help="stored at or after TIME: ISO 8601 (local time without a zone) or ms since the epoch")
@click.option("--until", default=None, metavar="TIME", help="stored at or before TIME (as --since)")
@click.option("--max", "max_messages", type=click.IntRange(1, MAX_ANSWERS), default=DEFAULT_MAX_ANSWERS,
              show_default=True, help="at most this many messages")
@click.option("--partition", "partitions", multiple=True, help="only these partitions (default: all)")
@click.option("--read-uncommitted", is_flag=True, help="also messages of transactions not yet committed")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.pass_obj
def lookup(obj, topic, key, msg_id, since, until, max_messages, partitions, read_uncommitted, fmt):
    """Print the messages of TOPIC with a key (--key), newest first, or the message with an id (--msg-id),
    as consume prints them; found through the brokers' key and offset indexes, not by reading the topic.
    Exit code 0 also when none is found (nothing is printed then)."""
    if (key is None) == (msg_id is None):
        raise click.UsageError("give --key or --msg-id, one of them")
    with _client(Consumer, obj) as consumer:
        found = _run(consumer.lookup, topic, key=key, msg_id=msg_id, start_ms=_time(since, "--since"),
                     end_ms=_time(until, "--until"), max_messages=max_messages,
                     partitions=list(partitions) or None, read_uncommitted=read_uncommitted)
    out = click.get_binary_stream("stdout")
    for m in found:
        _print_message(out, m, fmt)
    out.flush()


def _time(value: Optional[str], option: str) -> Optional[int]:
    """``--since``/``--until``: ms since the epoch, or an ISO 8601 date and time (local without a zone)."""
    if value is None:
        return None
    if value.lstrip("-").isdigit():
        return int(value)
    try:
        return int(datetime.fromisoformat(value).timestamp() * 1000)
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither ms since the epoch nor an ISO 8601 date and time, e.g. "
                                 f"2024-05-01T12:00:00", param_hint=option) from None


def _share(member: GroupMember) -> tuple:
    """(partitions, {partition: offset to read from}) of the member's share, said on stderr when other
    members hold some of the topic's partitions."""
    missing = sorted(set(_run(member.consumer.partitions, member.topic)) - set(member.partitions))
    if missing:
        click.echo(f"group {member.consumer.group}: partitions {','.join(missing)} of {member.topic} belong to "
                   f"other members now; reading {','.join(member.partitions) or 'none'}", err=True)
    return member.partitions, member.positions


@main.command()
@click.argument("topic")
@click.option("--timestamp", type=int, default=None, help="also the first offset at or after this time (ms)")
@click.pass_obj
def offsets(obj, topic, timestamp):
    """Per partition: earliest offset, latest (the last stable offset, where readers stop), log end (past
    it while a transaction is open), and with --timestamp the offset for that time; tab-separated."""
    with _client(Consumer, obj) as consumer:
        for p, item in sorted(_run(consumer.offset_bounds, topic, timestamp_ms=timestamp).items()):
            click.echo(f"{topic}\t{p}\t" + "\t".join(str(x) for x in item))


class _GroupsGroup(click.Group):
    """``metaq groups [GROUP] [--topic T]`` lists, as before the subcommands came: arguments that start
    with no subcommand's name go to ``list`` (a group named like a subcommand: ``metaq groups list NAME``)."""

    def parse_args(self, ctx, args):
        if not args or (args[0] not in self.commands and args[0] not in self.get_help_option_names(ctx)):
            args = ["list", *args]
        return super().parse_args(ctx, args)


@main.group(cls=_GroupsGroup)
def groups():
    """Consumer groups: list them with their lag (the default), reset their offsets, delete them."""


@groups.command("list")
@click.argument("group", required=False)
@click.option("--topic", default=None)
@click.pass_obj
def groups_list(obj, group, topic):
    """Consumer groups with their committed offsets and lag per partition."""
    with _client(Admin, obj) as admin:
        names = [group] if group else _run(admin.groups)
        click.echo(f"{'group':<24} {'topic':<20} {'partition':<10} {'committed':>12} {'latest':>12} {'lag':>10}")
        for g in names:
            for row in _run(admin.group_lag, g, topic):
                committed = "-" if row.committed is None else row.committed
                click.echo(f"{g:<24} {row.topic:<20} {row.partition:<10} {committed:>12} {row.latest:>12} {row.lag:>10}")


def _datetime(value: str) -> datetime:
    """ISO 8601; without a zone, local time (as Kafka's --to-datetime)."""
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an ISO 8601 date and time, e.g. 2024-05-01T12:00:00 "
                                 f"or 2024-05-01T12:00:00+02:00", param_hint="--to-datetime") from None


@groups.command("reset-offsets")
@click.option("--group", required=True)
@click.option("--topic", required=True)
@click.option("--to-earliest", is_flag=True, help="the first offset still stored")
@click.option("--to-latest", is_flag=True, help="the last stable offset: skip everything stored so far")
@click.option("--to-datetime", "to_datetime", metavar="ISO", default=None,
              help="the first offset stored at or after this time (ISO 8601; no zone: local time)")
@click.option("--to-offset", type=click.IntRange(0), default=None, help="this offset in every chosen partition")
@click.option("--partition", "partitions", multiple=True, help="only these partitions (default: all)")
@click.option("--dry-run", is_flag=True, help="print the plan, change nothing")
@click.option("--force", is_flag=True, help="even while the group has live members")
@click.pass_obj
def groups_reset_offsets(obj, group, topic, to_earliest, to_latest, to_datetime, to_offset, partitions, dry_run,
                         force):
    """Move a group's committed offsets for a topic; prints old -> new per partition. Refused while the
    group has live members, unless --force. A Spark query follows its checkpoint, not these offsets: they
    matter to a query started with startingOffsets=group and to `metaq consume --group`."""
    targets = ((["earliest"] if to_earliest else []) + (["latest"] if to_latest else [])
               + ([_datetime(to_datetime)] if to_datetime is not None else [])
               + ([to_offset] if to_offset is not None else []))
    if len(targets) != 1:
        raise click.UsageError("give exactly one of --to-earliest, --to-latest, --to-datetime, --to-offset")
    with _client(Admin, obj) as admin:
        plan = _run(admin.reset_offsets, group, topic, targets[0], list(partitions) or None, dry_run, force)
        for r in plan:
            click.echo(f"{group}\t{topic}\t{r.partition}\t{'-' if r.old is None else r.old} -> {r.new}")
        click.echo(f"dry run: nothing changed ({len(plan)} partitions)" if dry_run else
                   f"group {group}: {len(plan)} partitions reset", err=True)


@groups.command("delete")
@click.option("--group", required=True)
@click.option("--force", is_flag=True, help="even while the group has live members")
@click.pass_obj
def groups_delete(obj, group, force):
    """Delete a consumer group and its committed offsets. Refused while it has live members, unless --force."""
    with _client(Admin, obj) as admin:
        _run(admin.delete_group, group, force)
        click.echo(f"group {group} deleted", err=True)


@main.command()
@click.option("--broker", "broker_ids", type=int, multiple=True, help="broker id (default: all)")
@click.option("--topic", default="")
@click.pass_obj
def stats(obj, broker_ids, topic):
    """MetaQ's counters per partition: puts, gets, misses, failures, bytes; uptime and version."""
    with _client(Admin, obj) as admin:
        for bid in broker_ids or sorted(_run(admin.masters)):
            s = _run(admin.stats, bid, topic)
            click.echo(f"broker {s.broker_id} version {s.version} uptime {s.uptime_seconds:.0f}s")
            for p in s.partitions:
                click.echo(f"  {p.topic:<20} {p.partition:<8} puts {p.puts} ({p.put_messages} msgs, {p.put_bytes} B, "
                           f"{p.put_failures} failed)  gets {p.gets} ({p.get_messages} msgs, {p.get_bytes} B, "
                           f"{p.get_misses} misses, {p.get_failures} failed)")


# -- SCRAM users (Kafka's kafka-configs --entity-type users) -------------------------------------------
@main.group()
def users():
    """SCRAM-SHA-256 users, stored in ZooKeeper as salted credentials (never the password). Brokers notice
    a change at once and end the sessions of a user who was changed or removed."""


def _password(password, password_file, name) -> str:
    if password is not None and password_file is not None:
        raise click.UsageError("give --password or --password-file, not both")
    if password_file is not None:
        try:
            lines = Path(password_file).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise click.BadParameter(f"cannot read {password_file}: {e.strerror}",
                                     param_hint="--password-file") from None
        password = lines[0] if lines else ""
    if password is None:
        password = click.prompt(f"password for {name}", hide_input=True, confirmation_prompt=True, err=True)
    if not password:
        raise click.BadParameter("the password must not be empty", param_hint="--password")
    return password


@users.command("add")
@click.argument("name")
@click.option("--password", default=None, help="the password (visible in the process list; prefer "
              "--password-file or the prompt)")
@click.option("--password-file", type=click.Path(dir_okay=False), default=None,
              help="read the password from the first line of this file")
@click.option("--iterations", type=click.IntRange(MIN_ITERATIONS, MAX_ITERATIONS), default=DEFAULT_ITERATIONS,
              show_default=True, help="PBKDF2 iterations of the SCRAM credential (clients refuse more than "
                                      f"{MAX_ITERATIONS}, as Kafka's)")
@click.pass_obj
def users_add(obj, name, password, password_file, iterations):
    """Create user NAME, or give it a new password."""
    credential = Credential.make(_password(password, password_file, name), iterations)
    with _zk_session(obj) as zk:
        created = _run(zk_users.put_user, zk, obj["zk_root"], name, credential)
    click.echo(f"user {name} {'created' if created else 'updated'} ({MECHANISM}, {iterations} iterations)")


@users.command("remove")
@click.argument("name")
@click.pass_obj
def users_remove(obj, name):
    """Remove user NAME (its ACLs stay: `metaq acls remove` removes them)."""
    with _zk_session(obj) as zk:
        _run(zk_users.delete_user, zk, obj["zk_root"], name)
    click.echo(f"user {name} removed")


@users.command("list")
@click.pass_obj
def users_list(obj):
    """The users' names, one a line."""
    with _zk_session(obj) as zk:
        for name in _run(zk_users.list_users, zk, obj["zk_root"]):
            click.echo(name)


# -- ACLs (Kafka's kafka-acls) ------------------------------------------------------------------------
@main.group()
def acls():
    """Kafka-shaped ACLs, enforced by brokers with authorizer=acl: a principal (User:NAME, User:* for
    everyone) is allowed or denied an operation on a topic, group, sink or the cluster, named literally
    ('*': every name) or by a prefix. No matching allow means denied; a deny wins over any allow."""


def _resource_options(pattern_types, default):
    def decorate(fn):
        for option in reversed((
                click.option("--topic", default=None, help="a topic ('*': every topic)"),
                click.option("--group", default=None, help="a consumer group ('*': every group)"),
                click.option("--sink", default=None, help="an exactly-once sink id ('*': every sink)"),
                click.option("--cluster", is_flag=True, help=f"the cluster ({acl_mod.CLUSTER})"),
                click.option("--resource-pattern-type", "pattern_type", type=click.Choice(pattern_types,
                             case_sensitive=False), default=default, show_default=True,
                             help="literal: the name itself; prefixed: every name starting with it"
                                  + ("; any: both; match: every ACL that applies to the name"
                                     if "match" in pattern_types else "")))):
            fn = option(fn)
        return fn
    return decorate


def _resource(topic, group, sink, cluster, required: bool):
    """(resource type, name) of the one resource given; (None, None) if none and not ``required``."""
    given = [(t, n) for t, n in (("topic", topic), ("group", group), ("sink", sink),
                                 ("cluster", acl_mod.CLUSTER if cluster else None)) if n is not None]
    if len(given) > 1:
        raise click.UsageError("give one resource: --topic, --group, --sink or --cluster")
    if not given and required:
        raise click.UsageError("no resource: give --topic, --group, --sink or --cluster")
    return given[0] if given else (None, None)


def _principals(values, flag) -> list:
    try:
        return [parse_principal(v, flag) for v in values]
    except ConfigError as e:
        raise click.BadParameter(str(e).split(": ", 1)[-1], param_hint=flag) from None


def _operations(values) -> list:
    known = {o.lower(): o for o in acl_mod.OPERATIONS}
    for v in values:
        if v.strip().lower() not in known:
            raise click.BadParameter(f"unknown operation {v!r}; use one of {', '.join(acl_mod.OPERATIONS)}",
                                     param_hint="--operation")
    return [known[v.strip().lower()] for v in values]


def _acl_table(rows) -> None:
    header = ("principal", "permission", "operation", "resource", "name", "pattern")
    cells = [header] + [(a.principal, a.permission, a.operation, a.resource_type, a.name, a.pattern_type)
                        for a in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


_ACL_OPERATION_HELP = f"operation, repeatable: {', '.join(acl_mod.OPERATIONS)} (case-insensitive)"


@acls.command("add")
@click.option("--allow-principal", "allow", multiple=True, metavar="User:NAME", help="repeatable")
@click.option("--deny-principal", "deny", multiple=True, metavar="User:NAME", help="repeatable")
@click.option("--operation", "operations", multiple=True, help=_ACL_OPERATION_HELP + "  [default: All]")
@_resource_options(("literal", "prefixed"), "literal")
@click.pass_obj
def acls_add(obj, allow, deny, operations, topic, group, sink, cluster, pattern_type):
    """Allow or deny principals operations on one resource."""
    rtype, name = _resource(topic, group, sink, cluster, required=True)
    allow, deny = _principals(allow, "--allow-principal"), _principals(deny, "--deny-principal")
    if not allow and not deny:
        raise click.UsageError("give --allow-principal or --deny-principal")
    ops = _operations(operations) or ["All"]
    try:
        wanted = [acl_mod.Acl(p, perm, op, rtype, name, pattern_type.lower())
                  for perm, principals in (("Allow", allow), ("Deny", deny)) for p in principals for op in ops]
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    with _zk_session(obj) as zk:
        added = _run(zk_acls.add_acls, zk, obj["zk_root"], wanted)
    click.echo(f"added {len(added)} ACL(s)" + (f" ({len(wanted) - len(added)} were there already)"
                                               if len(added) < len(wanted) else ""))
    if added:
        _acl_table(added)


@acls.command("remove")
@click.option("--allow-principal", "allow", multiple=True, metavar="User:NAME", help="repeatable")
@click.option("--deny-principal", "deny", multiple=True, metavar="User:NAME", help="repeatable")
@click.option("--operation", "operations", multiple=True, help=_ACL_OPERATION_HELP + "  [default: every one]")
@_resource_options(("literal", "prefixed"), "literal")
@click.option("--force", is_flag=True, help="no question when every principal's ACLs of the resource go")
@click.pass_obj
def acls_remove(obj, allow, deny, operations, topic, group, sink, cluster, pattern_type, force):
    """Remove the ACLs of one resource pattern that match the principals and operations given (without
    principals: everyone's, after a question unless --force)."""
    rtype, name = _resource(topic, group, sink, cluster, required=True)
    allow, deny = _principals(allow, "--allow-principal"), _principals(deny, "--deny-principal")
    ops = set(_operations(operations))
    pattern_type = pattern_type.lower()
    if not allow and not deny and not force:
        click.confirm(f"remove every ACL of {rtype} {name!r} ({pattern_type}) for every principal?", abort=True,
                      err=True)
    wanted = {("Allow", p) for p in allow} | {("Deny", p) for p in deny}
    with _zk_session(obj) as zk:
        held = _run(zk_acls.list_acls, zk, obj["zk_root"], rtype, name, pattern_type)
        doomed = [a for a in held if (not wanted or (a.permission, a.principal) in wanted)
                  and (not ops or a.operation in ops)]
        removed = _run(zk_acls.remove_acls, zk, obj["zk_root"], doomed)
    click.echo(f"removed {len(removed)} ACL(s)")
    if removed:
        _acl_table(removed)


@acls.command("list")
@click.option("--principal", "principals", multiple=True, metavar="User:NAME", help="only these principals' ACLs")
@_resource_options(("literal", "prefixed", "any", "match"), "any")
@click.pass_obj
def acls_list(obj, principals, topic, group, sink, cluster, pattern_type):
    """List ACLs: all of them, or those of one resource."""
    rtype, name = _resource(topic, group, sink, cluster, required=False)
    principals = set(_principals(principals, "--principal"))
    pattern_type = pattern_type.lower()
    if pattern_type == "match" and name is None:
        raise click.UsageError("--resource-pattern-type match needs a resource (--topic, --group, --sink or "
                               "--cluster)")
    with _zk_session(obj) as zk:
        if pattern_type == "match":
            rows = [a for a in _run(zk_acls.list_acls, zk, obj["zk_root"], rtype) if a.covers(rtype, name)]
        else:
            rows = _run(zk_acls.list_acls, zk, obj["zk_root"], rtype, name,
                        None if pattern_type == "any" else pattern_type)
    rows = [a for a in rows if not principals or a.principal in principals]
    if rows:
        _acl_table(rows)
    else:
        click.echo("(no ACLs)")


# -- quickstart ---------------------------------------------------------------------------------------
@main.command()
@click.option("--dir", "workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="where ZooKeeper and the broker keep data (default: a temporary directory, removed on exit)")
@click.option("--messages", type=click.IntRange(1), default=10_000, show_default=True)
@click.option("--keep-running", is_flag=True, help="leave ZooKeeper and the broker up until Ctrl-C")
@click.option("--spark/--no-spark", default=True, show_default=True,
              help="also run a Spark streaming query from one topic into another")
@click.option("--console-port", type=click.IntRange(0, 65535), default=8480, show_default=True,
              help="serve the web console here (0: any free port; another one if taken)")
@click.option("--no-console", is_flag=True, help="do not start the web console")
def quickstart(workdir, messages, keep_running, spark, console_port, no_console):
    """Start a local ZooKeeper, one broker and the web console, create a topic, produce sample data and
    read it back, then pipe it through a Spark streaming query into a second topic."""
    _run(run_quickstart, workdir, messages, keep_running, spark, None if no_console else console_port)


# -- console ------------------------------------------------------------------------------------------
@main.command()
@click.option("--port", type=click.IntRange(0, 65535), default=8480, show_default=True, help="HTTP port (0: any free port)")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on (0.0.0.0: every interface)")
@click.option("--interval", type=click.FloatRange(0.2, 60), default=2.0, show_default=True,
              help="seconds between snapshots of the cluster")
@click.option("--history", "history_minutes", type=click.FloatRange(1, 1440), default=10.0, show_default=True,
              help="minutes of rates and lag kept for the charts")
@click.option("--allowed-hosts", default="", metavar="NAME,...",
              help="host names the console answers for besides loopback and --host (requests naming another "
                   "Host get nothing: DNS rebinding)")
@click.option("--ssl-certfile", type=click.Path(dir_okay=False, exists=True), default=None,
              help="serve HTTPS with this certificate (PEM; with --ssl-keyfile)")
@click.option("--ssl-keyfile", type=click.Path(dir_okay=False, exists=True), default=None,
              help="the private key of --ssl-certfile (PEM)")
@click.pass_obj
def console(obj, port, host, interval, history_minutes, allowed_hosts, ssl_certfile, ssl_keyfile):
    """Serve the read-only web console (brokers, topics, groups and lag, transactions, messages); prints
    its URL and runs until Ctrl-C. With security.protocol=SASL_SSL in --command-config every person logs
    in as a user of the cluster and sees what that user's ACLs allow."""
    if (ssl_certfile is None) != (ssl_keyfile is None):
        raise click.BadParameter("give both or neither", param_hint="--ssl-certfile/--ssl-keyfile")
    security, login = _console_security(obj)
    hosts = [h.strip() for h in allowed_hosts.split(",") if h.strip()]
    for h in hosts:
        if any(c in h for c in "/:@ ") and not h.startswith("["):
            raise click.BadParameter(f"{h!r} is not a host name (no scheme, port or path)", param_hint="--allowed-hosts")
    try:
        _run(run_console, None if obj["brokers"] else obj["zk"], obj["zk_root"], obj["brokers"], host, port,
             interval, history_minutes * 60, click.echo, security, login, hosts, ssl_certfile, ssl_keyfile)
    except OSError as e:
        raise Fail(f"cannot serve the console on {host}:{port}: {e}") from None


def _console_security(obj) -> tuple:
    """(ClientSecurity, login): with SASL_SSL each person logs in, so the file's sasl.username and
    sasl.password are not used (a console acting as one user for everyone would show everyone that user's
    view) and the settings are kept without a user, to which each login adds its own."""
    props = dict(obj.get("props") or {})
    login = str(props.get("security.protocol", "PLAINTEXT")).strip().upper() == "SASL_SSL"
    if not login:
        return _client_security(obj), False
    given = [props.pop(key, None) for key in ("sasl.username", "sasl.password")]
    if any(given):
        click.echo("metaq console: sasl.username and sasl.password of --command-config are not used: each person "
                   "logs in as themselves", err=True)
    checked = _client_security({**obj, "props": {**props, "sasl.username": "-", "sasl.password": "-"}})
    return dataclasses.replace(checked, sasl_username=None, sasl_password=None), True


# -- offline inspection -------------------------------------------------------------------------------
@main.group("log")
def log_group():
    """Inspect partition logs in a broker's data directory (run only while the broker is stopped)."""


def _open_partition(directory: Path, key_index: bool = False):
    """The partition in ``directory``; ``key_index``: with its key indexes (only ``reindex`` builds any)."""
    topic, _, num = directory.name.rpartition("-")
    if not topic or not num.isdigit():
        raise click.BadParameter(f"{directory} is not a <topic>-<partition> directory", param_hint="PARTITION_DIR")
    return PartitionLog.open(directory, topic, int(num), TopicConfig(key_index=key_index))


@log_group.command("describe")
@click.argument("partition_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
def describe(partition_dir: Path):
    """List a partition's segments: offsets, bytes and last store time."""
    p = _run(_open_partition, partition_dir)
    try:
        click.echo(f"{p.name}: offsets {p.earliest_offset} to {p.log_end_offset} (next), last stable offset "
                   f"{p.last_stable_offset}, {p.size_bytes} bytes")
        unsettled = sorted(p.txns.ongoing.items(), key=lambda x: x[1])
        aborted = p.aborted_in(p.earliest_offset, p.log_end_offset)
        click.echo(f"  transactions: {len(unsettled)} unsettled"
                   + "".join(f", #{t} from offset {first}" for t, first in unsettled)
                   + f"; {len(aborted)} aborted with batches here"
                   + "".join(f", #{a['txn']} offsets {a['first']}-{a['last'] - 1}" for a in aborted[:20]))
        segments = p.segments()
        index_bytes = sum(offset_index.HEADER_SIZE + offset_index.ENTRY_DTYPE.itemsize * s.index_entries
                          for s in segments)
        click.echo(f"  sparse offset index: {sum(s.index_entries for s in segments)} entries, {index_bytes} bytes "
                   f"({100 * index_bytes / max(p.size_bytes, 1):.2f}% of the log; the active segment's in memory)")
        keys = [f for f in (s.path.with_suffix(".keys") for s in segments[:-1]) if f.exists()]
        key_bytes = sum(f.stat().st_size for f in keys)
        click.echo(f"  key index: {len(keys)} of {len(segments) - 1} sealed segments have one, {key_bytes} bytes "
                   f"({100 * key_bytes / max(p.size_bytes, 1):.2f}% of the log; metaq log reindex writes the others)")
        for s in segments:
            click.echo(f"  {s.path.name}  base offset {s.base_offset:>12}  messages {s.count:>10}  bytes {s.size:>12}"
                       f"  index entries {s.index_entries:>8}"
                       f"  last stored {s.last_timestamp if s.last_timestamp is not None else '-'}")
    finally:
        p.close()


@log_group.command("reindex")
@click.argument("partition_dirs", nargs=-1, required=True,
                type=click.Path(exists=True, file_okay=False, path_type=Path))
def reindex(partition_dirs):
    """Build the key indexes of partitions' sealed segments again from their logs (lost or damaged ones,
    or a topic whose keyIndex was just turned on), so that no lookup has to. The broker must be stopped."""
    for directory in partition_dirs:
        p = _run(_open_partition, directory, True)
        try:
            start = time.monotonic()
            entries = _run(p.rebuild_key_indexes)
            click.echo(f"{directory.name}: key indexes of {len(p.segments()) - 1} sealed segments written, "
                       f"{entries} keys, in {time.monotonic() - start:.1f}s")
        finally:
            p.close()


@log_group.command("verify")
@click.argument("partition_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
def verify(partition_dir: Path):
    """Check every batch's checksums and offsets, and that each segment's offset index and key index are
    the ones its batches make; exit 1 if anything is damaged."""
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


if __name__ == "__main__":
    main()
