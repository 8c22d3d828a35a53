"""What the fuzzers (tests/test_fuzz_*.py) share: how many inputs a run tries, and valid inputs to start
mutating from. A short run in CI; the long one (docs/security.md):

    METAQ_FUZZ_EXAMPLES=100000 python -m pytest -q -s tests/test_fuzz_records.py tests/test_fuzz_dataport.py \
        tests/test_fuzz_grpc.py

Hypothesis keeps the failing inputs it found in .hypothesis/ and tries them first next time."""
import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from metaq_broker.protocol import records

EXAMPLES = int(os.environ.get("METAQ_FUZZ_EXAMPLES", "0"))


def fuzz_settings(short: int):
    """``short`` inputs in CI, METAQ_FUZZ_EXAMPLES in a long run; no per-input deadline (a loaded machine)."""
    return settings(max_examples=EXAMPLES or short, deadline=None, derandomize=not EXAMPLES,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much])


values = st.lists(st.binary(max_size=64), min_size=1, max_size=20)


@st.composite
def bodies(draw) -> records.EncodedBody:
    """A batch body as a producer encodes it, with or without keys and attributes."""
    vals = draw(values)
    keys = draw(st.one_of(st.none(), st.lists(st.one_of(st.none(), st.binary(max_size=16)),
                                              min_size=len(vals), max_size=len(vals))))
    attrs = draw(st.one_of(st.none(), st.lists(st.one_of(st.none(), st.text(max_size=8)),
                                               min_size=len(vals), max_size=len(vals))))
    return records.encode_body(vals, keys, attrs)


@st.composite
def mutated(draw, data: bytes) -> bytes:
    """``data`` with a few bytes overwritten, cut out or inserted, or cut short, or longer."""
    out = bytearray(data)
    for _ in range(draw(st.integers(0, 4))):
        how = draw(st.sampled_from(["set", "cut", "insert", "truncate", "extend"]))
        at = draw(st.integers(0, max(len(out) - 1, 0)))
        if how == "set" and out:
            out[at] = draw(st.integers(0, 255))
        elif how == "cut" and out:
            del out[at:at + draw(st.integers(1, 8))]
        elif how == "insert":
            out[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif how == "truncate":
            del out[at:]
        elif how == "extend":
            out += draw(st.binary(max_size=64))
    return bytes(out)
