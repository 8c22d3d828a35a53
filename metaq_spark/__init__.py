"""Spark 4 Python Data Source for metaq: ``metaq_spark.register(spark)``, then
``spark.readStream.format("metaq")`` / ``spark.read.format("metaq")``."""
from .source import MetaqDataSource


def register(spark) -> None:
    """Register the ``metaq`` format with a SparkSession (once per session)."""
    spark.dataSource.register(MetaqDataSource)


__all__ = ["MetaqDataSource", "register"]
