"""The sink's ``headers`` column in process, without Spark's tasks: the schema check's types, the row a null
header key is reported at (sliced and chunked Arrow input, as the sender's queued batches are), and a
table of several chunks with a ``topic`` column encoded into record batches that decode to the same
headers per message."""
from __future__ import annotations

import pyarrow as pa
import pytest
from pyspark.sql.types import ArrayType, BinaryType, StringType, StructField, StructType

from metaq_broker.errors import InvalidMessageError
from metaq_broker.protocol import records
from metaq_spark.options import parse_sink
from metaq_spark.pipeline import check_headers, send_arrow
from metaq_spark.sink import SinkSchemaError, check_schema

pytestmark = pytest.mark.unit

# What Spark hands the Python writer for array<struct<key: string, value: binary>>
SPARK_HEADERS = pa.list_(pa.field("element", pa.struct([("key", pa.string()), ("value", pa.binary())])))
OPTS = parse_sink({"metaq.zk.connect": "127.0.0.1:1", "topic": "t"})


def schema(headers_type) -> StructType:
    return StructType([StructField("value", StringType()), StructField("headers", headers_type)])


def header(key, value, key_nullable=True) -> StructType:
    return StructType([StructField("key", key, key_nullable), StructField("value", value)])


def test_the_headers_type_is_kafkas_whatever_its_nullability():
    for t in (ArrayType(header(StringType(), BinaryType())),
              ArrayType(header(StringType(), BinaryType(), key_nullable=False), containsNull=False)):
        assert check_schema(schema(t), OPTS) == {"value": 0, "headers": 1}
    for t, found in [(StringType(), "string"),
                     (ArrayType(header(BinaryType(), BinaryType())), "array<struct<key:binary,value:binary>>"),
                     (ArrayType(header(StringType(), StringType())), "array<struct<key:string,value:string>>"),
                     (ArrayType(StructType([StructField("key", StringType())])), "array<struct<key:string>>"),
                     (header(StringType(), BinaryType()), "struct<key:string,value:binary>")]:
        with pytest.raises(SinkSchemaError, match=rf"^column 'headers' has type {found}; the metaq sink needs "
                                                  r"array<struct<key: string, value: binary>>$"):
            check_schema(schema(t), OPTS)


def rows(*headers):
    return pa.array([None if h is None else [None if x is None else {"key": x[0], "value": x[1]} for x in h]
                     for h in headers], SPARK_HEADERS)


@pytest.mark.parametrize("arr, first, message", [
    (rows([("a", b"1")], None, [], [("b", None), (None, b"2")]), 0, r"row 3 .* has a null key \(its header 1\)"),
    (rows([("a", b"1")], None, [], [("b", None), (None, b"2")]).slice(2), 5, r"row 6 .* null key \(its header 1\)"),
    (pa.chunked_array([rows([("a", b"1")], None), rows([], [(None, None)])]), 10, r"row 13 .* \(its header 0\)"),
    (rows(None, [("a", b"1"), ("b", b""), None]), 0, r"row 1 of this task has a header that is null \(its header 2\)"),
])
def test_a_null_header_or_key_is_refused_naming_the_row(arr, first, message):
    with pytest.raises(InvalidMessageError, match=rf"^the headers column: {message}; Kafka header keys are "
                                                  r"strings, never null \(a null header value is allowed\)$"):
        check_headers(arr, first)


def test_null_values_empty_keys_and_no_headers_pass():
    check_headers(rows(None, [], [("", b"")], [("k", None), ("k", None)], [("ключ", b"\0" * 100_000)]))
    check_headers(pa.chunked_array([rows(None, None)]))


def test_a_table_of_chunks_with_topics_keeps_each_rows_headers():
    """As the sender's queued batches go: one table of several chunks, split by its topic column."""
    batches = [pa.record_batch({"value": [b"v%d" % (3 * j + i) for i in range(3)], "topic": ["p", None, "q"],
                                "headers": rows([("i", b"%d" % (3 * j))], None, [("dup", b"x"), ("dup", None)])})
               for j in range(4)]
    sent = {}

    def send(topic, values, keys, attributes, flags, partition=None, headers=None):
        body = records.encode_body(values, headers=headers)
        buf = records.encode_header(body, 0, 1, 5) + b"".join(bytes(p) for p in body.parts)
        got = records.decode(buf, headers=True)
        sent[topic] = list(zip(got.column("value").to_pylist(), got.column("headers").to_pylist()))

    assert send_arrow(send, pa.Table.from_batches(batches), {"value": 0, "topic": 1, "headers": 2}, "q") == 12
    dup = [{"key": "dup", "value": b"x"}, {"key": "dup", "value": None}]
    assert sent == {"p": [(b"v%d" % (3 * j), [{"key": "i", "value": b"%d" % (3 * j)}]) for j in range(4)],
                    "q": [x for j in range(4) for x in ((b"v%d" % (3 * j + 1), []), (b"v%d" % (3 * j + 2), dup))]}
