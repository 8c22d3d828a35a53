"""Kafka-shaped ACLs and their evaluation. An ACL allows or denies one principal (or ``User:*``) one
operation on resources of one type named literally (``*`` is every name) or by a prefix. A request is
allowed when some ACL allows it and none denies it; super users are always allowed. As in Kafka, Read,
Write, Delete and Alter imply Describe, and All stands for every operation."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Iterable

from metaq_broker.errors import ConfigError
from metaq_broker.security.settings import parse_principal

OPERATIONS = ("Read", "Write", "Create", "Delete", "Describe", "Alter", "ClusterAction", "DescribeConfigs", "All")
RESOURCE_TYPES = ("topic", "group", "cluster", "sink")
PATTERN_TYPES = ("literal", "prefixed")
PERMISSIONS = ("Allow", "Deny")
CLUSTER = "metaq-cluster"  # the one cluster resource's name (Kafka's kafka-cluster)
WILDCARD = "*"
_IMPLIES_DESCRIBE = ("Read", "Write", "Delete", "Alter")


def _pick(what: str, value: str, allowed) -> str:
    for a in allowed:
        if str(value).strip().lower() == a.lower():
            return a
    raise ConfigError(f"{what} {value!r} is not one of {', '.join(allowed)}")


@dataclass(frozen=True)
class Acl:
    principal: str
    permission: str
    operation: str
    resource_type: str
    name: str
    pattern_type: str = "literal"

    def __post_init__(self):
        parse_principal(self.principal)
        for attr, allowed in (("permission", PERMISSIONS), ("operation", OPERATIONS),
                              ("resource_type", RESOURCE_TYPES), ("pattern_type", PATTERN_TYPES)):
            object.__setattr__(self, attr, _pick(attr.replace("_", " "), getattr(self, attr), allowed))
        if not self.name:
            raise ConfigError("an ACL needs a resource name (or '*')")
        if self.resource_type == "cluster" and self.name != CLUSTER:
            raise ConfigError(f"the cluster resource is named {CLUSTER!r}, not {self.name!r}")
        if self.pattern_type == "prefixed" and self.name == WILDCARD:
            raise ConfigError("a prefixed ACL cannot have the name '*'; use a literal '*'")

    def covers(self, resource_type: str, name: str) -> bool:
        if resource_type != self.resource_type:
            return False
        if self.pattern_type == "prefixed":
            return name.startswith(self.name)
        return self.name == WILDCARD or self.name == name

    def grants(self, operation: str) -> bool:
        return self.operation in ("All", operation) or (operation == "Describe" and self.operation in _IMPLIES_DESCRIBE)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, m: dict) -> "Acl":
        return cls(**{k: m[k] for k in ("principal", "permission", "operation", "resource_type", "name",
                                        "pattern_type")})

    def __str__(self) -> str:
        return (f"{self.principal} has {self.permission} permission for operation {self.operation} on "
                f"{self.resource_type} {self.name!r} ({self.pattern_type})")


def encode(acls: Iterable[Acl]) -> bytes:
    return json.dumps({"version": 1, "acls": [a.to_json() for a in acls]}, sort_keys=True).encode()


def decode(data: bytes) -> list:
    return [Acl.from_json(m) for m in json.loads(data or b'{"acls": []}').get("acls", [])]


class AclTable:
    """The ACLs in force, by resource type; ``allows`` is what the broker asks for each request."""

    def __init__(self, acls: Iterable[Acl] = (), super_users: Iterable[str] = ()):
        self.super_users = frozenset(super_users)
        self._by_type: dict = {}
        for a in acls:
            self._by_type.setdefault(a.resource_type, []).append(a)

    def allows(self, principal: str, operation: str, resource_type: str, name: str) -> bool:
        if principal in self.super_users:
            return True
        allowed = False
        for a in self._by_type.get(resource_type, ()):
            if a.principal not in (principal, "User:*") or not a.covers(resource_type, name):
                continue
            if a.permission == "Deny":
                if a.operation in ("All", operation):  # a denial implies nothing further, as in Kafka
                    return False
            elif a.grants(operation):
                allowed = True
        return allowed

    def allows_some(self, principal: str, operation: str, resource_type: str) -> bool:
        """Whether ``operation`` is allowed to ``principal`` on at least one resource of the type: a super
        user, or an allowing ACL of the principal (or ``User:*``) not cancelled by a denial of every name."""
        if principal in self.super_users:
            return True
        mine = [a for a in self._by_type.get(resource_type, ()) if a.principal in (principal, "User:*")]
        if any(a.permission == "Deny" and a.operation in ("All", operation) and a.name == WILDCARD
               and a.pattern_type == "literal" for a in mine):
            return False
        return any(a.permission == "Allow" and a.grants(operation) for a in mine)
