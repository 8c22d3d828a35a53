"""A process that uses metaq can start children while its gRPC channels are busy: the way pyspark starts
Spark's JVM (``subprocess.Popen`` with ``preexec_fn``, so a real fork) is the way every child here is started.
With gRPC's fork handlers on (grpcio's default), about one child in a hundred died before it could exec
(grpc/grpc#43055); the quickstart and the notebook then failed with "Java gateway process exited"."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.process

SCRIPT = textwrap.dedent("""
    import os, subprocess, sys, threading
    import metaq_broker  # before grpc, as any program using metaq imports it
    from concurrent import futures
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    done = threading.Event()

    def busy():
        while not done.is_set():
            stub.Check(health_pb2.HealthCheckRequest())
    for _ in range(2):
        threading.Thread(target=busy, daemon=True).start()
    codes = [subprocess.Popen(["/bin/true"], preexec_fn=lambda: None, stdin=subprocess.PIPE).wait()
             for _ in range(int(sys.argv[1]))]
    done.set()
    print(sum(c != 0 for c in codes), os.environ.get("GRPC_ENABLE_FORK_SUPPORT"))
    sys.stdout.flush()
    os._exit(0)
""")


def test_children_forked_while_grpc_calls_run_all_start():
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, "1500"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    failed, setting = out.stdout.split()
    assert failed == "0", f"{failed} of 1500 children died before they could exec"
    assert setting == "false"


def test_a_setting_the_user_made_wins():
    show = "import os, metaq_broker; print(os.environ['GRPC_ENABLE_FORK_SUPPORT'])"
    out = subprocess.run([sys.executable, "-c", show],
                         env={**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "true"}, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "true", out.stderr
