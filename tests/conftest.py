import pytest


class FakeClock:
    """A settable clock (seconds), passed as ``clock=`` so time-dependent behaviour is deterministic."""

    def __init__(self, start: float = 1_700_000_000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock():
    return FakeClock()
