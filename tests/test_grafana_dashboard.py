"""docker/grafana-dashboard.json charts only what brokers export: every metric name in every query (panels
and template variables) is among the samples of a live broker's /metrics, with a group committed, so the
lag series exist."""
import json
import re
import urllib.request
from pathlib import Path

import pytest
from conftest import wait_until

from metaq_broker.client.admin import Admin
from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer
from metaq_broker.zk.group_offsets import GroupStore

pytestmark = pytest.mark.unit

DASHBOARD = Path(__file__).resolve().parent.parent / "docker" / "grafana-dashboard.json"
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan"}


def panels(items):
    for p in items:
        yield p
        yield from panels(p.get("panels", []))


def queries(dashboard) -> list:
    out = [t["expr"] for p in panels(dashboard["panels"]) for t in p.get("targets", [])]
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            out.append(v["query"]["query"] if isinstance(v["query"], dict) else v["query"])
    return out


def metric_names(expr: str) -> set:
    """Metric names of a PromQL expression or a Grafana ``label_values(selector, label)`` query."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", expr)
    if m:
        expr = m.group(1)
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)  # label matchers, ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", expr):  # not the unit of 5m, nor 1e3
        rest = expr[m.end():].lstrip()
        if not rest.startswith("(") and m.group().lower() not in KEYWORDS:
            names.add(m.group())
    return names


def test_the_name_extraction_itself():
    assert metric_names('sum by (group, topic) (rate(a_total{x=~"$g", y="b c"}[$__rate_interval])) / b') == {
        "a_total", "b"}
    assert metric_names("histogram_quantile(0.99, sum by (le) (rate(h_bucket[5m])))") == {"h_bucket"}
    assert metric_names("label_values(metaq_latest_offset, topic)") == {"metaq_latest_offset"}
    assert metric_names("x - on (topic) group_left y offset 5m") == {"x", "y"}


def test_every_query_names_only_metrics_a_live_broker_exports(cluster):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = queries(dashboard)
    names = set().union(*map(metric_names, exprs))
    assert len(exprs) >= 15 and {"metaq_consumergroup_lag", "metaq_consumergroup_lag_seconds", "metaq_messages_in_total",
                                 "metaq_messages_out_total", "metaq_last_stable_offset", "metaq_latest_offset",
                                 "metaq_fsync_seconds_total"} <= names
    for p in panels(dashboard["panels"]):
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]

    port = cluster.start_broker(1, settings={"metricsPort": 0, "numPartitions": 2}).metrics_port
    with cluster.client(Admin) as admin, cluster.client(Producer) as producer, cluster.client(Consumer) as consumer:
        wait_until(lambda: admin.brokers(), what="broker registered")
        admin.create_topic("t")
        wait_until(lambda: producer.cluster.topic_partitions("t"), what="topic")
        producer.send_batch("t", [b"x"] * 10, partition="1-0")
        consumer.fetch("t", "1-0", 0)
        GroupStore(admin.cluster.zk, cluster.zk_root).commit("dash", "t", {"1-0": 3})

    def exported():
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}

    samples = wait_until(lambda: (lambda s: "metaq_consumergroup_lag" in s and s)(exported()), what="lag series")
    assert sorted(names - samples) == []
