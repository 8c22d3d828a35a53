"""Spark 4 Python Data Source for metaq: ``metaq_spark.register(spark)``, then
``spark.readStream.format("metaq")`` / ``spark.read.format("metaq")``."""
from metaq_spark.datasource import MetaqDataSource
from metaq_spark.group_commit import install as _install_group_commit


def register(spark) -> None:
    """Register the ``metaq`` format with a SparkSession, and the listener that records each committed
    batch's offsets for the consumer group in ZooKeeper. Calling it again is harmless."""
    spark.dataSource.register(MetaqDataSource)
    _install_group_commit(spark)


__all__ = ["MetaqDataSource", "register"]
