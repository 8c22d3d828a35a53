"""TLS for the data port (Python's ``ssl``; gRPC takes the same PEM files through its own credentials) and
TLS failures told in words. The principal a client certificate names is ``certificates``'s: only a broker
needs it, and its X.509 parser costs every client process ~60 ms to import."""
from __future__ import annotations

import ssl

from metaq_broker.errors import ConfigError
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
