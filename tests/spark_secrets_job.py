"""A Spark job with secret options, run by test_security_secrets.py in a process of its own with Spark's
logging at INFO (and, through the test's sitecustomize, metaq's at DEBUG in the driver and in every
Python worker), so that everything it prints (local[2] runs the executors in this process and its Python
workers) can be searched for the secret. Writes what Spark shows of the queries (plans, progress, status,
errors) as JSON to the file named by its argument."""
import json
import sys

from spark_helpers import metaq_session


def options(a: dict, user: str) -> dict:
    return {"metaq.zk.connect": a["zk"], "metaq.zk.root": a["root"], "metaq.security.protocol": "SASL_SSL",
            "metaq.ssl.ca.location": a["ca"], "metaq.sasl.username": user, "metaq.sasl.password": a["secret"],
            "metaq.zk.auth": f"digest:apps:{a['secret']}"}


def pipeline(spark, a: dict, user: str, checkpoint: str, sink_id: str):
    src = (spark.readStream.format("metaq").options(**options(a, user)).option("subscribe", "in")
           .option("group", "etl-group").load())
    q = (src.selectExpr("key", "value").writeStream.format("metaq").options(**options(a, user))
         .option("topic", "out").option("sinkId", sink_id).option("checkpointLocation", checkpoint)
         .trigger(availableNow=True).start())
    return src, q


def main() -> None:
    a = json.loads(sys.argv[1])
    spark = metaq_session("local[2]", "metaq-secrets")
    spark.sparkContext.setLogLevel("INFO")
    shown = {}

    src, q = pipeline(spark, a, "etl", a["checkpoint"], "etl-orders")
    q.awaitTermination(180)
    shown["error"] = str(q.exception())
    shown["source plan"] = src._jdf.queryExecution().toString()
    shown["query plan"] = q._jsq.explainInternal(True)
    shown["progress"] = [p.json for p in q.recentProgress]
    shown["status"] = str(q.status)

    batch = spark.read.format("metaq").options(**options(a, "etl")).option("subscribe", "in").load()
    shown["batch plan"] = batch._jdf.queryExecution().toString()
    shown["batch rows"] = batch.count()
    batch.selectExpr("value").write.format("metaq").mode("append").options(**options(a, "etl")) \
        .option("topic", "out").option("sinkId", "etl-batch").save()

    # A query that fails (the intruder has the same password, not the sink's ACL): its error carries the
    # query's logical plan, options included.
    _, failing = pipeline(spark, a, "intruder", a["failing_checkpoint"], "etl-orders")
    try:
        failing.awaitTermination(180)
    except Exception as e:  # noqa: BLE001 - what the user sees is what is checked
        shown["failure"] = str(e)
    shown["failure in full"] = failing._jsq.exception().get().toString()
    spark.stop()
    with open(a["out"], "w") as f:
        json.dump(shown, f)


if __name__ == "__main__":
    main()
