"""The principal a verified client certificate names, one function for every port (``principals`` has the
mapping rule). A broker's alone: kept apart from ``tls``, which every client imports, because
``cryptography.x509`` costs ~60 ms to import (each Spark task's Python worker, each ``metaq`` command)."""
from __future__ import annotations

from typing import Optional

from cryptography import x509

from metaq_broker.errors import AuthenticationError
from metaq_broker.security.principals import principal_of_dn
from metaq_broker.security.tls import ANONYMOUS


def principal_of_certificate(cert: Optional[bytes], rules: tuple) -> str:
    """The principal of a verified client certificate (DER or PEM bytes), for every port alike: its subject
    DN mapped by ``rules`` (``principals.parse_rules`` of ``ssl.principal.mapping.rules``); ANONYMOUS
    without a certificate. Raises AuthenticationError when no rule maps the subject (an empty one)."""
    if not cert:
        return ANONYMOUS
    try:
        parsed = (x509.load_pem_x509_certificate(cert) if cert.lstrip().startswith(b"-----BEGIN")
                  else x509.load_der_x509_certificate(cert))
        dn = parsed.subject.rfc4514_string()
    except ValueError as e:
        raise AuthenticationError(f"the client certificate cannot be read: {e}") from None
    principal = principal_of_dn(dn, rules)
    if principal is None:
        raise AuthenticationError(f"the client certificate's subject {dn!r} names no principal: no rule of "
                                  f"ssl.principal.mapping.rules maps it (a subject alternative name is never used)")
    return principal


def peer_certificate(auth_context: dict) -> Optional[bytes]:
    """The client certificate (PEM) of a gRPC call, from ``context.auth_context()``; None without one."""
    values = auth_context.get("x509_pem_cert")
    return values[0] if values else None
