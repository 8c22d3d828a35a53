"""The broker's INI configuration: defaults, sections, flag overrides, and refusal of bad input."""
import subprocess
import sys

import pytest

from metaq_broker.errors import ConfigError
from metaq_broker.server.config import load
from metaq_broker.store import DeletePolicy

pytestmark = pytest.mark.unit


def write(tmp_path, text):
    path = tmp_path / "broker.ini"
    path.write_text(text)
    return str(path)


def test_defaults_without_a_file():
    cfg = load(None)
    assert (cfg.broker_id, cfg.server_port, cfg.zk_root, cfg.zk_connect) == (0, 8123, "/meta", "127.0.0.1:2181")
    assert cfg.topic_defaults.group_commit and cfg.topics == {}


def test_system_topic_sections_and_flag_overrides(tmp_path):
    path = write(tmp_path, """
[system]
brokerId=7
serverPort=9000
dataPath=/var/metaq
zk.connect=zk1:2181,zk2:2181
zk.root=/prod/meta/
numPartitions=3
unflushThreshold=100
deletePolicy=archive,24

[topic=orders]
numPartitions=8
unflushThreshold=0

[topic=logs.raw]
maxSegmentSize=1048576
""")
    cfg = load(path, {"serverPort": "9100"})
    assert (cfg.broker_id, cfg.server_port, cfg.data_path) == (7, 9100, "/var/metaq")
    assert (cfg.zk_connect, cfg.zk_root) == ("zk1:2181,zk2:2181", "/prod/meta")
    assert cfg.topic_defaults.num_partitions == 3 and cfg.topic_defaults.unflush_threshold == 100
    orders = cfg.topics["orders"]
    assert (orders.num_partitions, orders.unflush_threshold) == (8, 0)
    assert orders.delete_policy == DeletePolicy("archive", 24)  # inherited from [system]
    logs = cfg.topics["logs.raw"]
    assert (logs.num_partitions, logs.max_segment_size, logs.unflush_threshold) == (3, 1048576, 100)


@pytest.mark.parametrize("text,overrides,match", [
    ("[system]\nbrokerID=1\n", {}, r"\[system\]: unknown key 'brokerID'"),
    ("[system]\nserverPort=http\n", {}, r"serverPort: 'http' is not an integer"),
    ("[system]\nserverPort=70000\n", {}, r"serverPort: 70000 is outside"),
    ("[system]\nbrokerId=-1\n", {}, r"brokerId: -1 is outside"),
    ("[system]\nzk.root=meta\n", {}, r"zk.root: 'meta' must start with '/'"),
    ("[system]\ndeletePolicy=purge,3\n", {}, r"deletePolicy"),
    ("[system]\nmaxSegmentSize=10\n", {}, r"maxSegmentSize: 10 is outside"),
    ("[system]\nrequestTimeout=50\n", {}, r"requestTimeout: 50 is outside"),
    ("[topic=orders]\nnumPartition=3\n", {}, r"\[topic=orders\]: unknown key 'numPartition'"),
    ("[topic=orders]\nnumPartitions=0\n", {}, r"\[topic=orders\] numPartitions: 0 is outside"),
    ("[topic=a/b]\nnumPartitions=1\n", {}, r"\[topic=a/b\].*'/'"),
    ("[brokers]\nx=1\n", {}, r"unknown section \[brokers\]"),
    ("[system]\n", {"serverPort": "x"}, r"serverPort: 'x' is not an integer"),
    ("[system\nbrokerId=1\n", {}, r"broker.ini"),
])
def test_bad_configuration_is_refused_naming_the_key(tmp_path, text, overrides, match):
    with pytest.raises(ConfigError, match=match):
        load(write(tmp_path, text), overrides)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load(str(tmp_path / "nope.ini"))


@pytest.mark.process
def test_broker_command_refuses_bad_config_with_exit_code_2(tmp_path):
    path = write(tmp_path, "[system]\nserverPort=abc\n")
    proc = subprocess.run([sys.executable, "-m", "metaq_broker.server.main", "--config", path],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "serverPort: 'abc' is not an integer" in proc.stderr
