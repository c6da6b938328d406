"""Whether a server speaks TLS: asked after a plain (http://, ws://) request was hung up
on, so that the error can say "is it https?" rather than that no answer came; and the
mirror, whether a TLS handshake failed because the server answered in plain text. Also
the certificates Rota's clients trust, loaded once for each thread."""

from __future__ import annotations

import os
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Callable


def speaks_tls(url: str, timeout: float = 1.0) -> bool:
    """Whether the server at an http:// (or ws://) URL completes a TLS handshake, and so
    wanted https:// (wss://): a TLS server hangs up on a plain request, and the client saw
    only that.
    Asked only after a request failed so; nothing is sent but the handshake, and no
    certificate is trusted or checked (the question is only which protocol it speaks).
    A TLS server answers a ClientHello at once; a plain one that waits for a request line
    would hold the error back for the whole ``timeout``, so it is short."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "ws") or not parts.hostname:
        return False
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((parts.hostname, parts.port or 80), timeout) as sock:
            with context.wrap_socket(sock, server_hostname=parts.hostname):
                return True
    except (OSError, ValueError):
        return False


# OpenSSL's reasons for a handshake answered by a plain-text server ("HTTP/1.1 400 ...").
PLAIN_REASONS = frozenset({"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "PACKET_LENGTH_TOO_LONG",
                           "RECORD_LAYER_FAILURE", "UNKNOWN_PROTOCOL"})


def plain_answer(url: str, exc: BaseException | None) -> bool:
    """Whether a failed https:// (wss://) request met a server that speaks no TLS: its
    handshake got plain text back, and so wanted http:// (ws://). ``exc`` is looked
    through its causes, as a library (httpx, websockets) wraps the ssl error."""
    if urllib.parse.urlsplit(url).scheme not in ("https", "wss"):
        return False
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ssl.SSLError) and not isinstance(exc, ssl.SSLCertVerificationError):
            return exc.reason in PLAIN_REASONS
        exc = exc.__cause__ or exc.__context__
    return False


def distrust(exc: BaseException) -> str | None:
    """A refused certificate, and what to do about it, as the clients and the worker say
    it; None if that is not what failed."""
    if not isinstance(exc, ssl.SSLCertVerificationError):
        return None
    return (f"a certificate this client does not trust ({exc.verify_message}): for a"
            " private CA or a self-signed certificate, set SSL_CERT_FILE to its PEM file")


def plain_url(url: str) -> str:
    """The http:// (ws://) URL of an https:// (wss://) one."""
    return url[:url.index("s://")] + url[url.index("s://") + 1:]


# The certificates a client trusts, made once for each thread and each SSL_CERT_FILE and
# SSL_CERT_DIR, and made again when the file or directory changes: a new context loads
# its certificates, about 15 ms of CPU here, on the caller's thread or event loop, at
# every client made or connection opened. Per thread: httpcore sets a context's ALPN at
# each connection, and another thread's connection may be reading it then.
_made = threading.local()


def default_trust() -> ssl.SSLContext:
    """What an httpx client trusts by default: certifi's certificates, or those that
    SSL_CERT_FILE or SSL_CERT_DIR name (Rota's AsyncClient, a server's forwards)."""
    return _trust("httpx", _httpx_trust)


def system_trust() -> ssl.SSLContext:
    """What the standard library trusts by default: the system's certificates, or those
    that SSL_CERT_FILE or SSL_CERT_DIR name (Rota's sync Client and its event stream),
    for HTTP/1.1, all they speak."""
    return _trust("system", _system_trust)


def _trust(kind: str, make: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
    cafile, capath = os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR")
    key = (cafile, capath, _stamp(cafile), _stamp(capath))
    kept = getattr(_made, kind, None)
    if kept is None or kept[0] != key:
        kept = (key, make())
        setattr(_made, kind, kept)
    return kept[1]


def _stamp(path: str | None) -> tuple[int, int] | None:
    """When a file or directory last changed, and its size (a CA bundle replaced)."""
    if not path:
        return None
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_mtime_ns, found.st_size


def _httpx_trust() -> ssl.SSLContext:
    import httpx  # (here: the SDK worker and the server's start need no httpx)

    return httpx.create_ssl_context(verify=True, trust_env=True)  # (it reads them itself)


def _system_trust() -> ssl.SSLContext:
    context = ssl.create_default_context()  # (OpenSSL reads them itself)
    context.set_alpn_protocols(["http/1.1"])
    return context
