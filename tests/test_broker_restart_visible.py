"""A broker killed with SIGKILL and started again waits for ZooKeeper to expire its previous session before
it registers; meanwhile ``Admin.brokers_status()`` and ``metaq brokers`` show it as starting, with the
time left, and once it is registered as live again, with no trace of the wait left in ZooKeeper."""
import json
import threading

from click.testing import CliRunner
from conftest import wait_until

from metaq_broker.client.admin import Admin
from metaq_broker.tools.cli import main
from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.session import new_client

SESSION_MS = 10_000  # the longest the test ZooKeeper grants (20 ticks): a wait long enough to look at


def status_of(admin, broker_id):
    return next((s for s in admin.brokers_status() if s.broker_id == broker_id), None)


def test_a_restarted_broker_is_shown_starting_until_its_old_session_expires(cluster, zookeeper, zk_root):
    settings = {"zk.sessionTimeout": SESSION_MS}
    first = cluster.start_broker(0, settings)
    cluster.start_broker(1, settings)
    cli = ["--zk", zookeeper.connect_string, "--zk-root", zk_root, "brokers"]
    with cluster.client(Admin) as admin:
        wait_until(lambda: [(s.broker_id, s.state) for s in admin.brokers_status()] == [(0, "live"), (1, "live")],
                   what="two live brokers")
        assert admin.brokers_status()[0].address == first.address
        out = CliRunner().invoke(main, cli)
        assert out.exit_code == 0, out.output
        assert [line.split() for line in out.output.splitlines()[1:]] == [  # the Kafka listener's address too
            ["0", first.address, first.bootstrap, "live"],
            ["1", cluster.brokers[1].address, cluster.brokers[1].bootstrap, "live"]]

        first.kill()  # no deregistration: ZooKeeper keeps broker 0's node until the session times out
        # A restart on the same data would take its dead run's nodes over at once (docs/replication.md,
        # "Restart right after a crash"); a new lock file (another inode) is a run that cannot prove it: it waits.
        lock = first.workdir / "data" / "replication" / "lock"
        lock.rename(lock.with_name("lock.old"))
        restarted = {}
        restart = threading.Thread(target=lambda: restarted.setdefault("b", cluster.start_broker(0, settings)))
        restart.start()
        try:
            waiting = wait_until(lambda: (s := status_of(admin, 0)) is not None and s.state == "starting" and s,
                                 timeout=SESSION_MS / 1000 + 10, what="broker 0 shown starting")
            assert waiting.address == first.address
            assert waiting.since < waiting.expected_expiry <= waiting.since + SESSION_MS / 1000 + 1
            assert waiting.describe().startswith("starting: waiting for the previous ZooKeeper session to expire, ")
            assert status_of(admin, 1).state == "live"

            text = CliRunner().invoke(main, cli)
            as_json = CliRunner().invoke(main, cli + ["--format", "json"])
        finally:
            restart.join()
        assert text.exit_code == 0 and as_json.exit_code == 0, text.output + as_json.output
        line = next(line for line in text.output.splitlines() if line.split()[0] == "0")
        assert first.address in line and "starting: waiting for the previous ZooKeeper session to expire" in line
        rows = {r["brokerId"]: r for r in json.loads(as_json.output)}
        assert rows[1]["state"] == "live" and rows[1]["secondsLeft"] is None
        assert rows[0]["state"] == "starting" and rows[0]["address"] == first.address
        assert 0 <= rows[0]["secondsLeft"] <= SESSION_MS / 1000 + 1
        assert rows[0]["expectedExpiry"] == waiting.expected_expiry
        assert rows[0]["status"].startswith("starting: waiting for the previous ZooKeeper session to expire")

        assert "b" in restarted  # started: registered and serving
        wait_until(lambda: [(s.broker_id, s.state) for s in admin.brokers_status()] == [(0, "live"), (1, "live")],
                   what="broker 0 live again")
    zk = new_client(zookeeper.connect_string)
    zk.start()
    try:
        assert zk.get_children(ZkPaths(zk_root).brokers_starting()) == []  # removed once registered
    finally:
        zk.stop()
        zk.close()
    assert "waiting for it to expire" in restarted["b"].log_path.read_text()
