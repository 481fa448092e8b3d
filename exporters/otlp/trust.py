"""Lock-down of the OTLP receiver: TLS (and client certificates) for both
transports, a bearer token read from a mounted secret, and a per-sender
token-bucket rate limit, as the OpenTelemetry Collector's receivers offer;
and the two ends of the connection a request came on (Peer), from which the
agent establishes its sender."""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import ssl
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc

from spanlet.config import OtlpConfig
from spanlet.exporters.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

# How often the token file is looked at (stat) for a new token.
TOKEN_RECHECK_S = 1.0
BEARER = "bearer"


def _read(path: str, key: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        # the content is never part of the message; the path and the reason are
        raise OSError(e.errno, f"otlp.{key} {path!r} cannot be read: {e.strerror}") from None


def server_ssl_context(cfg: OtlpConfig) -> ssl.SSLContext | None:
    """The OTLP/HTTP port's TLS (None when tls_cert_file is not set);
    client certificates required and checked against tls_client_ca_file
    when it is set."""
    if not cfg.tls_cert_file:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    _read(cfg.tls_cert_file, "tls_cert_file")
    _read(cfg.tls_key_file, "tls_key_file")
    try:
        ctx.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
    except ssl.SSLError as e:
        raise OSError(f"otlp.tls_cert_file / otlp.tls_key_file: not a PEM certificate and "
                      f"its key ({e.reason or e})") from None
    if cfg.tls_client_ca_file:
        _read(cfg.tls_client_ca_file, "tls_client_ca_file")
        try:
            ctx.load_verify_locations(cafile=cfg.tls_client_ca_file)
        except ssl.SSLError as e:
            raise OSError(f"otlp.tls_client_ca_file: not PEM CA certificates "
                          f"({e.reason or e})") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def grpc_server_credentials(cfg: OtlpConfig) -> grpc.ServerCredentials | None:
    """The OTLP/gRPC port's TLS, the same files as server_ssl_context (which
    start() calls first, so the files are known to be good)."""
    if not cfg.tls_cert_file:
        return None
    key = _read(cfg.tls_key_file, "tls_key_file")
    chain = _read(cfg.tls_cert_file, "tls_cert_file")
    ca = _read(cfg.tls_client_ca_file, "tls_client_ca_file") if cfg.tls_client_ca_file else None
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=ca,
                                       require_client_auth=ca is not None)


def read_token(path: str) -> bytes:
    """A mounted secret: the whole file, less surrounding white space (a
    trailing newline); an empty one is refused."""
    token = _read(path, "bearer_token_file").strip()
    if not token:
        raise OSError(f"otlp.bearer_token_file {path!r} is empty")
    return token


class BearerToken:
    """The token clients must send as `authorization: Bearer <token>`. The
    file is looked at every TOKEN_RECHECK_S and re-read when it changed (a
    Kubernetes secret is updated by swapping a symlink); a file that cannot
    be read then keeps the previous token. The token is never logged."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._lock = threading.Lock()
        self._token = read_token(path)
        self._seen = self._identity()
        self._checked = clock()
        self._ratelog = RateLimitedLog(log)

    def _identity(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_dev, st.st_mtime_ns, st.st_size)

    def _current(self) -> bytes:
        now = self._clock()
        with self._lock:
            if now - self._checked < TOKEN_RECHECK_S:
                return self._token
            self._checked = now
            seen = self._identity()
            if seen is None or seen == self._seen:
                return self._token
            try:
                self._token = read_token(self.path)
                self._seen = seen
                log.info("OTLP receiver: bearer token re-read from otlp.bearer_token_file")
            except OSError as e:
                self._ratelog(logging.WARNING, "token", "OTLP receiver keeps its bearer token: %s", e)
            return self._token

    def accepts(self, authorization: str | None) -> bool:
        """Whether the `authorization` header (or gRPC metadata) value carries the token."""
        if not authorization:
            return False
        scheme, _, value = authorization.strip().partition(" ")
        return (scheme.lower() == BEARER
                and hmac.compare_digest(value.strip().encode("utf-8", "replace"), self._current()))


def split_grpc_peer(peer: str) -> tuple[str, int] | None:
    """(host, port) of a gRPC peer string: 'ipv4:10.0.0.5:4711',
    'ipv6:[::1]:4711'; None for any other kind (unix:...)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    try:
        return normal_sender(host.strip("[]")), int(port)
    except ValueError:
        return None


def sender_of_peer(peer: str) -> str:
    """The sender (IP address) of a gRPC peer string; anything that is not
    an IP peer is its own sender."""
    split = split_grpc_peer(peer)
    return split[0] if split else peer


def normal_sender(host: str) -> str:
    """One key per client whichever socket family it arrived on: an
    IPv4-mapped IPv6 address is its IPv4 address."""
    host = host.lower()
    return host[7:] if host.startswith("::ffff:") and "." in host else host


class SenderRateLimiter:
    """A token bucket of spans per sender: `rate` a second, up to `burst` at
    once. A request is admitted when its sender's bucket holds its spans (or
    a full burst, for requests bigger than the burst), and then paid for in
    full, so a sender of big requests waits that much longer. The buckets of
    at most `max_senders` senders are kept (the least recently seen is
    forgotten: it comes back with a full bucket)."""

    def __init__(self, rate: float, burst: int, max_senders: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = float(burst or max(1, round(rate)))
        self.max_senders = max_senders
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()   # sender -> [tokens, at]

    def take(self, sender: str, spans: int) -> float | None:
        """None when admitted; else the seconds until the request would be."""
        now = self._clock()
        need = min(float(max(spans, 1)), self.burst)
        with self._lock:
            bucket = self._buckets.get(sender)
            if bucket is None:
                bucket = self._buckets[sender] = [self.burst, now]
                if len(self._buckets) > self.max_senders:
                    self._buckets.popitem(last=False)
            else:
                self._buckets.move_to_end(sender)
                bucket[0] = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
                bucket[1] = now
            if bucket[0] >= need:
                bucket[0] -= max(spans, 1)
                return None
            return (need - bucket[0]) / self.rate

    def senders(self) -> int:
        with self._lock:
            return len(self._buckets)


WILDCARD_ADDRESSES = ("", "0.0.0.0", "::")


@dataclass(frozen=True)
class Peer:
    """The connection a request came on, as the receiver's accepted socket
    sees it (never anything the payload says): the sender's address and
    port, and the receiver's own. `local_host` is "" where the transport
    cannot tell it (gRPC bound to a wildcard address: see local_host_of)."""
    transport: str
    host: str
    port: int
    local_host: str
    local_port: int

    @property
    def connection(self) -> tuple:
        return (self.transport, self.host, self.port, self.local_host, self.local_port)


def grpc_peer(peer: str, receiver_address: str, port: int) -> Peer | None:
    """The Peer of a gRPC call from its context.peer() string."""
    split = split_grpc_peer(peer)
    if split is None:
        return None
    local = "" if receiver_address in WILDCARD_ADDRESSES else normal_sender(receiver_address)
    return Peer("grpc", split[0], split[1], local, port)


def _proc_net_address(field_: str) -> tuple[str, int]:
    """An address of /proc/net/tcp{,6}: hex of 32-bit words in host byte
    order, a colon, the port in hex."""
    addr, _, port = field_.partition(":")
    raw = b"".join(int(addr[i:i + 8], 16).to_bytes(4, "little") for i in range(0, len(addr), 8))
    return normal_sender(str(ipaddress.ip_address(raw))), int(port, 16)


def local_host_of(peer_host: str, peer_port: int, local_port: int,
                  proc_net: str = "/proc/self/net") -> str:
    """The receiver's own address of the established connection from
    (peer_host, peer_port) to local_port, from the kernel's socket list of
    the agent's network namespace; "" when none is listed."""
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(proc_net, name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 4 or fields[3] != "01":        # TCP_ESTABLISHED
                continue
            try:
                local, remote = _proc_net_address(fields[1]), _proc_net_address(fields[2])
            except ValueError:
                continue
            if remote == (peer_host, peer_port) and local[1] == local_port:
                return local[0]
    return ""
