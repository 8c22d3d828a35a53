"""``spark.readStream.format("metaq")``, ``spark.read.format("metaq")`` and their writing twins: the data
source Spark instantiates, handing out the readers (``reader``) and the writers (``sink``)."""
from __future__ import annotations

from pyspark.sql.datasource import DataSource

from metaq_spark.options import parse
from metaq_spark.reader import MetaqBatchReader, MetaqStreamReader
from metaq_spark.sink import writer

SCHEMA = ("key binary, value binary, topic string, partition string, offset long, timestamp timestamp, "
          "msgId long, flag int, attribute string")


class MetaqDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "metaq"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema) -> "MetaqBatchReader":
        return MetaqBatchReader(parse(self.options, streaming=False))

    def streamReader(self, schema) -> "MetaqStreamReader":
        return MetaqStreamReader(parse(self.options, streaming=True))

    def writer(self, schema, overwrite: bool):
        """``df.write.format("metaq")``: see ``metaq_spark.sink``."""
        return writer(self.options, schema, streaming=False)

    def streamWriter(self, schema, overwrite: bool):
        """``df.writeStream.format("metaq")``: exactly once by default, see ``metaq_spark.sink``."""
        return writer(self.options, schema, streaming=True)
