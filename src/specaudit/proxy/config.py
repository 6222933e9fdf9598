"""The proxy's configuration: fixed at start, never influenced by a request."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from enum import StrEnum
from urllib.parse import urlsplit

from specaudit.errors import SpecauditError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8081
MIB = 1024 * 1024


class ProxyError(SpecauditError):
    """The proxy cannot start as configured (bad URL, port taken, plain backend speculates)."""


class OnPlainDown(StrEnum):
    """What a logprobs request gets while the plain backend cannot serve it."""

    ERROR = "error"  # 503 with an OpenAI-style error body saying why
    ANNOTATE = "annotate"  # the speculating backend, placeholders rewritten to null


@dataclass(frozen=True)
class ProxyConfig:
    plain: str  # base URL of a llama-server started without speculation
    spec: str  # base URL of a speculating llama-server
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT  # 0: a free port, see Proxy.url
    on_plain_down: OnPlainDown = OnPlainDown.ERROR
    max_body_bytes: int = 4 * MIB
    max_response_bytes: int = 64 * MIB  # a non-streamed upstream body, or one SSE event
    connect_timeout: float = 5.0
    read_timeout: float = 600.0  # longest silence from a backend, headers included
    total_timeout: float | None = None  # whole request; None: no limit beyond read_timeout
    check_interval: float = 10.0  # seconds between /slots role checks
    max_connections: int = 256  # per backend
    # a client has this long from its request's first byte (a new connection: from connecting)
    # to send the whole request, headers and body; then 408 and the connection is closed
    client_timeout: float = 30.0
    # connections still sending a request at once; a new one pushes out the oldest (408)
    max_incomplete_requests: int = 256
    # on stop (SIGTERM): how long in-flight requests may still run before they are ended
    shutdown_grace: float = 5.0
    # Keys the proxy itself uses for /slots on backends started with --api-key. Client
    # requests carry their own Authorization, which is forwarded as sent.
    plain_api_key: str | None = field(default=None, repr=False)
    spec_api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "plain", backend_url(self.plain, "plain"))
        object.__setattr__(self, "spec", backend_url(self.spec, "spec"))
        object.__setattr__(self, "on_plain_down", OnPlainDown(self.on_plain_down))
        if not 0 <= self.port <= 65535:
            raise ProxyError(f"port {self.port} is out of range")
        for name in (
            "max_body_bytes",
            "max_response_bytes",
            "max_connections",
            "max_incomplete_requests",
        ):
            if getattr(self, name) <= 0:
                raise ProxyError(f"{name.replace('_', '-')} must be positive")
        for name in ("connect_timeout", "read_timeout", "check_interval", "client_timeout"):
            if not getattr(self, name) > 0:
                raise ProxyError(f"{name.replace('_', '-')} must be positive")
        if not self.shutdown_grace >= 0:
            raise ProxyError("shutdown-grace must not be negative")

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)


def backend_url(url: str, role: str = "backend") -> str:
    """A backend base URL: http(s), a host, an optional path prefix; no credentials or query."""
    try:
        u = urlsplit(url.strip())
    except ValueError as e:  # e.g. "http://[::1": an unclosed IPv6 literal
        raise ProxyError(f"{role} URL cannot be parsed: {url!r} ({e})") from None
    if u.scheme not in ("http", "https"):
        raise ProxyError(f"{role} URL must start with http:// or https://, got {url!r}")
    if not u.hostname:
        raise ProxyError(f"{role} URL has no host: {url!r}")
    if u.username or u.password:
        raise ProxyError(
            f"{role} URL must not carry credentials; set SPECAUDIT_{role.upper()}_API_KEY instead"
        )
    if u.query or u.fragment:
        raise ProxyError(f"{role} URL must not have a query or fragment: {url!r}")
    try:
        port = u.port
    except ValueError:
        raise ProxyError(f"{role} URL has an invalid port: {url!r}") from None
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    netloc = f"{host}:{port}" if port else host
    return f"{u.scheme}://{netloc}{u.path.rstrip('/')}"


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT``, ``:PORT`` or ``PORT`` (host 127.0.0.1)."""
    v = value.strip()
    host, port_s = DEFAULT_HOST, v
    if v.startswith("["):
        end = v.find("]")
        if end < 0 or not v[end + 1 :].startswith(":"):
            raise ProxyError(f"--listen must be HOST:PORT, got {value!r}")
        host, port_s = v[1:end], v[end + 2 :]
    elif ":" in v:
        h, _, port_s = v.rpartition(":")
        host = h or DEFAULT_HOST
    if not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise ProxyError(f"--listen port must be a number 0-65535, got {value!r}")
    return host, int(port_s)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
