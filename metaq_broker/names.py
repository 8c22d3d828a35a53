"""Partition names: ``<brokerId>-<n>``, as MetaQ spells them, made and parsed here only."""
from __future__ import annotations

import operator
import re

_PARTITION = re.compile(r"(0|[1-9][0-9]*)-(0|[1-9][0-9]*)")


def partition_name(broker_id: int, n: int) -> str:
    """``(3, 12)`` → ``"3-12"``, the name users see for partition 12 of broker 3."""
    return f"{whole_number('broker id', broker_id)}-{whole_number('partition number', n)}"


def parse_partition_name(name: str) -> tuple[int, int]:
    """``"3-12"`` → ``(3, 12)``. Only the canonical spelling is accepted (no signs, spaces or leading
    zeros), so one partition always maps to one znode."""
    if not isinstance(name, str) or not _PARTITION.fullmatch(name):
        raise ValueError(f"partition {name!r} is not of the form <brokerId>-<n> (e.g. '1-0')")
    b, n = name.split("-")
    return int(b), int(n)


def whole_number(what: str, v, limit: int = 10**20) -> int:
    """``v`` as a non-negative int below ``limit``; ValueError naming ``what`` otherwise."""
    try:
        if isinstance(v, bool):
            raise TypeError
        i = operator.index(v)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {v!r}") from None
    if i < 0:
        raise ValueError(f"{what} must be non-negative, got {i}")
    if i >= limit:
        raise ValueError(f"{what} {i} is too large (at most {limit - 1})")
    return i
