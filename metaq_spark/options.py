"""Options of the ``metaq`` source and sink, checked on the driver once at load()/start()/save(), before any
task runs: every unknown or malformed option fails with a message that names it. Names follow Spark's
Kafka source and sink where the meaning is the same. Spark hands options over lower-cased; messages use
the documented spelling."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Optional

from metaq_broker.errors import ConfigError
from metaq_broker.names import parse_partition_name
from metaq_broker.security.settings import ClientSecurity
from metaq_broker.zk.decisions import BATCH_WRITE_PREFIX
from metaq_broker.zk.paths import check_component

# Both the source and the sink take these: the client's security keys with the prefix "metaq." (docs/security.md)
SECURITY_OPTIONS = {"metaq.security.protocol", "metaq.ssl.ca.location", "metaq.ssl.certificate.location",
                    "metaq.ssl.key.location", "metaq.sasl.mechanism", "metaq.sasl.username", "metaq.sasl.password",
                    "metaq.zk.auth"}
# Options whose values are secrets (a SASL password, the ZooKeeper digest, any key or keystore password or
# token a later option adds). Spark prints a data source's options in plans (explain, the UI, the logical
# plan a failed query's error carries) unless a redaction regex matches the key or the value, and its own
# regex matches "password" but not "metaq.zk.auth": ``register`` adds this one to the session's
# spark.sql.redaction.options.regex, so such a value is shown as *********(redacted) whatever it looks like.
SECRET_OPTIONS = re.compile(r"(?i)^metaq\.(zk\.auth|.*(password|passphrase|secret|token|credential).*)$")
SOURCE_OPTIONS = SECURITY_OPTIONS | {
    "metaq.zk.connect", "metaq.zk.root", "subscribe", "subscribePattern", "assign", "startingOffsets",
    "startingTimestamp", "startingOffsetsByTimestamp", "startingOffsetsByTimestampStrategy", "endingOffsets",
    "endingTimestamp", "maxOffsetsPerTrigger", "maxBytesPerTrigger", "minOffsetsPerTrigger", "maxTriggerDelay",
    "failOnDataLoss", "minPartitions", "group", "commitOffsets", "fetchMaxBytes", "fetchTimeoutMs",
    "includeHeaders",
}
SINK_OPTIONS = SECURITY_OPTIONS | {"metaq.zk.connect", "metaq.zk.root", "topic", "deliveryGuarantee", "sinkId",
                                   "transactionTimeoutMs", "deliveryTimeoutMs"}
_SINK_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")

EARLIEST, LATEST = -2, -1


class OptionError(ValueError):
    """A metaq source or sink option is unknown or has a bad value."""


def is_secret(name: str) -> bool:
    return SECRET_OPTIONS.match(name) is not None


def redaction_regex(current: Optional[str]) -> str:
    """Spark's ``spark.sql.redaction.options.regex`` (``current``; Spark's default ``(?i)url`` when unset)
    with ``SECRET_OPTIONS`` added once."""
    ours = SECRET_OPTIONS.pattern
    current = current or "(?i)url"
    return current if ours in current else f"{current}|{ours}"


@dataclass
class SourceOptions:
    zk_connect: str
    zk_root: str = "/meta"
    subscribe: Optional[list] = None
    subscribe_pattern: Optional[str] = None
    assign: Optional[dict] = None  # topic -> [partition names]
    starting: object = "earliest"  # "earliest" | "latest" | "group" | {topic: {partition: offset}}
    starting_timestamp: Optional[int] = None
    starting_by_timestamp: Optional[dict] = None
    timestamp_strategy: str = "error"
    ending: object = "latest"
    ending_timestamp: Optional[int] = None
    max_offsets: Optional[int] = None
    max_bytes: Optional[int] = None
    min_offsets: Optional[int] = None
    max_trigger_delay_ms: int = 15 * 60 * 1000
    fail_on_data_loss: bool = True
    include_headers: bool = False  # a ``headers`` column (Kafka record headers), as Kafka's source's option
    min_partitions: Optional[int] = None
    group: Optional[str] = None  # None: each streaming query gets its own (``default_group``)
    commit_offsets: bool = True
    fetch_max_bytes: int = 8 << 20
    fetch_timeout_ms: int = 120_000  # a task's wait for a partition's broker that is down (Kafka: pollTimeoutMs)
    security: ClientSecurity = field(default_factory=ClientSecurity)
    columns: Optional[tuple] = None  # a schema the user gave: only these columns are built (None: all)
    raw: dict = field(default_factory=dict)  # the options as given, secrets (is_secret) left out

    def topic_matcher(self):
        if self.subscribe is not None:
            wanted = set(self.subscribe)
            return lambda t: t in wanted
        if self.subscribe_pattern is not None:
            pattern = re.compile(self.subscribe_pattern)
            return lambda t: pattern.fullmatch(t) is not None
        return lambda t: t in self.assign

    def default_group(self, unique: str) -> str:
        """The group of a query that names none: the subscription for operators to recognise, and
        ``unique`` (chosen once per query and kept in its checkpoint), so two queries on one topic never
        share offsets by accident."""
        if self.subscribe is not None:
            what = "subscribe-" + "+".join(sorted(self.subscribe))
        elif self.subscribe_pattern is not None:
            what = "pattern-" + re.sub(r"[^A-Za-z0-9._-]", "_", self.subscribe_pattern)
        else:
            what = "assign-" + "+".join(sorted(self.assign))
        return f"spark-metaq-{what}"[:180] + f"-{unique}"


@dataclass(frozen=True)
class SinkOptions:
    zk_connect: str
    zk_root: str = "/meta"
    topic: Optional[str] = None
    exactly_once: bool = True
    sink_id: Optional[str] = None
    timeout_ms: int = 0  # BeginTransaction's timeout_ms; 0: the broker's transactionTimeout
    checkpoint: Optional[str] = None
    security: ClientSecurity = field(default_factory=ClientSecurity)
    delivery_timeout_ms: int = 30_000  # how long a put waits for its partition's broker (Kafka: delivery.timeout.ms)


def _by_name(options, known: set, given_by_spark: set, what: str) -> tuple:
    """(the options by their documented spelling, the ones Spark passes itself by lower-case name); an
    unknown option is an OptionError naming it and the known ones."""
    spelling = {name.lower(): name for name in known}
    opts, given = {}, {}
    for key, value in dict(options).items():
        name = spelling.get(key.lower())
        if name is not None:
            opts[name] = value
        elif key.lower() in given_by_spark:
            given[key.lower()] = value
        else:
            raise OptionError(f"unknown option {key!r} for the metaq {what}; known options: "
                              f"{', '.join(sorted(known))}")
    return opts, given


def _zookeeper(opts: dict) -> tuple:
    """(metaq.zk.connect, metaq.zk.root), both checked."""
    if not opts.get("metaq.zk.connect"):
        raise OptionError("option metaq.zk.connect is required (the ZooKeeper connect string, e.g. 'localhost:2181')")
    root = opts.get("metaq.zk.root", "/meta")
    if not root.startswith("/"):
        raise OptionError(f"option metaq.zk.root: {root!r} must start with '/'")
    return opts["metaq.zk.connect"], root


def security_option(opts: dict) -> ClientSecurity:
    """The client security the ``metaq.security.*``, ``metaq.ssl.*``, ``metaq.sasl.*`` and ``metaq.zk.auth`` options
    give (source and sink); OptionError naming the option otherwise (never showing a password)."""
    props = {k[len("metaq."):]: v for k, v in opts.items() if k in SECURITY_OPTIONS}
    try:
        return ClientSecurity.from_properties(props)
    except ConfigError as e:
        raise OptionError(f"option metaq.{e}") from None


def integer_option(name: str, raw: str, lo: int = 0) -> int:
    """Option ``name`` as an integer of at least ``lo``; OptionError naming it otherwise (source and sink)."""
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise OptionError(f"option {name}: {raw!r} is not an integer") from None
    if value < lo:
        raise OptionError(f"option {name}: must be at least {lo}, got {value}")
    return value


def _bool(name: str, raw: str) -> bool:
    value = str(raw).strip().lower()
    if value not in ("true", "false"):
        raise OptionError(f"option {name}: expected true or false, got {raw!r}")
    return value == "true"


def _duration_ms(name: str, raw: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*(ms|s|m|min|h)?\s*", str(raw))
    if not m:
        raise OptionError(f"option {name}: {raw!r} is not a duration like '30s', '5m' or '500ms'")
    unit = {"ms": 1, None: 1000, "s": 1000, "m": 60_000, "min": 60_000, "h": 3_600_000}[m.group(2)]
    return int(m.group(1)) * unit


def _offset_json(name: str, raw: str, allow_latest: bool = True) -> dict:
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as e:
        raise OptionError(f"option {name}: not valid JSON ({e})") from None
    if not isinstance(parsed, dict) or not all(isinstance(v, dict) for v in parsed.values()):
        raise OptionError(f'option {name}: expected {{"topic": {{"<brokerId>-<n>": offset}}}}')
    out = {}
    for topic, parts in parsed.items():
        out[topic] = {}
        for p, offset in parts.items():
            try:
                parse_partition_name(p)
            except ValueError as e:
                raise OptionError(f"option {name}: {e}") from None
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < EARLIEST:
                raise OptionError(f"option {name}: offset of {topic} {p} must be an integer >= -2, got {offset!r}")
            if offset == LATEST and not allow_latest:
                raise OptionError(f"option {name}: -1 (latest) is not allowed here")
            out[topic][p] = offset
    return out


def parse(options, streaming: bool) -> SourceOptions:
    """The source's options; unknown ones are errors naming them (the sink's options are not source options)."""
    opts, _ = _by_name(options, SOURCE_OPTIONS, {"path"}, "source")
    zk_connect, zk_root = _zookeeper(opts)
    o = SourceOptions(zk_connect=zk_connect, zk_root=zk_root, security=security_option(opts),
                      raw={k: v for k, v in opts.items() if not is_secret(k)})

    chosen = [k for k in ("subscribe", "subscribePattern", "assign") if k in opts]
    if len(chosen) != 1:
        raise OptionError("give exactly one of the options subscribe, subscribePattern or assign"
                          + (f" (got {', '.join(chosen)})" if chosen else ""))
    if "subscribe" in opts:
        topics = [t.strip() for t in opts["subscribe"].split(",") if t.strip()]
        if not topics:
            raise OptionError("option subscribe: no topic given")
        o.subscribe = topics
    elif "subscribePattern" in opts:
        try:
            re.compile(opts["subscribePattern"])
        except re.error as e:
            raise OptionError(f"option subscribePattern: not a valid regular expression ({e})") from None
        o.subscribe_pattern = opts["subscribePattern"]
    else:
        try:
            parsed = json.loads(opts["assign"])
        except json.JSONDecodeError as e:
            raise OptionError(f"option assign: not valid JSON ({e})") from None
        if not isinstance(parsed, dict) or not parsed or not all(isinstance(v, list) for v in parsed.values()):
            raise OptionError('option assign: expected {"topic": ["<brokerId>-<n>", ...]}')
        for topic, parts in parsed.items():
            for p in parts:
                try:
                    parse_partition_name(p)
                except ValueError as e:
                    raise OptionError(f"option assign: {e}") from None
        o.assign = {t: sorted(set(ps), key=parse_partition_name) for t, ps in parsed.items()}

    starts = [k for k in ("startingOffsets", "startingTimestamp", "startingOffsetsByTimestamp") if k in opts]
    if len(starts) > 1:
        raise OptionError(f"give at most one of {', '.join(starts)}")
    if "startingOffsets" in opts:
        value = opts["startingOffsets"].strip()
        if value in ("earliest", "latest", "group"):
            if value == "latest" and not streaming:
                raise OptionError("option startingOffsets: 'latest' is only for streaming queries")
            o.starting = value
        else:
            o.starting = _offset_json("startingOffsets", value, allow_latest=streaming)
    elif not streaming:
        o.starting = "earliest"
    if "startingTimestamp" in opts:
        o.starting_timestamp = integer_option("startingTimestamp", opts["startingTimestamp"])
    if "startingOffsetsByTimestamp" in opts:
        o.starting_by_timestamp = _offset_json("startingOffsetsByTimestamp", opts["startingOffsetsByTimestamp"])
    if "startingOffsetsByTimestampStrategy" in opts:
        o.timestamp_strategy = opts["startingOffsetsByTimestampStrategy"].strip().lower()
        if o.timestamp_strategy not in ("error", "latest"):
            raise OptionError("option startingOffsetsByTimestampStrategy: expected error or latest, "
                              f"got {opts['startingOffsetsByTimestampStrategy']!r}")

    for name in ("endingOffsets", "endingTimestamp"):
        if name in opts and streaming:
            raise OptionError(f"option {name} is only for batch queries (spark.read)")
    if "endingOffsets" in opts:
        value = opts["endingOffsets"].strip()
        if value == "latest":
            o.ending = "latest"
        elif value == "earliest":
            raise OptionError("option endingOffsets: 'earliest' would read nothing; use latest or JSON")
        else:
            o.ending = _offset_json("endingOffsets", value)
    if "endingTimestamp" in opts:
        if "endingOffsets" in opts:
            raise OptionError("give at most one of endingOffsets, endingTimestamp")
        o.ending_timestamp = integer_option("endingTimestamp", opts["endingTimestamp"])

    streaming_only = ("maxOffsetsPerTrigger", "maxBytesPerTrigger", "minOffsetsPerTrigger", "maxTriggerDelay")
    for name in streaming_only:
        if name in opts and not streaming:
            raise OptionError(f"option {name} is only for streaming queries")
    if "maxOffsetsPerTrigger" in opts:
        o.max_offsets = integer_option("maxOffsetsPerTrigger", opts["maxOffsetsPerTrigger"], 1)
    if "maxBytesPerTrigger" in opts:
        o.max_bytes = integer_option("maxBytesPerTrigger", opts["maxBytesPerTrigger"], 1)
    if "minOffsetsPerTrigger" in opts:
        o.min_offsets = integer_option("minOffsetsPerTrigger", opts["minOffsetsPerTrigger"], 1)
        if o.max_offsets is not None and o.min_offsets > o.max_offsets:
            raise OptionError("option minOffsetsPerTrigger must not exceed maxOffsetsPerTrigger")
    if "maxTriggerDelay" in opts:
        o.max_trigger_delay_ms = _duration_ms("maxTriggerDelay", opts["maxTriggerDelay"])
    if "failOnDataLoss" in opts:
        o.fail_on_data_loss = _bool("failOnDataLoss", opts["failOnDataLoss"])
    if "includeHeaders" in opts:
        o.include_headers = _bool("includeHeaders", opts["includeHeaders"])
    if "minPartitions" in opts:
        o.min_partitions = integer_option("minPartitions", opts["minPartitions"], 1)
    if "group" in opts:
        o.group = opts["group"].strip()
        if not o.group or "/" in o.group:
            raise OptionError(f"option group: {opts['group']!r} is not a usable group name")
    if "commitOffsets" in opts:
        o.commit_offsets = _bool("commitOffsets", opts["commitOffsets"])
    if "fetchMaxBytes" in opts:
        o.fetch_max_bytes = integer_option("fetchMaxBytes", opts["fetchMaxBytes"], 1024)
    if "fetchTimeoutMs" in opts:
        o.fetch_timeout_ms = integer_option("fetchTimeoutMs", opts["fetchTimeoutMs"], 1)
    if o.starting == "group" and o.group is None:
        raise OptionError("option startingOffsets=group needs the option group: a query that names no group "
                          "gets a new one of its own, which has no offsets yet")
    return o


def parse_sink(options, streaming: bool = False) -> SinkOptions:
    """The sink's options; unknown ones are errors naming them (the source's options are not sink options)."""
    opts, given = _by_name(options, SINK_OPTIONS, {"checkpointlocation", "path"}, "sink")
    zk_connect, root = _zookeeper(opts)
    topic = opts.get("topic")
    if topic is not None:
        try:
            check_component("topic", topic)
        except ValueError as e:
            raise OptionError(f"option topic: {e}") from None
    guarantee = opts.get("deliveryGuarantee", "exactly-once").strip().lower()
    if guarantee not in ("exactly-once", "at-least-once"):
        raise OptionError(f"option deliveryGuarantee: expected exactly-once or at-least-once, "
                          f"got {opts['deliveryGuarantee']!r}")
    sink_id = opts.get("sinkId")
    if sink_id is not None and not _SINK_ID.fullmatch(sink_id):
        raise OptionError(f"option sinkId: {sink_id!r} must be 1 to 64 characters of A-Z, a-z, 0-9, '.', '_', '-'")
    if sink_id in (".", ".."):
        raise OptionError(f"option sinkId: {sink_id!r} is reserved")
    timeout = integer_option("transactionTimeoutMs", opts.get("transactionTimeoutMs", 0))
    if streaming and sink_id and sink_id.startswith(BATCH_WRITE_PREFIX):
        raise OptionError(f"option sinkId: {sink_id!r}: names starting with {BATCH_WRITE_PREFIX!r} are "
                          f"reserved for batch writes")
    delivery = integer_option("deliveryTimeoutMs", opts.get("deliveryTimeoutMs", SinkOptions.delivery_timeout_ms), 1)
    return SinkOptions(zk_connect, root, topic, guarantee == "exactly-once", sink_id, timeout,
                       given.get("checkpointlocation"), security_option(opts), delivery)
