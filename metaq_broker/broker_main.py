"""``metaq-broker``: the broker process. The gRPC server, ZooKeeper registration and INI configuration
come with the broker issue; until then this entry point says so instead of pretending to run."""
import sys


def main() -> None:
    sys.stderr.write("metaq-broker: the broker server is not built yet (storage engine only in this version)\n")
    sys.exit(2)
