"""Keys for the RPC server and its clients: mutual TLS with a certificate authority of their own.

``pyggml-rpc-server --gen-key FILE`` makes a small certificate authority, signs one certificate
for the server and one for its clients with it, and forgets the authority's key.  ``FILE`` holds
the server's key and certificate, ``FILE.client`` the clients'; each file ends with the
authority's certificate, the only one either side accepts.  So only a peer holding one of the two
files can talk to the other (a server linking to another server presents its own): the server proves itself to clients, clients prove themselves to
the server, and everything between them is encrypted.  Both files are secrets (mode 0600).

The certificates are made with the ``openssl`` command (present wherever OpenSSL is installed);
using them needs only Python's ``ssl`` module.

The same files carry the keys of the ZeroMQ transport (``--transport zmq``): a CurveZMQ key pair
for each side, and the other side's public key - the server's file names the one client key its
ZAP handler admits, the clients' file the server's key they expect.  So one ``--gen-key`` makes
one server's keys for either transport.
"""
from __future__ import annotations

import base64
import os
import re
import shutil
import ssl
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

_PEM = re.compile(rb"-----BEGIN ([A-Z ]+)-----\r?\n.*?-----END \1-----\r?\n?", re.S)
_CONFIG = "[req]\ndistinguished_name = dn\nprompt = no\n[dn]\nCN = pyggml-rpc\n"
_DAYS = "36500"


def _openssl(*args: str, cwd: str) -> None:
    try:
        subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"openssl {args[0]} failed: {e.stderr.strip()}") from None


def generate(path: str | os.PathLike) -> tuple[Path, Path]:
    """Write the server's key file ``path`` and the clients' ``path.client``; returns both."""
    if shutil.which("openssl") is None:
        raise RuntimeError("making keys needs the openssl command; install OpenSSL (e.g. apt install openssl)")
    server_path, client_path = Path(path), Path(f"{path}.client")
    import zmq
    (server_public, server_secret), (client_public, client_secret) = zmq.curve_keypair(), zmq.curve_keypair()
    curve_blocks = {"server": _block(_CURVE_SECRET, server_secret) + _block(_CURVE_PEER, client_public),
                    "client": _block(_CURVE_SECRET, client_secret) + _block(_CURVE_PEER, server_public)}
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "req.cnf").write_text(_CONFIG)
        new_key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-config", "req.cnf")
        _openssl("req", "-x509", *new_key, "-keyout", "ca.key", "-out", "ca.pem", "-days", _DAYS,
                 "-subj", "/CN=pyggml-rpc-authority", "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign", cwd=tmp)
        # a server also connects to other servers (rpc/peers.py): its certificate serves both ends
        for serial, role, usage in ((1, "server", "serverAuth, clientAuth"), (2, "client", "clientAuth")):
            Path(tmp, f"{role}.ext").write_text(f"basicConstraints = CA:FALSE\nextendedKeyUsage = {usage}\n")
            _openssl("req", "-new", *new_key, "-keyout", f"{role}.key", "-out", f"{role}.csr",
                     "-subj", f"/CN=pyggml-rpc-{role}", cwd=tmp)
            _openssl("x509", "-req", "-in", f"{role}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-set_serial",
                     str(serial), "-days", _DAYS, "-extfile", f"{role}.ext", "-out", f"{role}.pem", cwd=tmp)
            out = server_path if role == "server" else client_path
            text = b"".join(Path(tmp, name).read_bytes() for name in (f"{role}.key", f"{role}.pem", "ca.pem"))
            text += curve_blocks[role]
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(text)
    return server_path, client_path


def context(path: str | os.PathLike, server_side: bool) -> ssl.SSLContext:
    """The TLS context of one side from its key file (``FILE`` for a server, ``FILE.client`` for clients)."""
    try:
        text = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    blocks = [(m.group(1).decode(), m.group(0)) for m in _PEM.finditer(text)]
    certs = [b for kind, b in blocks if kind == "CERTIFICATE"]
    if len(certs) < 2 or not any("PRIVATE KEY" in kind for kind, _ in blocks):
        hint = " (a CurveZMQ key from an older pyggml: make a new pair with --gen-key)" if len(text.strip()) == 40 else ""
        raise ValueError(f"{path}: not a pyggml RPC key file{hint}")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # the peer is known by the authority that signed it, not by a name
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_cert_chain(str(path))
        ctx.load_verify_locations(cadata=certs[-1].decode())
    except ssl.SSLError as e:
        raise ValueError(f"{path}: {e.reason or e}") from None
    return ctx


_CURVE_SECRET, _CURVE_PEER = "PYGGML CURVE SECRET KEY", "PYGGML CURVE PEER KEY"


def _block(kind: str, z85: bytes) -> bytes:
    """A key as a PEM block (base64 of its 32 bytes: OpenSSL, reading the certificates of the same
    file, decodes every block it meets)."""
    from zmq.utils import z85 as Z85
    return f"-----BEGIN {kind}-----\n{base64.b64encode(Z85.decode(z85)).decode()}\n-----END {kind}-----\n".encode()


@dataclass(frozen=True)
class CurveKeys:
    """One side's CurveZMQ keys (Z85 text): its own pair, and the other side's public key (for a
    server: the client key its ZAP handler admits; for a client: the server it expects)."""
    secret: bytes
    public: bytes
    peer: bytes


def curve(path: str | os.PathLike) -> CurveKeys:
    """The CurveZMQ keys of a key file (either side's)."""
    import zmq
    try:
        text = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    from zmq.utils import z85 as Z85
    found = {m.group(1).decode(): m.group(0).split(b"\n")[1].strip() for m in _PEM.finditer(text)}
    if _CURVE_SECRET not in found or _CURVE_PEER not in found:
        raise ValueError(f"{path}: no CurveZMQ keys in this key file (made by an older pyggml): make a new pair "
                         f"with pyggml-rpc-server --gen-key")
    try:
        secret, peer = (Z85.encode(base64.b64decode(found[k], validate=True)) for k in (_CURVE_SECRET, _CURVE_PEER))
        return CurveKeys(secret, zmq.curve_public(secret), peer)
    except (ValueError, zmq.ZMQError) as e:
        raise ValueError(f"{path}: a malformed CurveZMQ key ({e})") from None


@dataclass(frozen=True)
class ClientKey:
    """A client's key file read for both transports."""
    path: str
    tls: ssl.SSLContext
    curve: CurveKeys | None  # None for a file made before the ZeroMQ transport came back
