"""Each member's self-signed edge identity: a P-256 key, its certificate and fingerprint.

The fingerprint (SHA-256 of the DER certificate) travels to the other members under the session
key; QUIC edges pin it. The same key signs the client's proof on an edge's first stream, since
aioquic's server cannot ask for a client certificate.
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

CERT_VALID_DAYS = 30


def fingerprint(cert_der: bytes) -> str:
    return hashlib.sha256(cert_der).hexdigest()


@dataclass(frozen=True)
class Identity:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate
    cert_der: bytes
    fingerprint: str

    @classmethod
    def generate(cls, name: str) -> Identity:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kafila {name}"[:64])])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=CERT_VALID_DAYS))
            .sign(key, hashes.SHA256())
        )
        der = cert.public_bytes(serialization.Encoding.DER)
        return cls(key, cert, der, fingerprint(der))

    def sign(self, data: bytes) -> bytes:
        return self.key.sign(data, ec.ECDSA(hashes.SHA256()))


def verify_signature(cert_der: bytes, signature: bytes, data: bytes) -> bool:
    """Whether `signature` over `data` was made by the key of this certificate."""
    try:
        public = x509.load_der_x509_certificate(cert_der).public_key()
        if not isinstance(public, ec.EllipticCurvePublicKey):
            return False
        public.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False
