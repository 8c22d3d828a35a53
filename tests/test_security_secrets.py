"""Secret options never show (docs/security.md, section 5): a password that looks like nothing Spark's own
redaction knows (no "secret", "password" or "token" in it), given as metaq.sasl.password and inside
metaq.zk.auth, is searched for in the plans (explain, queryExecution), the streaming progress and status,
the errors of a failed query (with its logical plan), the driver's and executors' logs at INFO/DEBUG, the
checkpoints and the broker's log. The job runs in a process of its own (tests/spark_secrets_job.py)."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import wait_until

from metaq_broker.client import Consumer, Producer
from metaq_broker.devtools.broker_process import BrokerProcess
from metaq_broker.security.acl import Acl
from metaq_broker.security.scram import Credential
from metaq_broker.zk.acls import add_acls
from metaq_broker.zk.session import new_client
from metaq_broker.zk.users import put_user
from metaq_spark.options import is_secret, redaction_regex

pytestmark = pytest.mark.unit

SECRET = "hunter2-zx"
# Every Python process of the job (the driver, the workers that plan and read and write) logs metaq at
# DEBUG; py4j's DEBUG would echo each command sent to the JVM, the user's own option values included, so
# the rest stays at INFO.
SITECUSTOMIZE = """
import logging
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
for name in ("metaq_broker", "metaq_spark"):
    logging.getLogger(name).setLevel(logging.DEBUG)
"""
ROWS = 2000
TESTS = Path(__file__).resolve().parent


def test_secret_options_are_recognised_and_the_regex_is_added_once():
    for name in ("metaq.zk.auth", "metaq.sasl.password", "METAQ.SASL.PASSWORD", "metaq.ssl.key.password",
                 "metaq.ssl.keystore.password", "metaq.oauth.token"):
        assert is_secret(name), name
    for name in ("metaq.zk.connect", "metaq.sasl.username", "subscribe", "metaq.ssl.key.location", "password"):
        assert not is_secret(name), name
    once = redaction_regex(None)
    assert once.startswith("(?i)url|") and redaction_regex(once) == once
    assert redaction_regex("(?i)jdbc") == "(?i)jdbc|" + once.split("|", 1)[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, zookeeper, pki):
    work = tmp_path_factory.mktemp("secrets")
    root = f"/secrets-{time.time_ns()}"
    zk = new_client(zookeeper.connect_string)
    zk.start()
    for user, password in (("etl", SECRET), ("intruder", SECRET), ("admin", "admin-pw")):
        put_user(zk, root, user, Credential.make(password))
    add_acls(zk, root, [Acl(user, "Allow", op, "topic", topic) for user in ("User:etl", "User:intruder")
                        for op, topic in (("Read", "in"), ("Write", "out"))])
    add_acls(zk, root, [Acl("User:etl", "Allow", "Read", "group", "etl-group"),
                        Acl("User:intruder", "Allow", "Read", "group", "etl-group"),
                        Acl("User:etl", "Allow", "Write", "sink", "etl-", "prefixed"),
                        Acl("User:etl", "Allow", "Write", "sink", "write.etl-batch")])
    broker = BrokerProcess(work / "b", 1, zookeeper.connect_string, settings={
        "zk.root": root, "zk.sessionTimeout": 4000, "security.protocol": "SASL_SSL",
        "ssl.certificate.location": pki.broker.cert, "ssl.key.location": pki.broker.key, "ssl.ca.location": pki.ca,
        "authorizer": "acl", "super.users": "User:admin"},
        topics={"in": {"numPartitions": 2}, "out": {"numPartitions": 2}}).start()
    admin = {"security.protocol": "SASL_SSL", "ssl.ca.location": pki.ca, "sasl.username": "admin",
             "sasl.password": "admin-pw"}
    with Producer(zk_connect=zookeeper.connect_string, zk_root=root, security=admin) as p:
        wait_until(lambda: len(p.cluster.topic_partitions("in")) == 2, what="topic in")
        for part in ("1-0", "1-1"):
            p.send_batch("in", [b"%s:%d" % (part.encode(), i) for i in range(ROWS // 2)], partition=part)
    yield {"zk": zookeeper.connect_string, "root": root, "ca": pki.ca, "admin": admin, "broker": broker,
           "work": work}
    broker.kill()
    zk.stop()
    zk.close()


@pytest.mark.spark
def test_a_secret_shows_in_no_plan_progress_error_log_or_checkpoint(cluster, tmp_path):
    args = {"zk": cluster["zk"], "root": cluster["root"], "ca": cluster["ca"], "secret": SECRET,
            "checkpoint": str(tmp_path / "cp"), "failing_checkpoint": str(tmp_path / "cp-failing"),
            "out": str(tmp_path / "shown.json")}
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(TESTS),
                                                       os.environ.get("PYTHONPATH", "")]))
    with open(tmp_path / "job.log", "wb") as log:
        job = subprocess.run([sys.executable, str(TESTS / "spark_secrets_job.py"), json.dumps(args)], stdout=log,
                             stderr=subprocess.STDOUT, env=env, timeout=600)
    logs = (tmp_path / "job.log").read_text(errors="replace")
    assert job.returncode == 0, logs[-5000:]
    shown = json.loads((tmp_path / "shown.json").read_text())

    # the job did what it should, so the secrets were really used and really shown redacted
    assert shown["error"] == "None" and shown["batch rows"] == ROWS
    with Consumer(zk_connect=cluster["zk"], zk_root=cluster["root"], security=cluster["admin"]) as c:
        assert sum(end for _, end in c.offsets("out").values()) >= 2 * ROWS  # the stream, then the batch write
    assert "User:intruder is not allowed Write on sink 'etl-orders'" in shown["failure"]
    assert "Logical Plan" in shown["failure in full"]
    assert "metaq.zk.auth=*********(redacted)" in shown["source plan"]
    assert "metaq.sasl.password=*********(redacted)" in shown["source plan"]
    assert " INFO MicroBatchExecution" in logs  # Spark's INFO
    pids = {m.group(1) for m in re.finditer(r"^\d{4}-\d\d-\d\d [\d:,]+ (\d+) ", logs, re.MULTILINE)}
    assert len(pids) > 2, pids  # the driver's Python and its workers' logging (sitecustomize) are there

    places = {f"shown[{k}]": json.dumps(v) for k, v in shown.items()}
    places["the job's logs"] = logs
    places["the broker's log"] = cluster["broker"].log_path.read_text(errors="replace")
    for checkpoint in ("cp", "cp-failing"):
        for f in (tmp_path / checkpoint).rglob("*"):
            if f.is_file():
                places[str(f)] = f.read_bytes().decode(errors="replace")
    checkpoints = [p for p in places if "/cp" in p]
    assert any("/offsets/" in p for p in checkpoints) and any("/commits/" in p for p in checkpoints), checkpoints
    leaked = sorted(p for p, text in places.items() if SECRET in text)
    assert not leaked, {p: places[p][max(0, places[p].find(SECRET) - 300):places[p].find(SECRET) + 100]
                        for p in leaked}
