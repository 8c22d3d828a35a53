"""docker/: what can be proven without a Docker engine. hadolint on both Dockerfiles; the instructions
hadolint does not judge (non-root USER, VOLUME, EXPOSE, HEALTHCHECK, exec-form ENTRYPOINT); the
METAQ_* -> INI mapping through the real config loader; the real entrypoint on the host (a broker that
starts with the mapped config, answers the health check and exits 0 on SIGTERM); the compose file."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from metaq_broker.client.admin import Admin
from metaq_broker.devtools.zookeeper import free_port
from metaq_broker.errors import ConfigError
from metaq_broker.server.config import SYSTEM_KEYS, TOPIC_KEYS, BrokerConfig, load, topic_ini_values
from metaq_broker.store import TopicConfig
from metaq_broker.tools import container

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"


def instructions(dockerfile: Path) -> list:
    """[(INSTRUCTION, arguments)] with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in dockerfile.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        current += line.rstrip()[:-1] + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
            current = ""
    return out


def dockerfile_env(dockerfile: Path) -> dict:
    env = {}
    for word, args in instructions(dockerfile):
        if word == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(args))
    return env


def clean_env(**extra) -> dict:
    """The test process's environment without any METAQ_* a developer may have set, plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("METAQ_")}, **extra}


def entrypoint(env: dict, *args, **kw):
    return subprocess.run([sys.executable, "-m", "metaq_broker.tools.container", *args], env=env,
                          capture_output=True, text=True, timeout=60, **kw)


# -- Dockerfiles ----------------------------------------------------------------------------------------
@pytest.mark.process
@pytest.mark.parametrize("name", ["Dockerfile", "spark-job.Dockerfile"])
def test_hadolint_passes(name):
    r = subprocess.run(["hadolint", str(DOCKER / name)], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout + r.stderr) == (0, "")


def test_broker_dockerfile_runs_the_entrypoint_as_non_root_with_volume_ports_and_healthcheck():
    ins = instructions(DOCKER / "Dockerfile")
    words = [w for w, _ in ins]
    args = {w: a for w, a in ins}  # the last of each
    assert args["FROM"].startswith("python:3.11-slim")
    assert "pip install --no-cache-dir ." in args["RUN"]
    assert args["USER"].split(":")[0] not in ("root", "0") and words.index("USER") > words.index("RUN")
    assert json.loads(args["VOLUME"]) == ["/var/lib/metaq"]
    assert {"8123", "8125", "9123"} <= set(args["EXPOSE"].split())
    assert args["HEALTHCHECK"].endswith('CMD ["python", "-m", "metaq_broker.tools.container", "health"]')
    assert json.loads(args["ENTRYPOINT"]) == ["python", "-m", "metaq_broker.tools.container"]  # exec form: no shell
    assert not re.search(r"openjdk|temurin|default-jre|\bjava\b", (DOCKER / "Dockerfile").read_text(), re.I)
    env = dockerfile_env(DOCKER / "Dockerfile")
    assert env["METAQ_DATA_PATH"] == "/var/lib/metaq" and env["METAQ_SERVER_PORT"] == "8123"
    assert env["METAQ_METRICS_PORT"] == "9123" and env["METAQ_DATA_PORT"] == "8125"
    unknown = {v for v in env if v.startswith("METAQ_")} - set(container.env_keys())
    assert not unknown


def test_spark_job_dockerfile_has_java_17_and_runs_the_pipeline_as_non_root():
    ins = instructions(DOCKER / "spark-job.Dockerfile")
    args = {w: a for w, a in ins}
    assert [a for w, a in ins if w == "FROM"][0].startswith("eclipse-temurin:17-")
    assert args["USER"].split(":")[0] not in ("root", "0")
    assert json.loads(args["ENTRYPOINT"]) == ["python", "/opt/metaq/pipeline.py"]
    assert "COPY docker/pipeline.py /opt/metaq/pipeline.py" in [f"{w} {a}" for w, a in ins]
    compile((DOCKER / "pipeline.py").read_text(), "pipeline.py", "exec")


# -- the environment -> INI mapping ---------------------------------------------------------------------
def test_variable_names_follow_the_rule_for_every_key():
    assert container.env_name("brokerId") == "METAQ_BROKER_ID"
    assert container.env_name("zk.connect") == "METAQ_ZK_CONNECT"
    assert container.env_name("zk.sessionTimeout") == "METAQ_ZK_SESSION_TIMEOUT"
    assert container.env_name("maxFetchWait") == "METAQ_MAX_FETCH_WAIT"
    keys = container.env_keys()
    assert sorted(keys.values()) == sorted(list(SYSTEM_KEYS) + list(TOPIC_KEYS))  # generated, nothing missed
    assert {"METAQ_BROKER_ID", "METAQ_ZK_CONNECT", "METAQ_ZK_ROOT", "METAQ_HOST_NAME", "METAQ_SERVER_PORT",
            "METAQ_DATA_PATH", "METAQ_NUM_PARTITIONS", "METAQ_DELETE_POLICY"} <= set(keys)


def load_text(text: str, tmp_path) -> BrokerConfig:
    path = tmp_path / "broker.ini"
    path.write_text(text)
    return load(str(path))


def test_variables_load_through_the_broker_config_loader(tmp_path):
    cfg = load_text(container.config_from_env({
        "METAQ_BROKER_ID": "7", "METAQ_ZK_CONNECT": "zk1:2181,zk2:2181", "METAQ_ZK_ROOT": "/prod/",
        "METAQ_HOST_NAME": "broker7", "METAQ_SERVER_PORT": "9000", "METAQ_DATA_PATH": "/var/lib/metaq",
        "METAQ_ZK_SESSION_TIMEOUT": "6000", "METAQ_GRPC_WORKERS": "8", "METAQ_NUM_PARTITIONS": "4",
        "METAQ_UNFLUSH_THRESHOLD": "100", "METAQ_DELETE_POLICY": "archive,24", "METAQ_RETENTION_BYTES": " 1048576 ",
        "PATH": "/usr/bin", "HOME": "/root",  # not ours: ignored
        "METAQ_ZK": "elsewhere:2181", "METAQ_BROKERS": "1=x:1", "METAQ_LOG_LEVEL": "DEBUG",  # the CLI's / ours
    }), tmp_path)
    assert (cfg.broker_id, cfg.host_name, cfg.server_port, cfg.data_path) == (7, "broker7", 9000, "/var/lib/metaq")
    assert (cfg.zk_connect, cfg.zk_root, cfg.zk_session_timeout_ms) == ("zk1:2181,zk2:2181", "/prod", 6000)
    assert cfg.grpc_workers == 8
    t = cfg.topic_defaults
    assert (t.num_partitions, t.unflush_threshold, str(t.delete_policy), t.retention_bytes) == \
        (4, 100, "archive,24", 1048576)


def test_every_key_round_trips(tmp_path):
    """Each variable reaches its own key: the defaults, given explicitly, load back to the defaults."""
    default = load(None, {})
    values = {key: str(getattr(default, attr)) for key, (attr, _) in SYSTEM_KEYS.items()}
    values.update(topic_ini_values(default.topic_defaults))
    values["brokerId"], values["numPartitions"] = "12", "5"  # and two that differ, to see them arrive
    env = {var: values[key] for var, key in container.env_keys().items()}
    cfg = load_text(container.config_from_env(env), tmp_path)
    expected = load(None, values)
    assert (cfg.broker_id, cfg.topic_defaults.num_partitions) == (12, 5)
    assert {**vars(cfg), "source": None} == vars(expected)


def test_host_name_defaults_to_the_container_hostname(tmp_path):
    assert load_text(container.config_from_env({}), tmp_path).host_name == socket.gethostname()
    assert container.health_target({}) == f"{socket.gethostname()}:8123"
    assert container.health_target({"METAQ_HOST_NAME": "0.0.0.0", "METAQ_SERVER_PORT": "9"}) == "127.0.0.1:9"


@pytest.mark.parametrize("env, names", [
    ({"METAQ_SERVR_PORT": "1"}, ["unknown variable METAQ_SERVR_PORT", "did you mean METAQ_SERVER_PORT"]),
    ({"METAQ_TOPICS": "a,b"}, ["unknown variable METAQ_TOPICS"]),
    ({"METAQ_SERVER_PORT": "http"}, ["METAQ_SERVER_PORT='http'", "serverPort", "not an integer"]),
    ({"METAQ_BROKER_ID": "5000"}, ["METAQ_BROKER_ID='5000'", "brokerId", "outside 0..1023"]),
    ({"METAQ_DELETE_POLICY": "forever"}, ["METAQ_DELETE_POLICY='forever'", "deletePolicy"]),
    ({"METAQ_ZK_ROOT": "meta"}, ["METAQ_ZK_ROOT='meta'", "must start with '/'"]),
    ({"METAQ_DATA_PATH": ""}, ["METAQ_DATA_PATH=''", "must not be empty"]),
    ({"METAQ_DATA_PATH": "/x\n[topic=evil]"}, ["METAQ_DATA_PATH", "single line"]),
    ({"METAQ_LOG_LEVEL": "LOUD"}, ["METAQ_LOG_LEVEL='LOUD'"]),
])
def test_unknown_variables_and_bad_values_fail_naming_the_variable(env, names):
    with pytest.raises(ConfigError) as e:
        container.config_from_env(env)
    for text in names:
        assert text in str(e.value)


@pytest.mark.process
def test_entrypoint_refuses_a_typo_with_exit_2_naming_it():
    r = entrypoint(clean_env(METAQ_ZK_CONECT="zookeeper:2181", METAQ_SERVER_PORT="0"))
    assert r.returncode == 2
    assert "unknown variable METAQ_ZK_CONECT (did you mean METAQ_ZK_CONNECT?)" in r.stderr
    r = entrypoint(clean_env(METAQ_NUM_PARTITIONS="0"))
    assert r.returncode == 2 and "METAQ_NUM_PARTITIONS='0'" in r.stderr


def test_arguments_after_the_image_name_reach_the_broker_as_flags():
    from metaq_broker.server.main import parse_args
    cmd = container.broker_command("/tmp/b.ini", {"METAQ_LOG_LEVEL": "DEBUG"}, ["--numPartitions", "4"])
    assert cmd[:3] == [sys.executable, "-m", "metaq_broker.server.main"]
    args, overrides = parse_args(cmd[3:])
    assert (args.config, args.log_level, overrides) == ("/tmp/b.ini", "DEBUG", {"numPartitions": "4"})


# -- the real entrypoint on the host ---------------------------------------------------------------------
@pytest.mark.process
def test_entrypoint_starts_the_broker_with_the_mapped_config_and_stops_cleanly_on_sigterm(tmp_path):
    port, data = free_port(), tmp_path / "data"
    env = clean_env(METAQ_BROKER_ID="7", METAQ_ZK_CONNECT="none", METAQ_HOST_NAME="127.0.0.1",
                    METAQ_SERVER_PORT=str(port), METAQ_DATA_PATH=str(data), METAQ_NUM_PARTITIONS="3",
                    METAQ_DELETE_POLICY="archive,12", METAQ_KAFKA_PORT="0", TMPDIR=str(tmp_path),
                    PYTHONUNBUFFERED="1")
    assert entrypoint(env, "health").returncode == 1  # nothing listens yet: unhealthy
    log = open(tmp_path / "broker.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "metaq_broker.tools.container"], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while (health := entrypoint(env, "health")).returncode != 0:
            assert proc.poll() is None, (tmp_path / "broker.log").read_text()
            assert time.monotonic() < deadline, health.stderr
            time.sleep(0.2)
        assert health.stdout.strip() == f"127.0.0.1:{port}: SERVING"
        # exec'd, not a child: the entrypoint's own PID is now the broker, so docker's SIGTERM reaches it
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert b"metaq_broker.server.main" in cmdline
        ini = Path(cmdline[cmdline.index(b"--config") + 1].decode())
        assert ini.is_relative_to(tmp_path) and ini.read_text() == container.config_from_env(env)
        # the mapped values are the ones the broker runs with
        with Admin(brokers=f"7=127.0.0.1:{port}") as admin:
            assert sorted(admin.create_topic("orders")) == ["7-0", "7-1", "7-2"]
            assert admin.topic_config("orders", 7)["deletePolicy"] == "archive,12"
        assert sorted(p.name for p in data.iterdir() if p.is_dir()) == ["orders-0", "orders-1", "orders-2", "transactions"]
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - started < 15
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    text = (tmp_path / "broker.log").read_text()
    assert "metaq broker 7 listening on 127.0.0.1:%d" % port in text and "broker 7 stopped" in text
    assert entrypoint(env, "health").returncode == 1


# -- compose ---------------------------------------------------------------------------------------------
def compose() -> dict:
    return yaml.safe_load((DOCKER / "docker-compose.yml").read_text())


def environment(service: dict) -> dict:
    env = service.get("environment", {})
    return dict(item.split("=", 1) for item in env) if isinstance(env, list) else \
        {k: str(v) for k, v in env.items()}


def compose_members(spec: dict) -> dict:
    """{service name: service} of the services built from the broker image."""
    return {name: s for name, s in spec["services"].items()
            if s.get("build", {}).get("dockerfile") == "docker/Dockerfile"}


def container_env(service: dict) -> dict:
    """The METAQ_* variables a container of ``service`` sees: the image's ENV, then the service's."""
    return {**dockerfile_env(DOCKER / "Dockerfile"), **environment(service)}


def test_compose_has_zookeeper_a_group_of_three_and_the_spark_job():
    spec = compose()
    services = spec["services"]
    zk = services["zookeeper"]
    assert zk["image"] == "zookeeper:3.9" and zk["healthcheck"]["test"]
    members = compose_members(spec)
    assert len(members) == 3
    for name, s in members.items():
        assert (DOCKER / s["build"]["context"] / "setup.py").is_file()
        env = environment(s)
        assert env["METAQ_HOST_NAME"] == name == s["hostname"] and env["METAQ_ZK_CONNECT"] == "zookeeper:2181"
        targets = {str(p).rsplit(":", 1)[-1] for p in s["ports"]}
        assert {"8123", "8125", "9123"} <= targets  # gRPC, the data port replicas copy through, metrics
        volume, path = s["volumes"][0].split(":")[:2]
        assert path == "/var/lib/metaq" and volume in spec["volumes"]
        assert s["healthcheck"]["test"] == ["CMD", "python", "-m", "metaq_broker.tools.container", "health"]
        assert s["depends_on"] == {"zookeeper": {"condition": "service_healthy"}}
    # one group: the same brokerId, replicaId 0, 1, 2, nothing on the host shared
    envs = [environment(s) for s in members.values()]
    assert {e["METAQ_BROKER_ID"] for e in envs} == {"1"}
    assert sorted(e["METAQ_REPLICA_ID"] for e in envs) == ["0", "1", "2"]
    host_ports = [str(p).rsplit(":", 1)[0] for s in services.values() for p in s.get("ports", [])]
    assert len(host_ports) == len(set(host_ports)) == 1 + 3 * 3, host_ports
    assert len({s["volumes"][0].split(":")[0] for s in members.values()}) == 3
    job = services["spark-job"]
    assert job["build"]["dockerfile"] == "docker/spark-job.Dockerfile"
    assert (DOCKER / job["build"]["context"] / job["build"]["dockerfile"]).is_file()
    assert job["depends_on"] == {name: {"condition": "service_healthy"} for name in members}
    assert environment(job)["METAQ_ZK"] == "zookeeper:2181"
    assert environment(job)["PIPELINE_BROKERS"] == "1"  # a group is one broker: only its master is listed


def test_compose_members_load_as_one_group_through_the_config_loader(tmp_path):
    """Each member's variables, over the image's ENV as a container sees them, through the entrypoint's
    mapping and the broker's own loader: one brokerId, its own replicaId and host, the same topic defaults."""
    configs = {}
    for name, s in compose_members(compose()).items():
        path = tmp_path / f"{name}.ini"
        path.write_text(container.config_from_env(container_env(s)))
        configs[name] = load(str(path))
    assert sorted((c.broker_id, c.replica_id, c.host_name) for c in configs.values()) == \
        [(1, 0, "broker1-0"), (1, 1, "broker1-1"), (1, 2, "broker1-2")]
    for c in configs.values():
        assert (c.server_port, c.data_port, c.metrics_port, c.data_path) == (8123, 8125, 9123, "/var/lib/metaq")
        assert (c.zk_connect, c.zk_root) == ("zookeeper:2181", "/meta")
        t = c.topic_defaults
        assert (t.num_partitions, t.min_insync_replicas) == (2, 2)
    first = next(iter(configs.values()))
    assert all(c.topic_defaults == first.topic_defaults for c in configs.values())  # the same topics everywhere


def test_compose_members_form_a_group_through_the_real_entrypoint(tmp_path, zookeeper, zk_root):
    """The three members' variables, with only what a single host forces changed (loopback, free ports, a
    data directory each, the test's ZooKeeper), started through the real entrypoint: one master is elected,
    the other two join the in-sync set, and an acks=all put is acknowledged and read back."""
    from kazoo.client import KazooClient

    from metaq_broker.client.consumer import Consumer
    from metaq_broker.client.producer import Producer
    from metaq_broker.zk.paths import ZkPaths

    procs, logs = [], []
    try:
        for name, s in compose_members(compose()).items():
            env = clean_env(**{**container_env(s), **dict(
                METAQ_HOST_NAME="127.0.0.1", METAQ_SERVER_PORT=str(free_port()), METAQ_DATA_PORT=str(free_port()),
                METAQ_METRICS_PORT=str(free_port()), METAQ_KAFKA_PORT="0",  # one host here, a container each there
                METAQ_DATA_PATH=str(tmp_path / name),
                METAQ_ZK_CONNECT=zookeeper.connect_string, METAQ_ZK_ROOT=zk_root, TMPDIR=str(tmp_path),
                PYTHONUNBUFFERED="1")})
            logs.append(open(tmp_path / f"{name}.log", "w+"))
            procs.append(subprocess.Popen([sys.executable, "-m", "metaq_broker.tools.container"], env=env,
                                          stdout=logs[-1], stderr=subprocess.STDOUT))
        kz = KazooClient(hosts=zookeeper.connect_string)
        kz.start(15)
        try:
            state_path = ZkPaths(zk_root).group_state(1)
            deadline = time.monotonic() + 90
            while True:
                state = json.loads(kz.get(state_path)[0]) if kz.exists(state_path) else None
                if state and sorted(r for r, _ in state["isr"]) == [0, 1, 2]:
                    break
                assert all(p.poll() is None for p in procs), [(tmp_path / f"{n}.log").read_text()[-2000:]
                                                             for n in compose_members(compose())]
                assert time.monotonic() < deadline, f"no in-sync set of three: {state}"
                time.sleep(0.2)
            assert state["master"] in (0, 1, 2) and state["epoch"] >= 1
        finally:
            kz.stop()
            kz.close()
        with Producer(zk_connect=zookeeper.connect_string, zk_root=zk_root, acks="all", timeout=60) as producer, \
                Consumer(zk_connect=zookeeper.connect_string, zk_root=zk_root) as consumer:
            with Admin(zk_connect=zookeeper.connect_string, zk_root=zk_root) as admin:
                assert sorted(admin.create_topic("events")) == ["1-0", "1-1"]
            deadline = time.monotonic() + 60
            while len(producer.partitions("events")) != 2:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            sent = [b"event %d" % i for i in range(100)]
            assert sum(r.count for r in producer.send_batch("events", sent)) == 100
            got = []
            for name, (start, end) in consumer.offsets("events").items():
                got += consumer.read_range("events", name, start, end).column("value").to_pylist()
            assert sorted(got) == sorted(sent)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in logs:
            f.close()


# -- docker/README.md ------------------------------------------------------------------------------------
def expected_table() -> dict:
    """{variable: (key, default in the image)}: what the README's table must say."""
    image = dockerfile_env(DOCKER / "Dockerfile")
    broker, topic = BrokerConfig(), topic_ini_values(TopicConfig())
    rows = {}
    for var, key in container.env_keys().items():
        if var in image:
            rows[var] = (key, image[var])
        elif key == "hostName":
            rows[var] = (key, "the container's hostname")
        else:
            rows[var] = (key, topic[key] if key in TOPIC_KEYS else str(getattr(broker, SYSTEM_KEYS[key][0])))
    return rows


def test_readme_env_table_matches_the_mapping():
    rows = {m[1]: (m[2], m[3]) for m in re.finditer(r"^\| `(METAQ_\w+)` \| `([^`]+)` \| (.*?) \|",
                                                    (DOCKER / "README.md").read_text(), re.M)}
    expected = expected_table()
    table = "\n".join(f"| `{v}` | `{k}` | {d} |" for v, (k, d) in expected.items())
    assert rows == expected, f"docker/README.md's table should read:\n{table}"

