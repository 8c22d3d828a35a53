"""The principal a client certificate names, by Kafka's rule: the certificate's subject distinguished name
(RFC 4514, most specific attribute first: ``CN=alice,OU=eng,O=corp``) rewritten by the first of the
``ssl.principal.mapping.rules`` that matches it. Only the subject counts: a subject alternative name never
becomes a principal, and a certificate that no rule maps (an empty subject among them) is refused.

A rule is ``RULE:pattern/replacement/`` with an optional ``L`` or ``U`` after the last slash (lower or
upper case the result), or ``DEFAULT`` (the whole DN); rules are separated by commas and tried in order.
As in Kafka, the pattern must match the whole DN, ``$1`` in the replacement is the pattern's first group,
and a ``/`` inside a pattern or replacement is written ``\\/``. metaq's default (``DEFAULT_RULES``) maps a
subject whose most specific attribute is its CN to that CN (``CN=alice,O=corp`` -> ``User:alice``) and any
other subject to the whole DN (Kafka's default is the whole DN always)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from metaq_broker.errors import ConfigError

DEFAULT_RULES = r"RULE:^CN=((?:\\.|[^,\\])+)(?:,.*)?$/$1/,DEFAULT"
_BACKREF = re.compile(r"\$(\d+)")


@dataclass(frozen=True)
class Rule:
    pattern: Optional[re.Pattern]  # None: DEFAULT
    replacement: str = ""
    case: str = ""  # "", "L" or "U"

    def apply(self, dn: str) -> Optional[str]:
        if self.pattern is None:
            return dn
        m = self.pattern.fullmatch(dn)
        if m is None:
            return None
        groups = m.re.groups

        def group(ref: re.Match) -> str:  # $N beyond the groups stays literal, as in Kafka
            n = int(ref.group(1))
            return (m.group(n) or "") if 0 < n <= groups else ref.group(0)
        out = _BACKREF.sub(group, self.replacement)
        return out.lower() if self.case == "L" else out.upper() if self.case == "U" else out

    def __str__(self) -> str:
        if self.pattern is None:
            return "DEFAULT"
        return f"RULE:{self.pattern.pattern}/{self.replacement}/{self.case}"


def _field(text: str, i: int, key: str) -> tuple:
    """The text up to the next unescaped '/' from ``i`` (escapes kept for the regex), and the index after it."""
    out = []
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            out.append(text[i:i + 2])
            i += 2
            continue
        if c == "/":
            return "".join(out), i + 1
        out.append(c)
        i += 1
    raise ConfigError(f"{key}: a RULE needs RULE:pattern/replacement/[L|U], got {text!r}")


def parse_rules(text: Optional[str] = None, key: str = "ssl.principal.mapping.rules") -> tuple:
    """The rules of ``text`` (None or empty: metaq's default); ConfigError naming ``key`` and the rule."""
    text = (text or "").strip() or DEFAULT_RULES
    rules, i = [], 0
    while i < len(text):
        while i < len(text) and text[i] in " \t":
            i += 1
        if text.startswith("DEFAULT", i):
            rules.append(Rule(None))
            i += len("DEFAULT")
        elif text.startswith("RULE:", i):
            pattern, i = _field(text, i + len("RULE:"), key)
            replacement, i = _field(text, i, key)
            case = text[i] if i < len(text) and text[i] in "LU" else ""
            i += len(case)
            try:
                rules.append(Rule(re.compile(pattern), replacement.replace("\\/", "/"), case))
            except re.error as e:
                raise ConfigError(f"{key}: the pattern {pattern!r} is not a regular expression ({e})") from None
        else:
            raise ConfigError(f"{key}: expected DEFAULT or RULE:pattern/replacement/ at {text[i:]!r}")
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text):
            if text[i] != ",":
                raise ConfigError(f"{key}: expected ',' between rules at {text[i:]!r}")
            i += 1
    return tuple(rules)


def principal_of_dn(dn: str, rules: tuple) -> Optional[str]:
    """``User:<name>`` for subject ``dn`` by the first rule that maps it to a non-empty name; None when
    none does (the certificate is refused)."""
    for rule in rules:
        name = rule.apply(dn)
        if name is not None:
            return f"User:{name}" if name else None
    return None
