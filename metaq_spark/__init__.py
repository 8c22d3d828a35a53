"""Spark 4 Python Data Source for metaq: ``metaq_spark.register(spark)``, then
``spark.readStream.format("metaq")`` / ``spark.read.format("metaq")``."""
from metaq_spark.datasource import MetaqDataSource
from metaq_spark.group_commit import install as _install_group_commit
from metaq_spark.options import redaction_regex

REDACTION_CONF = "spark.sql.redaction.options.regex"


def register(spark) -> None:
    """Register the ``metaq`` format with a SparkSession, have the session redact metaq's secret options
    (``options.SECRET_OPTIONS``) wherever it shows options, and install the listener that records each
    committed batch's offsets for the consumer group in ZooKeeper. Calling it again is harmless."""
    spark.conf.set(REDACTION_CONF, redaction_regex(spark.conf.get(REDACTION_CONF)))
    spark.dataSource.register(MetaqDataSource)
    _install_group_commit(spark)


__all__ = ["MetaqDataSource", "register"]
