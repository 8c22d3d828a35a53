"""Version 2 record batches exactly as the previous metaq wrote them (a 48-byte header, a flag column always,
every column i32, values never null), by an encoder of their own: readers are checked against the frozen
format, not against today's encoder."""
import struct

import numpy as np

from metaq_broker.protocol import records


def v2_body(values, keys=None, attributes=None, flags=None) -> tuple:
    """(attribute bits, body bytes) of a version 2 body."""
    n = len(values)
    columns = [np.asarray([0] * n if flags is None else flags, "<i4"), np.array([len(v) for v in values], "<i4")]
    data, bits = [b"".join(values)], 0
    for bit, column in ((records.HAS_KEYS, keys), (records.HAS_ATTRIBUTES, attributes)):
        if column is None or all(c is None for c in column):
            continue
        column = [c.encode() if isinstance(c, str) else c for c in column]
        bits |= bit
        columns.append(np.array([-1 if c is None else len(c) for c in column], "<i4"))
        data.append(b"".join(c for c in column if c is not None))
    body = b"".join(c.tobytes() for c in columns) + b"".join(data)
    return bits, body + b"\0" * (-len(body) % 8)


def v2_batch(values, keys=None, attributes=None, flags=None, base=0, msg_id=1, ts=5, txn=0, extra_bits=0) -> bytes:
    bits, body = v2_body(values, keys, attributes, flags)
    batch_len = 48 + len(body)
    tail = struct.pack("<HBBIqqqII", records.MAGIC, 2, bits | extra_bits, len(values), base, msg_id, ts,
                       records.crc(body), txn)
    return struct.pack("<II", batch_len, records.crc(tail)) + tail + body
