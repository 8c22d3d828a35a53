"""A partition log's identity (KIP-516's topic id, per partition): 32 hex digits made when the log is
created and kept in ``<topic>-<n>/identity``. A wiped data directory, or a topic deleted and created again,
is a new log with a new identity even when it grows past the old offsets, so a reader holding offsets of
the old log (a Spark checkpoint, a consumer group) can tell. Replicas copy their master's.

The file, written whole (tmp, fsync, rename, directory fsync) before the log's first segment::

    <8 lowercase hex digits: CRC-32C of the JSON> "\\n" {"id": "<32 hex>", "created_ms": T, "adopted": B}

``adopted`` is true for an identity given to a log that existed before identities did (a data directory of
an older metaq) or taken over from a master without starting over: such a log was not created with it, so a
replica whose identity is adopted takes its master's without discarding its data."""
from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import NamedTuple

from metaq_broker.errors import CorruptLogError
from metaq_broker.protocol.records import crc
from metaq_broker.store.durable import make_dirs, replace_file
from metaq_broker.store.segment import LOG_SUFFIX

FILE = "identity"


class Identity(NamedTuple):
    id: str  # 32 lowercase hex digits
    created_ms: int
    adopted: bool  # not created with the log (see the module's docstring)


def new_id() -> str:
    return uuid.uuid4().hex


def check_id(value: str) -> str:
    """``value`` if it is 32 lowercase hex digits; ValueError otherwise."""
    if not isinstance(value, str) or len(value) != 32 or any(c not in "0123456789abcdef" for c in value):
        raise ValueError(f"a partition identity is 32 lowercase hex digits, got {value!r}")
    return value


def write(directory: Path, identity: Identity) -> None:
    body = json.dumps(identity._asdict()).encode()
    replace_file(Path(directory) / FILE, b"%08x\n" % crc(body) + body)


def load_or_create(directory: Path) -> Identity:
    """The partition directory's identity, made now if it has none: a new one for a directory without
    segments (a new log), an adopted one for a log written before identities existed."""
    directory = Path(directory)
    path = directory / FILE
    if path.exists():
        raw = path.read_bytes()
        try:
            checksum, body = int(raw[:8], 16), raw[9:]
            if crc(body) != checksum:
                raise ValueError("checksum mismatch")
            m = json.loads(body)
            return Identity(check_id(m["id"]), int(m["created_ms"]), bool(m["adopted"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CorruptLogError(f"{path}: unreadable partition identity ({e}); readers' offsets of this log "
                                  f"cannot be checked against it. Delete the file to give the log a new (adopted) "
                                  f"identity", path, 0) from None
    make_dirs(directory)
    existing = any(p.name.endswith(LOG_SUFFIX) for p in directory.iterdir())
    identity = Identity(new_id(), int(time.time() * 1000), existing)
    write(directory, identity)
    return identity
