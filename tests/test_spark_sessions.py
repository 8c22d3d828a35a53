"""The test worker's one SparkSession (tests/spark_helpers.SharedSpark), lent to the Spark test modules in turn:
a module gets it back as a fresh session would be, whatever the module before it left behind."""


def test_a_module_gets_the_session_as_a_fresh_one_would_be(spark_sessions):
    with spark_sessions.use("local[2]") as first:
        default_partitions = first.conf.get("spark.sql.shuffle.partitions")
        first.conf.set("spark.sql.shuffle.partitions", "7")  # changed
        first.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "5")  # not set before
        first.range(3).createOrReplaceTempView("left_behind")
        query = first.readStream.format("rate").load().writeStream.format("memory").queryName("rate_rows").start()
        assert query.isActive
    with spark_sessions.use("local[2]") as second:
        assert second is first  # the same JVM: no new start
        assert second.conf.get("spark.sql.shuffle.partitions") == default_partitions
        assert "spark.sql.execution.arrow.maxRecordsPerBatch" not in second.conf.getAll
        assert not second.streams.active and not query.isActive
        assert [t.name for t in second.catalog.listTables() if t.isTemporary] == []
