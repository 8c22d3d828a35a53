"""A throwaway certificate authority for the security tests: a CA, a broker certificate for 127.0.0.1 and
localhost, client certificates, and the bad cases (expired, signed by another CA, for another host).
Keys are made per test run in a temporary directory; nothing is committed."""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Pem:
    cert: str  # path of the certificate (PEM)
    key: str  # path of its private key (PEM, unencrypted)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, cert: x509.Certificate, key) -> Pem:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return Pem(str(path.with_suffix(".crt")), str(path.with_suffix(".key")))


class CertificateAuthority:
    def __init__(self, directory: Path, name: str = "metaq-test-ca"):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(days=1))
                     .not_valid_after(now + datetime.timedelta(days=30))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                  content_commitment=False, key_encipherment=False,
                                                  data_encipherment=False, key_agreement=False,
                                                  encipher_only=False, decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.ca_path = str(self.directory / f"{name}.crt")
        Path(self.ca_path).write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, file_name: str, common_name: str, hosts: tuple = (), client: bool = False,
              expired: bool = False, sans: Optional[list] = None, subject: Optional[x509.Name] = None) -> Pem:
        """A certificate signed by this CA. ``hosts`` become DNS or IP subject alternative names; ``subject``
        replaces the subject ``CN=<common_name>`` (an empty ``x509.Name([])`` for none)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        start, end = ((now - datetime.timedelta(days=10), now - datetime.timedelta(days=1)) if expired
                      else (now - datetime.timedelta(days=1), now + datetime.timedelta(days=30)))
        builder = (x509.CertificateBuilder().subject_name(_name(common_name) if subject is None else subject)
                   .issuer_name(self.cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(start).not_valid_after(end)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH if client
                                                         else ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
        names = list(sans or [])
        for h in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                names.append(x509.DNSName(h))
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names),  # critical without a subject
                                            critical=subject is not None and not len(subject))
        return _write(self.directory / file_name, builder.sign(self.key, hashes.SHA256()), key)


@dataclass
class TestPki:
    """Everything a security test needs, in one directory."""
    ca: str  # the trusted CA's certificate
    broker: Pem  # CN=broker, for 127.0.0.1 and localhost
    alice: Pem  # client certificate CN=alice
    bob: Pem  # client certificate CN=bob
    expired_broker: Pem  # the broker's names, expired yesterday
    other_host_broker: Pem  # CN=elsewhere, for another host only
    stranger_ca: str  # a CA nobody trusts
    stranger_broker: Pem  # a broker certificate signed by the stranger CA
    stranger_client: Pem  # a client certificate signed by the stranger CA


def make_pki(directory: Path) -> TestPki:
    directory = Path(directory)
    ca = CertificateAuthority(directory / "ca")
    stranger = CertificateAuthority(directory / "stranger", name="stranger-ca")
    hosts = ("127.0.0.1", "localhost")
    return TestPki(
        ca=ca.ca_path,
        broker=ca.issue("broker", "broker", hosts),
        alice=ca.issue("alice", "alice", client=True),
        bob=ca.issue("bob", "bob", client=True),
        expired_broker=ca.issue("expired", "broker", hosts, expired=True),
        other_host_broker=ca.issue("elsewhere", "elsewhere", ("elsewhere.example",)),
        stranger_ca=stranger.ca_path,
        stranger_broker=stranger.issue("stranger-broker", "broker", hosts),
        stranger_client=stranger.issue("stranger-client", "mallory", client=True),
    )
