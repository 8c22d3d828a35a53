"""MetaQ clients and Spark on one cluster: what a MetaQ producer writes (plain, with attributes, in committed
and rolled-back transactions) is read by metaq's Spark source exactly once, with its message ids and
attributes; what Spark writes (the exactly-once sink) a MetaQ consumer group reads whole, counting bytes."""
from kazoo.client import KazooClient

from conftest import wait_until
from metaq_broker.zk.metaq_layout import MetaqZkLayout
from tests.metaq_client import Cluster, GroupConsumer, LocalTransaction, Producer


def test_metaq_clients_and_spark_read_each_others_messages(spark, cluster, tmp_path):
    cluster.start_broker(1, settings={"metaqPort": 0}, topics={"in": {"numPartitions": 2}, "out": {"numPartitions": 2}})
    zk = KazooClient(hosts=cluster.zk_connect)
    zk.start(30)
    metaq = Cluster(zk, cluster.zk_root)
    try:
        wait_until(lambda: zk.exists(MetaqZkLayout(cluster.zk_root).topic_pub_broker("out", 1)), what="MetaQ's entries")
        producer = Producer(metaq, "in")
        sent = {}
        for i in range(40):
            attribute = f"a{i}" if i % 2 else None
            r = producer.send(b"in-%d" % i, (1, i % 2), attribute=attribute, flag=i % 3 * 2)
            sent[r.msg_id] = (b"in-%d" % i, attribute, i % 3 * 2 | (attribute is not None), f"1-{i % 2}")  # as sent
        committed, aborted = LocalTransaction(producer, 1), LocalTransaction(producer, 1)
        for tx, label in ((committed, b"tx-kept"), (aborted, b"tx-dropped")):
            tx.begin()
            r = tx.send(label, 0)
            if tx is committed:
                sent[r.msg_id] = (label, None, 0, "1-0")
        aborted.rollback()
        committed.commit()

        def read(path):
            q = (spark.readStream.format("metaq").option("metaq.zk.connect", cluster.zk_connect)
                 .option("metaq.zk.root", cluster.zk_root).option("subscribe", "in").load()
                 .select("msgId", "value", "attribute", "flag", "partition")
                 .writeStream.format("parquet").option("path", str(path))
                 .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())
            q.awaitTermination(120)
        read(tmp_path / "rows")
        read(tmp_path / "rows")  # again from the checkpoint: nothing twice
        rows = spark.read.parquet(str(tmp_path / "rows")).collect()
        assert len(rows) == len(sent) == 41
        assert {r.msgId: (r.value, r.attribute, r.flag, r.partition) for r in rows} == sent

        df = spark.createDataFrame([(f"out-{i}", f"n={i}" if i % 3 else None) for i in range(30)],
                                   "value string, attribute string")
        df.write.format("metaq").option("metaq.zk.connect", cluster.zk_connect) \
            .option("metaq.zk.root", cluster.zk_root).option("topic", "out").mode("append").save()
        consumer = GroupConsumer(metaq, "metaq-readers", "out", max_size=256)
        consumer.join()
        got = []
        wait_until(lambda: got.extend(consumer.poll()) or len(got) >= 30, what="Spark's 30 messages")
        assert sorted((m.value.decode(), m.attribute) for _, m in got) == \
            sorted((f"out-{i}", f"n={i}" if i % 3 else None) for i in range(30))
        assert consumer.poll() == []
        consumer.leave()
    finally:
        metaq.close()
        zk.stop()
        zk.close()
