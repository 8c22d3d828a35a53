"""The web console (``metaq console``) in a real headless Chromium against a real ZooKeeper and brokers:
what each page shows is checked against what the client reports, values are escaped, and a screenshot of
each page is taken; with METAQ_SCREENSHOTS=1 in the environment it is saved under docs/console/ for the
README and docs/console.md (a plain run leaves the repository as it was)."""
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from conftest import Cluster, wait_until
from selenium.webdriver.common.by import By
from webconsole import cell, open_page, start_console, stop_console, texts

from metaq_broker.client.admin import Admin
from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer
from metaq_broker.zk.group_offsets import GroupStore

pytestmark = pytest.mark.process
SHOTS = Path(__file__).resolve().parent.parent / "docs" / "console"
TOPIC = "orders"
# Long enough to see it restart after a kill: its ZooKeeper grants up to 20 ticks (a tick of 1 s here)
BROKER2 = {"numPartitions": 2, "zk.sessionTimeout": 20000}


def api(url, what):
    with urllib.request.urlopen(url + "api/" + what, timeout=10) as r:
        return json.load(r)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from metaq_broker.devtools.zookeeper import LocalZooKeeper
    with LocalZooKeeper(data_dir=tmp_path_factory.mktemp("console-zk"), tick_time_ms=1000) as zookeeper:
        yield from _env(tmp_path_factory, zookeeper)


def _env(tmp_path_factory, zookeeper):
    c = Cluster(tmp_path_factory.mktemp("console"), zookeeper.connect_string, f"/test-console-{os.getpid()}")
    c.start_broker(1, settings={"numPartitions": 2})
    c.start_broker(2, settings=BROKER2)
    admin = c.client(Admin)
    producer = c.client(Producer)
    try:
        wait_until(lambda: len(admin.brokers()) == 2, what="both brokers registered")
        admin.create_topic(TOPIC)
        producer.send_batch(TOPIC, [b"m%d" % i for i in range(40)], keys=[b"k%d" % i for i in range(40)])
        proc, url = start_console(c.zk_connect, c.zk_root)
        try:
            yield c, admin, producer, url
        finally:
            stop_console(proc)
    finally:
        producer.close()
        admin.close()
        c.stop()


def screenshot(driver, name):
    """A full-page PNG (the window grown to the page's height), saved as docs/console/<name>.png only when
    METAQ_SCREENSHOTS=1 asks for the pictures to be refreshed."""
    height = min(int(driver.execute_script("return document.documentElement.scrollHeight")), 2400)
    driver.set_window_size(1280, max(600, height))
    chrome = height - int(driver.execute_script("return window.innerHeight"))  # the window's own bars
    if chrome > 0:
        driver.set_window_size(1280, max(600, height + chrome))
    if os.environ.get("METAQ_SCREENSHOTS") == "1":
        SHOTS.mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(SHOTS / f"{name}.png"))
    else:
        assert driver.get_screenshot_as_png().startswith(b"\x89PNG\r\n")
    driver.set_window_size(1280, 900)


def n(x):
    return f"{x:,}"


def test_brokers_page_lists_live_brokers(env, browser):
    c, admin, _, url = env
    open_page(browser, url, "brokers")
    for bid, addr in admin.masters().items():
        assert cell(browser, f'tr[data-broker="{bid}"]', "address") == addr
        assert cell(browser, f'tr[data-broker="{bid}"]', "state") == "live"
        assert cell(browser, f'tr[data-broker="{bid}"]', "version")
    assert texts(browser, "#card-brokers .value") == ["2"]
    assert not browser.find_elements(By.CSS_SELECTOR, "#errors .error")
    screenshot(browser, "brokers")


def test_topics_page_shows_offsets_and_rates_while_producing(env, browser):
    c, admin, producer, url = env
    stop = threading.Event()

    def produce():
        with c.client(Consumer) as consumer:
            position = consumer.offsets(TOPIC, ["1-1"])["1-1"][1]
            while not stop.is_set():
                producer.send_batch(TOPIC, [b"x" * 100] * 200, partition="1-1")
                position = consumer.fetch(TOPIC, "1-1", position).next_offset
                stop.wait(0.05)

    sender = threading.Thread(target=produce, daemon=True)
    sender.start()
    try:
        open_page(browser, url, "topics")
        row = f'tr[data-topic="{TOPIC}"][data-partition="1-1"]'
        wait_until(lambda: cell(browser, row, "produce") not in ("", "–", "0.0"), what="a produce rate")
        wait_until(lambda: cell(browser, row, "fetch") not in ("", "–", "0.0"), what="a fetch rate")
        wait_until(lambda: sum(bool(x["topics"][TOPIC][0]) for x in api(url, "history")["samples"]) >= 6,
                   what="a few samples of the rate, for the chart")
        wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "svg.chart polyline"), what="a chart line")
    finally:
        stop.set()
        sender.join()
    bounds = admin.offset_bounds(TOPIC)
    sizes = {p.partition: p.bytes for p in admin.describe(TOPIC)}
    for p, (earliest, stable, end) in bounds.items():
        row = f'tr[data-topic="{TOPIC}"][data-partition="{p}"]'
        wait_until(lambda: cell(browser, row, "log_end") == n(end), what=f"{p}'s log end {end} on the page")
        assert (cell(browser, row, "earliest"), cell(browser, row, "last_stable")) == (n(earliest), n(stable))
        assert cell(browser, row, "state") == "open" and cell(browser, row, "bytes")
    wait_until(lambda: api(url, "snapshot")["topics"][0]["partitions"][1]["bytes"] == sizes["1-1"],
               what="1-1's size on disk as DescribeTopic reports it")
    screenshot(browser, "topics")


def test_groups_page_shows_lag_after_commits(env, browser):
    c, admin, _, url = env
    groups = GroupStore(admin.cluster.zk, c.zk_root)
    groups.commit("readers", TOPIC, {"1-0": 1, "2-1": 2})
    open_page(browser, url, "groups")

    def shown_lag_matches():
        rows = admin.group_lag("readers", TOPIC)
        return all(cell(browser, f'tr[data-group="readers"][data-partition="{r.partition}"]', "lag") == n(r.lag)
                   for r in rows) and rows

    wait_until(shown_lag_matches, what="the group's lag per partition on the page")
    before = cell(browser, 'tr[data-group="readers"][data-partition="1-0"]', "lag")
    latest = {p: r[1] for p, r in admin.offsets(TOPIC).items()}
    for step in (1, 2, 3):  # the group catches up; the page follows without a reload
        groups.commit("readers", TOPIC, {p: o * step // 3 for p, o in latest.items()}, forward_only=True)
        wait_until(shown_lag_matches, what=f"the group's lag per partition on the page (step {step})")
    assert before != "0"
    assert cell(browser, 'tr[data-group="readers"][data-partition="1-0"]', "lag") == "0"
    wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "svg.chart polyline"), what="a lag chart line")
    screenshot(browser, "groups")


def test_transactions_page_shows_prepared_and_unsettled(env, browser):
    c, admin, producer, url = env
    prepared = producer.transaction("console-prepared")
    prepared.send_batch(TOPIC, [b"p1", b"p2"], partition="1-0")
    prepared.prepare()
    open_tx = producer.transaction("console-open")
    open_tx.send_batch(TOPIC, [b"o1"], partition="2-0")
    producer.send_batch(TOPIC, [b"after the open transaction"], partition="2-0")  # held back behind it
    try:
        open_page(browser, url, "transactions")
        xid = prepared.xid_on(1)
        wait_until(lambda: cell(browser, f'tr[data-xid="{xid}"]', "messages") == "2", what="the prepared transaction")
        end = admin.offset_bounds(TOPIC, ["2-0"])["2-0"]
        row = f'tr[data-topic="{TOPIC}"][data-partition="2-0"]'
        wait_until(lambda: cell(browser, row, "log_end") == n(end[2]), what="the partition held back")
        assert cell(browser, row, "last_stable") == n(end[1]) and cell(browser, row, "held") == n(end[2] - end[1])
        end = admin.offset_bounds(TOPIC, ["1-0"])["1-0"]  # the prepared one holds 1-0 back
        assert end[2] > end[1]
        held = f'tr[data-topic="{TOPIC}"][data-partition="1-0"]'
        wait_until(lambda: cell(browser, held, "held") == n(end[2] - end[1]),
                   what="1-0 held back by the prepared transaction")
        screenshot(browser, "transactions")
    finally:
        prepared.rollback()
        open_tx.rollback()
    wait_until(lambda: not browser.find_elements(By.CSS_SELECTOR, "tr[data-xid]"), what="settled transactions gone")


def test_message_browser_escapes_values(env, browser):
    c, admin, producer, url = env
    start = admin.offsets(TOPIC, ["2-1"])["2-1"][1]
    values = [b"<script>window.__pwned = 1</script>", b'<img src=x onerror="window.__pwned = 2">',
              b"\x00\x01\xfe\xff binary", "h\u00e9llo w\u00f6rld".encode(), b"plain text", None]
    producer.send_batch(TOPIC, values, partition="2-1")
    open_page(browser, url, "messages", f"?topic={TOPIC}&partition=2-1&from={start}&count=10")
    wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "tr[data-offset]"), what="messages listed")
    shown = [cell(browser, f'tr[data-offset="{start + i}"]', "value") for i in range(len(values))]
    assert shown[0] == values[0].decode() and shown[1] == values[1].decode()
    assert shown[2] == "00 01 fe ff 20 62 69 6e 61 72 79"  # not UTF-8: hex
    assert shown[3:] == ["h\u00e9llo w\u00f6rld", "plain text", "null"]  # a null value (a tombstone)
    assert cell(browser, f'tr[data-offset="{start + 5}"]', "size") == "–"
    assert browser.execute_script("return window.__pwned") is None
    assert not browser.find_elements(By.CSS_SELECTOR, "main img, main td script")
    assert "2-1" in texts(browser, "#range")[0]
    screenshot(browser, "messages")
    open_page(browser, url, "messages", f"?topic={TOPIC}&partition=9-9")  # no such partition: an error, shown
    wait_until(lambda: browser.find_elements(By.ID, "browse-error"), what="the error of a bad partition")


def test_message_browser_finds_by_key_and_by_message_id(env, browser):
    c, admin, producer, url = env
    hostile = '<img src=x onerror="window.__pwned = 3">'
    producer.send_batch(TOPIC, [b"found-1", b"other", b"found-2"], keys=[b"find-me", b"not-me", b"find-me"])
    producer.send_batch(TOPIC, [b"found-3"], keys=[hostile.encode()])
    with c.client(Consumer) as consumer:
        want = [(m.partition, m.offset, m.msg_id) for m in consumer.lookup(TOPIC, key=b"find-me")]
    assert len(want) == 2
    open_page(browser, url, "messages", f"?topic={TOPIC}")
    browser.find_element(By.ID, "key").send_keys("find-me")
    browser.find_element(By.ID, "find-button").click()
    wait_until(lambda: len(browser.find_elements(By.CSS_SELECTOR, "tr[data-offset]")) == 2, what="found messages")
    rows = browser.execute_script("return Array.from(document.querySelectorAll('tr[data-offset]'), "
                                  "r => [r.dataset.partition, Number(r.dataset.offset)])")
    assert [tuple(r) for r in rows] == [(p, o) for p, o, _ in want]  # newest first, as the client's lookup
    assert texts(browser, 'td[data-col="value"]') == ["found-2", "found-1"]
    assert "find-me" in texts(browser, "#range")[0]
    screenshot(browser, "messages-find")
    # by message id: ids pass 2^53, so the page keeps them as text
    partition, offset, msg_id = want[1]
    open_page(browser, url, "messages", f"?topic={TOPIC}&msg_id={msg_id}&key=")
    wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "tr[data-offset]"), what="the message by id")
    assert texts(browser, 'td[data-col="id"]') == [str(msg_id)]
    assert cell(browser, f'tr[data-offset="{offset}"][data-partition="{partition}"]', "value") == "found-1"
    # a key that is markup stays text, in the form, the summary and the table
    open_page(browser, url, "messages", f"?topic={TOPIC}")
    browser.find_element(By.ID, "key").send_keys(hostile)
    browser.find_element(By.ID, "find-button").click()
    wait_until(lambda: texts(browser, 'td[data-col="value"]') == ["found-3"], what="the hostile key's message")
    assert texts(browser, 'td[data-col="key"]') == [hostile]
    assert browser.execute_script("return window.__pwned") is None and not browser.find_elements(By.CSS_SELECTOR,
                                                                                                 "main img")
    open_page(browser, url, "messages", f"?topic={TOPIC}&key=&msg_id=12x")  # a bad id: said, not a crash
    wait_until(lambda: browser.find_elements(By.ID, "browse-error"), what="the error of a bad message id")


def test_static_broker_list_without_zookeeper(env):
    """``metaq --brokers ... console``: brokers and topics from the brokers themselves, groups explained."""
    from metaq_broker.console.collector import Clients, Collector
    c, admin, _, url = env
    clients = Clients(None, "/meta", ",".join(f"{b}={a}" for b, a in sorted(admin.masters().items())))
    try:
        snap = Collector(clients).collect()
    finally:
        clients.close()
    assert [b["id"] for b in snap["brokers"]] == [1, 2] and snap["zookeeper"] is None
    bounds = admin.offset_bounds(TOPIC)
    assert {p["partition"]: (p["earliest"], p["last_stable"], p["log_end"])
            for p in snap["topics"][0]["partitions"]} == bounds
    assert any("consumer groups live in ZooKeeper" in e for e in snap["errors"]) and snap["groups"] == []


def test_a_restarted_and_a_stopped_broker_show_on_the_pages(env, browser):
    c, admin, _, url = env
    open_page(browser, url, "brokers")  # with everything the earlier tests made: the README's picture
    wait_until(lambda: texts(browser, "#card-groups .value") == [str(len(admin.groups()))], what="the groups counted")
    screenshot(browser, "brokers")
    c.brokers[2].kill()  # its ZooKeeper node stays until the session expires (BROKER2["zk.sessionTimeout"])
    lock = c.brokers[2].workdir / "data" / "replication" / "lock"  # a new lock file: the restart cannot take
    lock.rename(lock.with_name("lock.old"))  # its dead run's nodes over (docs/replication.md), so it waits
    restart = threading.Thread(target=c.start_broker, args=(2, BROKER2))
    restart.start()
    try:
        wait_until(lambda: cell(browser, 'tr[data-broker="2"]', "state").startswith(
            "starting: waiting for the previous ZooKeeper session to expire"), what="broker 2 shown starting")
        assert cell(browser, 'tr[data-broker="1"]', "state") == "live"
        def waiting():  # a snapshot taken while it waits (not one from its last moments of registering again)
            states = {p["partition"]: p["state"] for p in api(url, "snapshot")["topics"][0]["partitions"]
                      if p["partition"].startswith("2-")}
            return states if all(v.startswith("starting") for v in states.values()) else None
        wait_until(waiting, what="broker 2's partitions shown starting, not readable, while it waits")
    finally:
        restart.join()
    wait_until(lambda: cell(browser, 'tr[data-broker="2"]', "state") == "live", what="broker 2 live again")
    c.brokers[2].stop()  # deregisters; its topic entries stay: its partitions are down, not gone
    wait_until(lambda: not browser.find_elements(By.CSS_SELECTOR, 'tr[data-broker="2"]'), what="broker 2 gone")
    open_page(browser, url, "topics")
    wait_until(lambda: cell(browser, f'tr[data-topic="{TOPIC}"][data-partition="2-0"]', "state") == "broker down",
               what="broker 2's partitions shown down")
    assert cell(browser, f'tr[data-topic="{TOPIC}"][data-partition="1-0"]', "state") == "open"


def test_console_without_zookeeper_shows_the_error_and_exits_on_sigterm(tmp_path, browser):
    from metaq_broker.devtools.zookeeper import LocalZooKeeper
    zk = LocalZooKeeper(data_dir=tmp_path / "zk", tick_time_ms=500)  # not started yet
    proc, url = start_console(zk.connect_string, "/console-nozk")
    try:
        browser.get(url)
        wait_until(lambda: "connecting to" in texts(browser, "#status")[0] or texts(browser, "#errors .error"),
                   what="the page saying it waits")
        zk.start()
        wait_until(lambda: "(connected)" in texts(browser, "#status")[0], timeout=40,
                   what="the console connected once ZooKeeper is up")
        zk.stop()
        wait_until(lambda: any("not connected" in e for e in texts(browser, "#errors .error")),
                   timeout=30, what="the page saying ZooKeeper is gone")
        assert "Traceback" not in browser.page_source
    finally:
        zk.stop()
        stop_console(proc)


@pytest.mark.spark
def test_quickstart_prints_the_console_url_where_the_pipeline_lag_falls_to_zero(tmp_path, browser):
    """What a newcomer does: `metaq quickstart --keep-running`, open the console URL it prints, see the
    Spark pipeline's group (and the quickstart's readers) at lag 0 once the pipeline is done; Ctrl-C
    stops everything."""
    proc = subprocess.Popen([sys.executable, "-m", "metaq_broker.tools.cli", "quickstart", "--messages", "3000",
                             "--keep-running", "--console-port", "0", "--dir", str(tmp_path / "qs")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = []
    try:
        def line_with(text):
            while True:
                line = proc.stdout.readline()
                assert line, "".join(out) + proc.stderr.read()
                out.append(line)
                if text in line:
                    return line
        url = line_with("web console at ").split("web console at ")[1].split(": ")[0]
        open_page(browser, url, "groups")
        line_with("Ctrl-C stops them")  # the pipeline is done and everything is still up
        joined = "".join(out)
        assert "Spark read 3000 messages from quickstart-events" in joined
        assert "quickstart-upper now holds 3000 messages" in joined

        def lags():
            """{group: the lags shown on its partitions' rows}"""
            rows = browser.execute_script("return Array.from(document.querySelectorAll('tr[data-group]'), "
                                          "r => [r.dataset.group, r.querySelector('td[data-col=lag]').innerText])")
            out = {}
            for group, lag in rows:
                out.setdefault(group, set()).add(lag.strip())
            return out
        wait_until(lambda: any(g.startswith("spark-metaq-") for g in lags()), what="the Spark query's group shown")
        wait_until(lambda: {g: v for g, v in lags().items() if v != {"0"}} == {}, what="every group at lag 0")
        assert "quickstart-readers" in lags()
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
    rest = proc.stdout.read()
    assert rc == 0 and "stopped the broker and ZooKeeper" in rest, rest + proc.stderr.read()
