"""TLS for the data port (Python's ``ssl``; gRPC takes the same PEM files through its own credentials),
the principal a client certificate names (one function for every port; ``principals`` has the rule), and
TLS failures told in words."""
from __future__ import annotations

import ssl
from typing import Optional

from cryptography import x509

from metaq_broker.errors import AuthenticationError, ConfigError
from metaq_broker.security.principals import principal_of_dn
from metaq_broker.security.settings import BrokerSecurity, ClientSecurity

ANONYMOUS = "User:ANONYMOUS"


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str) -> None:
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as e:
        raise ConfigError(f"ssl.certificate.location {cert} and ssl.key.location {key} do not make a usable "
                          f"certificate and key ({e.reason or e})") from None


def _load_ca(ctx: ssl.SSLContext, ca: str) -> None:
    try:
        ctx.load_verify_locations(cafile=ca)
    except ssl.SSLError as e:
        raise ConfigError(f"ssl.ca.location {ca} holds no usable CA certificate ({e.reason or e})") from None


def server_context(sec: BrokerSecurity) -> ssl.SSLContext:
    """The data port's context: the broker's certificate; client certificates required, or not asked for."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, sec.certificate_location, sec.key_location)
    if sec.client_auth == "required":  # as gRPC: with "none" no client certificate is asked for
        _load_ca(ctx, sec.ca_location)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(sec: ClientSecurity) -> ssl.SSLContext:
    """A client's context: the broker's certificate checked against ``ssl.ca.location`` (the system's CAs
    without one) and its host name; the client's own certificate for mutual TLS."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if sec.ca_location:
        _load_ca(ctx, sec.ca_location)
    else:
        ctx.load_default_certs()
    if sec.certificate_location:
        _load_chain(ctx, sec.certificate_location, sec.key_location)
    return ctx


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


def explain(error: BaseException, address: str) -> str:
    """One sentence on why a TLS handshake with ``address`` failed: untrusted, expired, wrong host name,
    or a plaintext peer."""
    text = str(getattr(error, "verify_message", "") or getattr(error, "reason", "") or error)
    low = text.lower()
    if "alert" in low and any(s in low.replace("_", " ") for s in ("unknown ca", "bad certificate",
                                                                    "certificate unknown")):
        why = "it refused our client certificate (not signed by a CA it trusts?)"
    elif "alert" in low and "unsupported certificate" in low.replace("_", " "):
        why = ("it refused our client certificate for its purpose: a certificate used as a client needs the "
               "clientAuth extended key usage (a group member presents its broker certificate, which then needs "
               "serverAuth and clientAuth)")
    elif "expired" in low:
        why = "its certificate has expired"
    elif "hostname" in low or "ip address mismatch" in low or "host name" in low:
        why = f"its certificate is not for this host name ({text})"
    elif "unknown ca" in low or "self signed" in low or "unable to get local issuer" in low or "verify failed" in low:
        why = f"its certificate is not signed by a trusted CA (ssl.ca.location) ({text})"
    elif any(s in low.replace("_", " ") for s in ("wrong version number", "record layer failure",
                                                   "packet length too long", "unexpected eof")):
        why = "it does not speak TLS (a PLAINTEXT port?)"
    elif "certificate required" in low.replace("_", " ") or "peer did not return a certificate" in low:
        why = "it requires a client certificate (ssl.certificate.location, ssl.key.location)"
    else:
        why = text
    return f"TLS handshake with {address} failed: {why}"
