"""``spark.readStream.format("metaq")``, ``spark.read.format("metaq")`` and their writing twins: the data
source Spark instantiates, handing out the readers (``reader``) and the writers (``sink``)."""
from __future__ import annotations

import sys
from typing import Optional

from pyspark.sql.datasource import DataSource
from pyspark.sql.types import (ArrayType, BinaryType, IntegerType, LongType, StringType, StructField, StructType,
                               TimestampType)

from metaq_spark.options import OptionError, SourceOptions, parse
from metaq_spark.reader import COLUMNS, HEADERS, MetaqBatchReader, MetaqFilteringBatchReader, MetaqStreamReader
from metaq_spark.sink import writer

# As Kafka's source: ``value`` is null for a null value (a tombstone); ``timestamp`` is the create time where
# the producer gave one, else the store time, and ``timestampType`` says which (0 CreateTime, 1 LogAppendTime)
SCHEMA = StructType([StructField("key", BinaryType()), StructField("value", BinaryType(), nullable=True),
                     StructField("topic", StringType()), StructField("partition", StringType()),
                     StructField("offset", LongType()), StructField("timestamp", TimestampType()),
                     StructField("timestampType", IntegerType()), StructField("msgId", LongType()),
                     StructField("flag", IntegerType()), StructField("attribute", StringType())])
# includeHeaders=true adds Kafka's record headers, as Kafka's source does (null: a message without headers)
HEADERS_FIELD = StructField(HEADERS, ArrayType(StructType([StructField("key", StringType()),
                                                           StructField("value", BinaryType())])))


def source_schema(include_headers: bool) -> StructType:
    return StructType(SCHEMA.fields + [HEADERS_FIELD]) if include_headers else SCHEMA


def _include_headers(options) -> bool:
    """includeHeaders as given (checked with the other options by ``parse`` when the query starts)."""
    return any(k.lower() == "includeheaders" and str(v).strip().lower() == "true" for k, v in options.items())


def columns_of(schema: StructType, full: StructType = SCHEMA) -> Optional[tuple]:
    """The columns a query asked for by giving a schema (``.schema("value binary, offset long")``): some
    of ``full``'s (``SCHEMA``, with ``headers`` under includeHeaders), with their types, in any order;
    None for the whole schema. Anything else is an OptionError naming the column."""
    types = {f.name: f.dataType for f in full.fields}
    names = tuple(f.name for f in schema.fields)
    for f in schema.fields:
        if f.name not in types:
            raise OptionError(f"schema: metaq has no column {f.name!r} (it has {', '.join(types)})")
        if f.dataType != types[f.name]:
            raise OptionError(f"schema: column {f.name} is {types[f.name].simpleString()} in metaq, not "
                              f"{f.dataType.simpleString()}")
    if len(set(names)) != len(names):
        raise OptionError(f"schema: a column is named twice in {', '.join(names)}")
    if not names:
        raise OptionError("schema: name at least one column")
    return None if names == tuple(types) else names


def _options(options, schema, streaming: bool) -> SourceOptions:
    opts = parse(options, streaming=streaming)
    opts.columns = columns_of(schema, source_schema(opts.include_headers))
    if opts.columns is None and opts.include_headers:
        opts.columns = COLUMNS + (HEADERS,)
    return opts


class MetaqDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "metaq"

    def schema(self) -> StructType:
        return source_schema(_include_headers(self.options))

    def reader(self, schema) -> "MetaqBatchReader":
        """With filter pushdown on, a reader that answers filters itself (``pushdown``); else the plain one:
        pyspark 4.3 fails a filtered query whose reader defines ``pushFilters`` while
        spark.sql.python.filterPushdown.enabled is false, and it says which only by the worker it asks."""
        opts = _options(self.options, schema, streaming=False)
        return MetaqFilteringBatchReader(opts) if _pushing_filters() else MetaqBatchReader(opts)

    def streamReader(self, schema) -> "MetaqStreamReader":
        return MetaqStreamReader(_options(self.options, schema, streaming=True))

    def writer(self, schema, overwrite: bool):
        """``df.write.format("metaq")``: see ``metaq_spark.sink``."""
        return writer(self.options, schema, streaming=False)

    def streamWriter(self, schema, overwrite: bool):
        """``df.writeStream.format("metaq")``: exactly once by default, see ``metaq_spark.sink``."""
        return writer(self.options, schema, streaming=True)


def _pushing_filters() -> bool:
    """Is the reader made by pyspark's filter pushdown worker? It is only started, and so only asks for a
    reader, with spark.sql.python.filterPushdown.enabled true (the setting itself never reaches Python)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(PUSHDOWN_WORKER):
            return True
        frame = frame.f_back
    return False


PUSHDOWN_WORKER = "data_source_pushdown_filters.py"  # pyspark/sql/worker/
