"""A test's own PKI, made with the openssl command: a CA, a server
certificate for 127.0.0.1 and localhost, a client certificate it signed, and
a client certificate from another CA (one the server does not trust)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

_CURVE = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", *_CURVE, "-keyout", f"{name}.key", "-out", f"{name}.pem",
             "-days", "2", "-subj", f"/CN={name}", cwd=d)


def _signed(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _openssl("req", *_CURVE, "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
             cwd=d)


@dataclass(frozen=True)
class Pki:
    ca: Path               # trusted by the server for client certificates; signed the server's
    server_cert: Path
    server_key: Path
    client_cert: Path      # signed by `ca`
    client_key: Path
    rogue_cert: Path       # signed by another CA
    rogue_key: Path


def make_pki(d: Path) -> Pki:
    d.mkdir(parents=True, exist_ok=True)
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    _signed(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                               "extendedKeyUsage=serverAuth\n")
    _signed(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _signed(d, "rogue", "rogue-ca", "extendedKeyUsage=clientAuth\n")
    return Pki(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem",
               d / "client.key", d / "rogue.pem", d / "rogue.key")
