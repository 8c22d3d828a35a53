"""The MetaQ listener on a secured cluster: MetaQ 1.4 clients have no login, so they are ANONYMOUS; a broker
refuses to start such a listener on a cluster with ACLs or SASL unless ``metaq.anonymousTopics`` names the
topics they may use; there, ACLs still decide every command, other topics are refused (403), and the
listener speaks TLS when security.protocol is not PLAINTEXT."""
import ssl

import pytest
from kazoo.client import KazooClient

from metaq_broker.errors import ConfigError
from metaq_broker.security.acl import Acl
from metaq_broker.server.broker import Broker
from metaq_broker.server.config import load
from metaq_broker.zk import acls as zk_acls
from tests.metaq_client import Connection, decode_messages


def settings(tmp_path, zookeeper, zk_root, pki, **more):
    return {"brokerId": "1", "serverPort": "0", "dataPort": "-1", "kafkaPort": "0", "metaqPort": "0", "dataPath": str(tmp_path / "data"),
            "zk.connect": zookeeper.connect_string, "zk.root": zk_root, "authorizer": "acl",
            "security.protocol": "SSL", "ssl.certificate.location": pki.broker.cert,
            "ssl.key.location": pki.broker.key, "ssl.ca.location": pki.ca, "super.users": "User:admin", **more}


def tls_connection(pki, port) -> Connection:
    conn = Connection("127.0.0.1", port)
    context = ssl.create_default_context(cafile=pki.ca)
    context.check_hostname = False
    conn.sock = context.wrap_socket(conn.sock)
    return conn


@pytest.mark.parametrize("protocol", ["PLAINTEXT", "SSL"])
def test_a_metaq_listener_on_a_cluster_with_acls_needs_named_anonymous_topics(tmp_path, zookeeper, zk_root, pki,
                                                                             protocol):
    with pytest.raises(ConfigError, match=r"metaqPort: MetaQ 1.4 clients have no login.*metaq\.anonymousTopics"):
        Broker(load(None, settings(tmp_path, zookeeper, zk_root, pki, **{"security.protocol": protocol}))).start()


@pytest.mark.unit
def test_a_bad_anonymous_topic_name_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"metaq\.anonymousTopics"):
        load(None, {"metaq.anonymousTopics": "ok, bad/name"})


def test_anonymous_metaq_clients_use_only_the_named_topics_and_only_as_the_acls_allow(tmp_path, zookeeper,
                                                                                    zk_root, pki):
    ini = tmp_path / "broker.ini"
    ini.write_text("[topic=open]\n\n[topic=writeonly]\n\n[topic=other]\n")
    zk = KazooClient(hosts=zookeeper.connect_string)
    zk.start(15)
    broker = None
    try:
        zk_acls.add_acls(zk, zk_root, [Acl("User:ANONYMOUS", "Allow", op, "topic", "open")
                                       for op in ("Read", "Write", "Describe")] +
                         [Acl("User:ANONYMOUS", "Allow", "Write", "topic", "writeonly")] +
                         [Acl("User:ANONYMOUS", "Allow", op, "topic", "other") for op in ("Read", "Write")])
        broker = Broker(load(str(ini), settings(tmp_path, zookeeper, zk_root, pki,
                                                **{"metaq.anonymousTopics": "open,writeonly"}))).start()
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):  # TLS only: a plain client gets no answer
            plain = Connection("127.0.0.1", broker.metaq_port, timeout=5)
            plain.sock.sendall(b"version 1\r\n")
            plain.read_reply()
        conn = tls_connection(pki, broker.metaq_port)
        reply = conn.call(["put", "open", 0, 5, 0, -1], b"hello")
        assert reply.code == 200, reply.text
        messages, _ = decode_messages(conn.call(["get", "open", "g", 0, 0, 1000]).body, 0)
        assert [m.value for m in messages] == [b"hello"]
        assert conn.ok(["stats", "open"]).startswith("STATS")

        reply = conn.call(["put", "other", 0, 5, 0, -1], b"hello")  # ACLs allow it, metaq.anonymousTopics not
        assert reply.code == 403 and "metaq.anonymousTopics" in reply.text
        assert conn.call(["get", "other", "g", 0, 0, 1000]).code == 403
        assert conn.call(["put", "writeonly", 0, 5, 0, -1], b"hello").code == 200
        reply = conn.call(["get", "writeonly", "g", 0, 0, 1000])  # named, but no Read ACL
        assert reply.code == 403 and "not allowed Read" in reply.text
        assert conn.call(["stats", ""]).code == 403  # the broker's counters: not a named topic
        assert conn.call(["transaction", "TX:s:1", "s", "BEGIN"]).code == 403
        assert conn.version()  # refusals leave the connection usable
        conn.sock.close()
        assert broker.store.partition("other", 0).log_end_offset == 0
    finally:
        if broker is not None:
            broker.stop()
        zk.stop()
        zk.close()
