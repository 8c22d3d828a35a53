"""``metaq-broker --config broker.ini [--KEY VALUE ...]``: run a broker until SIGTERM or SIGINT.
Any [system] or per-topic default key may be given as a flag, e.g. ``--serverPort 9000``."""
from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys

from metaq_broker.errors import ConfigError, MetaqError
from metaq_broker.server.config import SYSTEM_KEYS, TOPIC_KEYS, load
from metaq_broker.store.durable import PRIVATE_UMASK


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="metaq-broker", description=__doc__)
    parser.add_argument("--config", help="INI file with a [system] section and [topic=NAME] sections")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--repair", action="store_true",
                        help="cut a damaged partition tail even where valid batches follow the damage (they may "
                             "have been acknowledged: topics with unflushThreshold > 0); what is cut is logged")
    for key in list(SYSTEM_KEYS) + list(TOPIC_KEYS):
        parser.add_argument(f"--{key}", dest=f"key:{key}", metavar="VALUE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    overrides = {k[4:]: v for k, v in vars(args).items() if k.startswith("key:") and v is not None}
    return args, overrides


def main(argv=None) -> None:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # New files 0600 and directories 0700 whatever the operator's umask (it may narrow them further).
    os.umask(os.umask(PRIVATE_UMASK) | PRIVATE_UMASK)
    # gRPC's C core logs each failed TLS handshake at INFO (a port scan or a flood of garbage would fill the
    # log); it reads GRPC_VERBOSITY once, when grpc is imported, hence the lazy import of the broker below.
    # An operator's own setting wins.
    os.environ.setdefault("GRPC_VERBOSITY", "INFO" if args.log_level == "DEBUG" else "ERROR")
    from metaq_broker.server.broker import Broker  # noqa: PLC0415 - lazy: after GRPC_VERBOSITY, see above
    broker, started, asked_to_stop = None, False, []

    def on_signal(signum, frame):
        logging.getLogger("metaq_broker").info("signal %d: shutting down", signum)
        if not started:
            # Still starting: Broker.start's own clean-up closes what it opened. The SystemExit can be lost
            # (one raised inside a ctypes callback, numba compiling, is printed and ignored): noted, so a
            # start that completes anyway stops at once.
            asked_to_stop.append(signum)
            raise SystemExit(0)
        broker.stop()

    # Installed before the start, so a SIGTERM while the store recovers or ZooKeeper is awaited ends the
    # start in order instead of by the default, abrupt death.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: every thread's stack on stderr
    try:
        config = load(args.config, overrides)
        broker = Broker(config, repair=args.repair)
        try:
            broker.start()
            started = True
        except SystemExit:  # also when start() had just returned: stopping twice is harmless
            broker.stop(grace=0)
            raise
    except (ConfigError, MetaqError) as e:
        sys.stderr.write(f"metaq-broker: {e}\n")
        sys.exit(2)
    if asked_to_stop:  # a signal came during the start and its SystemExit was swallowed: stop now
        broker.stop()
        return
    print(f"metaq broker {config.broker_id} listening on {broker.address}", flush=True)
    broker.wait()


def preload() -> None:
    """Import what ``main`` imports and load the Kafka listener's compiled kernels, ahead of any start: the
    test suite forks its brokers from a process that ran this (devtools/zygote.py), ~0.5 CPU-s a start."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # as main() sets it for every level but DEBUG
    from metaq_broker.protocol.kafka import records  # noqa: PLC0415 - lazy: as main's, after GRPC_VERBOSITY
    from metaq_broker.server.broker import Broker  # noqa: F401, PLC0415 - lazy: as main's, after GRPC_VERBOSITY
    records.warm_up()


if __name__ == "__main__":
    main()
