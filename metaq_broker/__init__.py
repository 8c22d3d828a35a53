"""metaq: a MetaQ-style message broker (storage, gRPC service, client, tools)."""
import os

# gRPC's fork handlers (grpcio 1.80 and later, grpc/grpc#43055) can kill a child forked while a channel is
# busy, before it execs: pyspark starts its JVM that way (``Popen(preexec_fn=...)``), so a driver whose metaq
# client was working failed to start Spark now and then ("Java gateway process exited before sending its
# port number"; measured: 17 of 1,500 forks). metaq's processes fork only to exec, which needs no fork
# support. gRPC reads the setting once, when it is imported: hence here, before any module of ours imports
# it. A value the user set wins (tests/test_grpc_fork.py).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__version__ = "0.1.0"
