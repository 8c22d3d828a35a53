"""The options of the metaq source and sink (metaq_spark/options.py) in-process, without Spark or a broker:
each parser takes only its own options and those Spark passes itself, both check ZooKeeper's the same way,
and a streaming sink may not take a batch write's reserved sink id."""
import pytest

from metaq_broker.zk.decisions import BATCH_WRITE_PREFIX
from metaq_spark.options import OptionError, SinkOptions, parse, parse_sink

pytestmark = pytest.mark.unit

ZK = {"metaq.zk.connect": "zk:2181"}


@pytest.mark.parametrize("parser", [lambda o: parse({"subscribe": "t", **o}, streaming=True), parse_sink],
                         ids=["source", "sink"])
def test_zookeeper_options_are_checked_alike(parser):
    with pytest.raises(OptionError, match=r"option metaq.zk.connect is required"):
        parser({})
    with pytest.raises(OptionError, match=r"option metaq.zk.root: 'meta' must start with '/'"):
        parser({**ZK, "metaq.zk.root": "meta"})
    assert parser({**ZK, "METAQ.ZK.ROOT": "/other"}).zk_root == "/other"  # Spark lower-cases keys; any case works
    assert parser(ZK).zk_root == "/meta"


def test_each_side_takes_its_own_options_and_what_spark_passes():
    with pytest.raises(OptionError, match=r"unknown option 'topic' for the metaq source; known options: assign, "):
        parse({**ZK, "subscribe": "t", "topic": "t"}, streaming=True)
    with pytest.raises(OptionError, match=r"unknown option 'checkpointLocation' for the metaq source"):
        parse({**ZK, "subscribe": "t", "checkpointLocation": "/ck"}, streaming=True)
    assert parse({**ZK, "subscribe": "t", "path": "x"}, streaming=True).subscribe == ["t"]
    with pytest.raises(OptionError, match=r"unknown option 'subscribe' for the metaq sink; known options: "
                                          r"deliveryGuarantee, deliveryTimeoutMs, metaq.sasl.mechanism, "):
        parse_sink({**ZK, "subscribe": "t"})
    assert parse_sink({**ZK, "checkpointlocation": "/ck", "path": "x"}) == SinkOptions("zk:2181", checkpoint="/ck")


def test_streaming_only_options_are_refused_in_a_batch_read():
    for name in ("maxOffsetsPerTrigger", "maxBytesPerTrigger", "minOffsetsPerTrigger", "maxTriggerDelay"):
        with pytest.raises(OptionError, match=rf"option {name} is only for streaming queries"):
            parse({**ZK, "subscribe": "t", name: "10"}, streaming=False)
        parse({**ZK, "subscribe": "t", name: "10"}, streaming=True)


def test_a_streaming_sink_may_not_take_a_batch_writes_sink_id():
    reserved = BATCH_WRITE_PREFIX + "job"
    with pytest.raises(OptionError, match=rf"option sinkId: '{reserved}': names starting with 'write.' are "
                                          r"reserved for batch writes"):
        parse_sink({**ZK, "sinkId": reserved}, streaming=True)
    assert parse_sink({**ZK, "sinkId": reserved}).sink_id == reserved  # a batch write's own record
    assert parse_sink({**ZK, "sinkId": "job"}, streaming=True).sink_id == "job"


def test_the_sinks_delivery_timeout_is_a_positive_number_of_milliseconds():
    assert parse_sink(ZK).delivery_timeout_ms == 30_000  # the Producer's own default
    assert parse_sink({**ZK, "deliverytimeoutms": "2500"}).delivery_timeout_ms == 2500
    for bad, message in (("0", "must be at least 1, got 0"), ("soon", "'soon' is not an integer")):
        with pytest.raises(OptionError, match=f"option deliveryTimeoutMs: {message}"):
            parse_sink({**ZK, "deliveryTimeoutMs": bad})
