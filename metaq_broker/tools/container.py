"""The broker container's entrypoint and health check (docker/Dockerfile).

Containers are configured by environment variables, the broker by an INI file, so this maps one onto the
other. Rule: every ``[system]`` key of ``broker_config.SYSTEM_KEYS`` and ``TOPIC_KEYS`` is ``METAQ_`` plus
the key in upper snake case, dots and camelCase humps becoming ``_`` (``zk.sessionTimeout`` ->
``METAQ_ZK_SESSION_TIMEOUT``). The table is built from those dicts, so a new key gets its variable with
no change here. A ``METAQ_*`` variable that is neither a key, ``METAQ_LOG_LEVEL`` nor one the ``metaq``
command line reads fails the start naming it: a typo must not be ignored.

``python -m metaq_broker.tools.container [broker flags]`` writes the INI and replaces itself (``exec``) with the
broker, so the broker is PID 1 and gets SIGTERM from ``docker stop`` directly.
``python -m metaq_broker.tools.container health`` asks the broker's gRPC health service; exit 0 when SERVING.
"""
from __future__ import annotations

import difflib
import os
import re
import socket
import sys
import tempfile
from typing import Mapping, Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from metaq_broker.errors import ConfigError
from metaq_broker.server.config import SYSTEM_KEYS, TOPIC_KEYS, BrokerConfig, load

PREFIX = "METAQ_"
LOG_LEVEL = "METAQ_LOG_LEVEL"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def env_name(key: str) -> str:
    """``zk.sessionTimeout`` -> ``METAQ_ZK_SESSION_TIMEOUT``."""
    parts = (re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", p) for p in key.split("."))
    return PREFIX + "_".join(parts).upper()


def env_keys() -> dict:
    """{variable: INI key} for every [system] key the broker knows, in SYSTEM_KEYS then TOPIC_KEYS order."""
    out: dict = {}
    for key in list(SYSTEM_KEYS) + list(TOPIC_KEYS):
        var = env_name(key)
        if var in out:  # two keys differing only in case or dots would be ambiguous
            raise RuntimeError(f"{out[var]!r} and {key!r} both map to {var}")
        out[var] = key
    return out


def cli_variables() -> set:
    """Variables the ``metaq`` command line reads (METAQ_ZK, ...): allowed in the container, not config."""
    # lazy: the CLI imports most of metaq (0.4 s); `health`, which Docker runs every interval, needs none of it
    import click
    from metaq_broker.tools.cli import main as cli
    found, todo = set(), [cli]
    while todo:
        cmd = todo.pop()
        found.update(p.envvar for p in cmd.params if isinstance(p.envvar, str))
        if isinstance(cmd, click.Group):
            todo.extend(cmd.commands.values())
    return {v for v in found if v.startswith(PREFIX)}


def config_from_env(environ: Mapping[str, str]) -> str:
    """The ``[system]`` INI text for the ``METAQ_*`` variables of ``environ``; ConfigError naming the
    variable for an unknown one or a value the broker would refuse. Without METAQ_HOST_NAME the host is
    the container's hostname: the broker's default 127.0.0.1 is unreachable from outside a container."""
    keys = env_keys()
    allowed = {LOG_LEVEL} | cli_variables()
    settings: dict = {}  # INI key -> (variable, value)
    for var in sorted(v for v in environ if v.startswith(PREFIX)):
        value = environ[var]
        if var in keys:
            if "\n" in value or "\r" in value:
                raise ConfigError(f"{var}: the value must be a single line")
            settings[keys[var]] = (var, value)
        elif var == LOG_LEVEL and value not in LOG_LEVELS:
            raise ConfigError(f"{var}={value!r}: expected one of {', '.join(LOG_LEVELS)}")
        elif var not in allowed:
            known = list(keys) + sorted(allowed - set(keys))
            close = difflib.get_close_matches(var, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"unknown variable {var}{hint}; known: {', '.join(known)}")
    settings.setdefault("hostName", ("(container hostname)", socket.gethostname()))
    for key, (var, value) in settings.items():  # one at a time, so the error names the variable
        try:
            load(None, {key: value})
        except ConfigError as e:
            raise ConfigError(f"{var}={value!r}: {e}") from None
    values = {key: value for key, (_, value) in settings.items()}
    try:
        load(None, values)  # rules across keys
    except ConfigError as e:
        raise ConfigError(f"{', '.join(var for var, _ in settings.values())}: {e}") from None
    return "[system]\n" + "".join(f"{key} = {value.strip()}\n" for key, value in values.items())


def broker_command(ini_path: str, environ: Mapping[str, str], extra_args=()) -> list:
    """The broker's argv. ``sys.executable -m`` rather than the ``metaq-broker`` script: the same
    interpreter, whatever PATH says."""
    return [sys.executable, "-m", "metaq_broker.server.main", "--config", ini_path,
            "--log-level", environ.get(LOG_LEVEL, "INFO"), *extra_args]


def run(argv, environ: Mapping[str, str]) -> None:
    """Write the INI (into a fresh private directory under $TMPDIR) and exec the broker: no
    wrapper process stays between ``docker stop`` and the broker."""
    text = config_from_env(environ)
    path = os.path.join(tempfile.mkdtemp(prefix="metaq-broker-"), "broker.ini")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    cmd = broker_command(path, environ, argv)
    sys.stdout.flush()
    os.execv(cmd[0], cmd)


def health_target(environ: Mapping[str, str]) -> str:
    """Where the broker listens, by the same rules as ``config_from_env``."""
    host = environ.get("METAQ_HOST_NAME", "").strip() or socket.gethostname()
    if host in ("0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    port = environ.get("METAQ_SERVER_PORT", "").strip() or str(BrokerConfig.server_port)
    return f"{host}:{port}"


def health(environ: Mapping[str, str], timeout: float = 3.0) -> int:
    """0 if the broker's health service says SERVING, else 1 (Docker's HEALTHCHECK contract)."""
    target = health_target(environ)
    try:
        with grpc.insecure_channel(target) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout).status
    except grpc.RpcError as e:
        print(f"{target}: {e.code().name}", file=sys.stderr)
        return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(f"{target}: {name}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


def main(argv: Optional[list] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["health"]:
        sys.exit(health(os.environ))
    try:
        run(argv, os.environ)
    except ConfigError as e:
        sys.stderr.write(f"metaq container: {e}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
