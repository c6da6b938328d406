"""Where the server may send a request of its own (an endpoint delivery, a webhook): the
URL's shape, and the addresses refused unless the operator allows private endpoints, so
that a spec or a subscription cannot reach the server's own network; and what such a
request came to (``Answer``). Pure."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

MAX_URL = 2048
MAX_BODY = 1 << 20  # bytes of an answer read at most (the rest is never read)
MAX_REDIRECTS = 3  # same-host redirects followed; another host's never
ErrorKind = Literal["timeout", "connect", "address_refused", "invalid_url"]


def url_problem(url: object) -> str | None:
    """Why ``url`` cannot be an endpoint (None: it can): http or https, a host, no user
    or password in it, no fragment."""
    if not isinstance(url, str) or not url:
        return "must be an http(s) URL"
    if len(url) > MAX_URL:
        return f"is longer than {MAX_URL} characters"
    if any(ord(c) < 33 or ord(c) == 127 for c in url):
        return "has a space or a control character"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"is not a URL ({exc})"
    if parts.scheme not in ("http", "https"):
        if "://" not in url:  # "localhost:9000" reads as scheme "localhost"
            return f"has no scheme: write it as http://{url} (or https://)"
        return f"must be http or https, not {parts.scheme!r}"
    if not parts.hostname:
        return "has no host"
    if parts.username is not None or parts.password is not None:
        return "may not carry a user or password (use headers and a secret)"
    if parts.fragment:
        return "may not have a #fragment"
    if port == 0:
        return "has port 0"
    return None


def address_refused(address: str) -> str | None:
    """Why a resolved address is refused without ``--allow-private-endpoints`` (None:
    it is public)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return f"{address} is not an IP address"
    if isinstance(ip, ipaddress.IPv6Address):  # an IPv4 address inside: judge that one
        inner = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        ip = inner or ip
    for kind, refused in (("loopback", ip.is_loopback), ("link-local", ip.is_link_local),
                          ("private", ip.is_private), ("multicast", ip.is_multicast),
                          ("unspecified", ip.is_unspecified), ("reserved", ip.is_reserved),
                          ("non-global", not ip.is_global)):  # (e.g. 100.64/10, shared NAT)
        if refused:
            return f"{address} is a {kind} address (rota serve --allow-private-endpoints" \
                   " allows it)"
    return None


def literal_refused(url: str) -> str | None:
    """Why a URL whose host is an IP address, or ``localhost``, is refused without
    ``--allow-private-endpoints`` (None: it is not, or only its DNS answer will tell)."""
    host = (urlsplit(url).hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return f"{host} is a loopback address (rota serve --allow-private-endpoints allows it)"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    return address_refused(host)


@dataclass(frozen=True, kw_only=True)
class Answer:
    """What one POST of the server's own came to (rota/server/outbound.py). Either an
    HTTP answer (``status`` set, ``error`` None) or none (``status`` None, ``error`` the
    kind, ``message`` what happened). ``headers`` by lower-case name; ``body`` at most
    ``max_body`` bytes, ``truncated`` if the answer had more; ``url`` is the one finally
    asked (after same-host redirects); ``ms`` the whole call's duration, redirects
    included."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    truncated: bool = False
    ms: float = 0.0
    error: ErrorKind | None = None
    message: str = ""
    url: str = ""
    redirects: int = 0
