"""``kafka_listener.to_metaq``: a Produce partition's decoded Kafka batches as one metaq batch body. What
every batch of the partition decides (any transactional or control batch is refused; create times are
kept unless a batch asks for LogAppendTime) holds whichever batch it is, not only the first."""
import numpy as np
import pyarrow as pa
import pytest

from metaq_broker.protocol import records as mrecords
from metaq_broker.protocol.kafka import records as krecords
from metaq_broker.server.kafka_listener import to_metaq

pytestmark = pytest.mark.unit

CREATED = 1_700_000_000_000


def batches(*attributes, timestamp_type=None):
    """Two records per batch, one batch per entry of ``attributes`` (its attribute bits)."""
    n = 2 * len(attributes)
    data = krecords.encode(np.arange(n), CREATED + np.arange(n), None, [b"v%d" % i for i in range(n)],
                           batch_starts=list(range(0, n, 2)), attributes=list(attributes))
    return krecords.decode(data)


@pytest.mark.parametrize("bit", [krecords.TRANSACTIONAL, krecords.CONTROL])
@pytest.mark.parametrize("where", [0, 1])
def test_a_transactional_or_control_batch_is_refused_wherever_it_is(bit, where):
    attributes = [0, 0]
    attributes[where] = bit
    with pytest.raises(krecords.KafkaRecordError, match="transaction"):
        to_metaq(batches(*attributes))


def test_create_times_are_kept_as_the_records_carry_them():
    body, producer = to_metaq(batches(0, 0))
    assert producer is None and body.create_times == (CREATED, CREATED + 3)
    decoded = mrecords.decode(mrecords.encode_header(body, 0, 0, 0) + b"".join(bytes(p) for p in body.parts))
    assert decoded.column("timestamp").cast(pa.int64()).to_pylist() == [CREATED + i for i in range(4)]


@pytest.mark.parametrize("where", [0, 1])
def test_a_log_append_time_batch_anywhere_makes_the_store_time_every_records_time(where):
    attributes = [0, 0]
    attributes[where] = krecords.TIMESTAMP_TYPE
    body, _ = to_metaq(batches(*attributes))
    assert body.create_times is None  # no create-time column: the batch's store time is each record's
