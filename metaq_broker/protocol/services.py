"""The gRPC services beside metaq.proto's ``Broker`` whose messages are JSON (no generated code), and the
metadata key that carries a SASL session: names the broker serves and clients call (docs/security.md)."""

AUTH_SERVICE, AUTHENTICATE = "metaq.v1.Auth", "Authenticate"  # SASL logins (server/auth.py)
AUTH_PATH = f"/{AUTH_SERVICE}/{AUTHENTICATE}"
GROUPS_SERVICE = "metaq.v1.Groups"  # group offsets of secured clients (server/group_offsets_service.py)
COMMIT_OFFSETS, FETCH_OFFSETS = "CommitOffsets", "FetchOffsets"
DESCRIBE_GROUPS = "DescribeGroups"  # the groups a principal may see (server/group_listing.py)
SINKS_SERVICE = "metaq.v1.Sinks"  # the exactly-once sinks' decision records (server/sinks.py)
DECIDE, READ_DECISION, FORGET_DECISIONS, SWEEP_BATCH_WRITES = "Decide", "Read", "Forget", "SweepBatchWrites"
TOPICS_SERVICE, DELETE_TOPIC = "metaq.v1.Topics", "DeleteTopic"  # topic deletion (server/topic_deletion.py)
SESSION_METADATA = "metaq-session"  # the session token a call carries after a SASL login


def groups_path(method: str) -> str:
    return f"/{GROUPS_SERVICE}/{method}"


def sinks_path(method: str) -> str:
    return f"/{SINKS_SERVICE}/{method}"


def topics_path(method: str) -> str:
    return f"/{TOPICS_SERVICE}/{method}"
